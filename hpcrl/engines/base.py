"""The two engine interfaces every backend implements, so roles never depend on a backend.

Training engines (`torch`, `megatron`, `deepspeed`) own a model replica or shard, its optimizer
and the minibatch loop; generation engines (`native`, `vllm`) own a rollout copy of the policy.
Weights travel between them as full tensors under Hugging Face names, so any trainer layout can
feed any rollout layout.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import numpy as np

    from hpcrl.engines.native_sampler import Generation, SamplingParams
    from hpcrl.engines.torch_trainer import Samples
    from hpcrl.ragged import Ragged

NamedTensors = list[tuple[str, torch.Tensor]]


class TrainingEngine(Protocol):
    # how many DP replicas, from the first, take part in gathering the first one's weights: 1 (its own
    # ranks: DDP, Megatron's TP/PP), all (FSDP2, ZeRO-3 shards), ep (Megatron's experts on EP ranks)
    gather_replicas: int

    def logprobs(self, prompt_ids: "Ragged", response_ids: "Ragged") -> "Ragged | None":
        """Per-token log-probabilities of each response under the current weights; on the ranks
        that hold the result (the last pipeline stage), None on the others."""

    def train_step(self, samples: "Samples", lr: float) -> dict[str, float]:
        """The PPO epochs and minibatch updates over this rank's shard at learning rate `lr`
        (`lr_schedule.learning_rate` of the step); returns metrics."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under HF names, for the weight sync: on each pipeline stage's
        TP rank 0 that stage's tensors (every tensor when pp = 1). Collective over the engine's
        model-parallel (and, for sharded data parallelism, DP) ranks; the others yield nothing."""

    def save_state(self, path: Path) -> None:
        """Write model and optimizer state under `path` (collective over the role's ranks)."""

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote, in place."""

    def offload(self) -> None:
        """Move weights and optimizer state to host memory (colocated roles time-share devices)."""

    def reload(self) -> None:
        """Bring them back before the engine's next stage."""


class GenerationEngine(Protocol):
    def generate(self, prompts: "Ragged", params: "SamplingParams", generator: torch.Generator,
                 budgets: "np.ndarray | None" = None,
                 stop: "Callable[[np.ndarray], bool] | None" = None) -> "Generation":
        """Sample one response per prompt, at most `budgets[i]` tokens (default: the params'),
        stopping unfinished rows as soon as `stop(finished)` is true (checked between decoding steps,
        given which rows have ended)."""

    def load_weights(self, weights: NamedTensors) -> None:
        """Replace the rollout weights with these HF-named tensors (one bucket of a sync)."""

    def weights_loaded(self) -> None:
        """The sync's last bucket is in: drop what was computed with the old weights (KV caches)."""

    def sleep(self) -> None:
        """Free device memory (weights and KV cache) while another colocated role runs."""

    def wake(self) -> None:
        """Reallocate after `sleep`."""
