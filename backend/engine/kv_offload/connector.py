"""The KV connector interface: how a store of KV blocks outside the device pool joins the
engine. The shape is vLLM's KVConnector (`v1/kv_connector/v1/base.py`), in our terms.

The scheduler side runs inside the KV cache manager, the one writer of KV state:
- `lookup`: after the device's prefix-cache hits, how many of the request's next full
  blocks the store holds;
- `on_allocated`: device blocks were allocated for those hits, so their contents are to
  be loaded in this step;
- `on_computed`: full blocks whose K/V a step has written, for the store to keep;
- `on_reused`: a device block is about to be written again;
- `take_transfers`: what the step moves, handed to the runner in SchedulerOutput.

The runner side (`KVConnectorWorker.start_transfers`) runs the copies before the step's
forward. It never decides anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from backend.engine.request import Request
    from backend.engine.scheduling.block_pool import KVBlock


@dataclass
class ExternalHit:
    """A full block of a request that the store holds: its place there, and the hash the
    device block loaded from it is registered under."""
    location: int
    block_hash: bytes


@dataclass
class KVTransfers:
    """One step's copies, in this order, all before its forward."""
    # (device block id, store location): device to store. Blocks computed by an earlier
    # step that the store keeps.
    saves: list[tuple[int, int]] = field(default_factory=list)
    # (store location, device block id): store to device, into blocks allocated for hits.
    loads: list[tuple[int, int]] = field(default_factory=list)
    # Some block saved here is written by this step (evicted from the prefix cache and
    # allocated again): the forward waits for the saves. Otherwise they run beside it.
    wait_for_saves: bool = False

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class KVConnectorScheduler(ABC):
    @abstractmethod
    def lookup(self, request: "Request", start: int, stop: int) -> list[ExternalHit]:
        """The store's hits among the request's full blocks start..stop-1, the leading
        run of them (the chain breaks at the first miss). `request.block_hashes` is up to
        date. Changes nothing but recency."""

    @abstractmethod
    def on_allocated(self, hits: Sequence[ExternalHit], blocks: Sequence["KVBlock"]) -> None:
        """Device blocks were allocated for `hits` (in order): load them in this step."""

    @abstractmethod
    def on_computed(self, blocks: Sequence["KVBlock"], first_index: int) -> None:
        """Full, registered blocks whose K/V a step has written: a request's blocks
        first_index, first_index + 1, ... (block 0's parent is the chain's root, not a
        block)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every block kept (the prefix cache was reset)."""

    @abstractmethod
    def on_reused(self, block: "KVBlock") -> None:
        """A device block was allocated: a later forward writes it."""

    @abstractmethod
    def take_transfers(self) -> Optional[KVTransfers]:
        """The copies recorded since the last call (None when there are none)."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters for the engine's stats and metrics."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def start_transfers(self, transfers: Optional[KVTransfers]) -> None:
        """Before every forward: issue the step's copies (saves, then loads), or, with
        None, none (the store may still order the forward after its earlier copies)."""
