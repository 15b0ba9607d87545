"""Sokoban as a text grid (ROLL ships it so): push every box onto a target. Rooms are generated
by playing backwards from the solved state (the player pulls boxes off their targets), so each
is solvable by pushing them back, as gym-sokoban builds its rooms."""
from __future__ import annotations

import numpy as np

from hpcrl.envs.base import MOVES, StepResult, TextEnv, parse_move

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "T", "B", "X", "P", "Q"


def generate_room(seed: int, size: int = 6, boxes: int = 1, pulls: int = 30
                  ) -> tuple[set[tuple[int, int]], set[tuple[int, int]], set[tuple[int, int]], tuple[int, int]]:
    """(walls, targets, boxes, player) of a room whose boxes start off their targets."""
    rng = np.random.default_rng(seed)
    while True:
        walls = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
        inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
        picks = rng.permutation(len(inner))[:boxes + 1]
        targets = {inner[i] for i in picks[:boxes]}
        player, placed = inner[picks[boxes]], set(targets)
        for _ in range(pulls):
            dr, dc = list(MOVES.values())[rng.integers(4)]
            ahead = (player[0] + dr, player[1] + dc)
            if ahead in walls or ahead in placed:
                continue
            behind = (player[0] - dr, player[1] - dc)
            if behind in placed:   # the pull: the box behind the player follows it
                placed = (placed - {behind}) | {player}
            player = ahead
        if placed != targets:
            return walls, targets, placed, player


class Sokoban(TextEnv):
    system_prompt = "push every B onto a T"
    action_format = "one move: U, D, L or R"
    alphabet = "#_TBXPQUDLR "

    def __init__(self, size: int = 6, boxes: int = 1, pulls: int = 30, invalid_reward: float = 0.0):
        self.size, self.boxes_count, self.pulls = size, boxes, pulls
        self.invalid_reward = invalid_reward
        self.walls: set[tuple[int, int]] = set()
        self.targets: set[tuple[int, int]] = set()
        self.boxes: set[tuple[int, int]] = set()
        self.player = (0, 0)

    def reset(self, seed: int) -> str:
        self.walls, self.targets, self.boxes, self.player = generate_room(seed, self.size, self.boxes_count,
                                                                          self.pulls)
        return self.render()

    def _tile(self, cell: tuple[int, int]) -> str:
        on_target = cell in self.targets
        if cell == self.player:
            return PLAYER_ON_TARGET if on_target else PLAYER
        if cell in self.boxes:
            return BOX_ON_TARGET if on_target else BOX
        return WALL if cell in self.walls else TARGET if on_target else FLOOR

    def render(self) -> str:
        return " ".join("".join(self._tile((r, c)) for c in range(self.size)) for r in range(self.size))

    def step(self, action: str) -> StepResult:
        move = parse_move(action)
        if move is None:
            return self.invalid(action, self.render())
        ahead = (self.player[0] + move[0], self.player[1] + move[1])
        if ahead in self.boxes:
            beyond = (ahead[0] + move[0], ahead[1] + move[1])
            if beyond in self.walls or beyond in self.boxes:
                return StepResult(self.render(), 0.0, False, {"blocked": True})
            self.boxes = (self.boxes - {ahead}) | {beyond}
        elif ahead in self.walls:
            return StepResult(self.render(), 0.0, False, {"blocked": True})
        self.player = ahead
        if self.boxes == self.targets:
            return StepResult(self.render(), 1.0, True, {"success": True})
        return StepResult(self.render(), 0.0, False, {})
