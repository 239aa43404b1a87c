"""The frontend's own `GET /metrics` (Prometheus text format): requests by route, method
and status, and their latencies, as vLLM's OpenAI server exports them
(prometheus-fastapi-instrumentator's names: `http_requests_total`,
`http_request_duration_seconds`). The engine's metrics stay on Triton's metrics port
(backend/triton_server/metrics.py); these are the HTTP side's.

Like vLLM's, /metrics needs no API key: it holds counts and latencies only (the route
label is the route's template, e.g. `/v1/models/{model_id}`, never a path a client
chose, nor a model name or a prompt). Bind the frontend to a private address, or put
the scrape behind the proxy, where that is too much.

A latency is taken from the request's arrival to its response's last byte, so a
stream's includes the whole generation.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.routing import Match
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

# Requests that matched no route are counted under one label, so that a scan of made-up
# paths cannot grow the series without bound.
UNMATCHED = "unmatched"
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Series:
    """The app's series, in a registry of its own (not prometheus_client's global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("handler", "method", "status")
        self.requests = Counter("http_requests_total", "HTTP requests by route, method and status", labels,
                                registry=self.registry)
        self.latency = Histogram("http_request_duration_seconds", "HTTP request latency, arrival to last byte",
                                 labels, buckets=BUCKETS, registry=self.registry)


class HTTPMetrics:
    """Pure ASGI middleware, so that a stream's latency runs to its last chunk."""

    def __init__(self, app, series: _Series, routes: list) -> None:
        self.app = app
        self.series = series
        self.routes = routes

    def _route(self, scope) -> str:
        """The route's template: the router left it in the scope; a request answered
        before routing (401 without a key) is matched here."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        return getattr(route, "path", None) or UNMATCHED

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]                  # what uvicorn answers when the app raises before starting one

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # (a client that left mid-stream still counts, with the status it was sent)
            labels = (self._route(scope), scope["method"], str(status[0]))
            self.series.requests.labels(*labels).inc()
            self.series.latency.labels(*labels).observe(time.perf_counter() - start)


def register(app: FastAPI) -> None:
    """Adds the middleware (outermost: 401s and 413s count too) and the route."""
    series = _Series()
    app.add_middleware(HTTPMetrics, series=series, routes=app.router.routes)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(series.registry), media_type=CONTENT_TYPE_LATEST)
