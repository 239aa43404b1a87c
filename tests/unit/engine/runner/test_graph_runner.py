"""The engine running an exported decoder graph instead of the torch model: the ONNX
reference export in onnxruntime gives transformers' greedy tokens (and prompt logprobs)
through the same scheduler and KV cache manager, with chunked prefill, preemption and
prefix hits. This is
the packed-step contract (names, dtypes, layouts) the TensorRT runner feeds its engine."""

import os

import pytest

from backend import LLM, ConfigError, EngineArgs, SamplingParams
from builder.onnx_export import export
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.pins import require_pinned
from tests.helpers.prompt_logprobs import check_against_transformers


@pytest.fixture(autouse=True, scope="module")
def _pinned_onnx():
    # Module scope: checked before the module's export fixtures run.
    require_pinned("onnx", "onnxscript", "onnxruntime")


@pytest.fixture(scope="module")
def exported(ckpt_dir, tmp_path_factory):
    path = make_checkpoint(str(ckpt_dir / "qwen2"), "qwen2")
    return path, export(path, str(tmp_path_factory.mktemp("onnx") / "model.onnx"), "reference", block_size=4)


def test_onnxruntime_runner_matches_transformers(exported):
    path, graph = exported
    prompts = random_prompts(6, [1, 40, 9, 23, 17, 40], seed=3)
    prompts[5][:24] = prompts[1][:24]            # a shared prefix: a cache hit on the 6th
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(path, block_size=4, num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=16,
              model_runner="onnxruntime", model_graph=graph)
    greedy = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    # Two ask for prompt logprobs: their rows ride in the graph's logits_indices.
    params = [greedy.model_copy(update={"prompt_logprobs": 2}) if i in (1, 3) else greedy for i in range(6)]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    for i in (1, 3):
        check_against_transformers(path, prompts[i], outs[i].prompt_logprobs, 2)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_pool_free(llm)


def test_runner_arguments_are_validated(exported, tmp_path):
    path, graph = exported
    with pytest.raises(ConfigError, match="model_graph"):
        EngineArgs.create(model=path, model_runner="onnxruntime")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineArgs.create(model=path, model_runner="onnxruntime", model_graph=graph, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="model_graph"):
        LLM(path, model_runner="onnxruntime", model_graph=str(tmp_path / "missing.onnx"), device="cpu")
    with pytest.raises(ConfigError, match="block_size"):
        LLM(path, model_runner="onnxruntime", model_graph=graph, block_size=8)
    with pytest.raises(ConfigError, match="tensorrt"):
        LLM(path, model_runner="tensorrt", model_graph=graph, device="cpu")
    assert os.path.isfile(graph)


def test_tensorrt_stream_waits_for_the_inputs_upload():
    """The TensorRT runner executes on its own stream: it must wait for an event recorded
    on the engine's stream (where the step's inputs were uploaded) before execute_async_v3.
    TensorRT and CUDA are stand-ins here; the order of the calls is what is checked."""
    import torch

    from backend.engine.runner.graph_runner import TensorRTGraph
    log = []

    class FakeEvent:
        def record(self, stream):
            log.append(("record", stream))

    class Cuda:
        Event = FakeEvent

        @staticmethod
        def current_stream(device):
            return "engine-stream"

    class Stream:
        cuda_stream = 1234

        def wait_event(self, event):
            log.append(("wait", type(event).__name__))

        def synchronize(self):
            log.append(("synchronize",))

    class Context:
        def set_input_shape(self, name, shape):
            pass

        def set_tensor_address(self, name, ptr):
            pass

        def get_tensor_shape(self, name):
            return (1, 8)

        def execute_async_v3(self, handle):
            log.append(("execute", handle))
            return True

    graph = object.__new__(TensorRTGraph)
    graph.context, graph.device, graph.cuda, graph.stream = Context(), torch.device("cpu"), Cuda(), Stream()
    logits = graph({"input_ids": torch.zeros(3, dtype=torch.long)})
    assert logits.shape == (1, 8)
    assert log == [("record", "engine-stream"), ("wait", "FakeEvent"), ("execute", 1234), ("synchronize",)]


def test_runtime_does_not_import_the_builder():
    """No module under backend/ imports builder/, at top level or inside a function (the
    onnxruntime runner once reached builder.onnx_export for the graph's output names)."""
    import ast
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    offenders = []
    for folder, _, files in os.walk(os.path.join(root, "backend")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{os.path.relpath(path, root)}: {m}" for m in modules
                              if m == "builder" or m.startswith("builder.")]
    assert offenders == []
