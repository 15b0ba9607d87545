"""The native generation engine: batched sampling with a KV cache, on any device torch supports.

It is the CPU default and the reference the vLLM engine is checked against: it returns, per
sample, the generated token ids and their log-probabilities under the sampling distribution.
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.engines.offload import Saved, model_state_tensors, release, restore
from hpcrl.engines.router_replay import RoutingRecorder
from hpcrl.engines.slot_forward import SlotCache
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
    the row is finished (stopped at a stop token or at its token budget) or was cut short (the round's
    time limit, or new weights) and continues in a later round (partial rollout)."""

    response_ids: Ragged     # int32
    logprobs: Ragged         # float32
    finished: np.ndarray     # bool
    routed_experts: Ragged | None = None   # a MoE model's routing, when recorded (hpcrl.engines.router_replay)

    @classmethod
    def empty(cls, rows: int, routing: type | None = None) -> Generation:
        """No tokens; with `routing` (an index dtype: recorded), no routing either, so that every
        replica's reply has the same columns."""
        return cls(Ragged.empty(rows, np.int32), Ragged.empty(rows, np.float32), np.ones(rows, dtype=bool),
                   None if routing is None else Ragged.empty(rows, routing))


class NativeSampler:
    def __init__(self, model: torch.nn.Module, stop_ids: Sequence[int], pad_id: int, step_delay_s: float = 0.0,
                 max_seqs: int | None = None, owns_weights: bool = True, lockstep: bool = False,
                 record_routing: bool = False):
        """`max_seqs`: sequences decoding at once (rollout.max_num_seqs; None: every prompt of a call);
        `lockstep`: static batching (rollout.batching), the baseline continuous batching is measured against;
        `stop_ids`: the tokens a response ends at (kept; the tokenizer's `stop_token_ids`);
        `record_routing`: a MoE model's generations carry the experts each token went to (router replay);
        `step_delay_s`: a pause after every decoding step, for tests of long rounds only;
        `owns_weights`: false when `model` is a trainer's, which sleep and wake leave where it is."""
        self.model = model
        self.owns_weights = owns_weights
        self.max_seqs = max_seqs
        self.lockstep = lockstep
        self.stop_ids = np.asarray(stop_ids, dtype=np.int64)
        self.pad_id = pad_id
        self.step_delay_s = step_delay_s
        self.recorder = RoutingRecorder(model) if record_routing else None
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
        if self.owns_weights and not self._asleep:
            self._host = release(model_state_tensors(self.model.parameters()), self._host)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            restore(self._host)
            self._asleep = False

    @torch.inference_mode()
    def generate(self, prompts: Ragged, params: SamplingParams, generator: torch.Generator,
                 budgets: np.ndarray | None = None, stop: Callable[[np.ndarray], bool] | None = None,
                 seeds: np.ndarray | None = None) -> Generation:
        """Sample a response per prompt; each stops at a stop token (kept), after `budgets[i]` tokens
        (default `params.max_new_tokens`), or unfinished as soon as `stop(finished)` is true (given
        which rows have ended).

        Continuous batching: at most `max_seqs` sequences decode together; a finished one leaves
        the batch at once and a waiting prompt takes its place (after its own prefill), so a long
        response never keeps the short ones' slots busy. Every sequence draws from uniforms of
        its own seed (`seeds[i]`, else drawn from `generator`) and token index, so its tokens do not
        depend on which others share its batch, while the batch samples in one call. Lock-step
        gives the same tokens, later: finished rows keep decoding (their tokens dropped) until the
        batch's last one ends, and only then do waiting prompts join."""
        count = len(prompts)
        if not count:
            return Generation.empty(0, None if self.recorder is None else self.recorder.dtype)
        training = self.model.training   # a trainer's model (owns_weights false) goes back to training mode
        self.model.eval()
        budgets = np.asarray(budgets if budgets is not None else np.full(count, params.max_new_tokens))
        if seeds is None:
            seeds = torch.randint(0, 2 ** 62, (count,), generator=generator).numpy()
        run = self.decoding(params, int(budgets.max(initial=0)))
        run.add(list(prompts), budgets, seeds)
        while run.busy:
            if stop is not None and stop(run.finished):
                break
            run.advance()
        self.model.train(training)
        return run.generation()

    def decoding(self, params: SamplingParams, width: int) -> Decoding:
        """An open batch that takes requests while it decodes (multi-turn rollout adds each turn as
        its environment answers); `width`: the most tokens a request may generate. The caller
        puts the model in eval mode."""
        return Decoding(self, params, width)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """A uniform in (0, 1) per (seed, token index): SplitMix64 of the pair, a counter-based draw, so
    that a sequence's tokens depend on its seed alone (not on which others share its batch, nor on
    the device) while the whole batch samples at once, without a generator per sequence."""
    with np.errstate(over="ignore"):
        z = seeds + (counters.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def _first_with_same_prompt(prompts: list[np.ndarray | None]) -> np.ndarray:
    """Per prompt, the index of the first with the same ids (None: one of its own)."""
    seen: dict[bytes, int] = {}
    return np.array([index if p is None else seen.setdefault(p.tobytes(), index) for index, p in enumerate(prompts)],
                    np.int64)


def _inverse_cdf(probs: torch.Tensor, uniforms: np.ndarray) -> torch.Tensor:
    """Per row, the token whose cumulative-probability interval holds the row's uniform (zero-probability
    tokens have empty intervals, so they are never drawn)."""
    cdf = probs.double().cumsum(-1)
    threshold = torch.from_numpy(uniforms).to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
    return (cdf < threshold).sum(-1).clamp_(max=probs.shape[-1] - 1)


class Decoding:
    """Sequences waiting, decoding together in one cache, or done; a request is a row, added at any
    time with `add` (each row's tokens and log-probs are kept in a [rows, width] array).

    The sequences decoding together hold slots 0 .. n-1 of a slot cache (hpcrl.engines.slot_forward),
    in the order of `active`; one that finishes leaves its slot to the last sequence, which moves in.

    A request may name a session (multi-turn rollout: its trajectory): when it ends, its keys and
    values are kept, and the session's next request, whose prompt continues the same tokens,
    prefills only what is new (the last sampled token and the env's answer) on top of them, so a
    turn costs its own tokens, not the whole conversation again. `release` drops a session."""

    def __init__(self, sampler: NativeSampler, params: SamplingParams, width: int):
        self.sampler, self.params, self.width = sampler, params, width
        self.device = next(sampler.model.parameters()).device
        self.prompts: list[np.ndarray] = []
        self.budgets = np.zeros(0, np.int64)
        self.seeds = np.zeros(0, np.uint64)
        self.tokens = np.zeros((0, width), np.int32)
        self.logprobs = np.zeros((0, width), np.float32)
        self.lengths = np.zeros(0, np.int64)
        self.finished = np.zeros(0, bool)
        self.sessions = np.zeros(0, np.int64)   # per row: its session, -1 for none
        # per session: its ids, their (keys, values) per layer, and their routing when recorded
        self.kept: dict[int, tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]], np.ndarray | None]] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.cache = SlotCache(sampler.model)
        self.active = np.zeros(0, np.int64)      # the row in each slot
        self.filled = np.zeros(0, np.int64)      # positions each slot holds (the next one's index)
        self.logits: torch.Tensor | None = None  # [slots, vocab]: each slot's next-token logits
        # router replay: per row, the experts of its prompt's positions, and of each token it fed after
        self.recorder = sampler.recorder
        self.prefill_routes: list[np.ndarray | None] = []
        self.step_routes: list[np.ndarray] = []

    def add(self, prompts: list[np.ndarray], budgets: np.ndarray, seeds: np.ndarray,
            sessions: np.ndarray | None = None) -> np.ndarray:
        """Queue requests (prompt ids, the most tokens each may generate, its sampling seed, its
        session or -1); returns their rows. A request with no budget is finished at once."""
        budgets = np.asarray(budgets, np.int64)
        if len(budgets) and budgets.max() > self.width:
            raise ValueError(f"a request's budget {budgets.max()} exceeds the batch's width {self.width}")
        first, count = len(self.prompts), len(prompts)
        self.prompts.extend(prompts)
        self.budgets = np.concatenate([self.budgets, budgets])
        self.seeds = np.concatenate([self.seeds, np.asarray(seeds).astype(np.uint64)])
        self.tokens = np.concatenate([self.tokens, np.zeros((count, self.width), np.int32)])
        self.logprobs = np.concatenate([self.logprobs, np.zeros((count, self.width), np.float32)])
        self.lengths = np.concatenate([self.lengths, np.zeros(count, np.int64)])
        self.finished = np.concatenate([self.finished, budgets <= 0])
        self.sessions = np.concatenate([self.sessions, np.full(count, -1) if sessions is None else sessions])
        if self.recorder is not None:
            self.prefill_routes.extend([None] * count)
            self.step_routes.extend(np.zeros((max(0, int(budget)), self.recorder.layers, self.recorder.top_k),
                                             self.recorder.dtype) for budget in budgets)
        rows = np.arange(first, first + count)
        self.waiting.extend(rows[budgets > 0].tolist())
        return rows

    def abort(self, rows: np.ndarray) -> None:
        """Drop requests: waiting ones leave the queue, decoding ones the batch at the next token."""
        self.finished[rows] = True
        dropped = set(rows.tolist())
        self.waiting = collections.deque(r for r in self.waiting if r not in dropped)

    def release(self, session: int) -> None:
        """The session's conversation is over: its kept cache goes."""
        self.kept.pop(session, None)

    @property
    def busy(self) -> bool:
        """Requests are waiting or decoding."""
        return bool(self.waiting) or bool(len(self.active))

    @torch.inference_mode()
    def advance(self) -> np.ndarray:
        """Admit waiting requests, decode one token; returns the rows that ended with it. In inference
        mode (no version counters or autograd metadata on the tensors it makes: the tiny job's 128
        rows 6.6 -> 6.1 ms): every tensor of a batch (its cache, its logits) is made and changed
        here, and the weights it reads are changed only outside it (syncs, the trainer's steps)."""
        self.admit()
        ended = self.step()
        if self.sampler.step_delay_s:
            time.sleep(self.sampler.step_delay_s)
        return ended

    def admit(self) -> None:
        """Prefill waiting prompts into the free slots and add them to the decoding batch; a prompt
        that continues its session's kept cache prefills only its new tokens. A prompt that another
        admitted with it repeats (a GRPO group's samples) is prefilled once: the copies take its
        keys and values and its logits (vLLM's prefix caching, for the whole prompt)."""
        first = len(self.active)
        free = (self.sampler.max_seqs or len(self.prompts)) - first
        if free <= 0 or not self.waiting or (self.sampler.lockstep and first):
            return
        rows = np.array([self.waiting.popleft() for _ in range(min(free, len(self.waiting)))])
        kept = [self._past(int(row)) for row in rows]
        cached = np.array([0 if k is None else len(k[0]) for k in kept], np.int64)
        source = _first_with_same_prompt([self.prompts[row] if n == 0 else None for row, n in zip(rows, cached)])
        # the prompts prefilled (the first of each) take the first slots, their copies the ones after
        order = np.argsort(source != np.arange(len(rows)), kind="stable")
        rows, cached, kept = rows[order], cached[order], [kept[i] for i in order]
        source = np.argsort(order)[source[order]]   # each row's prefilled one, by its new index
        unique = int((source == np.arange(len(rows))).sum())
        news = Ragged.from_arrays([self.prompts[row][n:] for row, n in zip(rows[:unique], cached[:unique])], np.int32)
        new_lengths = news.lengths.astype(np.int64)[source]
        # the columns its prompts' positions take, padding included (decoding steps grow them as needed)
        self.cache.reserve(first + len(rows), int(cached.max() + new_lengths.max()))
        for index, k in enumerate(kept):
            if k is not None:
                self.cache.put(first + index, k[1])
        ids = torch.from_numpy(news.padded(max(1, news.max_length()), self.sampler.pad_id).astype(np.int64))
        filled = cached + new_lengths
        logits, routes = self._forward(first, ids.to(self.device), cached[:unique], new_lengths[:unique])
        if unique < len(rows):
            copies = torch.from_numpy(first + np.arange(unique, len(rows))).to(self.device)
            self.cache.move(torch.from_numpy(first + source[unique:]).to(self.device), copies, int(filled.max()))
            logits = logits[torch.from_numpy(source).to(self.device)]
        if routes is not None:   # each row's real (not padding) positions, after its session's kept ones
            routes = routes.reshape(*ids.shape, *routes.shape[1:])
            for index, row in enumerate(rows):
                before = [] if kept[index] is None else [kept[index][2]]
                self.prefill_routes[row] = np.concatenate([*before, routes[source[index]][:new_lengths[index]]])
        self.logits = torch.cat([self.logits, logits]) if first else logits
        self.active = np.concatenate([self.active, rows])
        self.filled = np.concatenate([self.filled, filled])

    def _past(self, row: int) -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]], np.ndarray | None] | None:
        """The ids, keys and values (and routing) kept for the row's session, if its prompt continues their tokens."""
        found = self.kept.pop(int(self.sessions[row]), None)
        prompt = self.prompts[row]
        if found is None or len(prompt) <= len(found[0]) or not np.array_equal(prompt[:len(found[0])], found[0]):
            return None
        return found

    def _keep(self, slot: int) -> None:
        """Keep the finished sequence in `slot`'s keys and values for its session's next request: its
        prompt and every sampled token but the last (never fed); lock-step rows decode on after
        they end, at later columns, which are left."""
        row = int(self.active[slot])
        ids = np.concatenate([self.prompts[row], self.tokens[row, :self.lengths[row] - 1]])
        self.kept[int(self.sessions[row])] = (ids, self.cache.take(slot, len(ids)), self.routing_of(row))

    def step(self) -> np.ndarray:
        """Sample a token for every sequence in the batch and keep those of the unfinished ones; finished
        ones leave (lock-step: all together, once the last has finished); the rest advance one position.
        Returns the rows that ended with this token."""
        if not len(self.active):
            return np.zeros(0, np.int64)
        params = self.params
        logits = self.logits.float() / params.temperature
        full_logp = torch.log_softmax(logits, dim=-1)
        if params.greedy:
            chosen = logits.argmax(-1)
        else:
            probs = torch.softmax(_filter_logits(logits, params.top_k, params.top_p), dim=-1)
            chosen = _inverse_cdf(probs, _uniforms(self.seeds[self.active], self.lengths[self.active]))
        picked = full_logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).cpu().numpy()
        tokens = chosen.cpu().numpy()
        live = ~self.finished[self.active]   # all of them, except in lock-step
        rows = self.active[live]
        position = self.lengths[rows]
        self.tokens[rows, position] = tokens[live]
        self.logprobs[rows, position] = picked[live]
        self.lengths[rows] += 1
        self.finished[rows] = np.isin(tokens[live], self.sampler.stop_ids) | (self.lengths[rows] >= self.budgets[rows])
        ended = rows[self.finished[rows]]
        done = self.finished[self.active]
        if self.sampler.lockstep:
            done = np.full(len(done), done.all())
        for slot in np.flatnonzero(done & (self.sessions[self.active] >= 0)):
            self._keep(int(slot))
        if done.any():
            order = self._vacate(done)
            if not len(order):
                self.logits = None
                return ended
            chosen = chosen[torch.from_numpy(order).to(self.device)]
        fed = ~self.finished[self.active]   # lock-step's finished rows feed filler, whose routing is not kept
        self.cache.reserve(len(self.active), int(self.filled.max()) + 1)
        self.logits, routes = self._forward(0, chosen.unsqueeze(-1), self.filled, np.ones(len(self.active), np.int64))
        self.filled += 1
        if routes is not None:
            rows = self.active[fed]
            for row, position, route in zip(rows, self.lengths[rows] - 1, routes[fed]):
                self.step_routes[row][position] = route
        return ended

    def _vacate(self, done: np.ndarray) -> np.ndarray:
        """The `done` slots' sequences leave: the last remaining ones move into the slots they free, so
        that the batch stays slots 0 .. n-1 and only the moved sequences are copied. Returns, per new
        slot, the old slot it comes from."""
        keep = np.flatnonzero(~done)
        order = np.arange(len(keep))
        holes = np.flatnonzero(done[:len(keep)])
        movers = keep[keep >= len(keep)]
        if len(holes):
            self.cache.move(torch.from_numpy(movers).to(self.device), torch.from_numpy(holes).to(self.device),
                            int(self.filled[movers].max()))
            order[holes] = movers
        self.active, self.filled = self.active[order], self.filled[order]
        return order

    def _forward(self, first: int, ids: torch.Tensor, starts: np.ndarray,
                 lengths: np.ndarray) -> tuple[torch.Tensor, np.ndarray | None]:
        """The slot cache's forward (next-token logits), and the routing it took when recorded."""
        def forward() -> torch.Tensor:
            return self.cache.forward(first, ids, torch.from_numpy(starts).to(self.device),
                                      torch.from_numpy(lengths).to(self.device), int((starts + lengths).max()))
        if self.recorder is None:
            return forward(), None
        return self.recorder.capture(forward)

    def routing_of(self, row: int) -> np.ndarray | None:
        """[positions, layers, top_k] experts of the positions a trainer's forward needs (router
        replay): the row's prompt's and its response's but the last token's; None when not recorded
        (or for a row cut before it started)."""
        if self.recorder is None or self.prefill_routes[row] is None:
            return None
        return np.concatenate([self.prefill_routes[row], self.step_routes[row][:max(0, self.lengths[row] - 1)]])

    def routed_experts(self) -> Ragged | None:
        """`routing_of` every row, flat (empty where none), when recorded."""
        if self.recorder is None:
            return None
        empty = np.zeros(0, self.recorder.dtype)
        return Ragged.from_arrays([empty if (r := self.routing_of(row)) is None else r.reshape(-1)
                                   for row in range(len(self.prompts))], self.recorder.dtype)

    def generation(self) -> Generation:
        return Generation(Ragged.from_padded(self.tokens, self.lengths), Ragged.from_padded(self.logprobs, self.lengths),
                          self.finished.copy(), self.routed_experts())
