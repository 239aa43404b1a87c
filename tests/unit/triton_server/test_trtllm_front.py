"""The TensorRT-LLM fronts (backend/triton_server/trtllm_front.py) against
tests/helpers/fake_pb_utils.py, for what Python backend 24.10 frees without the GIL
(a stub's heap corrupted under perf_analyzer): outputs the client did not ask for, and
BLS streams whose last reference is the stub's own."""

import json

import numpy as np

from tests.helpers.fake_pb_utils import FINAL, ClientRequest, InferenceResponse, Tensor


def front(stub, contract="text"):
    config = {"parameters": {"trtllm_contract": {"string_value": contract}}}
    return stub.modules["trtllm_front"].TrtLlmFront({"model_config": json.dumps(config)}, contract)


def llm_says(*texts):
    """The llm model's responses to a row: one per text, the last with its finish reason."""
    def reply(bls_request):
        return [InferenceResponse([Tensor("text_output", np.array([t.encode()], dtype=object)),
                                   Tensor("output_ids", np.array([i + 1], dtype=np.int32)),
                                   Tensor("num_output_tokens", np.array([1], dtype=np.uint32)),
                                   Tensor("finish_reason", np.array([b"length" if i == len(texts) - 1 else b"None"],
                                                                    dtype=object))])
                for i, t in enumerate(texts)]
    return reply


def text_request(stub, prompt, requested, request_id="r1", stream=True, parameters=""):
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[2]], np.int32),
              "stream": np.array([[stream]])}
    return ClientRequest(stub, inputs, requested, request_id, parameters)


def test_sends_only_the_outputs_asked_for(stub):
    stub.bls = llm_says("a", "b")
    request = text_request(stub, "hi", ["text_output"])
    front(stub).execute([request])
    sent = request.sender.sent
    assert [bytes(r.output_tensors()[0].as_numpy()[0]) for r, _ in sent] == [b"a", b"b"]
    assert [flags for _, flags in sent] == [0, FINAL]
    assert stub.dropped == []   # batch_index and sequence_index were built and dropped by the sender
    # and asks llm for what it reads
    assert stub.bls_requests[0].requested_output_names == stub.modules["trtllm_front"].LLM_OUTPUTS


def test_a_read_stream_outlives_its_cleanup(stub):
    """Each request's streams are kept until an is_cancelled query, asked before a later
    FINAL, has waited for the stub's sender thread; never asked after FINAL."""
    stub.bls = llm_says("a", "b")
    f = front(stub)
    requests = [text_request(stub, "hi", ["text_output"], f"r{i}") for i in range(3)]
    for request in requests:
        f.execute([request])
    stop = text_request(stub, "", [], "r9", parameters=json.dumps({"stop_key": "k"}))
    stop.inputs = [Tensor("stop", np.array([[True]]))]
    tokens = front(stub, "tokens")
    tokens.execute([stop])
    assert all(r.sender.sent[-1][1] == FINAL for r in requests + [stop])
    assert stub.freed_off_gil == []
    assert stub.queries_after_final == []
    assert len(stub.bls_requests) == 4


def stop_request(stub, request_id, parameters=""):
    return ClientRequest(stub, {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[1]], np.int32),
                                "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]])},
                         [], request_id, parameters)


def test_rows_carry_the_clients_stop_key_or_one_no_client_knows(stub):
    """Issue 49 item 6: `llm` ends a row only for a `stop` with the key it was sent with."""
    stub.bls = llm_says("a")
    f = front(stub)
    f.execute([text_request(stub, "hi", ["text_output"], "c1", parameters=json.dumps({"stop_key": "mine"}))])
    f.execute([text_request(stub, "hi", ["text_output"], "c2")])
    keyed, keyless = (r.parameters["stop_key"] for r in stub.bls_requests)
    assert keyed == "mine"
    assert len(keyless) == 32 and keyless != "mine"


def test_a_clients_stop_reaches_llm_with_its_key(stub):
    tokens = front(stub, "tokens")
    stop = stop_request(stub, "c1", json.dumps({"stop_key": "mine"}))
    tokens.execute([stop])
    (sent,) = stub.bls_requests
    assert sent.request_id == "c1" and sent.parameters == {"stop_key": "mine"}
    assert stop.sender.sent[-1] == (None, FINAL)


def test_a_stop_without_a_key_is_refused_and_stops_nothing(stub):
    tokens = front(stub, "tokens")
    stop = stop_request(stub, "c1")
    tokens.execute([stop])
    assert stub.bls_requests == []
    response, flags = stop.sender.sent[-1]
    assert flags == FINAL and "stop_key" in response.error().message()
