"""Which roles are on their devices: the controller moves them at the stage changes of the plan.

The plan (placement.plan.StagePlan) says, for every stage whose entry moves roles, which roles are
resident while it runs. Entering such a stage, the controller asks each role that must leave to
`offload` (training engines: weights, gradients and optimizer state to host memory; rollout:
sleep) and each role that must come back to `reload` (wake), in that order, so memory is freed
before it is taken again. The calls are collective over the role's ranks and asynchronous: each
rank serves its calls in order, so the stage's work queues behind them without the controller
waiting, and a move of a role on other ranks overlaps with what runs there (ROLL's offload/reload
control, verl's sleep/wake of a colocated engine).
"""
from __future__ import annotations

from hpcrl.runtime.dispatch import Dispatch, Pending, WorkerGroup, wait


class Residency:
    def __init__(self, windows: dict[str, tuple[str, ...]], groups: dict[str, WorkerGroup]):
        """`windows`: stage -> the roles resident during it (plan.residency); `groups`: the roles."""
        self.windows = windows
        self.groups = groups
        # the roles that ever move are parked in host memory as they are built (WorldLayout.movable)
        self.resident = {role for role in groups if all(role in here for here in windows.values())}
        self.pending: list[Pending] = []
        self.moves: list[str] = []     # "stage:offload:role" since the last `take`

    def enter(self, stage: str) -> None:
        """Move the roles to where `stage` wants them (nothing for a stage that moves nothing)."""
        target = self.windows.get(stage)
        if target is None:
            return
        leaving = [role for role in self.groups if role in self.resident and role not in target]
        coming = [role for role in self.groups if role not in self.resident and role in target]
        for action, roles in (("offload", leaving), ("reload", coming)):
            if action == "reload" and leaving and coming:
                # memory is freed before it is taken again on every device: each rank serves its
                # calls in order, but a vLLM replica's GPUs are freed by its leader alone, while a
                # follower rank would already reload the trainer onto them
                wait(*self.pending)
            for role in roles:
                self.pending.append(self.groups[role].call(action, Dispatch.ONE_TO_ALL))
                self.moves.append(f"{stage}:{action}:{role}")
        self.resident = (self.resident - set(leaving)) | set(coming)

    def need(self, role: str, stage: str) -> None:
        """`role` on its devices for work outside a stage's own call (staging weights, a checkpoint):
        when it is away, enter `stage`, where it is resident."""
        if role in self.groups and role not in self.resident:
            self.enter(stage)

    def take(self) -> tuple[float, list[str]]:
        """Seconds spent moving since the last call (per move, its slowest rank's) and the moves."""
        seconds = sum(max(times) for times in wait(*self.pending))
        moves, self.pending, self.moves = self.moves, [], []
        return seconds, moves
