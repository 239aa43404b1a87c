"""Which adapters exist, which are loaded in host memory, and which sit in the device's
slots; and, per step, each scheduled request's slot.

- All adapters named in `lora_modules` are read and checked at load, so a bad one fails
  the model load with a message naming it. Host copies are kept for the `max_cpu_loras`
  most recently used (the others are read again from their folder when asked for).
- Adapters can be added and removed while the engine serves (vLLM's
  `/v1/load_lora_adapter`): `read_checked` reads and checks one off the engine thread,
  `add` registers it on the engine thread. `begin_unload` refuses new requests for an
  adapter at once; `finish_unloads` drops it (slot, host copy, name) once no unfinished
  request uses it.
- A request's cache salt (the root of its block-hash chain) comes from the adapter's
  name and files: KV computed under an adapter since unloaded is never reused under
  other files loaded under the same name, and replicas with the same files hash alike
  (KV events, routing).
- The device has `max_loras` slots (vLLM's name). A step's adapters are made resident
  before its forward, evicting the least recently used adapter that the step does not
  use. The scheduler never puts more distinct adapters in one step than there are
  slots, so that always succeeds.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from backend.config import EngineArgs
from backend.engine.errors import InvalidRequestError
from backend.lora.adapter import LoRAAdapter, load_adapter, projection_shapes, shard_adapter
from backend.lora.layers import SLICES, LoRAState, wrap_model
from backend.lora.punica import LoRAMetadataBuilder, make_lora_ops
from backend.models.config import ModelConfig
from backend.parallel.sharding import local_config

logger = logging.getLogger(__name__)


def cache_salt(lora_name: Optional[str], content_hash: bytes = b"") -> Optional[bytes]:
    """The root of a request's block-hash chain: KV computed under an adapter is found
    only by requests under the same adapter, of the same files."""
    if not lora_name:
        return None
    return hashlib.sha256(b"lora\0" + lora_name.encode() + b"\0" + content_hash).digest()


class RuntimeLoRAError(ValueError):
    """A runtime load or unload refused (the name is taken, unknown, or being unloaded);
    the message says which. `not_found`: the adapter does not exist (an HTTP 404)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


class LoRAManager:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, model: nn.Module, device: torch.device,
                 dtype: torch.dtype, kernel_backend: str, max_num_tokens: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        """Under tensor parallelism each rank has a manager of its own over its shard of the
        model and of every adapter; given the same steps in the same order, they make the
        same slot choices as rank 0's."""
        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.paths = dict(args.lora_modules)
        self.max_rank = args.max_lora_rank
        # Each adapter's files' hash (its cache salt), and the adapters whose unload
        # waits for their requests to finish.
        self._content: dict[str, bytes] = {}
        self.unloading: set[str] = set()
        # Loaded at run time: their host copies are never evicted (their folder may change
        # or go once loaded, and a re-read would run on the engine thread).
        self._runtime: set[str] = set()
        self.num_slots = args.max_loras
        self.max_cpu_loras = args.max_cpu_loras or max(args.max_loras, len(self.paths))
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        for name, path in self.paths.items():       # every adapter checked now, not on first use
            adapter = self.read_checked(name, path)
            self._content[name] = adapter.content_hash
            self._remember(adapter)
        shrink, expand = make_lora_ops(kernel_backend)
        self.state = LoRAState(self.num_slots, self.max_rank, device, shrink, expand)
        self.layers = wrap_model(model, projection_shapes(local_config(cfg, tp_size)), self.state, dtype, device)
        self._slot_of: OrderedDict[str, int] = OrderedDict()       # resident adapters, LRU first
        self._free = list(range(self.num_slots))
        self._meta = LoRAMetadataBuilder(max_num_tokens, self.num_slots, device)
        self.num_slot_loads = 0
        self.num_host_loads = 0

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def check_request(self, lora_name: str) -> None:
        if lora_name in self.unloading:
            raise InvalidRequestError(f"LoRA {lora_name} is being unloaded; it takes no new requests")
        if lora_name not in self.paths:
            # The Triton vLLM backend's words.
            raise InvalidRequestError(f"LoRA {lora_name} is not supported, we currently support {self.names}")

    def salt(self, lora_name: Optional[str]) -> Optional[bytes]:
        return cache_salt(lora_name, self._content.get(lora_name, b"")) if lora_name else None

    # ------------------------------------------------------------ at run time
    def read_checked(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, read and checked against the model (LoRAConfigError
        names what is wrong), this rank's shard of it. Touches no state: safe on any
        thread, so a runtime load reads its files off the engine thread."""
        adapter = load_adapter(name, path, self.cfg, self.max_rank)
        return shard_adapter(adapter, self.cfg, self.tp_rank, self.tp_size)

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter read by `read_checked` (engine thread)."""
        if adapter.name in self.unloading:
            raise RuntimeLoRAError(f"The lora adapter '{adapter.name}' is being unloaded; load it again once its "
                                   "requests have finished")
        if adapter.name in self.paths:
            raise RuntimeLoRAError(f"The lora adapter '{adapter.name}' has already been loaded.")
        self.paths[adapter.name] = adapter.path
        self._content[adapter.name] = adapter.content_hash
        self._runtime.add(adapter.name)
        self._remember(adapter)

    def begin_unload(self, name: str) -> None:
        """New requests for `name` are refused from now on (engine thread)."""
        if name not in self.paths or name in self.unloading:
            raise RuntimeLoRAError(f"The lora adapter '{name}' cannot be found.", not_found=True)
        self.unloading.add(name)

    def finish_unloads(self, in_use: set[str]) -> list[str]:
        """Drop the adapters being unloaded that no unfinished request uses (`in_use`:
        the adapters of every running and waiting request); returns their names."""
        done = sorted(self.unloading - in_use)
        for name in done:
            self.unloading.discard(name)
            self._runtime.discard(name)
            del self.paths[name]
            self._content.pop(name, None)
            self._host.pop(name, None)
            slot = self._slot_of.pop(name, None)
            if slot is not None:
                self._free.append(slot)
        return done

    # ------------------------------------------------------------------ per step
    def prepare(self, lora_names: list[Optional[str]], num_new_tokens: list[int],
                graph_size: Optional[int] = None) -> None:
        """Make the step's adapters resident and set the row groups the layers read; for
        a graph replay of `graph_size` rows, upload them where the graph reads them."""
        slots = self.activate(lora_names)
        if graph_size is None:
            self.state.meta = self._meta.build(slots, num_new_tokens)
        else:
            self._meta.build(slots, num_new_tokens, always=True)
            self.state.meta = self._meta.static(graph_size)

    def use_static(self, size: int) -> None:
        """Before capturing (or standing in for) a decode graph of `size` rows: the layers
        read the fixed views, and no row has an adapter until a step uploads some."""
        self._meta.build([], [], always=True)
        self.state.meta = self._meta.static(size)

    def activate(self, lora_names: list[Optional[str]]) -> list[int]:
        """Each request's slot (-1: base model), loading adapters into slots as needed."""
        wanted = list(dict.fromkeys(n for n in lora_names if n))
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; max_loras is {self.num_slots}")
        for name in wanted:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
            else:
                self._load_into_slot(name, self._take_slot(set(wanted)))
        return [self._slot_of[n] if n else -1 for n in lora_names]

    def _take_slot(self, keep: set[str]) -> int:
        if self._free:
            return self._free.pop(0)
        victim = next(n for n in self._slot_of if n not in keep)     # least recently used first
        return self._slot_of.pop(victim)

    def _load_into_slot(self, name: str, slot: int) -> None:
        adapter = self._adapter(name)
        for layer_idx, layers in enumerate(self.layers):
            for fused, lin in layers.items():
                lin.set_slot(slot, [adapter.weights.get((layer_idx, part)) for part in SLICES[fused]])
        self.state.scaling[slot] = adapter.scaling
        self.state.scaling_cpu[slot] = adapter.scaling
        self._slot_of[name] = slot
        self.num_slot_loads += 1

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            adapter = self.read_checked(name, self.paths[name])
            self.num_host_loads += 1
            self._remember(adapter)
        self._host.move_to_end(name)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        # Least recently used first; never the one just remembered, nor one loaded at run time.
        evictable = [n for n in self._host if n not in self._runtime and n != adapter.name]
        while len(self._host) > self.max_cpu_loras and evictable:
            del self._host[evictable.pop(0)]

    def index_of(self, lora_names: list[Optional[str]]) -> list[int]:
        """The names as indices into lora_modules (-1: the base model): what rank 0 sends
        the other tensor-parallel ranks each step."""
        order = {n: i for i, n in enumerate(self.paths)}
        return [order[n] if n else -1 for n in lora_names]

    def names_of(self, indices: list[int]) -> list[Optional[str]]:
        names = list(self.paths)
        return [names[i] if i >= 0 else None for i in indices]

