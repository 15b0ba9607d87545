"""How evenly a mixture-of-experts router spreads a train step's tokens over the experts, and the
load-balancing loss that evens it out (`algorithm.moe_aux_loss_coef`).

A balanced router sends each of the E experts of a layer k/E of the routed token slots. Per step
the trainer reports `moe_load_max`, the most loaded expert's share over that (1: balanced; E/k: one
expert takes every token), the largest over the layers, and `moe_load_min`, the least loaded
expert's (0: an expert no token reached), the smallest over the layers: the routing collapse that
RL on a MoE model must watch for. With router replay, `router_flip_frac` is the share of the real
tokens' routings (token x layer) that the trainer's own router would have sent to other experts
than the rollout's it replays: what replay corrects (the trainer's weights move after a step's
first minibatch, so later minibatches add the update's own changes). Counted over the real (not padding) tokens of the step's training
forward passes, summed over every rank of the role (each counts its own tokens: its samples, its
sequence-parallel or context-parallel positions, its pipeline stage's layers).

The loss is Switch Transformer's, normalised as megatron-core normalises it for top-k routing:
per layer and micro-batch, E * sum_e f_e * P_e, with f_e the share of the real tokens' k routed
slots that went to expert e and P_e the mean router probability of e (softmax over all experts, in
fp32): 1 when balanced. Only P carries a gradient. A micro-batch's loss is the mean over its layers,
counted over all its tokens also when sequence or context parallelism splits them over ranks
(`RouterStats.reduce`); it enters the minibatch's loss weighted by the micro-batch's share of the
minibatch's real tokens, and `moe_aux_loss` reports its token-weighted mean over the step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class RouterStats:
    """One layer's routing in one forward: tokens routed to each expert (no gradient), the summed
    router probabilities of each expert (with their gradient), and the real tokens."""

    def __init__(self, routed: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor):
        keep = keep.reshape(-1, 1).to(probs.dtype)
        self.sums = torch.cat([(routed.to(probs.dtype) * keep).sum(0).detach(), (probs * keep).sum(0),
                               keep.sum().reshape(1)])

    def reduce(self, group: dist.ProcessGroup | None) -> RouterStats:
        """The sums over `group` (ranks that hold parts of the same micro-batch's tokens), with autograd."""
        if group is not None and dist.get_world_size(group) > 1:
            import torch.distributed.nn.functional as dist_nn

            self.sums = dist_nn.all_reduce(self.sums, group=group)
        return self

    @property
    def tokens(self) -> torch.Tensor:
        return self.sums[-1]

    def aux_loss(self, top_k: int) -> torch.Tensor:
        """Switch Transformer's load-balancing loss of these tokens (1 when balanced)."""
        experts = (self.sums.shape[0] - 1) // 2
        routed, probs, tokens = self.sums[:experts], self.sums[experts:-1], self.tokens.clamp(min=1)
        return experts * (routed / (top_k * tokens) * probs / tokens).sum()


class ExpertLoad:
    """A train step's routing: tokens routed to each expert of each layer, the layers' statistics of
    the forward under way, and the load-balancing loss's token-weighted sum."""

    def __init__(self, layers: int, experts: int, top_k: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(layers, experts, dtype=torch.float64, device=device)
        self.top_k = top_k
        self.forward: list[RouterStats] = []
        self.aux = torch.zeros(2, dtype=torch.float64, device=device)   # sum of loss x tokens, tokens
        self.replay = torch.zeros(2, dtype=torch.float64, device=device)   # routings replayed: other / all

    def count(self, layer: int, routed: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor) -> RouterStats:
        """One layer's routing in the forward under way, counted: `routed` [tokens, experts] (1 where
        a token went), `probs` [tokens, experts] the router's softmax, `keep` [tokens] the real
        tokens. Its statistics, for the layer's loss (`forward` holds those a micro-batch's loss takes)."""
        stats = RouterStats(routed, probs, keep)
        self.counts[layer] += stats.sums[:routed.shape[1]].detach().to(self.counts)
        return stats

    def count_replay(self, own: torch.Tensor, replayed: torch.Tensor, keep: torch.Tensor) -> None:
        """One layer's replayed routing [tokens, k] (-1: a token without) against the router's `own`
        choice, over the real tokens `keep`."""
        replayed_real = (replayed[:, 0] >= 0) & keep.bool()
        other = (own.sort(-1).values != replayed.to(own.dtype).sort(-1).values).any(-1) & replayed_real
        self.replay += torch.stack([other.sum(), replayed_real.sum()]).to(self.replay)

    def record(self, loss: torch.Tensor, tokens: torch.Tensor, weight: float = 1.0) -> None:
        """Count a loss over `tokens` into the step's `moe_aux_loss` (with `weight`: a layer's share)."""
        self.aux += torch.stack([loss.detach() * tokens.detach(), tokens.detach()]).to(self.aux) * weight

    def micro_batch_loss(self, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean over layers of the forward just run, its real tokens), its statistics summed over
        `group`; recorded, and the forward's statistics cleared."""
        stats, self.forward = [s.reduce(group) for s in self.forward], []
        loss = torch.stack([s.aux_loss(self.top_k) for s in stats]).mean()
        self.record(loss, stats[0].tokens)
        return loss, stats[0].tokens

    def metrics(self, group: dist.ProcessGroup | None, duplicates: int = 1) -> dict[str, float]:
        """Collective over `group` (every rank of the role, or None: this rank alone); `duplicates`:
        how many ranks of it recorded each micro-batch's loss (its tp or cp ranks)."""
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(self.counts, group=group)
            dist.all_reduce(self.aux, group=group)
            dist.all_reduce(self.replay, group=group)
        routed = self.counts[self.counts.sum(1) > 0]
        if not len(routed):
            return {}
        share = routed / routed.mean(1, keepdim=True)
        weighted, tokens = (self.aux / duplicates).tolist()
        other, replayed = self.replay.tolist()
        return {"moe_load_max": float(share.max()), "moe_load_min": float(share.min()),
                "moe_aux_loss": weighted / max(tokens, 1.0),
                **({"router_flip_frac": other / replayed} if replayed else {})}


def one_hot(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """[tokens, experts] routing from the tokens' top-k expert indices [tokens, k]."""
    return torch.zeros(indices.shape[0], experts, device=indices.device).scatter_(1, indices.long(), 1.0)
