"""Context parallelism for the torch engine: each of a replica's cp ranks runs the decoder on its
share of every sequence's positions, and attends to all of the sequence's keys and values.

PyTorch's own context-parallel attention (torch.distributed.tensor.experimental.context_parallel)
only shards the CUDA SDPA kernels (flash, efficient, cuDNN) with a plain causal mask; it neither
runs on CPU nor takes the padding of a batch of prompts. So this is the all-gather form (Llama 3's,
Megatron's `cp_comm_type: all_gather`): queries stay local, keys and values are gathered over the
cp group (the gather's backward reduce-scatters their gradients to the ranks that own them), and
the mask is causal over global columns with the padding masked out. Positions are split as
Megatron splits them, load balanced: the width is cut into 2*cp chunks, rank r holding chunks r
and 2*cp-1-r, so every rank has as many early (cheap) as late (costly) queries of the causal mask.

The per-token results (log-probabilities, entropies, values) are computed where their positions
live and summed over the cp group into whole rows, with autograd: every cp rank then evaluates the
same loss on whole sequences, which keeps sequence-level objectives (GSPO's ratio, seq-mean
aggregation) exact. The gradient of that sum reaches each rank cp times over; DDP's average over
the dp x cp ranks divides it back, so the engine scales its loss by dp as without cp.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

ATTENTION = "hpcrl_context_parallel"   # the attention implementation name registered with transformers


@dataclass(frozen=True)
class ContextShard:
    """One cp rank's share of a batch: its group, and which keys each of its queries may attend to
    (in the order the gather lays every rank's keys out), built once per forward for all layers."""

    group: dist.ProcessGroup
    allowed: torch.Tensor      # [N, 1, width / cp, width] bool

    @classmethod
    def of(cls, group: dist.ProcessGroup, columns: torch.Tensor, key_valid: torch.Tensor) -> ContextShard:
        """`columns` [width / cp]: the global columns this rank holds; `key_valid` [N, width]: the
        whole batch's attention mask (real tokens). Causal over global columns with the padding out;
        a padding query sees itself only: its output is never used, and no row is fully masked."""
        cp = dist.get_world_size(group)
        keys = torch.cat([local_columns(key_valid.shape[1], cp, r) for r in range(cp)]).to(columns.device)
        causal = keys[None, :] <= columns[:, None]
        itself = keys[None, :] == columns[:, None]
        valid = key_valid[:, keys].bool()[:, None, None, :]
        return cls(group, (causal[None, None] & valid) | itself[None, None])


def padded_width(width: int, cp: int) -> int:
    """`width` rounded up to a multiple of 2*cp (the load-balanced chunks are equal)."""
    return -(-width // (2 * cp)) * 2 * cp


def local_columns(width: int, cp: int, rank: int) -> torch.Tensor:
    """The global columns of chunks `rank` and 2*cp-1-`rank` of a `width` cut into 2*cp chunks."""
    chunk = width // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([B, heads, L_local, D] -> [B, heads, L_local * cp, D], in rank
    order); the backward sums each rank's gradient of the whole and hands every rank its part."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        moved = local.movedim(2, 0).contiguous()
        out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        moved = grad.movedim(2, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.group)
        return out.movedim(0, 2), None


_current: ContextShard | None = None


@contextmanager
def sharded(shard: ContextShard) -> Iterator[None]:
    """Within this block, the attention of a model built with `ATTENTION` is context parallel over `shard`."""
    global _current
    previous, _current = _current, shard
    try:
        yield
    finally:
        _current = previous


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, Lq, D] of this rank's columns, key and
    value [B, KV, Lq, D]; returns [B, Lq, H, D]. The mask comes from the shard, not `attention_mask`."""
    shard = _current
    if shard is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs inside context_parallel.sharded() only")
    keys = _GatherSequence.apply(key, shard.group)
    values = _GatherSequence.apply(value, shard.group)
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=shard.allowed, dropout_p=dropout,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make `ATTENTION` an attention implementation transformers' models can be set to (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)   # the shard holds the mask


def gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Whole rows from each rank's entries (zero elsewhere): a sum over the cp group, with autograd."""
    return dist_nn.all_reduce(local, group=group)


def left_padded(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """The batch of hpcrl.engines.batch.pack widened on the left (prompt padding) to `width` columns."""
    extra = width - batch["input_ids"].shape[1]
    if extra == 0:
        return batch
    widened = dict(batch)
    for name in ("input_ids", "attention_mask", "position_ids"):
        widened[name] = F.pad(batch[name], (extra, 0), value=0)
    if "routed_experts" in batch:   # [N, width, layers, top_k] (router replay): no experts on padding
        widened["routed_experts"] = F.pad(batch["routed_experts"], (0, 0, 0, 0, extra, 0), value=-1)
    return widened


def local_view(batch: dict[str, torch.Tensor], group: dist.ProcessGroup
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The batch widened on the left to a multiple of 2*cp columns, and the columns of it this rank runs."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    batch = left_padded(batch, padded_width(batch["input_ids"].shape[1], cp))
    return batch, local_columns(batch["input_ids"].shape[1], cp, rank).to(batch["input_ids"].device)


def local_columns_of(batch: dict[str, torch.Tensor], name: str, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's columns of `batch[name]` ([N, width]), as `response_outputs` runs them."""
    batch, columns = local_view(batch, group)
    return batch[name][:, columns]


def response_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor], group: dist.ProcessGroup
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's outputs [N, k, out] at this rank's columns that predict response tokens, the
    response index of each [k], and the tokens they predict [N, k]; the model runs on this rank's
    columns of the batch (hpcrl.engines.batch.pack's layout), attending to every rank's.

    The outputs stay tied to the whole local forward even when k = 0, so that every rank's backward
    runs the same collectives (the key/value gathers of every layer)."""
    batch, columns = local_view(batch, group)
    width, responses = batch["input_ids"].shape[1], batch["response_ids"].shape[1]
    first = width - responses - 1   # the column whose output predicts response token 0
    keep = ((columns >= first) & (columns < width - 1)).nonzero().squeeze(1)
    with sharded(ContextShard.of(group, columns, batch["attention_mask"])):
        out = model(input_ids=batch["input_ids"][:, columns], position_ids=batch["position_ids"][:, columns],
                    attention_mask=None, use_cache=False, logits_to_keep=keep).logits
    if out.shape[1] != keep.numel():   # a head that ignores logits_to_keep (the critic's) gives every column
        out = out[:, keep]
    picked = columns[keep]
    anchor = out.sum() * 0   # no-op in value, keeps the graph whole (see above)
    return out + anchor, picked - first, batch["input_ids"][:, picked + 1]


def whole_rows(local: torch.Tensor, index: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[N, width] rows from each rank's entries `local` [N, k] at response indices `index`."""
    rows = local.new_zeros((local.shape[0], width)).index_add(1, index, local)
    return gather_rows(rows, group)
