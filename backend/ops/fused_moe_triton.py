"""Fused mixture-of-experts in OpenAI Triton (the torch reference: moe_reference.fused_moe).

Routing (route): softmax, top-k and renormalization in one launch, a program per token.

The layout is vLLM's fused_moe, written anew:
1. align_by_expert: the T x k (token, expert) slots are sorted by expert and each
   expert's run is padded to a multiple of BLOCK_M, so that every BLOCK_M-row block of the
   sorted list belongs to one expert. Done with scatter / cumsum / searchsorted on the
   device: no host sync, and a static upper bound on the padded length (T*k + E*(BLOCK_M-1))
   sizes the grid; blocks past the real padded total return at once. Experts with no
   tokens get no block.
2. One grouped GEMM over all experts for gate_up: block b multiplies the tokens of its
   slots by its expert's [2I, H] weight, gate and up tiles side by side, and writes
   SiLU(gate) * up per slot ([T*k, I]) (gpt-oss: + the expert's bias, clamped SwiGLU).
3. One grouped GEMM for down ([E, H, I]) over the same blocks, scaled by each slot's
   routing weight, written per slot ([T*k, H]).
4. A token's k slots are summed in slot order (as transformers does).
fp32 accumulation; each result is rounded to the activation dtype where transformers
rounds it. With TRITON_INTERPRET=1 it runs on CPU tensors (CI).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backend.ops import moe_reference
from backend.ops.mxfp4_triton import dot_tile, load_weight_tile


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_w_ptr,
                         bias_ptr, w_scale_ptr, N, K, num_slots, stride_am, stride_we, stride_wn, stride_om,
                         stride_be, stride_se, stride_sn,
                         A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         HAS_BIAS: tl.constexpr = False, SWIGLU_OAI: tl.constexpr = False,
                         ALPHA: tl.constexpr = 1.702, LIMIT: tl.constexpr = 7.0, MXFP4: tl.constexpr = False,
                         FP8: tl.constexpr = False, SCALED_DOT: tl.constexpr = False):
    """out[slot, n] for the slots of block program_id(0): A's row is slot // A_ROW_DIV
    (the token for gate_up, the slot itself for down). GATED: W's rows [0, N) are the
    gate and [N, 2N) the up projection; the output is SiLU(gate) * up, or with
    SWIGLU_OAI gpt-oss's (clamp(up) + 1) * g * sigmoid(ALPHA * g), g = min(gate, LIMIT).
    HAS_BIAS: the expert's bias row (stride_be per expert) is added to the GEMM output.
    MXFP4: W is packed bytes [E, rows, K / 2] with scales [E, rows, K / 32] (stride_se,
    stride_sn), decoded tile by tile (mxfp4_triton.py); SCALED_DOT (MXFP4, bf16 A): by
    `tl.dot_scaled` instead. FP8: W is float8_e4m3fn with an fp32 scale per expert and row
    ([E, rows]: stride_se, stride_sn), dequantized in the tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return                                     # slots of another rank's experts
    slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < num_slots                       # padding rows hold num_slots
    a_rows = (slot // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    w_base = w_ptr + expert * stride_we
    s_base = w_scale_ptr + expert * stride_se
    wdtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & mask_k[None, :],
                    other=0.0)
        if SCALED_DOT:
            acc = dot_tile(a, acc, w_base, s_base, cols, k0, K, mask_n, stride_wn, stride_sn, BLOCK_K)
            if GATED:
                acc_up = dot_tile(a, acc_up, w_base, s_base, cols + N, k0, K, mask_n, stride_wn, stride_sn, BLOCK_K)
        else:
            wmask = mask_k[:, None] & mask_n[None, :]
            w = load_weight_tile(w_base, s_base, cols, ks, wmask, stride_wn, stride_sn, wdtype, MXFP4,
                                 FP8)  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
            if GATED:
                wu = load_weight_tile(w_base, s_base, cols + N, ks, wmask, stride_wn, stride_sn, wdtype, MXFP4, FP8)
                if IEEE:
                    acc_up += tl.dot(a, wu, input_precision="ieee")
                else:
                    acc_up += tl.dot(a, wu)
    dtype = out_ptr.dtype.element_ty
    b_base = bias_ptr + expert * stride_be
    if GATED:
        # The GEMM outputs, the bias adds and the activation's steps round to the
        # activation dtype, as the model's torch ops do.
        g = acc.to(dtype).to(tl.float32)
        u = acc_up.to(dtype).to(tl.float32)
        if HAS_BIAS:
            g = (g + tl.load(b_base + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
            u = (u + tl.load(b_base + N + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(dtype).to(
                tl.float32)
        if SWIGLU_OAI:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            ga = (g * ALPHA).to(dtype).to(tl.float32)
            sig = (1.0 / (1.0 + tl.exp(-ga))).to(dtype).to(tl.float32)
            glu = (g * sig).to(dtype).to(tl.float32)
            acc = (u + 1.0).to(dtype).to(tl.float32) * glu
        else:
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            acc = act * u
    elif HAS_BIAS:
        acc = acc.to(dtype).to(tl.float32) + tl.load(b_base + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        weight = tl.load(topk_w_ptr + slot, mask=valid, other=0.0)
        acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype),
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, SOFTMAX_AFTER_TOPK: tl.constexpr = False):
    """One token: fp32 softmax over its E logits, the top k by repeated argmax (best
    first), optionally renormalized to sum to 1. SOFTMAX_AFTER_TOPK (gpt-oss): the top k
    of the logits, then a softmax over those k."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    if SOFTMAX_AFTER_TOPK:
        p = x
        taken = -float("inf")
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(e < E, p, -1.0)
        taken = -1.0
    kk = tl.arange(0, BLOCK_K)
    vals = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.argmax(p, axis=0)
        vals = tl.where(kk == k, best, vals)
        ids = tl.where(kk == k, idx, ids)
        p = tl.where(e == idx, taken, p)
    if SOFTMAX_AFTER_TOPK:
        z = tl.where(kk < TOP_K, vals, -float("inf"))
        z = tl.exp(z - tl.max(z, axis=0))
        vals = z / tl.sum(z, axis=0)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(weights_ptr + t * TOP_K + kk, vals, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, ids.to(tl.int64), mask=kk < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and result as moe_reference.route, in one launch."""
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), TOP_K=top_k,
                            BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(E), SOFTMAX_AFTER_TOPK=softmax_after_topk)
    return weights, ids


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] int32: slot indices grouped by expert, each group padded to a
    multiple of block_m with the value T*k; block_expert [P / block_m] int32;
    num_padded [1]: the real padded length). P is the static bound T*k + E*(block_m-1),
    rounded up to block_m. Ids outside [0, E) are gathered last, in blocks of expert -1."""
    flat = topk_ids.flatten()
    n = flat.numel()
    dev = flat.device
    # One more bucket, E, for the ids this rank does not hold.
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_experts += 1
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts        # where each expert's run starts, unpadded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = (ends - padded)[experts] + torch.arange(n, device=dev) - first[experts]
    total = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    block_expert = block_expert.masked_fill_(block_expert == num_experts - 1, -1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, act: str = "silu", b13: Optional[torch.Tensor] = None,
              b2: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0,
              w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same arguments and result as moe_reference.fused_moe (MXFP4 or FP8 weights
    dequantized in the GEMMs' tiles)."""
    if act not in ("silu", "swigluoai"):
        return moe_reference.fused_moe(x, w13, w2, topk_weights, topk_ids, act, b13, b2, alpha, limit,
                                       w13_scale, w2_scale)
    x = x.contiguous()
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = w13.shape[0], w13.shape[1] // 2
    fp8 = w13.dtype == torch.float8_e4m3fn
    mxfp4 = w13_scale is not None and not fp8
    if fp8:
        assert w13_scale.shape == w13.shape[:2] and w2_scale.shape == w2.shape[:2]
        assert w13_scale.dtype == w2_scale.dtype == torch.float32
    if mxfp4:
        assert w13.dtype == torch.uint8 and w13.shape[2] * 2 == H and w2.shape[2] * 2 == I
        assert H % 32 == 0 and I % 32 == 0, "MXFP4 scales one per 32 inputs"
        assert w13_scale.stride(2) == 1 and w2_scale.stride(2) == 1
    if T == 0:
        return torch.zeros_like(x)
    assert w13.stride(2) == 1 and w2.stride(2) == 1
    n = T * K
    # Small batches (decode) waste less padding with 16-row blocks.
    block_m = 16 if n <= 16 * E else 64
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, E, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    consts = dict(BLOCK_M=block_m, BLOCK_K=64, IEEE=x.dtype == torch.float32, HAS_BIAS=b13 is not None, MXFP4=mxfp4,
                  FP8=fp8, SCALED_DOT=mxfp4 and x.dtype == torch.bfloat16)
    if b13 is not None:
        assert b13.stride(1) == 1 and b2.stride(1) == 1
    bias13 = b13 if b13 is not None else weights     # unread without HAS_BIAS
    bias2 = b2 if b2 is not None else weights
    s13 = w13_scale if w13_scale is not None else w13      # unread without MXFP4 / FP8
    s2 = w2_scale if w2_scale is not None else w2
    num_blocks = block_expert.numel()
    inter = torch.empty(n, I, dtype=x.dtype, device=x.device)
    block_n = 64
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(I, block_n))](
        x, w13, inter, sorted_ids, block_expert, num_padded, weights, bias13, s13, I, H, n, x.stride(0), w13.stride(0),
        w13.stride(1), inter.stride(0), bias13.stride(0), s13.stride(0), s13.stride(1), A_ROW_DIV=K, GATED=True,
        MUL_WEIGHT=False,
        BLOCK_N=block_n, SWIGLU_OAI=act == "swigluoai", ALPHA=float(alpha), LIMIT=float(limit), **consts)
    # Zeros: the slots of experts this rank does not hold are never written.
    out = torch.zeros(n, H, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(H, block_n))](
        inter, w2, out, sorted_ids, block_expert, num_padded, weights, bias2, s2, H, I, n, inter.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), bias2.stride(0), s2.stride(0), s2.stride(1), A_ROW_DIV=1,
        GATED=False, MUL_WEIGHT=True, BLOCK_N=block_n, **consts)
    return out.view(T, K, H).sum(dim=1)
