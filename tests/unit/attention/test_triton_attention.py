"""The Triton kernels against the torch reference on randomized shapes (through the
interpreter on CPU, natively on CUDA): block sizes 8/16, GQA 1/4/8, head dims 64/128,
decode, prefill, chunked prefill after a cached prefix, ragged lengths including 1 and
block boundaries +-1, split-KV, sliding window, soft-capping, attention sinks, FP8 cache."""

import random

import pytest
import torch

from backend.attention.metadata import KVCacheLayer
from backend.attention.torch_attention import TorchPagedAttention
from backend.attention.triton_attention import TritonPagedAttention, paged_attention
from tests.helpers.paged_batch import build, rel_err, to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


KERNELS = [pytest.param(False, id="one-token"), pytest.param(True, id="tiled")]


def run_both(seqs, block_size, kvh, group, head_dim, seed, fp8=False, window=None, num_splits=None,
             fp8_scales=(0.05, 0.04), tiled=None, soft_cap=None, int8_scales=None, sinks=None):
    q, k, v, cache, meta = build(seqs, block_size, kvh, group, head_dim, seed, fp8, fp8_scales=fp8_scales,
                                 int8_scales=int8_scales)
    scale = head_dim ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(kvh * group, kvh, head_dim, scale, window, soft_cap).forward(*ref_args, sinks=sinks)
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    sinks2 = None if sinks is None else sinks.to(DEVICE)
    if num_splits is None and tiled is None:
        out = TritonPagedAttention(kvh * group, kvh, head_dim, scale, window, soft_cap).forward(
            q2, k2, v2, c2, m2, sinks=sinks2)
    else:
        out = paged_attention(q2, k2, v2, c2, m2, scale, window, num_splits=num_splits, tiled=tiled,
                              logits_soft_cap=soft_cap, sinks=sinks2)
    # The kernel wrote exactly what the reference wrote, FP8 bytes included.
    assert torch.equal(c2.key.cpu().view(torch.uint8), ref_args[3].key.view(torch.uint8))
    assert torch.equal(c2.value.cpu().view(torch.uint8), ref_args[3].value.view(torch.uint8))
    return out.cpu(), ref


CASES = []
for i, (bs, group, hd) in enumerate([(8, 1, 64), (16, 4, 64), (8, 8, 128), (16, 1, 128), (16, 8, 64), (8, 4, 128)]):
    rng = random.Random(100 + i)
    edge = [bs - 1, bs, bs + 1]
    seqs = [(0, 1),                                   # prompt of one token
            (rng.choice(edge), 1),                    # decode at a block boundary +-1
            (rng.randint(1, 3 * bs), 1),              # decode, ragged
            (0, rng.choice(edge)),                    # fresh prefill ending at a boundary +-1
            (bs * rng.randint(1, 2), rng.randint(2, bs + 3)),  # chunk after a cached (block-aligned) prefix
            (rng.randint(1, 2 * bs), rng.randint(2, 5))]       # chunk after a ragged context
    rng.shuffle(seqs)
    CASES.append(pytest.param(seqs, bs, 2, group, hd, 1000 + i, id=f"bs{bs}-gqa{group}-d{hd}"))


@pytest.mark.parametrize("tiled", KERNELS)
@pytest.mark.parametrize("seqs,bs,kvh,group,hd,seed", CASES)
def test_matches_torch_reference(seqs, bs, kvh, group, hd, seed, tiled):
    out, ref = run_both(seqs, bs, kvh, group, hd, seed, tiled=tiled)
    assert rel_err(out, ref) < 1e-5


def test_tiled_kernel_long_prompts_span_many_tiles():
    """Prompts longer than a tile (16 tokens) and a key tile (64): several programs per
    sequence, causal limits inside a tile, a chunk after a long cached context."""
    out, ref = run_both([(0, 70), (100, 37), (3, 1), (0, 17)], 16, 2, 4, 64, seed=21, tiled=True)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_matches(num_splits):
    seqs = [(70, 1), (33, 1), (5, 1)]
    out, ref = run_both(seqs, 8, 2, 4, 64, seed=7, num_splits=num_splits)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("tiled", KERNELS)
def test_sliding_window_matches(tiled):
    out, ref = run_both([(40, 1), (20, 6), (0, 12), (70, 30)], 8, 2, 2, 64, seed=8, window=9, tiled=tiled)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("tiled", KERNELS)
def test_soft_cap_matches(tiled):
    """Gemma 2's cap * tanh(score / cap), with a cap of 0.7 that binds most scores (they
    are ~N(0, 1) here), alone and with a window; the uncapped output differs."""
    # The chunk after a long context is 11 tokens (was 30: the one-token kernel runs one
    # program per query token in the interpreter, 16 s): its 81 tokens still span 11
    # blocks of 8, its chunk crosses block boundaries (72, 80) and ends in a partial block.
    seqs = [(40, 1), (20, 6), (0, 12), (70, 11), (9, 1)]
    for window in (None, 9):
        out, ref = run_both(seqs, 8, 2, 4, 64, seed=9, window=window, tiled=tiled, soft_cap=0.7)
        assert rel_err(out, ref) < 1e-5
        uncapped, _ = run_both(seqs, 8, 2, 4, 64, seed=9, window=window, tiled=tiled)
        assert rel_err(uncapped, ref) > 1e-2


def test_soft_cap_with_split_kv():
    out, ref = run_both([(70, 1), (33, 1), (5, 1)], 8, 2, 4, 64, seed=11, num_splits=4, soft_cap=0.7, window=40)
    assert rel_err(out, ref) < 1e-5


def test_attention_sinks_match():
    """gpt-oss's per-head sink logit in the denominator: the one-token kernel (GQA 4),
    the tiled one with a window and a padded head group (GQA 3 in 4 rows), split-KV
    (the sink counted once over the splits). Sinks of +-2 around scores of ~N(0, 1):
    the output without them differs."""
    seqs = [(20, 1), (9, 4), (0, 12), (5, 1)]
    for group, tiled, window, splits in [(4, False, None, None), (3, True, 9, None), (4, None, 30, 2)]:
        sinks = torch.linspace(-2.0, 2.0, 2 * group)
        seq = [s for s in seqs if s[1] == 1] if splits else seqs
        out, ref = run_both(seq, 8, 2, group, 64, seed=12, window=window, tiled=tiled, num_splits=splits,
                            sinks=sinks)
        assert rel_err(out, ref) < 1e-5, (group, tiled, window, splits)
        if splits:
            plain, _ = run_both(seq, 8, 2, group, 64, seed=12, window=window, num_splits=splits)
            assert rel_err(plain, ref) > 1e-2


FP8_BOUND = 1e-5  # same stored bytes, same dequantization: kernel vs torch path


@pytest.mark.parametrize("tiled", KERNELS)
def test_fp8_cache_matches_torch_fp8_path(tiled):
    out, ref = run_both([(17, 1), (8, 5), (0, 9)], 16, 2, 4, 64, seed=9, fp8=True, tiled=tiled)
    assert rel_err(out, ref) < FP8_BOUND


def test_int8_cache_matches_torch_int8_path():
    """INT8 cache with per-KV-head scales (one head's scale far from the other's): both
    kernels (and split-KV) store the torch path's int8 bytes and agree with its output;
    values past 127 * scale saturate. The same batch through a float cache differs by the
    quantization error, so the INT8 path is really taken."""
    seqs = [(17, 1), (8, 5), (0, 9), (40, 1)]
    scales = ((0.02, 0.009), (0.03, 0.011))      # |x| ~ N(0, 1): head 0's K saturates past 2.54
    for tiled, splits in ((False, None), (True, None), (False, 2)):
        out, ref = run_both(seqs, 16, 2, 4, 64, seed=31, tiled=tiled, num_splits=splits, int8_scales=scales)
        assert rel_err(out, ref) < FP8_BOUND
    exact, _ = run_both(seqs, 16, 2, 4, 64, seed=31)
    assert rel_err(exact, ref) > 1e-3


def test_fp8_writes_identical_where_the_reciprocal_rounds_differently():
    """For scale 0.17044, fp32(1/s) taken from double is one ulp above the fp32 division
    1/fp32(s) the kernel computes (about a quarter of scales differ so). K = 0.18109251
    then lands on either side of the E4M3 rounding midpoint 1.0625: both paths must use
    the same reciprocal to store the same byte."""
    seqs = [(0, 3)]
    q, k, v, cache, meta = build(seqs, 16, 2, 1, 64, seed=13, fp8=True, fp8_scales=(0.17044, 0.17044))
    k.fill_(0.18109251)
    v.fill_(0.18109251)
    ref_args = to("cpu", q, k, v, cache, meta)
    TorchPagedAttention(2, 2, 64, 64 ** -0.5).forward(*ref_args)
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    paged_attention(q2, k2, v2, c2, m2, 64 ** -0.5)
    assert torch.equal(c2.key.cpu().view(torch.uint8), ref_args[3].key.view(torch.uint8))
    assert torch.equal(c2.value.cpu().view(torch.uint8), ref_args[3].value.view(torch.uint8))


def test_fp8_cache_close_to_fp32():
    """Quantization error of the FP8 cache itself (E4M3 has a 3-bit mantissa)."""
    seqs = [(30, 1), (8, 5)]
    q, k, v, cache, meta = build(seqs, 16, 2, 4, 64, seed=10)
    scale = 64 ** -0.5
    exact = TorchPagedAttention(8, 2, 64, scale).forward(*to("cpu", q, k, v, cache, meta))
    qf, kf, vf, cf, mf = to(DEVICE, q, k, v, cache, meta)
    c8 = KVCacheLayer(cf.key.to(torch.float8_e4m3fn), cf.value.to(torch.float8_e4m3fn), 1.0, 1.0)
    out = TritonPagedAttention(8, 2, 64, scale).forward(qf, kf, vf, c8, mf).cpu()
    assert rel_err(out, exact) < 0.05


@pytest.mark.parametrize("tiled", KERNELS)
def test_padding_rows_write_nothing_and_leave_real_rows_alone(tiled):
    """Rows past the last sequence with slot -1 (a padded batch, as for CUDA graphs)."""
    seqs = [(9, 1), (0, 5)]
    q, k, v, cache, meta = build(seqs, 8, 2, 2, 64, seed=11)
    scale = 64 ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(4, 2, 64, scale).forward(*ref_args)
    pad = 3
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    q2, k2, v2 = (torch.cat([x, torch.randn((pad,) + x.shape[1:]).to(x.device)]) for x in (q2, k2, v2))
    m2.slot_mapping = torch.cat([m2.slot_mapping, torch.full((pad,), -1, device=m2.slot_mapping.device)])
    out = paged_attention(q2, k2, v2, c2, m2, scale, tiled=tiled).cpu()
    assert rel_err(out[:-pad], ref) < 1e-5
    assert torch.equal(c2.key.cpu(), ref_args[3].key) and torch.equal(c2.value.cpu(), ref_args[3].value)
    assert torch.isfinite(out[-pad:]).all()


@pytest.mark.parametrize("block_m", [4, 8])
def test_tiled_kernel_with_small_tiles_for_decode(block_m):
    """Decode rows (one token per sequence) in tiles of block_m tokens: the tile ->
    sequence mapping holds for any tile size, mixed with a prompt chunk."""
    from backend.attention.triton_tiled import launch_tiled_attention
    seqs = [(33, 1), (8, 1), (0, 1), (17, 6), (50, 1)]
    q, k, v, cache, meta = build(seqs, 8, 2, 4, 64, seed=23)
    scale = 64 ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(8, 2, 64, scale).forward(*ref_args)
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    out = torch.empty_like(q2)
    s = c2.scale_tensor()
    launch_tiled_attention(q2, k2, v2, c2.key, c2.value, m2.slot_mapping, m2.block_tables, m2.seq_lens,
                           m2.query_start_loc, s[0:1], s[1:2], out, scale, block_m=block_m)
    assert rel_err(out.cpu(), ref) < 1e-5
    assert torch.equal(c2.key.cpu(), ref_args[3].key)
    with pytest.raises(ValueError, match="16 rows"):       # 2 tokens x GQA 4: too few rows for tl.dot
        launch_tiled_attention(q2, k2, v2, c2.key, c2.value, m2.slot_mapping, m2.block_tables, m2.seq_lens,
                               m2.query_start_loc, s[0:1], s[1:2], out, scale, block_m=2)


def test_key_tile_shrinks_only_where_shared_memory_would_not_fit():
    """fp32 with GQA 8 and D 128 (128 query rows) needed 257 KiB of shared memory with 64
    keys per tile on an H100 (limit 227 KiB); bf16 Llama shapes keep 64 keys."""
    from backend.attention.triton_tiled import BLOCK_N, key_tile
    assert key_tile(128, 128, 4) < BLOCK_N and key_tile(16, 256, 4) < BLOCK_N
    assert key_tile(64, 64, 2) == key_tile(64, 128, 2) == key_tile(128, 128, 2) == BLOCK_N
    assert key_tile(1024, 512, 4) == 16



def test_fit_tiles_gives_up_query_tokens_only_where_16_keys_do_not_fit():
    from backend.attention.triton_tiled import fit_tiles
    assert fit_tiles(16, 4, 64, 2) == (16, 64) and fit_tiles(4, 4, 64, 2) == (4, 64)    # bf16 Llama: as asked
    block_m, block_n = fit_tiles(16, 16, 128, 4)           # fp32, GQA 16, D 128: 256 rows do not fit
    assert block_m < 16 and block_m * 16 >= 16 and block_n >= 16
    assert fit_tiles(1, 32, 128, 4)[0] == 1                # never below one token


def _spy_tiles(monkeypatch) -> list:
    """The block_m of every tiled launch paged_attention makes."""
    from backend.attention import triton_tiled
    calls, launch = [], triton_tiled.launch_tiled_attention

    def spy(*args, block_m=triton_tiled.BLOCK_M, **kw):
        calls.append(block_m)
        return launch(*args, block_m=block_m, **kw)
    monkeypatch.setattr(triton_tiled, "launch_tiled_attention", spy)
    return calls


@pytest.mark.parametrize("group,block_m", [(1, None), (2, None), (4, 4), (8, 2), (16, 1)])
def test_decode_rows_take_the_tiled_kernel_where_the_group_fills_a_tile(monkeypatch, group, block_m):
    """Decode steps with an unsplit KV range: GQA >= 4 on the tiled kernel with 16 // group
    tokens per tile (measured 4-5x faster on an H100 at batch 64-256), the rest on the
    one-token kernel; the same result either way."""
    calls = _spy_tiles(monkeypatch)
    seqs = [(33, 1), (8, 1), (0, 1), (50, 1), (16, 1)]
    out, ref = run_both(seqs, 8, 2, group, 64, seed=41)
    assert rel_err(out, ref) < 1e-5
    assert calls == ([block_m] if block_m else [])


def test_split_decode_stays_on_the_one_token_kernel(monkeypatch):
    """Few (token, head) programs over a long context: split-KV (faster at batch 1, 4k)."""
    calls = _spy_tiles(monkeypatch)
    out, ref = run_both([(1500, 1)], 16, 2, 4, 64, seed=42)
    assert rel_err(out, ref) < 1e-5 and calls == []


@pytest.mark.parametrize("query_len", [1, 3])
def test_graph_padded_decode_on_the_tiled_kernel(monkeypatch, query_len):
    """A CUDA graph's step (fixed split factor 1): real rows, then empty padding sequences
    (query and sequence length 0, table row 0) and padding tokens with slot -1, as
    StepInputBuilder pads a replay. Real rows equal the reference, padding rows are zero
    (not left as uninitialized memory, which per-tensor activation scales would read),
    and no padding row writes the cache."""
    from backend.attention.metadata import AttentionMetadata
    calls = _spy_tiles(monkeypatch)
    seqs = [(20, query_len), (9, query_len), (0, query_len)]
    q, k, v, cache, meta = build(seqs, 8, 2, 4, 64, seed=43)
    scale = 64 ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(8, 2, 64, scale).forward(*ref_args)
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    B, T, pad_seqs, pad_tokens = len(seqs), q.shape[0], 2, 2 * query_len
    q2, k2, v2 = (torch.cat([x, torch.randn((pad_tokens,) + x.shape[1:]).to(x.device)]) for x in (q2, k2, v2))
    dev = m2.slot_mapping.device
    tables = torch.cat([m2.block_tables, torch.zeros((pad_seqs, m2.block_tables.shape[1]), dtype=m2.block_tables.dtype,
                                                     device=dev)])
    padded = AttentionMetadata(
        query_start_loc=torch.cat([m2.query_start_loc, torch.full((pad_seqs,), T, dtype=m2.query_start_loc.dtype,
                                                                   device=dev)]),
        seq_lens=torch.cat([m2.seq_lens, torch.zeros(pad_seqs, dtype=m2.seq_lens.dtype, device=dev)]),
        block_tables=tables, slot_mapping=torch.cat([m2.slot_mapping, torch.full((pad_tokens,), -1, device=dev,
                                                                                 dtype=m2.slot_mapping.dtype)]),
        query_lens_cpu=[query_len] * (B + pad_seqs), seq_lens_cpu=[query_len] * (B + pad_seqs),
        max_query_len=query_len, max_seq_len=query_len, num_splits=1)
    out = paged_attention(q2, k2, v2, c2, padded, scale).cpu()
    assert calls == [4]
    assert rel_err(out[:T], ref) < 1e-5
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))
    assert torch.equal(c2.key.cpu(), ref_args[3].key) and torch.equal(c2.value.cpu(), ref_args[3].value)


def image_limits(seqs, spans):
    """Key limits (AttentionMetadata.key_limits): position + 1, or an image's end for its
    tokens; spans: per sequence, (start, end) positions of its images."""
    limits = []
    for (c, n), images in zip(seqs, spans):
        for p in range(c, c + n):
            limits.append(next((end for start, end in images if start <= p < end), p + 1))
    return torch.tensor(limits, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 5])
def test_image_tokens_attend_to_their_whole_image(window):
    """Gemma 3's image attention: an image's tokens see the whole image (keys after them
    in it too), in a fresh prompt and in a chunk after a cached context that holds the
    image's start; against an explicit mask over the same keys, and through the kernel."""
    from backend.attention.torch_attention import attend
    seqs = [(0, 12), (8, 9), (30, 1), (0, 5)]
    spans = [[(3, 9)], [(4, 14)], [], [(1, 3)]]
    q, k, v, cache, meta = build(seqs, 8, 2, 2, 64, seed=31)
    meta.key_limits = image_limits(seqs, spans)
    scale = 64 ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(4, 2, 64, scale, window).forward(*ref_args)
    # The fresh prompt, by hand: its keys are this step's.
    pos = torch.arange(12)
    allowed = (pos[None, :] < meta.key_limits[:12, None]) & (
        (pos[None, :] > pos[:, None] - window) if window else True)
    by_hand = attend(q[:12].transpose(0, 1)[None], k[:12].transpose(0, 1)[None], v[:12].transpose(0, 1)[None],
                     allowed, scale, None)[0].transpose(0, 1)
    assert rel_err(ref[:12], by_hand) < 1e-6
    causal, _ = run_both(seqs, 8, 2, 2, 64, seed=31, window=window)
    assert rel_err(causal[3:9], ref[3:9]) > 1e-2 and rel_err(causal[:3], ref[:3]) < 1e-6
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    out = TritonPagedAttention(4, 2, 64, scale, window).forward(q2, k2, v2, c2, m2)
    assert rel_err(out.cpu(), ref) < 1e-5


def test_tree_nodes_attend_to_their_ancestors_only():
    """A tree of proposals (AttentionMetadata.tree): a verification (root and four nodes
    after a cached context) and a drafter's level (two nodes whose earlier levels are
    cached), beside a plain decode row and a fresh prompt. Each node sees the context, the
    root, its ancestors and itself, never a sibling or a cousin; against an explicit mask
    over the same keys, and through the kernel, split-KV too."""
    from backend.attention.torch_attention import attend
    from backend.engine.spec_decode.token_tree import TokenTree
    bits = TokenTree.parse("[(0,), (1,), (0, 0), (1, 0)]").bits.tolist()     # [1, 2, 5, 10]
    seqs = [(20, 5), (17, 2), (30, 1), (0, 6)]
    none = [2 ** 40, 0]
    nodes = ([none] + [[21, b] for b in bits]) + [[15, bits[2]], [15, bits[3]]] + [none] + [none] * 6
    q, k, v, cache, meta = build(seqs, 8, 2, 2, 64, seed=41)
    meta.tree = torch.tensor(nodes, dtype=torch.int64)
    scale = 64 ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(4, 2, 64, scale).forward(*ref_args)
    # The verification's rows by hand: keys are the cache's 20 and this step's 5.
    from backend.attention.torch_attention import _gather
    keys = torch.cat([_gather(ref_args[3].key, meta.block_tables[0, :3].long(), None, q.dtype)[:20], k[:5]])
    values = torch.cat([_gather(ref_args[3].value, meta.block_tables[0, :3].long(), None, q.dtype)[:20], v[:5]])
    visible = torch.zeros(5, 25, dtype=torch.bool)
    visible[:, :21] = True                          # the context and the root
    for j, path in enumerate([[0], [1], [0, 2], [1, 3]]):
        visible[1 + j, [21 + a for a in path]] = True
    visible[0, 21:] = False
    by_hand = attend(q[:5].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                     visible, scale, None)[0].transpose(0, 1)
    assert rel_err(ref[:5], by_hand) < 1e-5         # (the CPU kernel rounds as it sums)
    causal, _ = run_both(seqs, 8, 2, 2, 64, seed=41)
    assert rel_err(causal[:2], ref[:2]) < 1e-6 and rel_err(causal[2:5], ref[2:5]) > 1e-2    # (node 0 sees all it would)
    assert rel_err(causal[5:7], ref[5:7]) > 1e-2 and rel_err(causal[7:], ref[7:]) < 1e-6
    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    for splits in (None, 4):
        out = paged_attention(q2, k2, v2, to(DEVICE, q, k, v, cache, meta)[3], m2, scale, num_splits=splits)
        assert rel_err(out.cpu(), ref) < 1e-5
    out = TritonPagedAttention(4, 2, 64, scale).forward(q2, k2, v2, c2, m2)
    assert rel_err(out.cpu(), ref) < 1e-5
