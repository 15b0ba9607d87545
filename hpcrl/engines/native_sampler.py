"""The native generation engine: batched sampling with a KV cache, on any device torch supports.

It is the CPU default and the reference the vLLM engine is checked against: it returns, per
sample, the generated token ids and their log-probabilities under the sampling distribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.engines.batch import left_pad, positions
from hpcrl.engines.offload import Saved, model_state_tensors, release, restore
from hpcrl.ragged import Ragged


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False   # the most likely token each step (evaluation); log-probs stay those of the sampling


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


@dataclass
class Generation:
    """One round's output, a row per prompt: the sampled ids, their log-probabilities, and whether
    the row is finished (stopped at `<eos>` or at its token budget) or was cut by the round's
    deadline and continues in a later round (partial rollout)."""

    response_ids: Ragged     # int32
    logprobs: Ragged         # float32
    finished: np.ndarray     # bool

    @classmethod
    def empty(cls, rows: int) -> Generation:
        return cls(Ragged.empty(rows, np.int32), Ragged.empty(rows, np.float32), np.ones(rows, dtype=bool))


class NativeSampler:
    def __init__(self, model: torch.nn.Module, eos_id: int, pad_id: int, step_delay_s: float = 0.0):
        """`step_delay_s`: a pause after every decoding step, for tests of long rounds only."""
        self.model = model
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.step_delay_s = step_delay_s
        self._landing: dict[tuple[str, ...], torch.Tensor] = {}
        self._host: Saved = []
        self._asleep = False

    def _params(self, names) -> list[torch.nn.Parameter]:
        params = dict(self.model.named_parameters())
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"weight sync: the rollout model has no parameter {missing[0]!r}")
        return [params[n] for n in names]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for param, (_, value) in zip(self._params([n for n, _ in weights]), weights):
                param.copy_(value)

    def weights_loaded(self) -> None:
        """After the last bucket of a sync: nothing is cached between calls here."""

    @torch.no_grad()
    def landing_buffer(self, meta: list[tuple[str, tuple[int, ...], torch.dtype]]) -> torch.Tensor | None:
        """One flat tensor that the parameters named in `meta` become views of, so that a weight
        sync receives straight into the model (no copy, no receive buffer). Made on the first
        sync, kept for the next ones; None for a model on a GPU (the sync arrives in host memory)."""
        key = tuple(name for name, _, _ in meta)
        if key not in self._landing:
            params = self._params(key)
            if any(p.device.type != "cpu" or p.dtype != meta[0][2] or tuple(p.shape) != tuple(shape)
                   for p, (_, shape, _) in zip(params, meta)):
                return None
            flat = torch.empty(sum(p.numel() for p in params), dtype=meta[0][2])
            start = 0
            for param in params:
                view = flat[start:start + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                start += param.numel()
            self._landing[key] = flat
        return self._landing[key]

    def sleep(self) -> None:
        """The weights to host memory (it keeps no cache between calls); the landing buffers they are
        views of go too, and come back in place, so a sync still lands in them."""
        if not self._asleep:
            self._host = release(model_state_tensors(self.model.parameters()), self._host)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            restore(self._host)
            self._asleep = False

    @torch.no_grad()
    def generate(self, prompts: Ragged, params: SamplingParams, generator: torch.Generator,
                 budgets: np.ndarray | None = None, deadline: float | None = None) -> Generation:
        """Sample a response per prompt; each stops at `<eos>` (kept), after `budgets[i]` tokens
        (default `params.max_new_tokens`), or unfinished when `time.monotonic()` passes `deadline`."""
        batch = len(prompts)
        if not batch:
            return Generation.empty(0)
        self.model.eval()
        device = next(self.model.parameters()).device
        input_ids, attention_mask = (t.to(device) for t in left_pad(prompts, self.pad_id))
        position_ids = positions(attention_mask)
        budget = torch.as_tensor(budgets if budgets is not None else np.full(batch, params.max_new_tokens),
                                 dtype=torch.long, device=device)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True)
        finished = budget <= 0
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        for step in range(int(budget.max())):
            logits = out.logits[:, -1].float() / params.temperature
            full_logp = torch.log_softmax(logits, dim=-1)
            if params.greedy:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(_filter_logits(logits, params.top_k, params.top_p), dim=-1)
                # The generator lives on the CPU so that a seed means the same samples on any device.
                token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
            token = torch.where(finished, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(full_logp.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            lengths += (~finished).long()
            finished |= (token == self.eos_id) | (step + 1 >= budget)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if bool(finished.all()) or (deadline is not None and time.monotonic() > deadline):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = self.model(input_ids=token.unsqueeze(-1), attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=True, **_kv_cache(out))
        if not tokens:
            return Generation.empty(batch)
        lengths = lengths.cpu().numpy()
        return Generation(Ragged.from_padded(torch.stack(tokens, 1).cpu().numpy().astype(np.int32), lengths),
                          Ragged.from_padded(torch.stack(logprobs, 1).float().cpu().numpy(), lengths),
                          finished.cpu().numpy())


def _kv_cache(out) -> dict:
    """The KV cache to pass back: transformers 5.20 renamed `past_key_values` to `cache`, and vLLM
    0.32 (built for our torch) needs transformers < 5.20, so both spellings are served."""
    return {"cache": out.cache} if hasattr(out, "cache") else {"past_key_values": out.past_key_values}
