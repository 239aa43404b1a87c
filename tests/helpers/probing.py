"""A request sent while normal ones keep arriving: that one route's work does not stall the
frontend's event loop for the others (issue 49)."""

from __future__ import annotations

import threading
import time


def post_while_probing(client, route: str, body: bytes, headers: dict) -> tuple:
    """(the response, its seconds, the seconds of each normal request sent meanwhile: a
    GET /v1/models at a time, every 10 ms, while the post runs). The first
    probe starts before the post is sent, so there is always at least one."""
    result, sent = {}, threading.Event()

    def attack():
        sent.wait()
        t0 = time.perf_counter()
        result["r"] = client.post(route, content=body, headers={**headers, "content-type": "application/json"})
        result["elapsed"] = time.perf_counter() - t0
    client.get("/v1/models", headers=headers)      # (warm)
    sender = threading.Thread(target=attack)
    sender.start()
    waits = []
    while not waits or sender.is_alive():
        t0 = time.perf_counter()
        sent.set()
        assert client.get("/v1/models", headers=headers).status_code == 200
        waits.append(time.perf_counter() - t0)
        time.sleep(0.01)            # (a client's pace: back to back, the probes would take the GIL from the post)
    sender.join()
    return result["r"], result["elapsed"], waits
