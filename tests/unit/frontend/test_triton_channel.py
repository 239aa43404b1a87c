"""The frontend's gRPC channel options (frontend/openai_api/triton_channel.py): a short
reconnect backoff (a frontend started before tritonserver kept failing for ~40 s after
Triton was ready, issue 31), tritonclient's own options kept, and unreachable = 503."""

import grpc
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE
from tritonclient.utils import InferenceServerException

from frontend.openai_api.triton_channel import channel_args, unavailable


def test_reconnects_fast_and_keeps_tritonclients_options():
    args = dict(channel_args())
    assert args["grpc.max_reconnect_backoff_ms"] <= 1000 and args["grpc.initial_reconnect_backoff_ms"] <= 1000
    assert args["grpc.max_receive_message_length"] == MAX_GRPC_MESSAGE_SIZE
    assert "grpc.keepalive_time_ms" in args and "grpc.ssl_target_name_override" not in args
    assert dict(channel_args("triton.internal"))["grpc.ssl_target_name_override"] == "triton.internal"


def test_unreachable_is_a_503_other_errors_are_not():
    down = InferenceServerException("failed to connect to all addresses", status=str(grpc.StatusCode.UNAVAILABLE))
    assert unavailable(down).status == 503
    assert unavailable(InferenceServerException("bad input", status=str(grpc.StatusCode.INVALID_ARGUMENT))) is None
    assert unavailable(ValueError("x")) is None
