"""The few calls into tritonserver's HTTP API that the supervisor makes (standard library only)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Optional


def http_request(url: str, method: str = "GET", timeout_s: float = 5.0,
                 headers: Optional[dict[str, str]] = None) -> tuple[Optional[int], str]:
    """(status, body) of one HTTP call, error statuses included; status None when the
    server cannot be reached."""
    data = b"" if method == "POST" else None
    request = urllib.request.Request(url, method=method, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError, http.client.HTTPException) as e:
        return None, str(e)


class TritonAPI:
    def __init__(self, http_url: str, headers: Optional[dict[str, str]] = None) -> None:
        """headers: the admin key's (supervisor/admin_access.py); the repository API needs it."""
        self.base = f"http://{http_url}"
        self.headers = headers or {}

    def _call(self, method: str, path: str, timeout_s: float) -> tuple[Optional[int], str]:
        return http_request(self.base + path, method, timeout_s, self.headers)

    def server_ready(self, timeout_s: float = 2.0) -> bool:
        return self._call("GET", "/v2/health/ready", timeout_s)[0] == 200

    def model_ready(self, model: str, timeout_s: float = 2.0) -> bool:
        return self._call("GET", f"/v2/models/{model}/ready", timeout_s)[0] == 200

    def model_state(self, model: str) -> Optional[str]:
        """READY, UNLOADING, LOADING, UNAVAILABLE, ... from the repository index."""
        status, body = self._call("POST", "/v2/repository/index", 5.0)
        if status != 200:
            return None
        states = [m.get("state") for m in json.loads(body) if m.get("name") == model]
        return states[0] if states else None

    def unload(self, model: str) -> tuple[bool, str]:
        status, body = self._call("POST", f"/v2/repository/models/{model}/unload", 30.0)
        return status == 200, body

    def load(self, model: str, timeout_s: float) -> tuple[bool, str]:
        """Blocks until the model has loaded or failed to."""
        status, body = self._call("POST", f"/v2/repository/models/{model}/load", timeout_s)
        return status == 200, body
