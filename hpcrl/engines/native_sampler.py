"""The native generation engine: batched sampling with a KV cache, on any device torch supports.

It is the CPU default and the reference the vLLM engine is checked against: it returns, per
sample, the generated token ids and their log-probabilities under the sampling distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.engines.batch import left_pad, positions


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask out tokens outside the top-k and outside the smallest set holding top-p probability."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class NativeSampler:
    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int):
        self.model = model
        self.eos_id = eos_id
        self.pad_id = pad_id

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in weights:
                if name not in params:
                    raise KeyError(f"weight sync: the rollout model has no parameter {name!r}")
                params[name].copy_(value)

    def sleep(self) -> None:
        """The native engine keeps no cache between calls: nothing to free."""

    def wake(self) -> None:
        """See `sleep`."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        """Sample a response per prompt; stop each at `<eos>` (kept) or `max_new_tokens`."""
        self.model.eval()
        device = next(self.model.parameters()).device
        input_ids, attention_mask = (t.to(device) for t in left_pad(prompts, self.pad_id))
        position_ids = positions(attention_mask)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True)
        batch = len(prompts)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        tokens, logprobs = [], []
        for _ in range(params.max_new_tokens):
            logits = out.logits[:, -1].float() / params.temperature
            full_logp = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(_filter_logits(logits, params.top_k, params.top_p), dim=-1)
            # The generator lives on the CPU so that a seed means the same samples on any device.
            token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
            token = torch.where(finished, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(full_logp.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            finished |= token == self.eos_id
            if bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(input_ids=token.unsqueeze(-1), attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=True, **_kv_cache(out))
        return _trim(torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).cpu(), self.eos_id)


def _kv_cache(out) -> dict:
    """The KV cache to pass back: transformers 5.20 renamed `past_key_values` to `cache`, and vLLM
    0.32 (built for our torch) needs transformers < 5.20, so both spellings are served."""
    return {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}


def _trim(tokens: torch.Tensor, logprobs: torch.Tensor, eos_id: int) -> tuple[list[list[int]], list[list[float]]]:
    """Cut each row after its first `<eos>`."""
    ids_out, logp_out = [], []
    for row, row_logp in zip(tokens.tolist(), logprobs.tolist()):
        length = row.index(eos_id) + 1 if eos_id in row else len(row)
        ids_out.append(row[:length])
        logp_out.append(row_logp[:length])
    return ids_out, logp_out
