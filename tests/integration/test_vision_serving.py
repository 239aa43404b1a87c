"""Images served: a real tritonserver (with the supervised OpenAI frontend, as `make
serve` runs it) serving a tiny random Qwen2-VL checkpoint, built with `builder build`.
The official `openai` client sends data: URL images in chat (and the Responses API's
input_image) and gets the offline engine's tokens; Triton's gRPC and HTTP generate take
the vLLM backend's `image` input the same way, and TensorRT-LLM's `ensemble` its
`image_bytes_input`. Each bad image is a 400 naming the
problem while a text stream runs on undisturbed, and the pool ends free. Starts its own
server (model `llm`)."""

import base64
import io
import json
import threading
import urllib.request

import numpy as np
import pytest

from backend import LLM, SamplingParams
from clients.tritonserver import TritonServer
from tests.helpers.vl_checkpoints import make_images, make_qwen2_vl
from builder.trtllm_models import write_fronts
from tests.integration.conftest import build_repo, infer, openai_frontend, wait_blocks_free

pytestmark = pytest.mark.integration

KEY = "sk-vision-0123456789"
LIMITS = dict(limit_mm_per_prompt={"image": 2}, max_image_bytes=200_000, max_image_pixels=1_000_000)


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    ckpt = make_qwen2_vl(str(root / "qwen2_vl"), tokenizer=True)
    repo = build_repo(root / "repo", ckpt, **LIMITS)
    write_fronts(repo, instances=1)
    with TritonServer(repo, log_path=str(root / "server.log"), supervised=True, openai=True,
                      api_keys=(KEY,)) as srv:
        yield srv, ckpt


def offline(ckpt: str, messages: list[dict], images: list, max_tokens: int) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    llm = LLM(ckpt, dtype="float32", block_size=16, num_kv_blocks=256, max_num_batched_tokens=256,
              max_model_len=1024, **LIMITS)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0))[0]
    return out.text, out.token_ids, text


def test_openai_chat_and_responses_with_images_give_the_offline_tokens(vl_server):
    import openai
    srv, ckpt = vl_server
    client = openai.OpenAI(base_url=openai_frontend(srv) + "/v1", api_key=KEY, max_retries=0)
    images = make_images([(70, 120), (100, 60)], seed=11)
    messages = [{"role": "user", "content": [{"type": "text", "text": "compare "}, {"type": "image"},
                                             {"type": "text", "text": " and "}, {"type": "image"}]}]
    text, tokens, prompt = offline(ckpt, messages, images, 16)
    sent = [{"role": "user", "content": [{"type": "text", "text": "compare "}, image_part(data_url(png(images[0]))),
                                         {"type": "text", "text": " and "}, image_part(data_url(png(images[1])))]}]
    reply = client.chat.completions.create(model="llm", messages=sent, max_tokens=16, temperature=0,
                                           extra_body={"min_tokens": 16})
    assert reply.choices[0].message.content == text and reply.usage.completion_tokens == 16
    response = client.responses.create(model="llm", max_output_tokens=16, temperature=0, extra_body={"min_tokens": 16},
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "compare "},
                                           {"type": "input_image", "image_url": data_url(png(images[0]))},
                                           {"type": "input_text", "text": " and "},
                                           {"type": "input_image", "image_url": data_url(png(images[1]))}]}])
    assert response.output_text == text
    # Triton's own endpoints, with the vLLM backend's `image` input (base64 per image).
    b64 = np.array([base64.b64encode(png(image)) for image in images], dtype=object)
    sampling = json.dumps({"max_tokens": 16, "min_tokens": 16, "temperature": 0})
    responses, error = infer(srv, "llm", {"text_input": np.array([prompt.encode()], dtype=object), "image": b64,
                                          "sampling_parameters": np.array([sampling.encode()], dtype=object)},
                             outputs=("text_output", "output_ids"))
    assert error is None and responses[-1].as_numpy("output_ids").tolist() == tokens
    body = json.dumps({"text_input": prompt, "image": [b.decode() for b in b64], "sampling_parameters": sampling,
                       "exclude_input_in_output": True})
    with urllib.request.urlopen(urllib.request.Request(f"http://{srv.http_url}/v2/models/llm/generate", body.encode(),
                                                       {"Content-Type": "application/json"}), timeout=60) as r:
        assert json.loads(r.read())["text_output"] == text
    # TensorRT-LLM's ensemble, raw pixels [batch, images, H, W, C], one image.
    one_text, _, one_prompt = offline(ckpt, [{"role": "user", "content": [{"type": "image"}]}], images[:1], 16)
    responses, error = infer(srv, "ensemble", {
        "text_input": np.array([[one_prompt.encode()]], dtype=object), "max_tokens": np.array([[16]], np.int32),
        "min_length": np.array([[16]], np.int32), "exclude_input_in_output": np.array([[True]]),
        "image_bytes_input": np.asarray(images[0])[None, None]})
    assert error is None and "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses) == one_text
    wait_blocks_free(srv)


def test_each_bad_image_is_a_400_naming_it_while_a_text_stream_completes(vl_server):
    import openai
    from PIL import Image
    srv, _ = vl_server
    client = openai.OpenAI(base_url=openai_frontend(srv) + "/v1", api_key=KEY, max_retries=0)
    done = {}

    def stream():
        chunks = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "tell a story"}],
                                                max_tokens=300, temperature=0, stream=True,
                                                extra_body={"min_tokens": 300})
        done["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    runner = threading.Thread(target=stream)
    runner.start()
    small = png(make_images([(40, 40)])[0])
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (400, 400, 3), dtype=np.uint8))
    tiff = io.BytesIO()
    make_images([(40, 40)])[0].save(tiff, format="TIFF")
    cases = [([data_url(small)] * 3, "limit_mm_per_prompt allows 2"),
             ([data_url(png(noise))], "exceeds the limit of 200000 bytes"),
             ([data_url(png(Image.new("RGB", (2000, 2000))))], "exceeds the limit of 1000000 pixels"),
             ([data_url(b"\x89PNG\r\n\x1a\n" + bytes(300))], "not a decodable image"),
             ([data_url(tiff.getvalue(), "image/tiff")], "unsupported image format TIFF"),
             (["http://example.com/cat.png"], "scheme 'http'")]
    for urls, message in cases:
        content = [{"type": "text", "text": "what is this?"}] + [image_part(u) for u in urls]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="llm", messages=[{"role": "user", "content": content}],
                                           max_tokens=4)
        assert message in str(e.value), (message, str(e.value))
    runner.join(timeout=120)
    assert done.get("finish") == "length"
    wait_blocks_free(srv)
