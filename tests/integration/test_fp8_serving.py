"""An FP8 build (weights and KV cache) served by a real tritonserver equals the offline
engine on the same build."""

import os

from backend import LLM, SamplingParams
from builder.build import BuildOptions, build
from tests.integration.conftest import assert_served_like_offline


def test_fp8_build_served(tmp_path, tiny_ckpt):
    repo = tmp_path / "repo"
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", weights="fp8",
                              kv_cache="fp8", num_kv_blocks=128, max_model_len=1024),
          log=lambda *_: None, progress=False)
    prompts = ["The assert statement", "The with statement"]
    params = {"max_tokens": 12, "min_tokens": 12, "temperature": 0}
    offline = LLM(os.path.join(repo, "llm", "checkpoint"), block_size=16, num_kv_blocks=128,
                  kv_cache_dtype="fp8").generate(prompts, SamplingParams(**params))
    assert_served_like_offline(str(repo), str(tmp_path / "server.log"), prompts, params, offline)
