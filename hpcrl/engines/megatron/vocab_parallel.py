"""Log-probabilities and entropy from vocab-sharded logits, without gathering the vocabulary.

With TP > 1 each rank holds logits for its slice of the vocabulary. Both quantities are written
as functions of three sums over the vocabulary of purely local terms, Z = sum exp(s),
T = sum exp(s) * s and the picked logit (s = logits - max): log p = s_target - log Z and
entropy = log Z - T / Z. Each rank sums its slice and an all-reduce over the TP group adds the
slices. The reduction's backward is the identity (as megatron-core's
`reduce_from_tensor_model_parallel_region`): every TP rank computes the same loss from the same
sums, so the gradient it receives for a sum is already the whole one. (Computing the entropy as
sum p * s with p = exp(s - log Z) would not do: part of log Z's gradient would then flow through
the other ranks' slices only.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _SumOverGroup.apply(tensor, group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and the entropy, for logits [..., V/tp] sharded over `group`.

    Targets are global token ids; the caller has already divided the logits by the temperature.
    """
    logits = logits.float()
    shard = logits.shape[-1]
    start = shard * (dist.get_rank(group) if group is not None else 0)
    peak = logits.detach().amax(dim=-1, keepdim=True)
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    exp = shifted.exp()
    normaliser = _sum(exp.sum(-1), group)
    local = targets - start
    owned = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * owned
    logprobs = _sum(picked, group) - normaliser.log()
    entropy = None
    if with_entropy:
        entropy = normaliser.log() - _sum((exp * shifted).sum(-1), group) / normaliser
    return logprobs, entropy
