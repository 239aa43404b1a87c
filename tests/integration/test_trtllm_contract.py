"""TensorRT-LLM's models (`ensemble`, `tensorrt_llm_bls`, `tensorrt_llm`) in front of `llm`,
through a REAL tritonserver (its own, unsupervised: a repository of `llm` plus the three
entries `builder default` writes), called the way TensorRT-LLM's end_to_end_grpc_client
and inflight_batcher_llm_client call them: `[batch, 1]` tensors over gRPC streaming."""

import json
import os
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend import LLM, SamplingParams
from backend.engine.sampling.bad_words import tokenize_words
from builder.build import BuildOptions, build
from builder.trtllm_models import write_fronts
from clients.tritonserver import TritonServer
from tests.integration.conftest import infer, tensor, wait_blocks_free

PROMPTS = ["The yield statement", "Class definitions create"]


@pytest.fixture(scope="module")
def trt_server(tmp_path_factory, tiny_ckpt):
    repo = tmp_path_factory.mktemp("trtllm_repo")
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", link=True,
                              block_size=16, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                              max_model_len=1024), log=lambda *_: None)
    assert write_fronts(str(repo), instances=2) == ["ensemble", "tensorrt_llm_bls", "tensorrt_llm"]
    # perf_analyzer reads the model config over gRPC, where it cannot send the admin key.
    with TritonServer(str(repo), log_path=os.path.join(str(repo), "..", "trtllm_server.log"),
                      unrestricted_apis=("model-config",)) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_kv_blocks=128)


def text_request(prompt, max_tokens=8, stream=False, **extra):
    inputs = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[max_tokens]], np.int32),
              "stream": np.array([[stream]]), "temperature": np.array([[1.0]], np.float32),
              "beam_width": np.array([[1]], np.int32), "exclude_input_in_output": np.array([[False]])}
    inputs.update(extra)
    return inputs


def greedy(offline, prompt, n=8, **kw):
    return offline.generate(prompt, SamplingParams(max_tokens=n, temperature=0, **kw))[0]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stream", [False, True])
def test_text_models_serve_what_llm_serves(trt_server, offline, model, stream):
    """As the TensorRT-LLM client sends it (temperature 1.0, no top_k/top_p: greedy in
    TensorRT-LLM); not streamed the prompt is echoed (exclude_input_in_output false)."""
    want = greedy(offline, PROMPTS[0])
    responses, error = infer(trt_server, model, text_request(PROMPTS[0], stream=stream),
                             outputs=("text_output", "batch_index", "sequence_index"))
    assert error is None
    texts = [r.as_numpy("text_output")[0].decode() for r in responses]
    if stream:
        assert len(texts) == len(want.token_ids) and "".join(texts) == want.text
    else:
        assert texts == [PROMPTS[0] + want.text]
    assert all(r.as_numpy("batch_index")[0][0] == 0 and r.as_numpy("sequence_index")[0][0] == 0 for r in responses)
    wait_blocks_free(trt_server)


@pytest.mark.parametrize("stream", [False, True])
def test_token_model_serves_what_llm_serves(trt_server, offline, stream):
    ids = offline.tokenizer.encode(PROMPTS[1])
    want = greedy(offline, ids)
    inputs = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[8]], np.int32), "streaming": np.array([[stream]]),
              "end_id": np.array([[-1]], np.int32), "pad_id": np.array([[0]], np.int32)}
    responses, error = infer(trt_server, "tensorrt_llm", inputs, outputs=("output_ids", "sequence_length"))
    assert error is None
    got = [list(r.as_numpy("output_ids")[0][0]) for r in responses]
    lengths = [int(r.as_numpy("sequence_length")[0][0]) for r in responses]
    if stream:  # only the new tokens, one response each
        assert sum(got, []) == want.token_ids and lengths == [1] * len(want.token_ids)
    else:  # the input echoed, as TensorRT-LLM does without exclude_input_in_output
        assert got == [ids + want.token_ids] and lengths == [len(ids) + len(want.token_ids)]
    wait_blocks_free(trt_server)


def test_a_batch_of_two_rows(trt_server, offline):
    inputs = {"text_input": np.array([[p] for p in PROMPTS], dtype=object),
              "max_tokens": np.array([[6], [6]], np.int32), "exclude_input_in_output": np.array([[True], [True]])}
    responses, error = infer(trt_server, "tensorrt_llm_bls", inputs, outputs=("text_output", "batch_index"))
    assert error is None
    by_row = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("text_output")[0].decode() for r in responses}
    assert by_row == {i: greedy(offline, p, 6).text for i, p in enumerate(PROMPTS)}
    wait_blocks_free(trt_server)


def test_num_return_sequences_are_the_seeded_children(trt_server, offline):
    """n sampled sequences: sequence i is the single request seeded random_seed + i."""
    extra = {"num_return_sequences": np.array([[3]], np.int32), "random_seed": np.array([[5]], np.uint64),
             "top_k": np.array([[50]], np.int32), "exclude_input_in_output": np.array([[True]])}
    responses, error = infer(trt_server, "ensemble", text_request(PROMPTS[0], **extra),
                             outputs=("text_output", "sequence_index"))
    assert error is None
    got = {int(r.as_numpy("sequence_index")[0][0]): r.as_numpy("text_output")[0].decode() for r in responses}
    want = {i: offline.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, top_k=50,
                                                           seed=5 + i))[0].text for i in range(3)}
    assert got == want and len(set(got.values())) > 1
    wait_blocks_free(trt_server)


def test_log_probs(trt_server, offline):
    want = greedy(offline, PROMPTS[0], logprobs=0)
    responses, error = infer(trt_server, "tensorrt_llm_bls",
                             text_request(PROMPTS[0], return_log_probs=np.array([[True]])),
                             outputs=("text_output", "cum_log_probs", "output_log_probs"))
    assert error is None and len(responses) == 1
    chosen = [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)]
    assert responses[0].as_numpy("output_log_probs")[0][0] == pytest.approx(chosen, abs=1e-4)
    assert responses[0].as_numpy("cum_log_probs")[0][0] == pytest.approx(want.cumulative_logprob, abs=1e-4)
    wait_blocks_free(trt_server)


def _words_in(offline, ids: list[int]) -> list[str]:
    """Two words the greedy output `ids` holds, as bad_words ban them: the first of
    several tokens, then one of one token after it."""
    encode = lambda text: offline.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    words, start = [], 0
    for n in (2, 1):
        for k in range(start, len(ids) - n + 1):
            word = offline.tokenizer.decode(ids[k:k + n]).strip()
            if len(word) > 3 and word.isalpha() and ids[k:k + n] in tokenize_words([word], encode):
                words.append(word)
                start = k + n
                break
    assert len(words) == 2, offline.tokenizer.decode(ids)
    return words


def test_bad_words_through_llm_ensemble_bls_and_tensorrt_llm(trt_server, offline):
    """Greedy, on a prompt whose output holds two words (one of several tokens): banned
    through `llm` (sampling_parameters bad_words, as vLLM's), `ensemble` and
    `tensorrt_llm_bls` (TensorRT-LLM's bad_words, comma-separated), streamed and not, and
    `tensorrt_llm` (bad_words_list ids), the words never appear and the output is the
    offline engine's with the same bad words."""
    free = greedy(offline, PROMPTS[0], 16)
    words = _words_in(offline, free.token_ids)
    assert all(w in free.text for w in words)
    want = greedy(offline, PROMPTS[0], 16, bad_words=words)
    assert want.token_ids != free.token_ids and not any(w in want.text for w in words)
    params = json.dumps({"max_tokens": 16, "temperature": 0, "bad_words": words})
    for stream in (False, True):
        llm = {"text_input": np.array([PROMPTS[0].encode()], dtype=object), "stream": np.array([stream]),
               "sampling_parameters": np.array([params.encode()], dtype=object),
               "exclude_input_in_output": np.array([True])}
        trt = text_request(PROMPTS[0], max_tokens=16, stream=stream, exclude_input_in_output=np.array([[True]]),
                           bad_words=np.array([[",".join(words)]], dtype=object))
        for model, inputs in (("llm", llm), ("ensemble", trt), ("tensorrt_llm_bls", trt)):
            responses, error = infer(trt_server, model, inputs)
            assert error is None, (model, error)
            text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses)
            assert text == want.text and not any(w in text for w in words), (model, stream, text)
    ids = offline.tokenizer.encode(PROMPTS[0])
    sequences = tokenize_words(words, lambda text: offline.tokenizer.encode(text, add_special_tokens=False))
    flat, ends = sum(sequences, []), np.cumsum([len(q) for q in sequences]).tolist()
    inputs = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[16]], np.int32),
              "bad_words_list": np.array([[flat, ends + [-1] * (len(flat) - len(ends))]], np.int32)}
    responses, error = infer(trt_server, "tensorrt_llm", inputs, outputs=("output_ids",))
    assert error is None and [list(r.as_numpy("output_ids")[0][0]) for r in responses] == [ids + want.token_ids]
    wait_blocks_free(trt_server)


@pytest.mark.parametrize("name, value, match", [
    ("bad_words", np.array([[",".join(f"w{i}" for i in range(200))]], dtype=object), "'bad_words'"),
    ("embedding_bias_words", np.array([["the"]], dtype=object), "'embedding_bias_words'"),
    ("beam_width", np.array([[2]], np.int32), "'beam_width'"),
    ("return_context_logits", np.array([[True]]), "'return_context_logits'"),
    ("return_generation_logits", np.array([[True]]), "'return_generation_logits'"),
    ("lora_task_id", np.array([[3]], np.uint64), "'lora_task_id'"),
    ("guided_decoding_guide_type", np.array([["json"]], dtype=object), "'guided_decoding_guide_type'"),
    ("max_tokens", np.array([[-3]], np.int32), "max_tokens"),
])
def test_unsupported_inputs_are_clear_errors(trt_server, offline, name, value, match):
    responses, error = infer(trt_server, "ensemble", text_request(PROMPTS[0], **{name: value}))
    assert error is not None and match in error and not responses
    ok, error = infer(trt_server, "ensemble", text_request(PROMPTS[0], exclude_input_in_output=np.array([[True]])))
    assert error is None and ok[0].as_numpy("text_output")[0].decode() == greedy(offline, PROMPTS[0]).text
    wait_blocks_free(trt_server)


def test_multi_token_stop_sequence_is_refused(trt_server):
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[4]], np.int32),
              "stop_words_list": np.array([[[11, 12], [2, -1]]], np.int32)}
    _, error = infer(trt_server, "tensorrt_llm", inputs, outputs=("output_ids",))
    assert error and "stop_words_list" in error
    wait_blocks_free(trt_server)


def test_client_cancellation_frees_the_engine(trt_server):
    inputs = text_request(PROMPTS[0], max_tokens=400, stream=True)
    responses, error = infer(trt_server, "tensorrt_llm_bls", inputs, cancel_after=3)
    assert error == "cancelled" and len(responses) >= 3
    wait_blocks_free(trt_server, timeout_s=20)


def test_stop_request_ends_a_running_request_only_with_its_key(trt_server):
    """TensorRT-LLM's way: a second request to tensorrt_llm with `stop` and the same id
    ends the first, which sends its final response; here only when the stop carries the
    `stop_key` the request was sent with (issue 49 item 6: request ids are guessable). A
    stop without a key is a clear error; one with another key ends nothing."""
    done: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(trt_server.grpc_url)
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    inputs = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[500]], np.int32), "streaming": np.array([[True]]),
              "end_id": np.array([[-1]], np.int32)}
    client.async_stream_infer("tensorrt_llm", [tensor(k, v) for k, v in inputs.items()], request_id="long-1",
                              enable_empty_final_response=True, parameters={"stop_key": "mine"})
    assert done.get(timeout=30)[1] is None  # it is generating
    stop = {"input_ids": np.array([[0]], np.int32), "input_lengths": np.array([[1]], np.int32),
            "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]])}

    def send_stop(**parameters):
        client.async_stream_infer("tensorrt_llm", [tensor(k, v) for k, v in stop.items()], request_id="long-1",
                                  enable_empty_final_response=True, parameters=parameters or None)

    def answer_to_stop():
        """Read until the stop's own answer: (long-1's tokens meanwhile, whether it ended,
        the stop's error)."""
        tokens, ended = 0, False
        while True:
            result, err = done.get(timeout=30)
            if err is not None:
                return tokens, ended, str(err)
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("output_ids") is not None:
                tokens, ended = tokens + 1, ended or final
            elif final:
                return tokens, ended, None

    send_stop()                                         # no key: refused
    read1, ended, error = answer_to_stop()
    assert error and "stop_key" in error and not ended
    send_stop(stop_key="guessed")                       # another key: ends nothing
    read2, ended, error = answer_to_stop()
    assert error is None and not ended
    # long-1 runs on: it sends more tokens after the wrong stop was answered
    more = 0
    while more < 5:
        result, err = done.get(timeout=30)
        assert err is None and not result.get_response().parameters["triton_final_response"].bool_param
        more += result.as_numpy("output_ids") is not None
    send_stop(stop_key="mine")                          # its own key: ends it
    tokens, finals = 1 + read1 + read2 + more, 0
    while finals < 2:  # the stop request's own final, and the stopped request's
        result, err = done.get(timeout=30)
        assert err is None
        finals += result.get_response().parameters["triton_final_response"].bool_param
        tokens += result.as_numpy("output_ids") is not None
    client.stop_stream()
    client.close()
    assert tokens < 500
    wait_blocks_free(trt_server, timeout_s=20)


def test_an_error_in_one_request_leaves_others_served(trt_server, offline):
    with pytest.raises(InferenceServerException):
        grpcclient.InferenceServerClient(trt_server.grpc_url).infer(
            "ensemble", [tensor("text_input", np.array([["x"]], dtype=object))])  # not decoupled-capable call
    responses, error = infer(trt_server, "ensemble", text_request(PROMPTS[1], exclude_input_in_output=np.array([[True]])))
    assert error is None and responses[0].as_numpy("text_output")[0].decode() == greedy(offline, PROMPTS[1]).text


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls", "tensorrt_llm"])
def test_every_output_asked_for_comes_in_every_response(trt_server, model):
    """What perf_analyzer and genai-perf ask for: every output of the model's config. Each
    streamed response has them all (perf_analyzer 24.10 reads an absent one as heap
    garbage, and a NaN there leaves its profile export empty)."""
    config = grpcclient.InferenceServerClient(trt_server.grpc_url).get_model_config(model, as_json=True)
    names = [o["name"] for o in config["config"]["output"]]
    inputs = (text_request(PROMPTS[1], max_tokens=3, stream=True) if model != "tensorrt_llm" else
              {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
               "request_output_len": np.array([[3]], np.int32), "streaming": np.array([[True]])})
    responses, error = infer(trt_server, model, inputs, outputs=names)
    assert error is None and len(responses) == 3
    for r in responses:
        assert all(r.as_numpy(n) is not None and r.as_numpy(n).size for n in names), names
        assert r.as_numpy("output_log_probs").tolist() == [[[0.0]]] and r.as_numpy("cum_log_probs").tolist() == [[0.0]]
    wait_blocks_free(trt_server)


def test_perf_analyzer_against_ensemble(trt_server):
    from benchmarks import perf_analyzer
    r = perf_analyzer.run(trt_server.grpc_url, model="ensemble", concurrency=2, seconds=2, max_tokens=8,
                          contract="tensorrtllm", max_trials=10)
    assert r["infer_per_s"] > 0
    wait_blocks_free(trt_server)


def test_genai_perf_tensorrtllm_backend(trt_server, tiny_ckpt):
    """genai-perf (own venv) with --backend tensorrtllm -m ensemble, as TensorRT-LLM users run it."""
    from benchmarks import genai_perf
    r = genai_perf.run(trt_server.grpc_url, tiny_ckpt, model="ensemble", concurrency=2, input_tokens=32,
                       output_tokens=16, request_count=8, entries=10, backend="tensorrtllm")
    assert r["request_count"]["avg"] == 8        # every request measured, none lost
    assert r["time_to_first_token"]["avg"] > 0 and r["output_token_throughput"]["avg"] > 0
    wait_blocks_free(trt_server)


def test_engine_failure_mid_stream_is_an_error_not_a_hang(tmp_path, tiny_ckpt):
    """Its own server: `llm` with the test-only fault hook (tests/helpers/faults.py) and the
    three fronts. The engine fails while an `ensemble` stream is running: the client gets
    an error, promptly."""
    from tests.helpers.faults import build_fault_repo, trigger
    repo = build_fault_repo(str(tmp_path), tiny_ckpt)
    write_fronts(repo, instances=1)
    # Triton 24.10's ensemble keeps the failed stream's request live, so its shutdown waits
    # out the exit timeout (30 s by default): 3 s here, the test is about the client.
    with TritonServer(repo, log_path=str(tmp_path / "server.log"), extra_args=["--exit-timeout-secs", "3"]) as srv:
        done: "queue.Queue" = queue.Queue()
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        client.start_stream(callback=lambda result, error: done.put((result, error)))
        inputs = text_request(PROMPTS[0], max_tokens=500, stream=True, end_id=np.array([[-1]], np.int32))
        client.async_stream_infer("ensemble", [tensor(k, v) for k, v in inputs.items()],
                                  enable_empty_final_response=True)
        assert done.get(timeout=30)[1] is None  # streaming
        trigger(repo, "crash")
        while True:
            result, error = done.get(timeout=30)
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        client.close()
        assert error is not None and "ended without its final response" in str(error)
