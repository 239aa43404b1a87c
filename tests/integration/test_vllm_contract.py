"""vLLM-backend contract details and per-token logprobs through the session's real tritonserver (supervised, as `make
serve`), in the vLLM backend's contract: inputs `return_logprobs` and
`return_cumulative_logprob`, outputs `logprobs` (JSON: per token {id: {logprob, rank,
decoded_token}}, only the new tokens' on each streamed response; null when the sampling
parameter `logprobs` was not set) and `cumulative_logprob`; with `return_prompt_logprobs`,
the output `prompt_logprobs` (the sampling parameter's, vLLM's list, sent once)."""

import json

import numpy as np
import pytest

from backend import LLM, SamplingParams
from clients.triton_client import StreamingRequest
from tests.integration.conftest import infer, metric, wait_blocks_free

PROMPT = "The yield statement"
FLAGS = {"return_logprobs": np.array([True]), "return_cumulative_logprob": np.array([True])}


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1,
                                                 ignore_eos=True))[0]


def as_offline(entries):
    return [{int(t): (round(d["logprob"], 4), d["rank"], d["decoded_token"]) for t, d in e.items()}
            for e in entries]


def as_offline_entries(entries):
    return [{t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()} for e in entries]


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_equal_offline(server, offline, stream):
    params = {"max_tokens": 8, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True}
    res = StreamingRequest(server.grpc_url).run(PROMPT, params, stream=stream,
                                                extra={**FLAGS, "return_prompt_logprobs": np.array([True])})
    assert res.ok, res.error
    # The prompt's, once (the first response), null first, as the offline engine's.
    sent = [p for p in res.prompt_logprobs if p is not None]
    assert len(sent) == 1 and res.prompt_logprobs[0] == sent[0] and sent[0][0] is None
    assert as_offline(sent[0][1:]) == as_offline_entries(offline.prompt_logprobs[1:])
    assert res.token_ids == offline.token_ids
    if stream:  # one token per response, each with its own entry only
        assert all(len(entries) == 1 for entries in res.logprobs)
    got = [e for entries in res.logprobs for e in entries]
    assert as_offline(got) == as_offline_entries(offline.logprobs)
    assert res.cumulative_logprobs[-1] == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    if stream:
        assert len(set(res.cumulative_logprobs)) == len(res.cumulative_logprobs)  # changes every token
    wait_blocks_free(server)


def test_cumulative_without_logprobs_says_null(server, offline):
    """As the vLLM backend: cumulative_logprob is sent, logprobs is null without the
    sampling parameter."""
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    res = StreamingRequest(server.grpc_url).run(PROMPT, params, extra=FLAGS)
    assert res.ok and res.logprobs and all(entries is None for entries in res.logprobs)
    assert res.cumulative_logprobs[-1] == pytest.approx(offline.cumulative_logprob, abs=1e-4)
    plain = StreamingRequest(server.grpc_url).run(PROMPT, params)
    assert plain.ok and not plain.logprobs and not plain.cumulative_logprobs
    wait_blocks_free(server)


def test_too_many_logprobs_is_a_clear_error(server):
    res = StreamingRequest(server.grpc_url).run(PROMPT, {"max_tokens": 2, "logprobs": 21}, extra=FLAGS)
    assert res.error and "logprobs" in res.error
    wait_blocks_free(server)


def test_streamed_rank_one_tokens_spell_the_text(server):
    """The vLLM backend's own consistency check: each streamed response's rank-1
    `decoded_token`s are its `text_output`; finish_reason is "None" until the last."""
    res = StreamingRequest(server.grpc_url).run(PROMPT, {"max_tokens": 12, "temperature": 0, "logprobs": 2,
                                                         "ignore_eos": True}, extra=FLAGS)
    assert res.ok and len(res.pieces) == 12
    for piece, entries in zip(res.pieces, res.logprobs):
        assert piece == "".join(d["decoded_token"] for e in entries for d in e.values() if d["rank"] == 1)
    assert res.finish_reasons == ["None"] * 11 + ["length"]
    wait_blocks_free(server)


def test_request_parameters_stand_in_for_the_tensor(server):
    """Sampling parameters sent as Triton request parameters, no tensor: honoured."""
    res = StreamingRequest(server.grpc_url).run(PROMPT, None, parameters={"max_tokens": 3, "temperature": 0})
    assert res.ok and len(res.token_ids) == 3
    bad = StreamingRequest(server.grpc_url).run(PROMPT, None, parameters={"max_tokens": 3, "best_of": 2})
    assert bad.error and "best_of" in bad.error
    wait_blocks_free(server)


def vllm_request(prompt, sampling, stream):
    return {"text_input": np.array([prompt.encode()], dtype=object), "stream": np.array([stream]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
            "return_finish_reason": np.array([True]), "return_num_output_tokens": np.array([True])}


def seeded_children(tiny_ckpt, n, **params):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    return [llm.generate(PROMPT, SamplingParams(seed=params["seed"] + i, **{k: v for k, v in params.items()
                                                                          if k != "seed"}))[0] for i in range(n)]


def test_n_sequences_in_one_response(server, tiny_ckpt):
    """As the vLLM backend: `n` texts in `text_output`, each with the prompt echoed
    (a single response); sequence i is the request seeded seed + i."""
    sampling = {"n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 6, "ignore_eos": True}
    responses, error = infer(server, "llm", vllm_request(PROMPT, sampling, False),
                             outputs=("text_output", "finish_reason", "num_output_tokens"))
    assert error is None and len(responses) == 1
    want = seeded_children(tiny_ckpt, 3, seed=5, temperature=1.0, max_tokens=6, ignore_eos=True)
    assert [t.decode() for t in responses[0].as_numpy("text_output")] == [PROMPT + w.text for w in want]
    assert list(responses[0].as_numpy("finish_reason")) == [b"length"] * 3
    assert list(responses[0].as_numpy("num_output_tokens")) == [6, 6, 6]
    assert len({w.text for w in want}) > 1
    wait_blocks_free(server)


def test_n_sequences_streamed(server, tiny_ckpt):
    """Streamed: each response has n entries, the sequence that moved carries its delta."""
    sampling = {"n": 2, "seed": 9, "temperature": 1.0, "max_tokens": 5, "ignore_eos": True}
    responses, error = infer(server, "llm", vllm_request(PROMPT, sampling, True),
                             outputs=("text_output", "finish_reason", "num_output_tokens"))
    assert error is None and len(responses) == 10
    texts = ["", ""]
    for r in responses:
        entries = [t.decode() for t in r.as_numpy("text_output")]
        counts = list(r.as_numpy("num_output_tokens"))
        assert len(entries) == 2 and sorted(counts) == [0, 1]
        texts = [a + b for a, b in zip(texts, entries)]
    assert list(responses[-1].as_numpy("finish_reason")) == [b"length", b"length"]
    want = seeded_children(tiny_ckpt, 2, seed=9, temperature=1.0, max_tokens=5, ignore_eos=True)
    assert texts == [w.text for w in want]
    wait_blocks_free(server)


VLLM_COUNTS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
               "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
               "vllm:request_prompt_tokens_count", "vllm:request_prompt_tokens_sum",
               "vllm:request_generation_tokens_count", "vllm:request_generation_tokens_sum",
               "vllm:request_params_n_count", "vllm:request_params_n_sum"]


def test_vllm_metrics_count_a_known_workload_right_after_it(server, tiny_ckpt):
    """The vLLM backend's metrics test, ours: scraped right after the last response (no
    waiting), each family counts exactly what was sent and generated; time per output
    token is observed once per generated token after the first."""
    tok = LLM(tiny_ckpt, block_size=16, num_kv_blocks=16).tokenizer
    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    before = {n: metric(server, n) for n in VLLM_COUNTS}
    for stream in (False, True):
        for p in prompts:
            _, error = infer(server, "llm", vllm_request(p, {"max_tokens": 16, "temperature": 0, "ignore_eos": True},
                                                         stream), outputs=("text_output",))
            assert error is None
    _, error = infer(server, "llm", vllm_request(prompts[0], {"n": 2, "max_tokens": 4, "ignore_eos": True}, False))
    assert error is None
    after = {n: metric(server, n) for n in VLLM_COUNTS}
    prompt_tokens = 2 * sum(len(tok.encode(p)) for p in prompts) + 2 * len(tok.encode(prompts[0]))
    sequences, generated = 6 + 2, 6 * 16 + 2 * 4
    want = {"vllm:prompt_tokens_total": prompt_tokens, "vllm:generation_tokens_total": generated,
            "vllm:time_to_first_token_seconds_count": sequences,
            "vllm:time_per_output_token_seconds_count": generated - sequences,
            "vllm:e2e_request_latency_seconds_count": sequences, "vllm:request_prompt_tokens_count": sequences,
            "vllm:request_prompt_tokens_sum": prompt_tokens, "vllm:request_generation_tokens_count": sequences,
            "vllm:request_generation_tokens_sum": generated, "vllm:request_params_n_count": 7,
            "vllm:request_params_n_sum": 6 + 2}
    assert {n: after[n] - before[n] for n in VLLM_COUNTS} == want
    labels = server.metrics()
    assert 'vllm:num_requests_running{model="llm",version="1"}' in labels
    wait_blocks_free(server)


def test_genai_perf_vllm_contract(server, tiny_ckpt):
    """genai-perf (own venv, numpy 2) with --backend vllm against our model over gRPC."""
    from benchmarks import genai_perf
    r = genai_perf.run(server.grpc_url, tiny_ckpt, concurrency=2, input_tokens=32, output_tokens=16,
                       request_count=8, entries=10)
    assert r["request_count"]["avg"] == 8        # every request measured, none lost
    assert r["time_to_first_token"]["avg"] > 0 and r["output_token_throughput"]["avg"] > 0
