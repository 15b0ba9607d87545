"""The torch training engine: DDP over the role's data-parallel group, AdamW, PPO-style updates.

It is the default on CPU (gloo) and runs unchanged on GPUs (NCCL). The loss is a plain function
from hpcrl.algos; this class only owns the model, the optimizer and the minibatch loop.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hpcrl.checkpoint.model_state import load_train_state, save_train_state
from hpcrl.algos import aggregate_loss, gspo_loss, kl_penalty, ppo_clip_loss
from hpcrl.config.job import JobConfig
from hpcrl.engines.batch import pack, response_logprobs, right_pad, unpad
from hpcrl.engines.lr_schedule import set_learning_rate
from hpcrl.ragged import Ragged


@dataclass
class Samples:
    """A DP shard of the rollout batch, as it arrives over MPI: packed rows, one per sample."""

    prompt_ids: Ragged
    response_ids: Ragged
    columns: dict[str, Ragged]  # per response token: old_logprobs, ref_logprobs, advantages, ...


def _fully_shard(model: torch.nn.Module, dp_group: dist.ProcessGroup, device: torch.device) -> None:
    """FSDP2 in place: every decoder layer, then the rest (embeddings, norm, head) as the root unit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dp_group, device.type)
    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def adamw(model: torch.nn.Module, job: JobConfig) -> torch.optim.AdamW:
    """The optimizer of every torch-based engine (torch, deepspeed) from the job's train settings."""
    return torch.optim.AdamW(model.parameters(), lr=job.train.lr, weight_decay=job.train.weight_decay)


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


class TorchTrainer:
    """Holds one model replica per DP rank; gradients are averaged by DDP over `dp_group`."""

    def __init__(self, model: torch.nn.Module, job: JobConfig, pad_id: int, dp_group: dist.ProcessGroup | None,
                 trainable: bool = True, fsdp: bool = False):
        """fsdp: shard with FSDP2 over `dp_group` (each decoder layer a unit) instead of DDP replicas."""
        self.model = model
        self.job = job
        self.pad_id = pad_id
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.device = next(model.parameters()).device
        self.optimizer = None
        # FSDP2 gathers each parameter over the DP ranks: every rank takes part in named_weights
        self.gathers_over_dp = fsdp and self.dp_size > 1
        if self.gathers_over_dp:
            _fully_shard(model, dp_group, self.device)
        if trainable:
            model.train()
            if self.dp_size > 1 and not fsdp:
                self.model = DistributedDataParallel(model, process_group=dp_group)
            self.optimizer = adamw(model, job)
        else:
            model.requires_grad_(False)
            model.eval()

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters under their HF names; FSDP2 shards are gathered one parameter at a time
        (collective over the DP group: every DP rank iterates)."""
        for name, p in self.module.named_parameters():
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()

    def offload(self) -> None:
        """Nothing to do on CPU; on GPUs the weights and Adam state move to pinned host memory."""
        self._move("cpu")

    def reload(self) -> None:
        self._move(self.device)

    def _move(self, device: str | torch.device) -> None:
        self.module.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device)

    @torch.no_grad()
    def logprobs(self, prompt_ids: Ragged, response_ids: Ragged) -> Ragged:
        """Per-token log-probabilities of the responses under the current weights."""
        batch = self._to_device(pack(prompt_ids, response_ids, self.pad_id))
        logp, _ = response_logprobs(self.module, batch, self.job.rollout.temperature)
        return unpad(logp, response_ids.lengths)

    def _to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in tensors.items()}

    def _global_tokens(self, mask: torch.Tensor) -> float:
        """Valid tokens of this minibatch over all DP ranks: the denominator of the token mean."""
        count = mask.sum().reshape(1)
        if self.dp_size > 1:
            dist.all_reduce(count, group=self.dp_group)
        return float(count.item())

    def train_step(self, samples: Samples, lr: float) -> dict[str, float]:
        """`ppo_epochs` passes over the shard, each in `minibatches` optimizer steps at rate `lr`."""
        algo, train = self.job.algorithm, self.job.train
        set_learning_rate(self.optimizer, lr)
        batch = self._to_device(pack(samples.prompt_ids, samples.response_ids, self.pad_id))
        width = batch["response_ids"].shape[1]
        token = self._to_device({k: right_pad(v, 0.0, torch.float32, width) for k, v in samples.columns.items()})
        n = len(samples.prompt_ids)
        if n % train.minibatches:
            raise ValueError(f"a DP shard of {n} samples does not split into train.minibatches={train.minibatches}")
        history: dict[str, list[float]] = {}
        for _ in range(train.ppo_epochs):
            for index in torch.arange(n).chunk(train.minibatches):
                mb = {k: v[index] for k, v in batch.items()}
                mt = {k: v[index] for k, v in token.items()}
                mask = mb["response_mask"]
                # token-mean over the whole minibatch: every rank divides by the global token count and
                # DDP's average is undone by `scale`; the seq-mean modes are means of per-rank means.
                token_mean = algo.loss_agg == "token-mean"
                global_tokens = self._global_tokens(mask) if token_mean else None
                scale = self.dp_size if token_mean else 1
                logp, entropy = response_logprobs(self.model, mb, self.job.rollout.temperature, with_entropy=True)
                loss_fn = gspo_loss if algo.policy_loss == "gspo" else ppo_clip_loss
                extra = {"dual_clip_c": algo.dual_clip_c} if algo.policy_loss == "ppo_clip" else {}
                policy, metrics = loss_fn(logp, mt["old_logprobs"], mt["advantages"], mask,
                                          clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                                          global_token_count=global_tokens,
                                          importance_weights=mt.get("importance_weights"), **extra)
                loss = policy
                if algo.kl_coef > 0 and "ref_logprobs" in mt:
                    kl = aggregate_loss(kl_penalty(logp, mt["ref_logprobs"], algo.kl_estimator), mask,
                                        algo.loss_agg, global_tokens)
                    loss = loss + algo.kl_coef * kl
                    metrics["kl_loss"] = float(kl.detach()) * scale
                if algo.entropy_coef > 0:
                    loss = loss - algo.entropy_coef * aggregate_loss(entropy, mask, algo.loss_agg, global_tokens)
                grad_norm = self._update(loss * scale)
                if grad_norm is not None:
                    metrics["grad_norm"] = grad_norm
                metrics["loss"] = float(loss.detach()) * scale
                metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
                for key, value in metrics.items():
                    history.setdefault(key, []).append(float(value))
        return {key: _mean(values) for key, values in history.items()}

    def _update(self, loss: torch.Tensor) -> float | None:
        """One optimizer step on `loss`; returns the gradient norm when it is clipped."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = None
        if self.job.train.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.train.grad_clip))
        self.optimizer.step()
        return grad_norm

    def save_state(self, path: Path) -> None:
        """DCP shards of model + optimizer (collective over the DP group): loadable on another DP size."""
        save_train_state(self.module, self.optimizer, path, self.dp_group)

    def load_state(self, path: Path) -> None:
        load_train_state(self.module, self.optimizer, path, self.dp_group)
