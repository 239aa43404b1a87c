"""Sleep mode (vLLM's `/sleep` and `/wake_up`): the engine gives its memory back between
uses, as co-located training and rollouts need, and wakes up with the same outputs.

- level 1: the KV pool's memory is freed (its contents go, and the prefix cache is
  reset). On CUDA the weights move to (pageable) host memory, and their device memory
  is freed.
  On CPU the weights already live in host memory and stay.
- level 2: the KV pool and the weights are freed. `wake_up` reads the weights again from
  the checkpoint, loaded and packed as at start.

The KV tensors keep their objects: only their storage is freed and restored, so every
part of the engine holding one sees it back. The weights keep their parameter objects
and modules: each gets its data back by name. Captured CUDA graphs read the old
addresses, so `wake_up` captures them again.

Only an idle engine sleeps. While it sleeps, new requests are refused as unavailable
(retryable). Blocks the host KV tier still has to save are saved first. Not under tensor
or pipeline parallelism, and level 2 not with a draft model (refused, with the reason).
"""

from __future__ import annotations

import gc
import weakref
from typing import Iterator

import torch
from torch import nn

from backend.engine.errors import InvalidRequestError


def weight_slots(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, str]]:
    """(key, module, kind, name) of every tensor the checkpoint gives the model:
    parameters, buffers, and tensor attributes (oneDNN's packed weights). The key is the
    module's name with a LoRA wrapper's `.base` taken out, as a fresh model names it; the
    wrappers' own tensors (adapter slots) are not weights."""
    wrappers = {name for name, m in model.named_modules() if type(m).__module__ == "backend.lora.layers"}
    for name, module in model.named_modules():
        if name in wrappers:
            continue
        parent, _, last = name.rpartition(".")
        key = parent if last == "base" and parent in wrappers else name
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, t in table.items():
                if t is not None:
                    yield f"{key}:{attr}", module, kind, attr
        for attr, t in vars(module).items():
            # (private attributes are caches made on first use: `_dequantized` weights)
            if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not attr.startswith("_"):
                yield f"{key}:{attr}", module, "attr", attr


def drop_caches(model: nn.Module) -> None:
    """The modules' private tensor caches (made again on first use)."""
    for module in model.modules():
        for attr, t in list(vars(module).items()):
            if attr.startswith("_") and isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                setattr(module, attr, None)


def _get(module: nn.Module, kind: str, attr: str):
    return (module._parameters if kind == "param" else module._buffers if kind == "buffer" else vars(module))[attr]


def _set(module: nn.Module, kind: str, attr: str, value) -> None:
    if kind == "param":
        module._parameters[attr].data = value
    elif kind == "buffer":
        module._buffers[attr] = value
    else:
        setattr(module, attr, value)


class SleepMode:
    def __init__(self, engine) -> None:
        # A proxy: a reference back to the engine would make a cycle, and gc.freeze()
        # (gc_policy.py) keeps cycles of the engine's objects for the process's life.
        self.engine = weakref.proxy(engine)
        self.level = 0                  # 0: awake
        # Set while sleep or wake_up runs (on the engine thread): requests are refused
        # then too, on the caller's thread, so none waits behind a long copy.
        self.changing = False
        self._host: dict[str, torch.Tensor] = {}     # level 1 on CUDA: the weights' host copies
        # The weights freed, as weight_slots named them before (a freed attribute is None).
        self._slots: list[tuple[str, nn.Module, str, str]] = []

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    @property
    def refuses_requests(self) -> bool:
        return self.level > 0 or self.changing

    def sleep(self, level: int = 1) -> None:
        self.changing = True
        try:
            self._sleep(level)
        finally:
            self.changing = False

    def wake_up(self) -> None:
        self.changing = True
        try:
            self._wake_up()
        finally:
            self.changing = False

    def _kv_layers(self) -> list:
        engine = self.engine
        layers = list(engine.runner.kv_caches)
        proposer = getattr(engine.speculator, "proposer", None)
        layers += list(getattr(proposer, "kv_caches", None) or [])
        return layers

    def _sleep(self, level: int) -> None:
        engine = self.engine
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 (free the KV cache, weights to host memory) or 2 "
                                      f"(free both), not {level}")
        if self.is_sleeping:
            raise InvalidRequestError(f"the engine is asleep already (level {self.level})")
        if engine.has_unfinished_requests():
            raise InvalidRequestError(f"the engine has {engine.scheduler.num_unfinished} unfinished request(s): "
                                      "it sleeps only when idle")
        if engine.workers is not None:
            raise InvalidRequestError("sleep mode is not supported under tensor or pipeline parallelism yet")
        if level == 2 and self._kv_layers() != list(engine.runner.kv_caches):
            raise InvalidRequestError("sleep level 2 is not supported with a draft model yet: use level 1")
        if engine.model is None:
            raise InvalidRequestError("sleep mode needs the torch model (model_runner 'torch')")
        on_cuda = engine.device.type == "cuda"
        slots = list(weight_slots(engine.model)) if level == 2 or on_cuda else []
        if level == 1 and on_cuda:
            # The host copies first: if host memory runs out, nothing has been freed yet.
            # Pageable memory: torch's pinned allocator would round each weight up to a
            # power of two and keep it cached after wake_up.
            self._host = {key: _get(m, kind, attr).detach().to("cpu") for key, m, kind, attr in slots}
        transfers = engine.kv_cache.take_transfers()
        if transfers is not None:           # the host tier's last saves, before the blocks go
            engine.runner.kv_connector.start_transfers(transfers)
        if on_cuda:
            torch.cuda.synchronize(engine.device)
        engine.kv_cache.reset_prefix_cache()
        self._drop_graphs()
        for layer in self._kv_layers():
            for t in (layer.key, layer.value):
                t.untyped_storage().resize_(0)
        self._slots = slots
        for key, module, kind, attr in slots:
            t = _get(module, kind, attr)
            _set(module, kind, attr, torch.empty(0, dtype=t.dtype, device=t.device) if not t.is_mkldnn else None)
        drop_caches(engine.model)
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
        self.level = level

    def _wake_up(self) -> None:
        engine = self.engine
        if not self.is_sleeping:
            return
        if self.level == 2:
            from backend.engine.assembly import load_weights, pack_weights
            fresh = load_weights(engine.args, engine.model_config, engine.dtype, engine.device,
                                 engine.attention_backend, engine.max_position)
            pack_weights(fresh, engine.device, engine.dtype)
            values = {key: _get(m, kind, attr) for key, m, kind, attr in weight_slots(fresh)}
        else:
            values = {key: t.to(engine.device) for key, t in self._host.items()}
        for key, module, kind, attr in self._slots:
            if key not in values:
                raise RuntimeError(f"wake_up: the checkpoint has no '{key}' for this model any more")
            _set(module, kind, attr, values[key])
        self._host.clear()
        self._slots = []
        for layer in self._kv_layers():
            for t in (layer.key, layer.value):
                t.untyped_storage().resize_(t.numel() * t.element_size())
                t.zero_()
        self._capture_graphs()
        self.level = 0

    def _drop_graphs(self) -> None:
        engine = self.engine
        engine.runner.graphs = None
        drafter = engine.runner.drafter
        if drafter is not None:
            drafter.graphs = None

    def _capture_graphs(self) -> None:
        engine = self.engine
        if not engine.use_cuda_graphs:
            return
        from backend.engine import sizing
        from backend.engine.runner.cuda_graphs import verify_query_len
        args = engine.args
        engine.runner.capture_graphs(args.max_num_seqs, engine.max_model_len, verify_query_len(args))
        if engine.runner.drafter is not None:
            engine.runner.drafter.capture_graphs(args.max_num_seqs, engine.max_model_len,
                                                 sizing.draft_verify_query_len(args))
