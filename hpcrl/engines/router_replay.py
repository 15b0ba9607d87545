"""Routing replay for mixture-of-experts models (`algorithm.router_replay`, ROLL's MoE router replay,
verl's R3): rollout records which experts each token went to, and the trainer routes the same tokens
to the same experts when it recomputes log-probabilities and trains.

Why: a router's top-k is a discontinuous function of its input. The rollout engine and the trainer
compute the same model with other kernels, batch shapes and caches, so in 16-bit arithmetic a token
whose k-th and (k+1)-th experts are close may go elsewhere in training than it did when it was
sampled, and its log-prob (and every later token's) then differs by far more than rounding. With the
rollout's routing replayed, the trainer's gates are still its own router's probabilities (gathered
at the replayed experts, renormalised as the router does), so the router keeps its gradient.

A sample's routing is one flat row of `positions x layers x top_k` expert indices (uint8 up to 256
experts), over the positions the rollout fed through the model: its prompt and every response token
but the last (never fed). The row travels and is checkpointed like any other per-sample column. A
partial rollout's continuation prefills the whole prefix again with the new weights, and its
routing replaces the row: one routing must serve the trainer's single forward over the sample, and
the latest is the one its last tokens were computed on (the earlier tokens keep their own
behaviour log-probs, which the off-policy correction uses).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hpcrl.ragged import Ragged


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a Hugging Face MoE model (transformers' TopKRouter: logits, weights,
    expert indices), one per sparse layer, in layer order; empty for a dense model."""
    found = []
    for layer in getattr(getattr(model, "model", None), "layers", []):
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        if hasattr(router, "top_k"):
            found.append(router)
    return found


def index_dtype(experts: int) -> type:
    """The smallest integer type that holds an expert index."""
    return np.uint8 if experts <= 256 else np.int16


class RoutingRecorder:
    """Hooks on a model's routers that keep the expert indices of the forwards the native sampler
    runs through `capture` (its prefills and decoding steps)."""

    def __init__(self, model: torch.nn.Module):
        found = routers(model)
        self.layers, self.top_k = len(found), (found[0].top_k if found else 0)
        self.dtype = index_dtype(found[0].num_experts) if found else np.uint8
        self.active = False
        self._indices: list[torch.Tensor] = []
        for router in found:
            router.register_forward_hook(self._record)

    def _record(self, router: torch.nn.Module, inputs, output) -> None:
        if self.active:
            self._indices.append(output[2])

    def capture(self, forward: Callable[[], Any]) -> tuple[Any, np.ndarray]:
        """`forward()`'s output, and its routing [tokens, layers, top_k] (tokens in the flattened
        [batch, seq] order). Only forwards run here are recorded: a trainer sharing the model is not."""
        self.active = True
        try:
            out = forward()
        finally:
            self.active = False
        indices, self._indices = self._indices, []
        return out, torch.stack(indices, dim=1).cpu().numpy().astype(self.dtype)


def replayed_indices(own: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """[tokens, top_k] experts: `forced`'s where a token has a record, the router's `own` where it
    has none (-1: padding, a response's last token)."""
    return torch.where(forced[:, :1] >= 0, forced.to(own.dtype), own)


def replay_output(router: torch.nn.Module, output: tuple, forced: torch.Tensor) -> tuple:
    """The router's (logits, weights, indices) with `forced` [tokens, top_k] experts wherever a token
    has them (-1: none, the router's own choice stays): the weights are the router's softmax at those
    experts, renormalised where the router renormalises (Mixtral always, Qwen-MoE with norm_topk_prob).
    A token's own choice replayed in the router's order gives bit-identical weights (in another
    order, the experts' outputs are summed in that order: equal to rounding)."""
    logits, weights, indices = output
    indices = replayed_indices(indices, forced)
    chosen = torch.softmax(logits.float(), dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return logits, chosen.to(weights.dtype), indices


def padded_routing(routing: Ragged, prompt_lengths: np.ndarray, response_lengths: np.ndarray, layers: int,
                   top_k: int, width: int | None = None) -> torch.Tensor:
    """Rows of recorded routing as [N, columns, layers, top_k] int16 (the trainer's routers take
    them as their indices), -1 where a position has none (padding, a response's last token, a row
    the rollout did not record): in `batch.pack`'s layout (prompts left-padded to P, responses
    right-padded to R), or with `width` in megatron packing's (each row from column 0, `width` columns).
    A row that is not whole positions of this model, or has more than its sample feeds, is refused:
    replayed shifted, it would route every token wrongly."""
    per_position = layers * top_k
    positions = routing.lengths // per_position
    fed = np.maximum(prompt_lengths + response_lengths - 1, 0)
    bad = np.flatnonzero((routing.lengths % per_position != 0) | (positions > fed))
    if len(bad):
        row = int(bad[0])
        raise ValueError(f"router replay: sample {row}'s routing holds {routing.lengths[row]} expert indices, not "
                         f"{layers} layers x top-{top_k} for each of at most {fed[row]} positions (its prompt and "
                         "response but the last token): rollout recorded another model or layout")
    row = np.repeat(np.arange(len(routing)), positions)
    index = np.arange(int(positions.sum())) - np.repeat(np.cumsum(positions) - positions, positions)
    if width is None:
        width_p, width_r = (max(1, int(lengths.max(initial=0))) for lengths in (prompt_lengths, response_lengths))
        prompt = prompt_lengths[row]
        column, width = np.where(index < prompt, width_p - prompt + index, width_p + index - prompt), width_p + width_r
    else:
        column = index
    out = np.full((len(routing), width, layers, top_k), -1, np.int16)
    out[row, column] = routing.values.reshape(-1, layers, top_k)
    return torch.from_numpy(out)


class MegatronReplay:
    """What megatron-core's TopKRouter takes as its `router_replay` (megatron.core.transformer.moe.
    router_replay.RouterReplay's hook into its top-k): the router's own top-k, with the experts of
    `forced` [tokens, layers, top_k] (-1: none) at its layer, and their scores gathered as megatron
    gathers them for a replay (the softmax over the k when the router renormalises the top-k,
    Mixtral's and norm_topk_prob's; the full softmax's values otherwise). Unlike megatron's own
    RouterReplay it routes the tokens without a record (padding, a response's last token) itself.
    `seen(own, forced)` is told both, for the flip count."""

    def __init__(self, router: torch.nn.Module, seen: Callable[[torch.Tensor, torch.Tensor], None]):
        self.router = router   # its layer_number (1-based, over every stage) is set once the layer is built
        self.seen = seen
        self.forced: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups, group_topk, default_compute_topk):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.forced is None:
            return values, indices
        forced = self.forced[:, self.router.layer_number - 1]
        self.seen(indices, forced)
        indices = replayed_indices(indices, forced)
        return scores.gather(1, indices), indices
