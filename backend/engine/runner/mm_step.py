"""The runner's side of the vision tower: the outputs it holds by image hash, the images
the scheduler names encoded before the step's forward, and the step's image rows put
in place of their placeholder tokens (vLLM's encoder cache in the GPU model runner).

What to encode and what to drop is the scheduler's (scheduling/encoder_cache.py); this
only carries it out: drops first (never an output the step uses), then encodes, then
gathers each scheduled chunk's rows, a chunk that ends inside an image included."""

from __future__ import annotations

import numpy as np
import torch

from backend.engine.runner.image_attention import image_chunks
from backend.engine.runner.step_inputs import StepInputs
from backend.engine.scheduling.sched_output import SchedulerOutput


class EncoderOutputs:
    def __init__(self, model, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype          # the decoder's: what the rows are stored in (sizing.py counts them so)
        self.outputs: dict[bytes, torch.Tensor] = {}

    @staticmethod
    def needs_eager(out: SchedulerOutput) -> bool:
        """A step with prompt tokens of a request with images runs eagerly: a graph
        (decode, or verify) would drop the image rows, the M-RoPE table and the key
        limits. (A prompt's last chunk may be one token, after a prefix hit.)"""
        return any(s.in_image_prompt for s in out.scheduled)

    def prepare(self, out: SchedulerOutput, states, step: StepInputs) -> None:
        """Sets step.model_kwargs for the model's forward (`states`: the scheduled
        requests', request_state.py)."""
        for h in out.encoder_frees:
            self.outputs.pop(h, None)
        if out.encoder_inputs:
            self._encode(out.encoder_inputs)
        index: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        for start, item, lo, hi in image_chunks(out.scheduled, states):
            rows.append(self.outputs[item.mm_hash][lo - item.offset:hi - item.offset])
            index.append(np.arange(start, start + hi - lo))
        kwargs = {}
        if rows:
            kwargs["mm_embeds"] = (torch.from_numpy(np.concatenate(index)).to(self.device), torch.cat(rows))
        if step.mrope_positions is not None:
            kwargs["mrope_positions"] = torch.from_numpy(step.mrope_positions).to(self.device)
        step.model_kwargs = kwargs

    def _encode(self, items) -> None:
        """One tower run over the step's new images (each attends within itself)."""
        pixels = torch.cat([item.pixel_values for item in items]).to(self.device)
        outputs = self.model.encode_images(pixels, [item.grid_thw for item in items])
        for item, rows in zip(items, outputs):
            # A copy: a view would keep the whole batch's output alive as long as any image
            # of it is cached (encoder_cache_size counts rows, not batches).
            self.outputs[item.mm_hash] = rows.to(self.dtype, copy=True)
