"""The decoder's fused projections, which the loader (unquantized and FP8 weights) and
the INT formats' loader both build from a checkpoint's separate ones."""

# Fused parameter <- the checkpoint's parameters it concatenates (along the output dim).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
