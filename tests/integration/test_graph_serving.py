"""Starts a real tritonserver on a `builder build --engine onnxruntime` entry: the backend
loads the exported graph named in config.pbtxt (relative to the model directory) and
streams the same tokens as the offline torch engine on the same checkpoint."""

from backend import LLM, SamplingParams
from builder.build import BuildOptions, build
from clients.triton_client import StreamingRequest
from clients.tritonserver import TritonServer
from tests.integration.conftest import wait_blocks_free


def test_onnxruntime_entry_served(tmp_path, tiny_ckpt):
    repo = tmp_path / "repo"
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(repo / "llm"), name="llm", engine="onnxruntime",
                              weights="float32", num_kv_blocks=64, max_model_len=512),
          log=lambda *_: None, progress=False)
    prompts = ["The assert statement", "The with statement"]
    params = {"max_tokens": 8, "min_tokens": 8, "temperature": 0}
    offline = LLM(tiny_ckpt, dtype="float32", block_size=16, num_kv_blocks=64).generate(
        prompts, SamplingParams(**params))
    with TritonServer(str(repo), log_path=str(tmp_path / "server.log")) as srv:
        for p, o in zip(prompts, offline):
            res = StreamingRequest(srv.grpc_url).run(p, params)
            assert res.ok and res.token_ids == o.token_ids
        wait_blocks_free(srv)
