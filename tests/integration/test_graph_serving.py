"""Starts a real tritonserver on a `builder build --engine onnxruntime` entry: the backend
loads the exported graph named in config.pbtxt (relative to the model directory) and
streams the same tokens as the offline torch engine on the same checkpoint."""

from backend import LLM, SamplingParams
from builder.build import BuildOptions, build
from tests.integration.conftest import assert_served_like_offline


def test_onnxruntime_entry_served(tmp_path, tiny_ckpt):
    repo = tmp_path / "repo"
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", engine="onnxruntime",
                              weights="float32", num_kv_blocks=64, max_model_len=512),
          log=lambda *_: None, progress=False)
    prompts = ["The assert statement", "The with statement"]
    params = {"max_tokens": 8, "min_tokens": 8, "temperature": 0}
    offline = LLM(tiny_ckpt, dtype="float32", block_size=16, num_kv_blocks=64).generate(
        prompts, SamplingParams(**params))
    assert_served_like_offline(str(repo), str(tmp_path / "server.log"), prompts, params, offline)
