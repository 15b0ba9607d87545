"""Log-probabilities and entropy from vocab-sharded logits, without gathering the vocabulary.

With TP > 1 each rank holds logits for its slice of the vocabulary. The softmax normaliser, the
picked token's logit and the expected logit are sums over the vocabulary: each rank reduces its
slice, and one all-reduce over the TP group adds the slices. The reduction's backward is the
identity (as megatron-core's `reduce_from_tensor_model_parallel_region`): every TP rank computes
the same loss from the reduced values, so each slice's gradient is already complete.
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
    log_normaliser = _sum(shifted.exp().sum(-1), group).log()
    local = targets - start
    owned = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * owned
    logprobs = _sum(picked, group) - log_normaliser
    entropy = None
    if with_entropy:
        probs = (shifted - log_normaliser.unsqueeze(-1)).exp()
        entropy = log_normaliser - _sum((probs * shifted).sum(-1), group)
    return logprobs, entropy
