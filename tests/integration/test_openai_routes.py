"""The frontend's smaller routes against the session's real tritonserver, and
/v1/embeddings against a server of its own holding a tiny Qwen3-Embedding-style model
(runner pooling), with the official `openai` client, typed and raw (its `post` for the
routes it has no method for): models.retrieve and its 404, /tokenize and /detokenize
round trips whose counts are the completions' usage, /metrics without a key, and
embeddings equal to transformers' last-token hidden states, normalized (fp32, <= 1e-5).

The embedding model has a server of its own rather than a place in the session's
repository: two paged_llm engines in one tritonserver lose a backend process to a
SIGSEGV at startup in about one start of three (reproduced with two copies of `llm`;
docs/archive/status-notes.md), which would make every test of the session flaky."""

import base64
import re
import urllib.request

import numpy as np
import pytest

from builder.build import BuildOptions, build
from clients.tritonserver import TritonServer
from tests.integration.conftest import API_KEY, openai_frontend, wait_blocks_free

openai = pytest.importorskip("openai")
TEXTS = ["The pass statement does nothing.", "A generator yields values one at a time, lazily."]
EMBED_MODEL = "qwen3-embed"


def raw_post(url: str, path: str, body: dict) -> dict:
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0).post(path, body=body, cast_to=object)


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:        # no key
        return r.read().decode()


def counted(text: str, handler: str, method: str, status: str) -> bool:
    return re.search(rf'http_requests_total\{{handler="{re.escape(handler)}",method="{method}",status="{status}"\}} '
                     r'[1-9]', text) is not None


@pytest.fixture(scope="module")
def embed_ckpt(tmp_path_factory, tiny_ckpt):
    """A tiny Qwen3-Embedding-style checkpoint with the default model's tokenizer."""
    from tests.helpers.checkpoints import make_embedding_checkpoint
    return make_embedding_checkpoint(str(tmp_path_factory.mktemp("embed") / "qwen3-embed"), seed=1,
                                     tokenizer_from=tiny_ckpt)


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, embed_ckpt):
    repo = tmp_path_factory.mktemp("embed-repo")
    build(BuildOptions.create(checkpoint=embed_ckpt, output=str(repo / EMBED_MODEL), name=EMBED_MODEL, link=True,
                              runner="pooling", block_size=16, num_kv_blocks=64, max_num_seqs=8,
                              max_num_batched_tokens=64, max_model_len=512, grace_period_s=2.0),
          log=lambda *_: None, progress=False)
    with TritonServer(str(repo), log_path=str(repo / "server.log"), supervised=True, openai=True,
                      api_keys=(API_KEY,)) as srv:
        yield srv


def test_models_tokenize_and_metrics_routes(server, tiny_ckpt):
    from transformers import AutoTokenizer

    url = openai_frontend(server)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)

    def post(path: str, body: dict) -> dict:
        return raw_post(url, path, body)

    # GET /v1/models/{id}
    assert client.models.retrieve("llm").id == "llm" and client.models.retrieve("sql").parent == "llm"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == 404 and e.value.body["param"] == "model"

    # /tokenize -> the completion's prompt tokens; /detokenize back
    r = post("/tokenize", {"model": "llm", "prompt": TEXTS[0]})
    assert r["tokens"] == tok(TEXTS[0])["input_ids"] and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    done = client.completions.create(model="llm", prompt=TEXTS[0], max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens == r["count"]
    assert post("/detokenize", {"model": "llm", "tokens": r["tokens"]}) == {"prompt": TEXTS[0]}
    messages = [{"role": "user", "content": TEXTS[1]}]
    chat = post("/tokenize", {"model": "llm", "messages": messages})
    done = client.chat.completions.create(model="llm", messages=messages, max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens == chat["count"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).post(
            "/tokenize", body={"model": "llm", "prompt": "x"}, cast_to=object)

    text = metrics_text(url)
    for handler, method, status in (("/tokenize", "POST", "200"), ("/detokenize", "POST", "200"),
                                    ("/v1/models/{model_id:path}", "GET", "404"),
                                    ("/v1/completions", "POST", "200")):
        assert counted(text, handler, method, status), (handler, status)
    assert 'http_request_duration_seconds_count{handler="/tokenize",method="POST",status="200"}' in text


def test_embeddings_equal_transformers(embed_server, tiny_ckpt, embed_ckpt):
    from transformers import AutoTokenizer

    from tests.helpers.checkpoints import hf_last_token_embeddings
    url = openai_frontend(embed_server)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)

    def post(path: str, body: dict) -> dict:
        return raw_post(url, path, body)

    # /v1/embeddings: the client's default (base64), floats, token ids; usage
    ids = [tok(t)["input_ids"] for t in TEXTS]
    ref = [v.numpy() for v in hf_last_token_embeddings(embed_ckpt, ids)]
    out = client.embeddings.create(model=EMBED_MODEL, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == sum(map(len, ids))
    for d, want in zip(out.data, ref):
        assert np.abs(np.asarray(d.embedding, dtype=np.float32) - want).max() <= 1e-5
    floats = post("/v1/embeddings", {"model": EMBED_MODEL, "input": ids[1], "encoding_format": "float"})
    assert np.abs(np.asarray(floats["data"][0]["embedding"]) - ref[1]).max() <= 1e-5
    b64 = post("/v1/embeddings", {"model": EMBED_MODEL, "input": ids, "encoding_format": "base64"})
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]]
    assert all(np.abs(v - w).max() <= 1e-5 for v, w in zip(vectors, ref))
    assert client.embeddings.create(model=EMBED_MODEL, input=TEXTS[0]).usage.total_tokens == len(ids[0])
    # an embedding model on the completion routes, dimensions, a prompt past max_model_len
    # (the engine's 400): each a 400 naming the field (a generative model on /v1/embeddings:
    # tests/unit/frontend/test_routes.py)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=EMBED_MODEL, prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBED_MODEL, input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBED_MODEL, input=[[5] * 600, ids[0]])
    assert "max_model_len" in e.value.body["message"]
    assert client.models.retrieve(EMBED_MODEL).id == EMBED_MODEL
    wait_blocks_free(embed_server, model=EMBED_MODEL)
    text = metrics_text(url)
    assert counted(text, "/v1/embeddings", "POST", "200") and counted(text, "/v1/embeddings", "POST", "400")


