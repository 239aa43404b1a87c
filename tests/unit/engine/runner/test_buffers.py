"""Host staging buffers (backend/engine/runner/buffers.py): a write waits only for the upload it
would overwrite, and a buffer written several times a step (the draft model's inputs and
sampler) never waits for an upload of the same step. Events are stand-ins here (on a GPU
a wait is a cudaEventSynchronize): they record when they were recorded."""

import torch

import backend.engine.runner.buffers as buffers
from backend import LLM, SamplingParams
from backend.engine.runner.buffers import StagedBuffer
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint


class Clock:
    def __init__(self):
        self.step = 0               # what a recorded event is stamped with
        self.waits: list[tuple[int, int]] = []      # (stamp waited on, step at the wait)


class StandInEvent:
    def __init__(self, clock: Clock):
        self.clock, self.stamp = clock, None

    def record(self):
        self.stamp = self.clock.step

    def synchronize(self):
        if self.stamp is not None:
            self.clock.waits.append((self.stamp, self.clock.step))


def test_a_write_waits_for_the_upload_of_its_own_host_buffer(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(buffers, "_new_event", lambda device: StandInEvent(clock))
    for slots in (1, 3):
        buf, clock.waits = StagedBuffer(8, torch.int32, torch.device("cpu"), slots), []
        for i in range(7):
            clock.step = i
            buf.writable()[:2] = [i, i]
            buf.writable()[2] = i               # (a second call before the upload: no new wait)
            assert buf.upload(3).tolist() == [i, i, i]
            assert buf.np[:3].tolist() == [i, i, i]     # (the buffer that went up, until the next write)
        # Write i waits on the upload `slots` writes before it: the last that used its buffer.
        assert clock.waits == [(i - slots, i) for i in range(slots, 7)], (slots, clock.waits)


def test_the_draft_model_never_waits_for_an_upload_of_its_own_step(ckpt_dir, monkeypatch):
    """The draft builds and draws k times a step; with one host buffer each, each build
    and draw after the first waited for the device to have read the one before (on a GPU,
    with async scheduling, for the next step's whole forward, queued before the draft)."""
    clock = Clock()
    monkeypatch.setattr(buffers, "_new_event", lambda device: StandInEvent(clock))
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
    llm = LLM(path, block_size=8, num_kv_blocks=64, max_num_seqs=8, speculative_config=spec)
    drafter = llm.engine.runner.drafter
    real, in_draft = drafter.propose, []

    def propose(sched, states, sampled, target_hidden=None, paths=None):
        clock.step += 1
        clock.waits, start = [], len(in_draft)
        result = real(sched, states, sampled, target_hidden, paths)
        in_draft.extend(clock.waits)
        clock.step += 1
        assert all(stamp < clock.step - 1 for stamp, _ in in_draft[start:]), in_draft[start:]
        return result
    drafter.propose = propose
    params = [SamplingParams(max_tokens=16, temperature=t, seed=3, repetition_penalty=1.1, ignore_eos=True)
              for t in (0.0, 0.8, 0.0)]
    llm.generate(random_prompts(3, [5, 12, 7], seed=1), params)
    assert in_draft and llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)
