"""Padding prompts and responses into tensors, and the log-probabilities of response tokens.

Layout: prompts are left-padded to P, responses right-padded to R, so that every response starts
at column P; positions count only real tokens. Rollout and training share this one layout, which
keeps their log-probabilities comparable token for token.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from hpcrl.config.constants import LOGSOFTMAX_CHUNK_ELEMENTS
from hpcrl.ragged import Ragged


def left_pad(rows: Ragged, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, longest] ids with each row at the right end, and the mask of real tokens."""
    width = max(1, rows.max_length())
    ids = torch.from_numpy(rows.padded(width, pad_id, left=True).astype(np.int64))
    mask = torch.from_numpy(Ragged(np.ones(len(rows.values), np.int64), rows.offsets).padded(width, 0, left=True))
    return ids, mask


def right_pad(rows: Ragged, pad: float, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """[N, width] (default: the longest row, at least 1) with each row at the left end."""
    return torch.from_numpy(rows.padded(width, pad)).to(dtype)


def length_mask(lengths: Sequence[int] | np.ndarray, dtype: torch.dtype = torch.float32,
                width: int | None = None) -> torch.Tensor:
    """[N, width] with 1 on each row's first `lengths[i]` columns: which response tokens are real."""
    lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    width = max(1, int(lengths.max()) if len(lengths) else 0) if width is None else width
    return (torch.arange(width)[None] < lengths[:, None]).to(dtype)


def unpad(values: torch.Tensor, lengths: np.ndarray) -> Ragged:
    """The first `lengths[i]` entries of each row of [N, W] values, as float32 rows."""
    return Ragged.from_padded(values.detach().float().cpu().numpy(), lengths)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def pack(prompts: Ragged, responses: Ragged, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + response ids with masks; `response_mask` marks the tokens that were generated."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids = right_pad(responses, pad_id, torch.long)
    response_mask = length_mask(responses.lengths, torch.long)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": positions(attention_mask),
        "response_ids": response_ids,
        "response_mask": response_mask.float(),
    }


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), the distribution rollout samples from."""
    return _token_stats(logits, tokens, temperature, with_entropy=False)[0]


def _token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def chunked_token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (and entropy) of [N, R, V] logits, a chunk of positions at a time.

    The fp32 log-softmax of a chunk is recomputed in the backward (checkpoint) instead of kept, so
    besides the logits themselves (in the model's dtype) only one chunk's fp32 copy ever exists.
    Logits that fit in one chunk are not checkpointed: the forward then keeps that chunk's fp32
    log-softmax and exp, which the memory estimate counts for the recompute anyway, and saves the
    recompute and its hooks (the tiny job's minibatch: forward and backward 0.44 -> 0.16 ms).
    """
    chunk = max(1, LOGSOFTMAX_CHUNK_ELEMENTS // max(1, logits.shape[0] * logits.shape[-1]))
    recompute = torch.is_grad_enabled() and logits.requires_grad and logits.shape[1] > chunk
    logps, entropies = [], []
    for start in range(0, max(1, logits.shape[1]), chunk):   # no position: one empty chunk, still in the graph
        args = (logits[:, start:start + chunk], tokens[:, start:start + chunk], temperature, with_entropy)
        logp, entropy = (torch.utils.checkpoint.checkpoint(_token_stats, *args, use_reentrant=False) if recompute
                         else _token_stats(*args))
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps, dim=1), (torch.cat(entropies, dim=1) if with_entropy else None)


def sliding_layers(config) -> list[bool]:
    """Which decoder layers of a HF model see only the last `config.sliding_window` positions, as
    the model chooses its masks: by layer type where the config lists them, else every layer when
    it has a window."""
    window = getattr(config, "sliding_window", None) or 0
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [bool(window) and kind == "sliding_attention" for kind in kinds]


def attention_masks(model: torch.nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """What the HF `model` (or a DDP, FSDP2 or DeepSpeed wrapper of it) takes as the attention mask
    of left-padded prompts and right-padded responses: with sdpa attention and every layer a full
    (causal) attention one, the [N, 1, L, L] boolean mask that its `create_causal_mask` would build
    (True: attend; causal, and no padding key), built here in three tensor operations. Otherwise the
    [N, L] mask, for HF to build what it needs: with no padding at all (sdpa's `is_causal` then),
    eager attention, sliding-window, chunked or linear layers, or a config that asks for the router
    logits (HF's MoE load-balancing loss reads the mask as 2-D; hpcrl counts routing with its own
    hooks). HF's mask building is a sixth of a small model's forward on CPU (the tiny job's 64 rows:
    0.6 of 3.9 ms), the same mask every forward; the model takes a 4-D mask as prepared."""
    config = getattr(model, "module", model).config
    kinds = getattr(config, "layer_types", None)
    full_attention = all(kind == "full_attention" for kind in kinds) if kinds else not any(sliding_layers(config))
    if (config._attn_implementation != "sdpa" or not full_attention or getattr(config, "output_router_logits", False)
            or bool(attention_mask.all())):
        return attention_mask
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    causal = columns[:, None] >= columns[None, :]
    return (causal & attention_mask.bool()[:, None, :]).unsqueeze(1)


def response_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities [N, R] of the response tokens (and their entropy if asked).

    Only the response positions' logits are computed (`logits_to_keep`): responses are the last
    R columns, and the logits at column t predict token t + 1."""
    response_len = batch["response_ids"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=attention_masks(model, batch["attention_mask"]),
                   position_ids=batch["position_ids"], use_cache=False, logits_to_keep=response_len + 1).logits
    return chunked_token_stats(logits[:, :-1], batch["response_ids"], temperature, with_entropy)


def response_values(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A critic's values [N, R] of the states before each response token: the head's output at
    the columns whose logits a policy would use to predict those tokens (response_logprobs)."""
    response_len = batch["response_ids"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=attention_masks(model, batch["attention_mask"]),
                position_ids=batch["position_ids"]).logits
    return out[:, -response_len - 1:-1, 0].float()
