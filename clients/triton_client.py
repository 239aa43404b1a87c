"""tritonclient gRPC streaming against the `llm` model (vLLM backend contract).

One request per stream: `StreamingRequest(url, model).run(prompt, params)` returns the
deltas with their arrival times, the finish reason, or the error the server sent.
"""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.triton_inputs import make_inputs


@dataclass
class StreamResult:
    request_id: str
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)   # arrival of each response with tokens
    start: float = 0.0
    end: float = 0.0
    finish_reason: Optional[str] = None
    num_output_tokens: int = 0
    error: Optional[str] = None
    cancelled: bool = False
    # With return_logprobs / return_cumulative_logprob: the parsed `logprobs` of each
    # response (a list per token, or None for "null") and each `cumulative_logprob`.
    logprobs: list = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)  # as each response sent it
    cumulative_logprobs: list[float] = field(default_factory=list)
    # With return_prompt_logprobs: the parsed `prompt_logprobs` of each response (null
    # but on the one that carries them).
    prompt_logprobs: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled


class StreamingRequest:
    def __init__(self, url: str, model: str = "llm") -> None:
        self.url = url
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._events: "queue.Queue[tuple[Any, Any]]" = queue.Queue()

    def run(self, prompt: Optional[str], sampling: Optional[dict[str, Any]] = None, stream: bool = True,
            request_id: str = "", input_ids: Optional[list[int]] = None,
            extra: Optional[dict[str, np.ndarray]] = None, on_piece: Optional[Callable[[str], None]] = None,
            cancel_after: Optional[int] = None, timeout_s: float = 300.0,
            parameters: Optional[dict[str, Any]] = None) -> StreamResult:
        """Send one request and read its responses until the final one. With
        `cancel_after=n`, cancel the stream after n responses carrying tokens.
        `parameters` go as Triton request parameters."""
        res = StreamResult(request_id=request_id)
        self.client.start_stream(callback=lambda result, error: self._events.put((result, error)))
        try:
            res.start = time.perf_counter()
            try:
                self.client.async_stream_infer(self.model, make_inputs(prompt, sampling, stream, input_ids, extra),
                                               request_id=request_id, enable_empty_final_response=True,
                                               parameters=parameters)
            except InferenceServerException as e:
                # The stream broke before the request went out (e.g. the server is down);
                # the cause went to the callback.
                try:
                    res.error = str(self._events.get(timeout=5)[1] or e)
                except queue.Empty:
                    res.error = str(e)
                return res
            deadline = time.monotonic() + timeout_s
            while True:
                result, error = self._events.get(timeout=max(deadline - time.monotonic(), 0.001))
                now = time.perf_counter()
                if error is not None:
                    res.error = str(error)
                    break
                final = result.get_response().parameters.get("triton_final_response")
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    piece = text.reshape(-1)[0].decode("utf-8")
                    ids = result.as_numpy("output_ids")
                    ids = [] if ids is None else ids.reshape(-1).tolist()
                    res.pieces.append(piece)
                    res.token_ids.extend(ids)
                    if ids:
                        res.times.append(now)
                    if on_piece:
                        on_piece(piece)
                    reason = result.as_numpy("finish_reason")
                    if reason is not None and reason.size and reason.reshape(-1)[0]:
                        res.finish_reason = reason.reshape(-1)[0].decode()
                        res.finish_reasons.append(res.finish_reason)
                    lp = result.as_numpy("logprobs")
                    if lp is not None and lp.size:
                        res.logprobs.append(json.loads(lp.reshape(-1)[0].decode("utf-8")))
                    plp = result.as_numpy("prompt_logprobs")
                    if plp is not None and plp.size:
                        res.prompt_logprobs.append(json.loads(plp.reshape(-1)[0].decode("utf-8")))
                    cl = result.as_numpy("cumulative_logprob")
                    if cl is not None and cl.size:
                        res.cumulative_logprobs.append(float(cl.reshape(-1)[0]))
                    n = result.as_numpy("num_output_tokens")
                    if n is not None and n.size:
                        # Streaming responses count their delta; a single response the total.
                        count = int(n.reshape(-1)[0])
                        res.num_output_tokens = res.num_output_tokens + count if stream else count
                    if cancel_after is not None and len(res.times) >= cancel_after:
                        res.cancelled = True
                        break
                if final is not None and final.bool_param:
                    break
            res.end = time.perf_counter()
        finally:
            self.client.stop_stream(cancel_requests=res.cancelled)
            self.client.close()
        res.text = "".join(res.pieces)
        return res
