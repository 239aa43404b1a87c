"""The decode step taken apart (clients/cpu_step_parts.py): every part is clocked, the
forward's parts fit inside it, and the clocks come off afterwards."""

from backend.attention import cpu_decode
from backend.engine import llm_engine
from backend.models import cpu_packed_linear, llama
from backend.ops import cpu_layer_ops
from clients.cpu_step_parts import measure
from tests.conftest import assert_pool_free


def test_parts_are_clocked_and_the_clocks_come_off(llama_ckpt):
    originals = (cpu_decode.paged_decode, cpu_layer_ops.add_rms_norm, cpu_packed_linear.PackedLinear.forward,
                 llama.CausalLM.forward, llm_engine.LLMEngine.step)
    drained = []
    parts = measure(llama_ckpt, num_seqs=4, prompt_len=20, steps=3,
                    on_drained=lambda engine: (assert_pool_free(engine), drained.append(True)))
    assert drained
    assert {"decode attention", "k/v writes", "add + rms norm", "rotary", "silu and mul", "lm_head",
            "linear qkv_proj", "linear o_proj", "linear gate_up_proj", "linear down_proj"} <= set(parts)
    layers = parts["linear qkv_proj"][1]
    assert layers >= 1 and parts["decode attention"][1] == layers and parts["add + rms norm"][1] == 2 * layers + 1
    assert parts["python in the forward"][0] > 0 and parts["host outside the forward"][0] > 0
    assert parts["forward"][0] + parts["logits"][0] < parts["step"][0]
    assert (cpu_decode.paged_decode, cpu_layer_ops.add_rms_norm, cpu_packed_linear.PackedLinear.forward,
            llama.CausalLM.forward, llm_engine.LLMEngine.step) == originals
