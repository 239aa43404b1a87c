"""TensorRT-LLM's contract <-> the llm model's (backend/triton_server/trtllm_contract.py),
without a server."""

import json

import numpy as np
import pytest

from backend.engine.errors import InvalidRequestError
from backend.triton_server.trtllm_contract import (OUTPUT_SPECS, TEXT, TOKENS, batch_size, row_request,
                                                      row_responses)


def text(prompt="hi", **extra):
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object), "max_tokens": np.array([[8]], np.int32)}
    inputs.update({k: np.array([[v]]) if not isinstance(v, np.ndarray) else v for k, v in extra.items()})
    return inputs


def sampling(row):
    return json.loads(row.inputs["sampling_parameters"][0])


def test_default_is_greedy_as_in_tensorrt_llm():
    """No top_k and no top_p (or both 0): TensorRT-LLM samples greedily, whatever the temperature."""
    assert sampling(row_request(TEXT, text(temperature=np.array([[1.0]], np.float32)), 0)) == {
        "max_tokens": 8, "temperature": 0.0}
    s = sampling(row_request(TEXT, text(top_k=np.array([[40]], np.int32), top_p=np.array([[0.0]], np.float32),
                                        temperature=np.array([[0.7]], np.float32)), 0))
    assert s == {"max_tokens": 8, "temperature": pytest.approx(0.7), "top_k": 40, "top_p": 1.0}
    s = sampling(row_request(TEXT, text(top_k=np.array([[0]], np.int32), top_p=np.array([[0.9]], np.float32)), 0))
    assert s["top_k"] == -1 and s["top_p"] == pytest.approx(0.9) and "temperature" not in s


def test_scalars_map_to_sampling_parameters():
    row = row_request(TEXT, text(random_seed=np.array([[7]], np.uint64), min_length=np.array([[2]], np.int32),
                                 num_return_sequences=np.array([[3]], np.int32),
                                 repetition_penalty=np.array([[1.1]], np.float32),
                                 end_id=np.array([[2]], np.int32), return_log_probs=np.array([[True]])), 0)
    s = sampling(row)
    assert (s["seed"], s["min_tokens"], s["n"], s["stop_token_ids"], s["ignore_eos"], s["logprobs"]) == (
        7, 2, 3, [2], True, 0)
    assert row.return_log_probs and bool(row.inputs["return_logprobs"][0])
    # end_id -1: no end token at all
    assert sampling(row_request(TEXT, text(end_id=np.array([[-1]], np.int32)), 0))["ignore_eos"] is True


def test_streaming_never_echoes_the_prompt():
    row = row_request(TEXT, text(stream=True, exclude_input_in_output=False), 0)
    assert row.stream and bool(row.inputs["exclude_input_in_output"][0])
    row = row_request(TEXT, text(exclude_input_in_output=False), 0)
    assert not bool(row.inputs["exclude_input_in_output"][0])


@pytest.mark.parametrize("name, value", [
    ("embedding_bias_words", np.array([[b"x"]], dtype=object)), ("embedding_bias_weights", np.array([[0.5]], np.float32)),
    ("return_generation_logits", np.array([[True]])), ("lora_task_id", np.array([[1]], np.uint64)),
    ("guided_decoding_guide", np.array([[b"{}"]], dtype=object)), ("num_draft_tokens", np.array([[4]], np.int32)),
])
def test_unsupported_inputs_name_themselves(name, value):
    with pytest.raises(InvalidRequestError, match=f"'{name}'"):
        row_request(TEXT, text(**{name: value}), 0)


def test_unsupported_inputs_left_empty_or_false_are_fine():
    row_request(TEXT, text(bad_words=np.array([[b""]], dtype=object), return_context_logits=False,
                           embedding_bias_weights=np.array([[0.0]], np.float32)), 0)


def test_bad_words_pass_through_as_sampling_parameters():
    """Text models: each BYTES element a word, or several separated by commas (as
    TensorRT-LLM's preprocessing took them); tensorrt_llm: the [2, L] id layout."""
    row = row_request(TEXT, text(bad_words=np.array([[b"cat, dog", b'"a,b"', b""]], dtype=object)), 0)
    assert sampling(row)["bad_words"] == ["cat", " dog", "a,b"]
    assert "bad_words" not in sampling(row_request(TEXT, text(bad_words=np.array([[b""]], dtype=object)), 0))
    with pytest.raises(InvalidRequestError, match="'bad_words'"):
        row_request(TEXT, text(bad_words=np.array([[b"\xff"]], dtype=object)), 0)
    # words [9], [11, 12], [13]; offsets padded with -1, ids with 0
    row = row_request(TOKENS, tokens([4], bad_words_list=np.array([[[9, 11, 12, 13, 0], [1, 3, 4, -1, -1]]],
                                                                  np.int32)), 0)
    assert sampling(row)["bad_words_token_ids"] == [[9], [11, 12], [13]]
    assert "bad_words_token_ids" not in sampling(row_request(TOKENS, tokens([4], bad_words_list=np.zeros(
        (1, 2, 0), np.int32)), 0))
    for bad in ([[[9, 11], [2, 1]]], [[[9, 11], [3, -1]]], [[9, 11, 12]], [[[9, -4], [1, 2]]]):
        with pytest.raises(InvalidRequestError, match="'bad_words_list'"):
            row_request(TOKENS, tokens([4], bad_words_list=np.array(bad, np.int32)), 0)


def test_beam_search_is_refused():
    with pytest.raises(InvalidRequestError, match="beam_width"):
        row_request(TEXT, text(beam_width=np.array([[4]], np.int32)), 0)


def test_batch_rows_and_shared_scalars():
    inputs = {"text_input": np.array([[b"a"], [b"b"]], dtype=object), "max_tokens": np.array([[4]], np.int32)}
    assert batch_size(TEXT, inputs) == 2
    rows = [row_request(TEXT, inputs, b) for b in range(2)]
    assert [r.inputs["text_input"][0] for r in rows] == [b"a", b"b"]
    assert all(sampling(r)["max_tokens"] == 4 for r in rows)
    with pytest.raises(InvalidRequestError, match="rows"):
        row_request(TEXT, {**inputs, "max_tokens": np.array([[4], [5]], np.int32)}, 2)


def tokens(ids, length=None, **extra):
    inputs = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[length or len(ids)]], np.int32),
              "request_output_len": np.array([[5]], np.int32)}
    inputs.update(extra)
    return inputs


def test_token_rows_respect_input_lengths_and_single_token_stop_words():
    row = row_request(TOKENS, tokens([4, 5, 6, 0], 3, stop_words_list=np.array([[[9, 11], [1, 2]]], np.int32)), 0)
    assert list(row.inputs["input_ids"]) == [4, 5, 6] and sampling(row)["stop_token_ids"] == [9, 11]
    with pytest.raises(InvalidRequestError, match="stop_words_list"):
        row_request(TOKENS, tokens([4], stop_words_list=np.array([[[9, 11], [2, -1]]], np.int32)), 0)
    with pytest.raises(InvalidRequestError, match="input_lengths"):
        row_request(TOKENS, tokens([4, 5], 3), 0)


def llm_outputs(texts, ids, counts, cumulative=None, logprobs=None):
    out = {"text_output": np.array([t.encode() for t in texts], dtype=object),
           "output_ids": np.array(ids, np.int32), "num_output_tokens": np.array(counts, np.uint32)}
    if cumulative is not None:
        out["cumulative_logprob"] = np.array(cumulative, np.float32)
        out["logprobs"] = np.array([json.dumps(e).encode() for e in logprobs], dtype=object)
    return out


def test_token_responses_echo_the_input_unless_streamed():
    row = row_request(TOKENS, tokens([4, 5]), 0)
    [resp] = row_responses(TOKENS, row, llm_outputs(["xy"], [7, 8], [2]))
    assert resp["output_ids"].tolist() == [[[4, 5, 7, 8]]] and resp["sequence_length"].tolist() == [[4]]
    row = row_request(TOKENS, tokens([4, 5], streaming=np.array([[True]])), 0)
    [resp] = row_responses(TOKENS, row, llm_outputs(["y"], [8], [1]))
    assert resp["output_ids"].tolist() == [[[8]]]


def test_streamed_sequences_split_by_index_with_log_probs():
    row = row_request(TEXT, text(stream=True, num_return_sequences=np.array([[2]], np.int32),
                                 return_log_probs=np.array([[True]])), 0)
    out = llm_outputs(["", "b"], [[-1], [3]], [0, 1], [0.0, -0.5], [[], [{"3": {"logprob": -0.5}}]])
    [resp] = row_responses(TEXT, row, out)
    assert resp["sequence_index"].tolist() == [[1]] and resp["text_output"].tolist() == [b"b"]
    assert resp["output_log_probs"].tolist() == [[[-0.5]]] and resp["cum_log_probs"].tolist() == [[-0.5]]


@pytest.mark.parametrize("contract", [TEXT, TOKENS])
@pytest.mark.parametrize("stream", [False, True])
def test_every_response_carries_every_declared_output(contract, stream):
    """perf_analyzer and genai-perf ask for every output of the model config. perf_analyzer
    24.10 reads one a response lacks from a zero-byte buffer: heap garbage, sometimes a
    NaN, and then it writes an empty profile export. So the log probs come as zeros
    when not asked for, one per new token, like the real ones."""
    inputs = text(stream=stream) if contract == TEXT else tokens([4, 5], streaming=np.array([[stream]]))
    row = row_request(contract, inputs, 0)
    [resp] = row_responses(contract, row, llm_outputs(["xy"], [7, 8], [2]))
    assert set(resp) == {o["name"] for o in OUTPUT_SPECS[contract]}
    assert resp["cum_log_probs"].tolist() == [[0.0]] and resp["output_log_probs"].tolist() == [[[0.0, 0.0]]]
    assert all(v.size for v in resp.values())       # (an empty tensor is read the same way)


def test_multimodal_image_inputs_become_the_llm_models_image_input():
    """TensorRT-LLM's ensemble takes raw pixels (image_bytes_input, channels first or
    last) or image URLs (image_url_input): each row's images reach `llm` as base64 image
    files; preprocessed image_input, fetched URLs and two kinds at once are refused."""
    import base64
    import io

    from PIL import Image
    pixels = np.random.default_rng(0).integers(0, 255, (2, 3, 8, 6), dtype=np.uint8)     # [images, C, H, W]
    for layout in (pixels, pixels.transpose(0, 2, 3, 1)):
        row = row_request(TEXT, text(image_bytes_input=layout[None]), 0)
        decoded = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in row.inputs["image"]]
        assert all(np.array_equal(d, p.transpose(1, 2, 0)) for d, p in zip(decoded, pixels))
    url = b"data:image/png;base64,iVBORw0KGgo="
    assert row_request(TEXT, text(image_url_input=np.array([[url]], dtype=object)), 0).inputs["image"].tolist() == [url]
    assert "image" not in row_request(TEXT, text(), 0).inputs
    for extra, message in (({"image_url_input": np.array([[b"https://x.org/a.png"]], dtype=object)}, "scheme 'https'"),
                           ({"image_input": np.ones((1, 1, 3, 4, 4), dtype=np.float16)}, "'image_input'"),
                           ({"image_bytes_input": pixels[None], "image_url_input": np.array([[url]], dtype=object)},
                            "one image input per request"),
                           ({"image_bytes_input": np.zeros((1, 2, 5, 4, 6), dtype=np.uint8)}, "3 or 4 channels")):
        with pytest.raises(InvalidRequestError, match=message):
            row_request(TEXT, text(**extra), 0)
