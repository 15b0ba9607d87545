"""Env workers on MPI ranks of their own (`roles.env`): the envs of a rollout rank run on an env rank
instead of beside the model, so that a CPU-heavy env (a simulator, a sandbox, a web page) takes the
CPU of the nodes the plan gives the env role, not the rollout ranks' (ROLL's environment workers).

A rollout rank plays its trajectories with a `RemoteEnvPool`, which has EnvPool's interface: each
env call goes to its env rank as a message, and the answers come back as they arrive. The env rank
hosts an EnvPool of `env.workers` slots for every rollout rank it serves and answers them all at
once while the round runs (`serve_round`, called by the controller beside the rollout's `play`):
the hung, raising or dying envs are killed and replaced there, and come back as EnvFailures, so
the rollout rank counts and fails those trajectories as with local envs. A rollout rank ends its
part of the round with `end_round`; the env rank returns when every one of its rollout ranks has.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from hpcrl.envs.base import StepResult
from hpcrl.envs.host import EnvFailure, EnvPool
from hpcrl.runtime.messages import TAG_ENV
from hpcrl.runtime.mpi_world import poll_recv, send

Answer = tuple[int, str | StepResult | EnvFailure]
END_ROUND = "end-round"
ANSWER_WAIT_S = 0.002   # how long an env rank with calls in flight waits on its envs before reading MPI again


def env_rank_of(rollout_rank: int, rollout_leaders: list[int], env_ranks: list[int]) -> int:
    """The env rank serving a rollout replica's leader: the leaders dealt round-robin over the env ranks."""
    return env_ranks[sorted(rollout_leaders).index(rollout_rank) % len(env_ranks)]


def clients_of(env_rank: int, rollout_leaders: list[int], env_ranks: list[int]) -> tuple[int, ...]:
    """The rollout leaders an env rank serves."""
    return tuple(r for r in sorted(rollout_leaders) if env_rank_of(r, rollout_leaders, env_ranks) == env_rank)


class RemoteEnvPool:
    """`size` env slots hosted on `env_rank` (EnvPool's interface, for hpcrl.rollout.multi_turn)."""

    def __init__(self, env_rank: int, size: int):
        self.env_rank = env_rank
        self.slots = [None] * size   # only counted: the slots live on the env rank
        self.in_flight: set[int] = set()
        self.failures: Counter[str] = Counter()

    def submit(self, index: int, kind: str, payload: Any) -> None:
        if index in self.in_flight:
            raise RuntimeError(f"env slot {index} has a call in flight")
        self.in_flight.add(index)
        send((index, kind, payload), self.env_rank, TAG_ENV)

    def pending(self) -> list[int]:
        return sorted(self.in_flight)

    def collect(self, timeout: float | None = None) -> list[Answer]:
        """The answers that arrive within `timeout` (None: wait for at least one)."""
        if not self.in_flight:
            return []
        message = poll_recv(source=self.env_rank, tag=TAG_ENV, timeout=timeout)
        if message is None:
            return []
        answers: list[Answer] = message[0]
        for index, answer in answers:
            self.in_flight.discard(index)
            if isinstance(answer, EnvFailure):
                self.failures[answer.kind] += 1
        return answers

    def end_round(self) -> None:
        """This rank's trajectories of the round are over: its env rank may stop serving it."""
        send(END_ROUND, self.env_rank, TAG_ENV)

    def close(self) -> None:
        """The env processes belong to the env rank (they end with it)."""

    def __enter__(self) -> RemoteEnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_round(pools: dict[int, EnvPool]) -> None:
    """Answer the env calls of every rollout rank in `pools` (its EnvPool) until each has ended its
    round (the rollout ranks count the failures from the answers). Idle, it sleeps in MPI's probe
    (poll_recv); with calls in flight it waits on the envs a little at a time (one short wait per
    pass over the rollout ranks) and reads MPI in between."""
    open_clients = set(pools)
    while open_clients:
        busy = any(pool.pending() for pool in pools.values())
        message = poll_recv(tag=TAG_ENV, timeout=0.0 if busy else None)
        if message is not None:
            call, client, _ = message
            if call == END_ROUND:
                open_clients.discard(client)
            else:
                pools[client].submit(*call)
            continue
        wait_s = ANSWER_WAIT_S
        for client, pool in pools.items():
            if pool.pending():
                answers, wait_s = pool.collect(wait_s), 0.0
                if answers:
                    send(answers, client, TAG_ENV)
