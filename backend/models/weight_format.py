"""The interface one weight format implements: how a checkpoint's decoder projections
are stored, and the layers that run them.

A format recognizes its checkpoints from config.json's quantization_config, replaces the
decoder's projections on the meta model with its layers, and turns the checkpoint's
tensors into those layers' parameters. The loader and the config reader ask the
registry (backend/models/quant_linears.py) and nothing else, so a new format is its
module and a line there. Embeddings and the LM head stay in the compute dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

import torch
from torch import nn


class WeightFormat(ABC):
    # What `unsupported quantization` lists as supported (a phrase).
    summary: ClassVar[str]
    # The layers swap_in puts in: the loader keeps their parameters as the checkpoint has them.
    linear_classes: ClassVar[tuple[type[nn.Module], ...]]

    @abstractmethod
    def scheme_of(self, quant: dict[str, Any]) -> Optional[Any]:
        """This format's reading of quantization_config; None when it is not this format;
        a ValueError naming the field when it is, in a variant the engine does not run."""

    @abstractmethod
    def describe(self, scheme: Any) -> str:
        """A short name of the scheme (logs, build manifests, errors)."""

    @abstractmethod
    def swap_in(self, model: nn.Module, scheme: Any, use_kernel: bool) -> None:
        """Replace the decoder's fused projections on the meta model by this format's
        layers (use_kernel: the Triton GEMM also off CUDA)."""

    @abstractmethod
    def state_dict(self, state: dict[str, torch.Tensor], num_layers: int, scheme: Any) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (Hugging Face names, before q/k/v and gate/up are
        fused) as the layers' parameters; every other tensor as it is."""

    def tensor_parallel(self, scheme: Any) -> bool:
        """Whether its layers split across tensor-parallel ranks (sharding.py's rules)."""
        return False
