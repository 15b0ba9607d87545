"""A decoder's forward over a slot KV cache: the native sampler's prefills and decoding steps.

Why not the Hugging Face forward with its DynamicCache: per decoding step that forward builds
masks, cache objects and output classes in Python (about two thirds of a small model's step on
CPU), and its cache grows by concatenation, so every step copies every sequence's keys and values;
a sequence leaving the batch copies them all again. Here each sequence owns a slot of one cache
(its positions from column 0, no left padding; the cache grows by doubling, so seldom), a step
writes one column per slot, and a finished sequence's slot is refilled by moving one other
sequence into it.

The layers are the model's own modules (embedding, norms, projections, MLP or MoE block, rotary
embedding, LM head), so a dense or mixture-of-experts LLaMA-family model (Qwen2, LLaMA, Qwen2-MoE,
Qwen3-MoE with its q/k norms, Mixtral, sliding-window layers included) computes what its HF forward
computes, up to float rounding; only the attention's cache and masks are ours.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpcrl.engines.batch import sliding_layers
from hpcrl.engines.hf_model import ARCHS


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, as the LLaMA family applies it (halves rotated, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Grouped-query attention of q [n, heads, m, d] over keys and values [n, kv_heads, width, d]
    where `mask` [n, m, width] allows. A prefill (m > 1) takes torch's fused kernel, which never
    holds the [m, width] scores; a decoding step plain matmuls, which on CPU beat the fused kernel
    for its one query and many short sequences (0.35 against 0.49 ms for 256 sequences of 40
    positions). The softmax is in fp32, as Hugging Face's eager attention takes it."""
    rows, heads, steps, dim = q.shape
    kv_heads = keys.shape[1]
    if steps > 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1), scale=scale,
                                              enable_gqa=heads != kv_heads)
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)).mul_(scale).masked_fill_(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).view(rows, heads, 1, dim)


def _grown(need: int, have: int) -> int:
    return have if need <= have else max(need, 2 * have)


class SlotCache:
    """Keys and values of up to `slots` sequences: per layer a [slots, kv_heads, columns, head_dim]
    tensor in the model's dtype, each sequence's positions from column 0. Columns grow (doubling)
    as sequences get longer; a sequence's slot is its index in the decoding batch."""

    def __init__(self, model: torch.nn.Module):
        if model.config.model_type not in ARCHS:
            raise ValueError(f"the native sampler runs LLaMA-family decoders {ARCHS}, not "
                             f"{model.config.model_type!r}: use a model of one of these architectures")
        self.model = model
        layers = model.model.layers
        self.kv_heads, self.head_dim = model.config.num_key_value_heads, layers[0].self_attn.head_dim
        self.window = getattr(model.config, "sliding_window", None) or 0
        self.sliding = sliding_layers(model.config)
        param = next(model.parameters())
        empty = torch.zeros((0, self.kv_heads, 0, self.head_dim), dtype=param.dtype, device=param.device)
        self.keys = [empty for _ in layers]
        self.values = [empty for _ in layers]

    def reserve(self, slots: int, columns: int) -> None:
        """Room for `slots` sequences of `columns` positions (what is held is copied over; each
        dimension at least doubles when it grows, so growing is rare)."""
        have_slots, have_columns = self.keys[0].shape[0], self.keys[0].shape[2]
        if slots <= have_slots and columns <= have_columns:
            return
        slots, columns = _grown(slots, have_slots), _grown(columns, have_columns)
        for store in (self.keys, self.values):
            for index, old in enumerate(store):
                new = old.new_zeros((slots, self.kv_heads, columns, self.head_dim))
                new[:have_slots, :, :have_columns] = old
                store[index] = new

    def move(self, sources: torch.Tensor, targets: torch.Tensor, width: int) -> None:
        """Copy the first `width` columns of slots `sources` into slots `targets`."""
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[targets, :, :width] = tensor[sources, :, :width]

    def take(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one slot's first `length` positions, per layer (a multi-turn session's kept cache)."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.keys, self.values)]

    def put(self, slot: int, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Restore what `take` copied into a slot."""
        for (keys, values), k, v in zip(kept, self.keys, self.values):
            k[slot, :, :keys.shape[1]] = keys
            v[slot, :, :values.shape[1]] = values

    @torch.no_grad()
    def forward(self, first: int, ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                width: int) -> torch.Tensor:
        """Feed `ids` [n, m] (row i's first `lengths[i]` are real, the rest padding) to the slots
        `first .. first + n - 1`, row i's at positions `starts[i]` onwards, writing their keys and
        values; returns the logits after each row's last real token [n, vocab]. `width`: the most
        positions any of these slots holds afterwards (starts + lengths), which the caller knows
        without a device sync; the cache must have `max(starts) + m` columns."""
        model = self.model.model
        rows, steps = ids.shape
        offsets = torch.arange(steps, device=ids.device)
        positions = starts.unsqueeze(1) + offsets                           # [n, m]
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                       # [n, 1, m, d]
        columns = torch.arange(width, device=ids.device)
        visible = columns <= positions.unsqueeze(-1)                        # [n, m, width], causal
        if any(self.sliding):
            windowed = visible & (columns > positions.unsqueeze(-1) - self.window)
        row_index = torch.arange(rows, device=ids.device).unsqueeze(1)
        slots = slice(first, first + rows)
        for layer, keys, values, sliding in zip(model.layers, self.keys, self.values, self.sliding):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, steps, -1, self.head_dim)
            k = attn.k_proj(x).view(rows, steps, -1, self.head_dim)
            v = attn.v_proj(x).view(rows, steps, -1, self.head_dim)
            if hasattr(attn, "q_norm"):   # Qwen3: RMS norms over each head before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k = _rotate(k.transpose(1, 2), cos, sin)
            keys[slots][row_index, :, positions] = k.transpose(1, 2)
            values[slots][row_index, :, positions] = v
            out = _attention(q, keys[slots, :, :width], values[slots, :, :width], windowed if sliding else visible,
                             attn.scaling)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(rows, steps, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[torch.arange(rows, device=ids.device), lengths - 1]
        return self.model.lm_head(model.norm(last))
