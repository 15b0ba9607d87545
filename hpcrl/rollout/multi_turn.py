"""Multi-turn rollout: generate -> env step -> append the observation -> generate, for many envs at once.

Every env progresses on its own: a trajectory's next turn joins the decoding batch as soon as its env
has answered (continuous batching across envs), and its action goes to its env as soon as the turn
ends, so one slow env or long answer stalls no other trajectory. Lock-step, the baseline, makes
every turn of every env wait for the slowest (each wave generates, then every env steps).
Observation tokens enter the context but not the loss (mask 0, no behaviour log-prob); each
generated token keeps the log-prob it was sampled with. An env that hangs, raises or dies fails its
trajectory with the reason (hpcrl.envs.host replaces it), and the others go on. A group may start
`redundancy` extra trajectories and keep the first `keep` to finish, aborting the rest (ROLL Flash's
redundant environment rollout). Turns are plain text or the tokenizer's chat template (TurnFormat).
A trajectory's KV cache stays in the sampler between its turns, so a turn prefills only the
tokens the env added.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import fmean

import numpy as np

from hpcrl.config.job import JobConfig
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.envs.base import StepResult, TextEnv
from hpcrl.envs.host import EnvFailure, EnvPool
from hpcrl.envs.registry import EnvSpec


class TurnFormat:
    """How turns become tokens.

    Plain (a tiny character model): the first turn is `<bos>`, the env's instructions and its first
    observation; every later one the observation alone, right after the action. Chat (`env.chat`, a
    tokenizer with a chat template): the instructions are the system message, each observation a
    user message and each action the assistant's, and every turn adds the tokens the template puts
    between the action's text and the next answer (the end of the assistant's message, the user's
    message, the assistant's header), so a trajectory reads as the whole conversation rendered at
    once: what the model sees at inference.
    """

    PROBE = ("\x00user\x00", "\x00assistant\x00")   # stand-ins that no template changes

    def __init__(self, tokenizer, chat: bool = False):
        self.tokenizer, self.chat = tokenizer, chat
        if not chat:
            return
        user, assistant = self.PROBE
        self._before = tokenizer.chat_text([{"role": "user", "content": user},
                                            {"role": "assistant", "content": assistant}], add_generation_prompt=False)
        self._closing = self._before[self._before.index(assistant) + len(assistant):]
        self._user_turn("observation")   # refuses a template that re-renders earlier turns, before any rollout

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def placeholder(self) -> np.ndarray:
        """The prompt of a group whose every trajectory failed before its env answered (those rows
        train on nothing): `<bos>`, or `<eos>` for a tokenizer without one."""
        bos = self.tokenizer.bos_token_id
        return np.array([self.tokenizer.eos_token_id if bos is None else bos], np.int32)

    def first(self, env: TextEnv, observation: str) -> np.ndarray:
        instructions = " ".join(part for part in (env.system_prompt, env.action_format) if part)
        if self.chat:
            messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
                {"role": "user", "content": observation}]
            return np.array(self.tokenizer.encode(self.tokenizer.chat_text(messages, add_generation_prompt=True)),
                            np.int32)
        return np.array(self.tokenizer.encode(f"{instructions} {observation} "), np.int32)

    def next(self, observation: str, action_ids: np.ndarray) -> np.ndarray:
        """The tokens between an action (`action_ids`, as generated) and the next one."""
        if not self.chat:
            return np.array(self.tokenizer.encode(f" {observation} ", add_bos=False), np.int32)
        closing = self._closing
        if len(action_ids) and int(action_ids[-1]) in self.tokenizer.stop_token_ids:
            end = self.tokenizer.token_text(int(action_ids[-1]))
            if closing.startswith(end):
                closing = closing[len(end):]   # the model wrote the end of its message itself
        return np.array(self.tokenizer.encode(closing + self._user_turn(observation), add_bos=False), np.int32)

    def _user_turn(self, observation: str) -> str:
        user, assistant = self.PROBE
        after = self.tokenizer.chat_text([{"role": "user", "content": user}, {"role": "assistant", "content": assistant},
                                          {"role": "user", "content": observation}], add_generation_prompt=True)
        if not after.startswith(self._before):
            raise ValueError("env.chat: the tokenizer's chat template does not extend a conversation turn by turn "
                             "(rendering one more user message changed the earlier ones); use env.chat: false")
        return after[len(self._before):]


@dataclass(frozen=True)
class Request:
    group: int
    env_seed: int       # the episode: every trajectory of a group starts from the same state
    sample_seed: int    # the policy's draws


@dataclass
class Trajectory:
    """One episode: the prompt (instructions and first observation), then actions and observations."""

    request: Request
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    response_ids: list[np.ndarray] = field(default_factory=list)   # per piece: an action or an observation
    loss_mask: list[np.ndarray] = field(default_factory=list)      # 1 on generated tokens
    logprobs: list[np.ndarray] = field(default_factory=list)       # behaviour log-probs (0 on observations)
    step_rewards: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    env_seconds: list[float] = field(default_factory=list)
    success: bool = False
    failure: str | None = None   # why the env failed it (hung, raised, died)
    aborted: bool = False        # redundancy: its group was complete without it
    ended: bool = False
    routing: np.ndarray | None = None   # router replay: the experts of its context's positions, up to its last action

    @property
    def reward(self) -> float:
        return float(sum(self.step_rewards))

    def tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(response ids, loss mask, behaviour log-probs, token rewards), flat; a turn's reward sits on
        the last token of its action (where the env answered it)."""
        def flat(parts, dtype):
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        rewards = [np.zeros(len(piece), np.float32) for piece in self.response_ids]
        actions = [i for i, mask in enumerate(self.loss_mask) if len(mask) and mask[0]]
        for index, reward in zip(actions, self.step_rewards):
            rewards[index][-1] = reward
        return (flat(self.response_ids, np.int32), flat(self.loss_mask, bool), flat(self.logprobs, np.float32),
                flat(rewards, np.float32))

    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, *self.response_ids]).astype(np.int32)

    def length(self) -> int:
        return sum(len(p) for p in self.response_ids)


class MultiTurnRollout:
    """Runs trajectories on `pool`'s env slots with `sampler`: at most one trajectory per slot at a time.
    `max_turns` actions per trajectory, `turn_tokens` tokens per action, `max_tokens` response tokens
    (actions and observations) per trajectory."""

    def __init__(self, sampler: NativeSampler, pool: EnvPool, env: TextEnv, turns: TurnFormat, params: SamplingParams,
                 max_turns: int, turn_tokens: int, max_tokens: int, lockstep: bool = False, keep_cache: bool = True):
        """`keep_cache`: a trajectory's keys and values stay between its turns (each turn prefills only
        its new tokens); false re-reads the whole context every turn."""
        self.sampler, self.pool, self.env, self.turns, self.params = sampler, pool, env, turns, params
        self.max_turns, self.turn_tokens, self.max_tokens, self.lockstep = max_turns, turn_tokens, max_tokens, lockstep
        self.keep_cache = keep_cache

    def run(self, requests: list[Request], keep: int | None = None) -> list[Trajectory]:
        """Every request's trajectory, in order. With `keep`, a group is complete once `keep` of its
        trajectories have ended without failing: the others are aborted (and returned so marked)."""
        run = _Run(self, requests, keep)
        training = self.sampler.model.training
        self.sampler.model.eval()
        try:
            run.loop()
        finally:
            self.sampler.model.train(training)
        return run.trajectories


class _Run:
    def __init__(self, rollout: MultiTurnRollout, requests: list[Request], keep: int | None):
        self.r = rollout
        self.trajectories = [Trajectory(q) for q in requests]
        self.queue = deque(range(len(requests)))
        self.keep = keep
        self.kept: Counter[int] = Counter()
        self.decoding = rollout.sampler.decoding(rollout.params, rollout.turn_tokens)
        self.row_of: dict[int, int] = {}       # decoding row -> trajectory
        self.slot_of: dict[int, int] = {}      # trajectory -> env slot
        self.on_slot: dict[int, int] = {}      # env slot -> trajectory whose call is in flight
        self.sent_at: dict[int, float] = {}
        self.free = deque(range(len(rollout.pool.slots)))
        self.to_generate: list[int] = []       # lock-step: held until the wave's envs have all answered
        self.to_step: list[tuple[int, str]] = []

    def loop(self) -> None:
        self._start_more()
        while True:
            self._flush_lockstep()   # may end trajectories (out of tokens)
            if all(t.ended for t in self.trajectories):
                return
            if not self.decoding.busy and not self.r.pool.pending():
                raise RuntimeError("multi-turn rollout: nothing in flight while trajectories are unfinished")
            for slot, answer in self.r.pool.collect(0 if self.decoding.busy else None):
                self._answered(slot, answer)
            if self.decoding.busy:
                for row in self.decoding.advance():
                    self._acted(self.row_of.pop(int(row)), int(row))

    def _flush_lockstep(self) -> None:
        """Lock-step: a wave's turns generate only once every env has answered, and its actions go
        out only once the wave's last turn has ended."""
        if self.to_generate and not self.r.pool.pending() and not self.to_step:
            for index in self.to_generate:
                self._generate(index)
            self.to_generate = []
        if self.to_step and not self.decoding.busy:
            for index, action in self.to_step:
                self._send(index, "step", action)
            self.to_step = []

    def _start_more(self) -> None:
        while self.free and self.queue:
            index = self.queue.popleft()
            if self.trajectories[index].ended:
                continue
            self.slot_of[index] = self.free.popleft()
            self._send(index, "reset", self.trajectories[index].request.env_seed)

    def _send(self, index: int, kind: str, payload) -> None:
        slot = self.slot_of[index]
        self.on_slot[slot] = index
        self.sent_at[index] = time.monotonic()
        self.r.pool.submit(slot, kind, payload)

    def _generate(self, index: int) -> None:
        t = self.trajectories[index]
        budget = min(self.r.turn_tokens, self.r.max_tokens - t.length())
        if budget <= 0:
            self._end(index)
            return
        seed = (t.request.sample_seed * 1_000_003 + len(t.turn_tokens)) % 2 ** 63
        session = np.array([index if self.r.keep_cache else -1])
        row = int(self.decoding.add([t.context()], np.array([budget]), np.array([seed]), session)[0])
        self.row_of[row] = index

    def _queue_generate(self, index: int) -> None:
        if self.r.lockstep:
            self.to_generate.append(index)
        else:
            self._generate(index)

    def _acted(self, index: int, row: int) -> None:
        """A turn ended: keep its tokens and send the action to the env."""
        t = self.trajectories[index]
        length = int(self.decoding.lengths[row])
        ids = self.decoding.tokens[row, :length].copy()
        t.response_ids.append(ids)
        t.loss_mask.append(np.ones(length, bool))
        t.logprobs.append(self.decoding.logprobs[row, :length].copy())
        t.turn_tokens.append(length)
        t.routing = self.decoding.routing_of(row)   # the whole conversation's so far (None unless recorded)
        if t.aborted:
            self._end(index)
            return
        action = self.r.turns.decode(ids.tolist())
        if self.r.lockstep:
            self.to_step.append((index, action))
        else:
            self._send(index, "step", action)

    def _answered(self, slot: int, answer: str | StepResult | EnvFailure) -> None:
        index = self.on_slot.pop(slot)
        t = self.trajectories[index]
        t.env_seconds.append(time.monotonic() - self.sent_at.pop(index))
        if isinstance(answer, EnvFailure):
            t.failure = f"{answer.kind}: {answer.reason}"
            self._end(index)
        elif t.aborted:
            self._end(index)
        elif isinstance(answer, str):   # the reset's first observation
            t.prompt_ids = self.r.turns.first(self.r.env, answer)
            self._queue_generate(index)
        else:
            t.step_rewards.append(answer.reward)
            if answer.done or len(t.turn_tokens) >= self.r.max_turns:
                t.success = bool(answer.info.get("success", False))
                self._end(index)
                return
            observation = self.r.turns.next(answer.observation, t.response_ids[-1])
            t.response_ids.append(observation)
            t.loss_mask.append(np.zeros(len(observation), bool))
            t.logprobs.append(np.zeros(len(observation), np.float32))
            self._queue_generate(index)

    def _end(self, index: int) -> None:
        t = self.trajectories[index]
        t.ended = True
        self.decoding.release(index)
        slot = self.slot_of.pop(index, None)
        if slot is not None:
            self.free.append(slot)
        if self.keep is not None and t.failure is None and not t.aborted:
            self.kept[t.request.group] += 1
            if self.kept[t.request.group] == self.keep:
                self._abort_rest(t.request.group)
        self._start_more()

    def _abort_rest(self, group: int) -> None:
        """The group is complete: its unstarted trajectories end now, those being decoded or waiting
        to be at once (their rows dropped), those with an env call in flight when it answers."""
        members = [i for i, t in enumerate(self.trajectories) if t.request.group == group and not t.ended]
        for index in members:
            self.trajectories[index].aborted = True
            if index not in self.slot_of:
                self.trajectories[index].ended = True
        rows = {i: r for r, i in self.row_of.items()}
        for index in members:
            if index in rows:
                self.row_of.pop(rows[index])
                self.decoding.abort(np.array([rows[index]]))
                self._end(index)
            elif index in self.to_generate:
                self.to_generate.remove(index)
                self._end(index)


def trajectory_metrics(trajectories: list[Trajectory], failures: Counter) -> dict[str, float]:
    """Success rate, turns, tokens per turn and env step time of the kept trajectories; failed and
    aborted counts; the pool's replaced envs by kind."""
    kept = [t for t in trajectories if not t.aborted and t.failure is None]
    turns = [n for t in kept for n in t.turn_tokens]
    return {
        "success_rate": fmean(t.success for t in kept) if kept else 0.0,
        "turns": fmean(len(t.turn_tokens) for t in kept) if kept else 0.0,
        "tokens_per_turn": fmean(turns) if turns else 0.0,
        "env_step_s": fmean(s for t in trajectories for s in t.env_seconds) if trajectories else 0.0,
        "trajectories_failed": float(sum(t.failure is not None for t in trajectories)),
        "trajectories_aborted": float(sum(t.aborted for t in trajectories)),
        **{f"envs_{kind}": float(count) for kind, count in sorted(failures.items())},
    }


def multi_turn_rollout(job: JobConfig, sampler: NativeSampler, tokenizer, pool=None) -> MultiTurnRollout:
    """A rollout rank's multi-turn rollout for the job's `env`: `env.workers` env processes (here, or
    `pool`: on an env rank), turns of `rollout.max_new_tokens` tokens, the job's sampling settings."""
    config, rollout = job.env, job.rollout
    spec = EnvSpec(config.name, config.options)
    turns = TurnFormat(tokenizer, config.chat)
    params = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k)
    pool = pool if pool is not None else EnvPool(spec, config.workers, config.step_timeout_s)
    return MultiTurnRollout(sampler, pool, spec.build(), turns, params,
                            config.max_turns, rollout.max_new_tokens, config.max_tokens,
                            lockstep=rollout.batching == "lockstep")
