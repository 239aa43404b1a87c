"""builder build --runner pooling: an embedding model's entry (config.pbtxt parameters
runner and pooler_config, read back by the backend as its engine arguments), and the
combinations it refuses before writing anything."""

import pytest

from backend.triton_server.serving_config import load_settings
from builder.build import BuildOptions, build
from builder.entry_files import BuildError
from tests.helpers.checkpoints import make_embedding_checkpoint


@pytest.fixture(scope="module")
def embed_ckpt(ckpt_dir):
    return make_embedding_checkpoint(str(ckpt_dir / "qwen3-embed"))


def params_of(pbtxt: str) -> dict:
    import re
    return {k: v.replace('\\"', '"') for k, v in re.findall(r'key: "(\w+)" value: \{ string_value: "(.*?)" \} \}',
                                                             pbtxt)}


def test_a_pooling_entry_names_its_runner_and_pooler(embed_ckpt, tmp_path):
    out = tmp_path / "emb"
    build(BuildOptions.create(checkpoint=embed_ckpt, output=str(out), link=True, runner="pooling",
                              pooler_config='{"pooling_type": "mean", "normalize": false}', num_kv_blocks=16),
          log=lambda *_: None, progress=False)
    params = params_of((out / "config.pbtxt").read_text())
    assert params["runner"] == "pooling"
    args, _ = load_settings(params, str(out))
    assert args.runner == "pooling" and args.pooler.pooling_type == "MEAN" and not args.pooler.normalize
    out2 = tmp_path / "emb2"
    build(BuildOptions.create(checkpoint=embed_ckpt, output=str(out2), link=True, runner="pooling",
                              num_kv_blocks=16), log=lambda *_: None, progress=False)
    args, _ = load_settings(params_of((out2 / "config.pbtxt").read_text()), str(out2))
    assert args.pooler.pooling_type == "LAST" and args.pooler.normalize       # Qwen3-Embedding's
    out3 = tmp_path / "gen"
    build(BuildOptions.create(checkpoint=embed_ckpt, output=str(out3), link=True, num_kv_blocks=16),
          log=lambda *_: None, progress=False)
    assert "runner" not in params_of((out3 / "config.pbtxt").read_text())


@pytest.mark.parametrize("options, message", [
    (dict(pooler_config={"pooling_type": "LAST"}), "pooler_config is for runner=pooling"),
    (dict(runner="pooling", engine="onnxruntime"), "engine=onnxruntime"),
    (dict(runner="pooling", tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(runner="pooling", pooler_config={"pooling_type": "CLS"}), "pooling_type"),
    (dict(runner="embed"), "runner"),
])
def test_bad_pooling_options_are_refused_naming_them(embed_ckpt, tmp_path, options, message):
    with pytest.raises(BuildError, match=message):
        BuildOptions.create(checkpoint=embed_ckpt, output=str(tmp_path / "x"), **options)
