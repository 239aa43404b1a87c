"""builder build for Gemma 2, Gemma 3 and Phi-3 (issue 29): bf16 and fp32 entries, loaded
as the backend loads them, serve; the fp32 entry gives transformers' greedy tokens."""

import re

import pytest

from backend import LLM, SamplingParams
from builder.build import BuildOptions, build
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_build_and_serve(ckpt_dir, tmp_path, arch):
    from backend.triton_server.serving_config import load_settings
    ckpt = make_checkpoint(str(ckpt_dir / arch), arch)
    prompts = random_prompts(2, [70, 9], seed=4)     # Phi-3: one past its 64-token original context
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    for weights in ("float32", "bfloat16"):
        out = build(BuildOptions.create(checkpoint=ckpt, output=str(tmp_path / weights), weights=weights,
                                        num_kv_blocks=64, block_size=8), log=lambda *_: None, progress=False)
        text = (tmp_path / weights / "config.pbtxt").read_text()
        settings = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', text))
        args, _ = load_settings(settings, out)
        assert args.dtype == weights
        llm = LLM(**args.model_dump(exclude_none=True))
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert all(len(t) == 6 for t in got)
        if weights == "float32":
            assert got == hf_greedy(ckpt, prompts, 6)
        assert_pool_free(llm)


def test_what_is_not_supported_yet_is_refused_by_name(ckpt_dir, tmp_path):
    from builder.build import BuildError
    gemma2 = make_checkpoint(str(ckpt_dir / "gemma2"), "gemma2")
    with pytest.raises(BuildError, match="'engine'.*soft-capping"):
        build(BuildOptions.create(checkpoint=gemma2, output=str(tmp_path / "g"), engine="onnxruntime"),
              log=lambda *_: None, progress=False)
    phi3 = make_checkpoint(str(ckpt_dir / "phi3"), "phi3")
    with pytest.raises(BuildError, match="tensor_parallel_size.*fused qkv_proj"):
        build(BuildOptions.create(checkpoint=phi3, output=str(tmp_path / "p"), tensor_parallel_size=2),
              log=lambda *_: None, progress=False)
