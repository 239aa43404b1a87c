"""A draft model's proposals, kept on the device until the step that verifies them.

The draft proposes inside the runner's step (draft_model.py), after that step's one copy
to the host. Reading its proposals back would be a second device-to-host copy and wait:
with async scheduling, a wait for the next step's forward too, launched before. So the
proposals stay where the draft drew them, and the host holds only how many there are
(all the scheduler needs: slots, budget, rows). The verifying step writes them on the
device where it needs their values, into its input ids (StepInputBuilder's proposal
positions), the rejection sampler's plan and the penalties' proposal counts
(`device_fill`), and sends them to the host within its own copy, beside the accept
flags (ModelRunner.sample): the host learns a request's accepted tokens from that.

Only bad words that span several tokens read proposals on the host before that (a
verification row's output tail: `tolist`). The first read copies the whole draft step's
proposals, which every slice of them shares: one wait per draft step, for the draft's
forwards and, with async scheduling, the step launched before them.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer


class DraftTokens:
    """Proposals start:start + length of `base` (int64, on the device), one request's; or,
    with `index`, base[index] (a path through a tree of proposals: `take`)."""
    __slots__ = ("base", "start", "length", "_read", "index")

    def __init__(self, base: torch.Tensor, start: int, length: int, _read: Optional[list] = None,
                 index: Optional[np.ndarray] = None) -> None:
        self.base, self.start, self.length = base, start, length
        # [base on the host, or None until read], shared by every slice of `base`.
        self._read = _read if _read is not None else [None]
        self.index = index

    def positions(self) -> np.ndarray:
        """Where in `base` these proposals are."""
        return self.index if self.index is not None else np.arange(self.start, self.start + self.length)

    def take(self, nodes) -> "DraftTokens":
        """These proposals' entries `nodes` (offsets into them), in that order."""
        return DraftTokens(self.base, 0, len(nodes), self._read, self.positions()[np.asarray(nodes, dtype=np.int64)])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if not isinstance(index, slice):
            return self.tolist()[index]
        a, b, step = index.indices(self.length)
        if step != 1:
            raise ValueError("DraftTokens slices take step 1")
        if self.index is not None:
            return DraftTokens(self.base, 0, max(b - a, 0), self._read, self.index[a:b])
        return DraftTokens(self.base, self.start + a, max(b - a, 0), self._read)

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, DraftTokens)) else NotImplemented

    __hash__ = None

    def tolist(self) -> list[int]:
        """The values on the host: the first read of any slice of `base` copies all of
        it and waits for the draft's step (on a GPU). The step paths never call it; bad
        words spanning several tokens do."""
        if not self.length:
            return []
        if self._read[0] is None:
            self._read[0] = self.base.tolist()
        if self.index is not None:
            return [self._read[0][i] for i in self.index.tolist()]
        return self._read[0][self.start:self.start + self.length]

    def __repr__(self) -> str:
        return f"DraftTokens(start={self.start}, length={self.length})"


def extend_staged(values: list[int], tokens: Sequence[int], on_device: list[tuple[int, DraftTokens]]) -> None:
    """Appends proposals to a host list bound for an upload: their ids, or for a draft
    model's (on the device) zeros and where they go in `on_device`, for device_fill to
    write once the list is on the device."""
    if isinstance(tokens, DraftTokens):
        on_device.append((len(values), tokens))
        values.extend([0] * len(tokens))
    else:
        values.extend(tokens)


def device_fill(dest: torch.Tensor, entries: list[tuple[int, DraftTokens]], staging: GrowingStagedBuffer) -> None:
    """dest[pos : pos + len(tokens)] = tokens, on the device, for each (pos, tokens) of
    `entries`: one upload of indices, at most one concatenation (proposals drawn by
    different draft steps), one gather, one scatter. No host sync."""
    entries = [(pos, t) for pos, t in entries if t.length]
    if not entries:
        return
    bases: dict[int, tuple[torch.Tensor, int]] = {}
    offset = 0
    for _, t in entries:
        if id(t.base) not in bases:
            bases[id(t.base)] = (t.base, offset)
            offset += t.base.shape[0]
    positions = np.concatenate([np.arange(pos, pos + t.length) for pos, t in entries])
    sources = np.concatenate([t.positions() + bases[id(t.base)][1] for _, t in entries])
    n = positions.shape[0]
    index = staging.upload(np.concatenate([positions, sources]).astype(np.int64))
    source = next(iter(bases.values()))[0] if len(bases) == 1 else torch.cat([b for b, _ in bases.values()])
    dest.index_copy_(0, index[:n], source.index_select(0, index[n:]).to(dest.dtype))
