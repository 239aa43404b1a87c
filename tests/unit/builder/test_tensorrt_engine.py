"""The TensorRT engine build's optimization profile covers every step the engine can
schedule; without TensorRT the build says so. (The build itself needs TensorRT and a
GPU and is skipped.)"""

import pytest

from builder.tensorrt_engine import ProfileLimits, build_engine

LIMITS = ProfileLimits(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096, block_size=16,
                       num_kv_blocks=1000)


def test_profile_covers_the_engine_limits():
    assert LIMITS.shapes("input_ids", ())[2] == (512,)
    assert LIMITS.shapes("slot_mapping", ())[0] == (1,)
    assert LIMITS.shapes("block_tables", ())[2] == (64, 256)     # 4096 / 16 blocks per sequence
    assert LIMITS.shapes("query_start_loc", ())[2] == (65,)       # sequences + 1
    assert LIMITS.shapes("logits_indices", ())[2] == (64,)
    lo, opt, hi = LIMITS.shapes("k_pool_3", (-1, 16, 8, 128))
    assert lo == opt == hi == (1000, 16, 8, 128)                  # the engine allocates exactly this
    for name in ("input_ids", "block_tables", "seq_lens", "query_start_loc"):
        lo, opt, hi = LIMITS.shapes(name, ())
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    with pytest.raises(KeyError):
        LIMITS.shapes("something_else", ())


def test_build_without_tensorrt_says_so(tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):
        build_engine(str(tmp_path / "model.onnx"), str(tmp_path / "model.plan"), LIMITS)
