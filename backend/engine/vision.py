"""A vision-language engine's extra parts, built from the engine arguments: the
checkpoint's multimodal processor (used on the caller's thread by the intake), the
image limits, and the scheduler's encoder cache (vLLM's encoder budget and cache
size). None for a text-only model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from backend.config import ConfigError, EngineArgs
from backend.engine.errors import InvalidRequestError
from backend.engine.scheduling.encoder_cache import EncoderCacheManager
from backend.models.config import ModelConfig
from backend.multimodal.images import ImageLimits, load_image
from backend.multimodal.inputs import MultiModalInputs
from backend.multimodal.registry import make_processor


@dataclass
class VisionParts:
    processor: object
    limits: ImageLimits
    encoder_cache: EncoderCacheManager
    max_images: int                     # limit_mm_per_prompt["image"]
    max_chunk: int                      # max_num_batched_tokens (an image computed whole must fit)

    @property
    def budget(self) -> int:
        return self.encoder_cache.budget_per_step

    def process(self, token_ids: list[int], mm_data: Any) -> tuple[list[int], MultiModalInputs]:
        """A prompt's `multi_modal_data` (vLLM's: {"image": an image or a list}) checked,
        read and placed: the prompt's tokens with each image's placeholders expanded."""
        if not isinstance(mm_data, dict):
            raise InvalidRequestError("multi_modal_data must be an object such as {\"image\": [...]}")
        other = sorted(set(mm_data) - {"image"})
        if other:
            raise InvalidRequestError(f"multi_modal_data modality '{other[0]}' is not supported (supported: image)")
        images = mm_data.get("image")
        images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.max_images:
            raise InvalidRequestError(f"the prompt has {len(images)} images; limit_mm_per_prompt allows "
                                      f"{self.max_images}")
        images = [load_image(image, self.limits) for image in images]
        ids, mm = self.processor.process(token_ids, images)
        for item in mm.items:
            if self.encoder_cache.whole_images and item.length > self.max_chunk:
                raise InvalidRequestError(
                    f"an image of {item.length} tokens exceeds max_num_batched_tokens={self.max_chunk}: this "
                    "model computes an image's tokens in one step (they attend to each other)")
            if item.length > self.budget:
                raise InvalidRequestError(
                    f"an image of {item.length} tokens exceeds the encoder budget max_num_encoder_input_tokens="
                    f"{self.budget}: send a smaller image or raise the budget")
        return ids, mm


def make_vision(args: EngineArgs, cfg: ModelConfig) -> Optional[VisionParts]:
    processor = make_processor(args.model, cfg)
    if processor is None:
        return None
    why = None
    if args.model_runner != "torch":
        why = f"model_runner '{args.model_runner}' (an exported graph takes token ids only)"
    elif args.world_size > 1:
        why = "tensor or pipeline parallelism (the vision tower runs on one rank)"
    elif args.runner != "generate":
        why = f"runner '{args.runner}'"
    elif args.speculative_config is not None and args.speculative_config.reads_target_hidden:
        why = f"speculative method '{args.speculative_config.method}' (its head does not read M-RoPE positions)"
    if why is not None:
        raise ConfigError(f"{cfg.architecture} is served with images, which is not supported with {why}")
    budget = args.max_num_encoder_input_tokens or max(args.max_num_batched_tokens, processor.max_tokens_per_image())
    cache = args.encoder_cache_size or budget
    if cache < budget:
        raise ConfigError(f"invalid engine argument 'encoder_cache_size': {cache} is below the encoder budget "
                          f"max_num_encoder_input_tokens={budget} (an image encoded in a step must fit)")
    return VisionParts(processor, ImageLimits(args.max_image_bytes, args.max_image_pixels),
                       EncoderCacheManager(cache, budget, processor.whole_images),
                       args.limit_mm_per_prompt.get("image", 0), args.max_num_batched_tokens)
