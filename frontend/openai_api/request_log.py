"""Request logging, off by default: prompts and outputs are the users' data.

`--enable-log-requests` turns it on (vLLM's flag), `--max-log-len N` cuts each prompt and
output to N characters (vLLM's too). Without it, the frontend's log holds what uvicorn's
access log writes: method, path, status.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

log = logging.getLogger("frontend.requests")


class RequestLog:
    def __init__(self, enabled: bool = False, max_len: Optional[int] = None) -> None:
        self.enabled, self.max_len = enabled, max_len

    def _cut(self, value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text if self.max_len is None else text[:self.max_len]

    def received(self, request_id: str, model: str, prompt: Any, sampling: dict) -> None:
        if self.enabled:
            log.info("received request %s: model=%s, prompt=%r, sampling_parameters=%s", request_id, model,
                     self._cut(prompt), json.dumps(sampling, default=str))

    def finished(self, request_id: str, texts: list[str], finish_reasons: list[Optional[str]]) -> None:
        if self.enabled:
            log.info("finished request %s: finish_reasons=%s, outputs=%r", request_id, finish_reasons,
                     [self._cut(t) for t in texts])
