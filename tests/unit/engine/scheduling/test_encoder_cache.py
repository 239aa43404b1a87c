"""The encoder budget and cache (backend/engine/scheduling/encoder_cache.py) on their
own: chunks cut before an image the step cannot encode, outputs shared by hash,
references held while a request is inside an image, least-recently-used eviction that
never drops an output in use."""

import torch

from backend.engine.request import Request
from backend.engine.scheduling.encoder_cache import EncoderCacheManager
from backend.multimodal.inputs import ImageItem, MultiModalInputs
from backend.sampling_params import SamplingParams


def item(name: str, offset: int, length: int) -> ImageItem:
    return ImageItem(name.encode().ljust(8, b"."), offset, length, torch.zeros(1), (1, 2, 2))


def request(rid: str, items: list[ImageItem], prompt_len: int = 40) -> Request:
    return Request(request_id=rid, prompt_token_ids=[5] * prompt_len, sampling_params=SamplingParams(),
                   arrival_time=0.0, max_tokens=4, mm_inputs=MultiModalInputs(items))


def schedule(cache: EncoderCacheManager, r: Request, num_new: int):
    plan = cache.plan(r, r.num_computed_tokens, num_new)
    cache.commit(r, plan)
    r.num_computed_tokens += plan.num_new_tokens
    return plan


def test_the_budget_cuts_the_chunk_before_an_image_it_cannot_encode():
    cache = EncoderCacheManager(cache_size=64, budget_per_step=10)
    r = request("a", [item("x", 2, 8), item("y", 12, 8)])
    cache.begin_step()
    plan = schedule(cache, r, 30)
    assert plan.num_new_tokens == 12 and [i.mm_hash[:1] for i in plan.encode] == [b"x"]
    cache.begin_step()
    plan = schedule(cache, r, 28)
    assert plan.num_new_tokens == 28 and [i.mm_hash[:1] for i in plan.encode] == [b"y"]
    assert not cache.refs                   # both images computed: released


def test_a_request_inside_an_image_keeps_it_and_a_shared_image_is_encoded_once():
    cache = EncoderCacheManager(cache_size=16, budget_per_step=16)
    a = request("a", [item("x", 0, 8)])
    b = request("b", [item("x", 4, 8)])
    cache.begin_step()
    assert len(schedule(cache, a, 4).encode) == 1
    assert cache.refs == {item("x", 0, 8).mm_hash: {"a"}}
    cache.begin_step()
    assert schedule(cache, b, 20).encode == [] and cache.num_cache_hits == 1
    # Room for another 8-row image only by evicting x, which "a" still needs: cut.
    c = request("c", [item("z", 0, 16)])
    cache.begin_step()
    assert cache.plan(c, 0, 20).num_new_tokens == 0
    schedule(cache, a, 20)                  # a passes x: x is unreferenced, still held
    assert cache.held and not cache.refs
    cache.begin_step()
    plan = schedule(cache, c, 20)
    assert plan.num_new_tokens == 20 and cache.take_freed() == [item("x", 0, 8).mm_hash]


def test_an_output_used_in_the_step_is_not_evicted_in_it():
    cache = EncoderCacheManager(cache_size=8, budget_per_step=16)
    a = request("a", [item("x", 0, 8)])
    cache.begin_step()
    schedule(cache, a, 20)                  # encoded and completed in this step: unreferenced
    b = request("b", [item("y", 0, 8)])
    assert cache.plan(b, 0, 20).num_new_tokens == 0     # x is the step's: no room
    cache.begin_step()
    assert schedule(cache, b, 20).num_new_tokens == 20
    assert cache.take_freed() == [item("x", 0, 8).mm_hash]


def test_release_drops_a_preempted_requests_references():
    cache = EncoderCacheManager(cache_size=16, budget_per_step=16)
    a = request("a", [item("x", 0, 8)])
    cache.begin_step()
    schedule(cache, a, 4)
    cache.release(a)
    assert not cache.refs and cache.held


def test_making_room_never_evicts_an_image_the_same_chunk_reads():
    """A chunk that reads a held image x and encodes a new one y: the room for y comes
    from elsewhere or the chunk stops before y (it took x once: a KeyError)."""
    cache = EncoderCacheManager(cache_size=16, budget_per_step=16)
    first = request("a", [item("x", 0, 8)])
    cache.begin_step()
    schedule(cache, first, 20)              # x held, unreferenced
    both = request("b", [item("x", 0, 8), item("y", 8, 16)])
    cache.begin_step()
    plan = schedule(cache, both, 30)
    assert plan.num_new_tokens == 8 and plan.encode == []       # y waits: only x's rows could make room
    assert item("x", 0, 8).mm_hash in cache.held


def test_whole_images_never_end_a_chunk_inside_an_image():
    cache = EncoderCacheManager(cache_size=64, budget_per_step=64, whole_images=True)
    r = request("a", [item("x", 4, 8)])
    cache.begin_step()
    assert schedule(cache, r, 10).num_new_tokens == 4          # ends before the image
    cache.begin_step()
    assert cache.plan(r, 4, 6).num_new_tokens == 0            # the image's 8 tokens do not fit in 6
    assert schedule(cache, r, 8).num_new_tokens == 8 and not cache.refs
