"""builder build of mixture-of-experts checkpoints: a float32 entry served as the backend
loads it gives transformers' greedy tokens, a bfloat16 entry serves with bf16 experts,
the memory plan names total and active parameters, and quantized weights other than FP8
(test_build_moe_fp8.py) are refused with a clear error."""

import os
import re

import pytest
import torch

from backend import LLM, SamplingParams
from backend.triton_server.serving_config import load_settings
from builder.build import BuildError, BuildOptions, build
from tests.conftest import assert_pool_free
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.moe_checkpoints import make_moe_checkpoint


def served(out):
    text = open(os.path.join(out, "config.pbtxt")).read()
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', text))
    args, _ = load_settings(params, out)
    return LLM(**args.model_dump())


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_moe_build_serves(ckpt_dir, tmp_path, weights):
    path = make_moe_checkpoint(str(ckpt_dir / "mixtral"), "mixtral")
    lines = []
    out = build(BuildOptions.create(checkpoint=path, output=str(tmp_path / weights), weights=weights,
                                    num_kv_blocks=64, block_size=8), log=lines.append, progress=False)
    plan = next(line for line in lines if line.startswith("memory plan"))
    assert "total" in plan and "active" in plan
    llm = served(out)
    experts = llm.engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.dtype == (torch.float32 if weights == "float32" else torch.bfloat16)
    prompts = [[5, 9, 13, 2, 7, 40, 41], [11, 3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    if weights == "float32":
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)
    else:
        assert all(len(o.token_ids) == 6 for o in outs)
    assert_pool_free(llm)


def test_quantized_or_graph_moe_build_is_refused(ckpt_dir, tmp_path):
    path = make_moe_checkpoint(str(ckpt_dir / "mixtral"), "mixtral")
    with pytest.raises(BuildError, match="'weights': int8 is not supported for mixture-of-experts .* \\(or fp8\\)"):
        build(BuildOptions.create(checkpoint=path, output=str(tmp_path / "q"), weights="int8"),
              log=lambda *_: None, progress=False)
    with pytest.raises(BuildError, match="'engine': onnxruntime graphs of mixture-of-experts"):
        build(BuildOptions.create(checkpoint=path, output=str(tmp_path / "o"), engine="onnxruntime"),
              log=lambda *_: None, progress=False)


def test_lora_on_moe_is_refused(ckpt_dir):
    from backend import ConfigError
    path = make_moe_checkpoint(str(ckpt_dir / "mixtral"), "mixtral")
    with pytest.raises(ConfigError, match="'enable_lora': LoRA adapters on mixture-of-experts"):
        LLM(path, enable_lora=True, num_kv_blocks=16)
