"""The frontend's gRPC channel to tritonserver: its options, and what an unreachable
server looks like (a 503, in OpenAI's error shape, while Triton starts or restarts)."""

from __future__ import annotations

from typing import Optional

import grpc
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions
from tritonclient.utils import InferenceServerException

from frontend.openai_api.errors import APIError

# gRPC's reconnect backoff grows to 120 s by default: a frontend started before
# tritonserver kept failing for ~40 s after Triton was ready. Retry every second at most.
RECONNECT_BACKOFF_MS = (100, 1000)


def channel_args(target_name: Optional[str] = None) -> list[tuple]:
    """tritonclient's own channel options (message sizes, keepalive: channel_args replace
    them), a short reconnect backoff, and the TLS name override when given."""
    keepalive = KeepAliveOptions()
    initial, most = RECONNECT_BACKOFF_MS
    args = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", initial), ("grpc.min_reconnect_backoff_ms", initial),
            ("grpc.max_reconnect_backoff_ms", most)]
    if target_name:
        args.append(("grpc.ssl_target_name_override", target_name))
    return args


def unavailable(e: Exception) -> Optional[APIError]:
    """A 503 when `e` says tritonserver cannot be reached (not started yet, restarting)."""
    status = e.code() if isinstance(e, grpc.RpcError) else (e.status() if isinstance(e, InferenceServerException)
                                                             else None)
    if status is not None and "UNAVAILABLE" in str(status):
        return APIError(503, "tritonserver is not reachable (starting, or restarting): retry shortly")
    return None
