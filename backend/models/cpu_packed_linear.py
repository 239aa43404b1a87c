"""oneDNN pre-packed weights for the decoder's fp32 linears on the CPU.

torch's `F.linear` on the CPU calls MKL's sgemm with the weight as stored, every step.
oneDNN (what vLLM-CPU and Inductor's CPU path use) runs the same product from a weight
reordered once into its blocked layout: measured on the 2-core CI machine (one thread,
fp32), 1.1x at the default model's shapes (128 x 256 x 1536) and 1.6-1.9x at hidden 1024
(32 x 1024 x 6144, and the 32,000-row LM head). The results differ from `F.linear` by
fp32 rounding (another summation order), as MKL's own do between batch sizes.

Only the dense decoder's projections (q/k/v, o, gate/up, down) and the LM head are
packed, on a single-rank fp32 CPU engine: plain `nn.Linear` modules that nothing reads
the weight of after load. Under LoRA a projection is a wrapper that calls its `base`
layer (backend/lora/layers.py): that base is packed, so an engine with adapters and one
without compute the base model alike. The packed weight is an opaque
oneDNN tensor; `packed_nbytes` keeps what the weight occupied, for the engine's figures.
What packing leaves in the checkpoint file's mapping (embedding, norms) is then copied
out of it (`own_remaining_weights`), so that the mapping can go.
"""

from __future__ import annotations

import logging
import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

PACKED_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
# The row count oneDNN lays the weight out for. One value for every engine: the blocked
# layout (and so the summation order) follows it, and an engine's results must not
# depend on its max_num_seqs (an offline engine and a server gave logprobs 1e-4 apart
# at one row with hints 256 and 64). 64 was as fast as 256 at 32 and 128 rows here.
PACK_BATCH_HINT = 64


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_nbytes = weight.numel() * weight.element_size()
        # A plain attribute: an opaque tensor has no storage for .to() or state_dict.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_cpu_linears(model: nn.Module) -> int:
    """Replaces the model's fp32 CPU projections and LM head by PackedLinear; returns how
    many (0 where oneDNN is not in this torch build)."""
    if not available():
        logger.info("oneDNN is not available in this torch build: CPU linears stay on torch's GEMM")
        return 0
    targets = [(parent, name, child) for parent_name, parent in model.named_modules()
               for name, child in parent.named_children()
               if (name in PACKED_NAMES or (name == "base" and parent_name.rsplit(".", 1)[-1] in PACKED_NAMES))
               and type(child) is nn.Linear and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.float32]
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    # A weight still held by a parameter (an LM head tied to the embedding) is counted there.
    kept = {p.data_ptr() for p in model.parameters()}
    for parent, name, child in targets:
        if child.weight.data_ptr() in kept:
            getattr(parent, name).packed_nbytes = 0
    return len(targets)


def packed_bytes(model: nn.Module) -> int:
    """What the packed linears' weights occupied (they are no longer parameters)."""
    return sum(m.packed_nbytes for m in model.modules() if isinstance(m, PackedLinear))



def checkpoint_mappings(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """This process's address ranges that map checkpoint files (Linux's /proc; elsewhere
    none are known)."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(suffix):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        pass
    return ranges


def own_remaining_weights(model: nn.Module) -> int:
    """Copies the CPU parameters and buffers that still lie in a checkpoint file's
    mapping (after packing: the embedding and the norms) into memory of their own;
    returns the bytes copied.

    Why: safetensors loads a CPU tensor as a view of the file's mapping, and the whole
    mapping stays while any one of its tensors does. After packing, the hidden-1024
    Llama's embedding and norms kept 485 MiB of the file resident (clean pages, so
    reclaimable, but counted in the process's resident memory and a container's
    working set) for a 131 MB embedding. A tied weight stays one tensor."""
    ranges = checkpoint_mappings()
    if not ranges:
        return 0
    copies: dict[int, torch.Tensor] = {}
    copied = 0
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or t.device.type != "cpu" or not any(lo <= t.data_ptr() < hi for lo, hi in ranges):
                        continue
                    if id(t) not in copies:
                        data = t.detach().clone()
                        copies[id(t)] = nn.Parameter(data, requires_grad=False) if isinstance(t, nn.Parameter) \
                            else data
                        copied += t.numel() * t.element_size()
                    table[name] = copies[id(t)]
    return copied
