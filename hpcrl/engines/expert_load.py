"""How evenly a mixture-of-experts router spreads a train step's tokens over the experts.

A balanced router sends each of the E experts of a layer k/E of the routed token slots. Per step
the trainer reports `moe_load_max`, the most loaded expert's share over that (1: balanced; E/k: one
expert takes every token), the largest over the layers, and `moe_load_min`, the least loaded
expert's (0: an expert no token reached), the smallest over the layers: the routing collapse that
RL on a MoE model must watch for. Counted over the real (not padding) tokens of the step's training
forward passes, summed over every rank of the role (each counts its own tokens: its samples, its
sequence-parallel or context-parallel positions, its pipeline stage's layers).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ExpertLoad:
    """Tokens routed to each expert of each layer, as the forward passes of a step route them."""

    def __init__(self, layers: int, experts: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(layers, experts, dtype=torch.float64, device=device)

    def add(self, layer: int, routed: torch.Tensor) -> None:
        """`routed` [tokens, experts]: 1 where a (real) token went to an expert."""
        self.counts[layer] += routed.detach().sum(0).to(self.counts)

    def metrics(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Collective over `group` (every rank of the role, or None: this rank alone)."""
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(self.counts, group=group)
        routed = self.counts[self.counts.sum(1) > 0]
        if not len(routed):
            return {}
        share = routed / routed.mean(1, keepdim=True)
        return {"moe_load_max": float(share.max()), "moe_load_min": float(share.min())}


def one_hot(indices: torch.Tensor, experts: int, keep: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] routing of the kept tokens from their top-k expert indices [tokens, k]."""
    routed = torch.zeros(indices.shape[0], experts, device=indices.device)
    routed.scatter_(1, indices.long(), 1.0)
    return routed * keep.reshape(-1, 1).to(routed)
