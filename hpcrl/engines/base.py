"""The two engine interfaces every backend implements, so roles never depend on a backend.

Training engines (`torch`, `megatron`, `deepspeed`) own a model replica or shard, its optimizer
and the minibatch loop; generation engines (`native`, `vllm`) own a rollout copy of the policy.
Weights travel between them as full tensors under Hugging Face names, so any trainer layout can
feed any rollout layout.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hpcrl.engines.native_sampler import SamplingParams
    from hpcrl.engines.torch_trainer import Samples

NamedTensors = list[tuple[str, torch.Tensor]]


class TrainingEngine(Protocol):
    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each response under the current weights."""

    def train_step(self, samples: "Samples", lr: float) -> dict[str, float]:
        """The PPO epochs and minibatch updates over this rank's shard at learning rate `lr`
        (`lr_schedule.learning_rate` of the step); returns metrics."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under HF names, for the weight sync. Collective over the
        engine's model-parallel ranks; meaningful on the sync source only."""

    def save_state(self, path: Path) -> None:
        """Write model and optimizer state under `path` (collective over the role's ranks)."""

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote, in place."""

    def offload(self) -> None:
        """Move weights and optimizer state to host memory (colocated roles time-share devices)."""

    def reload(self) -> None:
        """Bring them back before the engine's next stage."""


class GenerationEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: "SamplingParams",
                 generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        """Sample one response per prompt; returns token ids and their log-probabilities."""

    def load_weights(self, weights: NamedTensors) -> None:
        """Replace the rollout weights with these HF-named tensors."""

    def sleep(self) -> None:
        """Free device memory (weights and KV cache) while another colocated role runs."""

    def wake(self) -> None:
        """Reallocate after `sleep`."""
