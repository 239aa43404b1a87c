"""The decode step taken apart (benchmarks/cpu_step_parts.py): every part is clocked, the
forward's parts fit inside it, and the clocks come off afterwards."""

from benchmarks.cpu_step_parts import clocked, measure
from tests.conftest import assert_pool_free


def test_parts_are_clocked_and_the_clocks_come_off(llama_ckpt):
    originals = [owner.__dict__[name] for owner, name, _ in clocked()]
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
    assert [owner.__dict__[name] for owner, name, _ in clocked()] == originals     # every clock off
