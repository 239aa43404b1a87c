"""The scheduler's side of the vision tower (vLLM v1's encoder budget and
EncoderCacheManager): which images a step encodes, and which outputs the runner keeps.

An image's placeholder tokens need the tower's output for the whole image (its
patches attend to each other), so a prompt chunk that reaches an image needs that
output in the step: already held (cached by content hash, so a repeated image is
encoded once), or encoded in the step within the step's budget
(`max_num_encoder_input_tokens`, in output rows) and the cache's room
(`encoder_cache_size`). Otherwise the chunk ends before the image, and the request
waits for a later step.

A request holds a reference on each image it has started until its tokens are computed
(or it ends, or is preempted); outputs nobody references stay cached and are evicted
least recently used when room is needed, never one the step uses. The runner is told
what to encode (SchedulerOutput.encoder_inputs) and what to drop (encoder_frees).

With `whole_images` (models whose image tokens attend to the whole image, Gemma 3) a
chunk never ends inside an image: all of an image's remaining tokens are computed in one
step, or the chunk ends before the image.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from backend.engine.request import Request
from backend.multimodal.inputs import ImageItem


@dataclass
class EncoderPlan:
    num_new_tokens: int
    encode: list[ImageItem] = field(default_factory=list)
    touched: list[ImageItem] = field(default_factory=list)


class EncoderCacheManager:
    def __init__(self, cache_size: int, budget_per_step: int, whole_images: bool = False) -> None:
        self.cache_size = cache_size
        self.whole_images = whole_images
        self.budget_per_step = budget_per_step
        self.held: OrderedDict[bytes, int] = OrderedDict()      # hash -> rows, least recently used first
        self.refs: dict[bytes, set[str]] = {}
        self.rows_held = 0
        self._budget = budget_per_step
        self._step: set[bytes] = set()          # used by the step being scheduled: never evicted in it
        self._freed: list[bytes] = []
        self.num_encoded = 0                    # images encoded, and images served from the cache
        self.num_cache_hits = 0

    def begin_step(self) -> None:
        self._budget = self.budget_per_step
        self._step = set()

    def stats(self) -> dict:
        return {"encoder_images_encoded": self.num_encoded, "encoder_cache_hits": self.num_cache_hits,
                "encoder_cache_rows": self.rows_held, "encoder_cache_size": self.cache_size}

    def take_freed(self) -> list[bytes]:
        freed, self._freed = self._freed, []
        return freed

    def _evictable_rows(self, keep: set[bytes]) -> int:
        return sum(n for h, n in self.held.items() if not self.refs.get(h) and h not in self._step and h not in keep)

    def plan(self, request: Request, start: int, num_new: int) -> EncoderPlan:
        """The request's chunk of num_new tokens from `start`, cut before the first image
        whose output can be neither found nor made in this step. Changes nothing."""
        mm = request.mm_inputs
        end = start + num_new
        if mm is None or start >= len(request.prompt_token_ids):
            return EncoderPlan(num_new)
        plan = EncoderPlan(num_new)
        overlapping = mm.overlapping(start, end)
        needed = {mm.items[i].mm_hash for i in overlapping}      # (held ones are not room for the others)
        budget, room = self._budget, self.cache_size - self.rows_held + self._evictable_rows(needed)
        for i in overlapping:
            item = mm.items[i]
            if self.whole_images and item.end > end:
                plan.num_new_tokens = max(0, item.offset - start)       # (0: the image's rest waits whole)
                break
            plan.touched.append(item)
            if item.mm_hash in self.held or any(e.mm_hash == item.mm_hash for e in plan.encode):
                continue
            if item.length <= budget and item.length <= room:
                plan.encode.append(item)
                budget -= item.length
                room -= item.length
                continue
            plan.touched.pop()
            plan.num_new_tokens = max(0, item.offset - start)
            break
        return plan

    def commit(self, request: Request, plan: EncoderPlan) -> None:
        """The planned chunk was scheduled: its images are encoded (room made) and
        referenced; those it completes are released (they stay cached)."""
        rid = request.request_id
        for item in plan.touched:           # first: the room made below never takes them
            self._step.add(item.mm_hash)
        for item in plan.encode:
            self._make_room(item.length)
            self.held[item.mm_hash] = item.length
            self.rows_held += item.length
            self._budget -= item.length
            self.num_encoded += 1
        encoded = {item.mm_hash for item in plan.encode}
        end = request.num_computed_tokens + plan.num_new_tokens
        for item in plan.touched:
            h = item.mm_hash
            self.held.move_to_end(h)
            if h not in encoded and item.offset >= request.num_computed_tokens:
                self.num_cache_hits += 1        # (its first chunk found it held)
            if item.end <= end:
                self._unref(h, rid)
            else:
                self.refs.setdefault(h, set()).add(rid)

    def release(self, request: Request) -> None:
        """The request ended or was preempted: its references go (the outputs stay cached)."""
        if request.mm_inputs is None:
            return
        for item in request.mm_inputs.items:
            self._unref(item.mm_hash, request.request_id)

    def _unref(self, h: bytes, rid: str) -> None:
        owners = self.refs.get(h)
        if owners is not None:
            owners.discard(rid)
            if not owners:
                del self.refs[h]

    def _make_room(self, rows: int) -> None:
        for h in list(self.held):
            if self.rows_held + rows <= self.cache_size:
                return
            if self.refs.get(h) or h in self._step:
                continue
            self.rows_held -= self.held.pop(h)
            self._freed.append(h)
