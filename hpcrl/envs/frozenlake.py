"""FrozenLake as a text grid (ROLL ships it so): walk from P to G over frozen tiles without falling
into a hole, non-slippery. A fixed set of maps, each checked solvable; a seed picks one."""
from __future__ import annotations

from collections import deque

import numpy as np

from hpcrl.envs.base import MOVES, StepResult, TextEnv, parse_move

FROZEN, HOLE, GOAL, PLAYER = "_", "O", "G", "P"


def distances_to_goal(grid: list[str]) -> dict[tuple[int, int], int]:
    """Moves from each cell to G without stepping on a hole; cells that cannot reach G are absent."""
    size = len(grid)
    goal = next((r, c) for r in range(size) for c in range(size) if grid[r][c] == GOAL)
    distance, queue = {goal: 0}, deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in distance and grid[nxt[0]][nxt[1]] != HOLE:
                distance[nxt] = distance[(r, c)] + 1
                queue.append(nxt)
    return distance


def frozenlake_maps(count: int = 8, size: int = 4, holes: int = 3, seed: int = 0
                    ) -> list[tuple[list[str], tuple[int, int]]]:
    """`count` different solvable maps (grid rows, start cell), the same for the same arguments."""
    rng = np.random.default_rng(seed)
    maps: list[tuple[list[str], tuple[int, int]]] = []
    while len(maps) < count:
        cells = rng.permutation(size * size)
        start, goal, pits = divmod(int(cells[0]), size), int(cells[1]), {int(c) for c in cells[2:2 + holes]}
        grid = ["".join(GOAL if r * size + c == goal else HOLE if r * size + c in pits else FROZEN
                        for c in range(size)) for r in range(size)]
        if start in distances_to_goal(grid) and (grid, start) not in maps:
            maps.append((grid, start))
    return maps


class FrozenLake(TextEnv):
    system_prompt = "reach G, avoid O"
    action_format = "one move: U, D, L or R"
    alphabet = "PGO_UDLR "

    def __init__(self, maps: int = 8, size: int = 4, holes: int = 3, map_seed: int = 0, invalid_reward: float = 0.0,
                 progress_reward: float = 0.0):
        """`progress_reward` > 0 adds that much per move for each step it brings the player closer to
        G (and takes it back for each step away): a dense signal from the first step on every map,
        where the success reward alone reaches a random policy on the hard maps once in a hundred
        episodes. Cycles earn nothing and a success always earns the most (1 + progress_reward times
        the start's distance), so the best policy is the unshaped one's."""
        self.maps = frozenlake_maps(maps, size, holes, map_seed)
        self.distances = [distances_to_goal(grid) for grid, _ in self.maps]
        self.invalid_reward = invalid_reward
        self.progress_reward = progress_reward
        self.grid: list[str] = []
        self.position = (0, 0)
        self.distance: dict[tuple[int, int], int] = {}

    def reset(self, seed: int) -> str:
        self.grid, self.position = self.maps[seed % len(self.maps)]
        self.distance = self.distances[seed % len(self.maps)]
        return self.render()

    def render(self) -> str:
        """Rows separated by spaces, the player as P: 'P__O _O__ ___G ____'."""
        r0, c0 = self.position
        return " ".join("".join(PLAYER if (r, c) == (r0, c0) else tile for c, tile in enumerate(row))
                        for r, row in enumerate(self.grid))

    def step(self, action: str) -> StepResult:
        move = parse_move(action)
        if move is None:
            return self.invalid(action, self.render())
        size, before = len(self.grid), self.distance[self.position]
        # a move off the grid leaves the player where it is (gymnasium's FrozenLake does the same)
        self.position = (min(size - 1, max(0, self.position[0] + move[0])),
                         min(size - 1, max(0, self.position[1] + move[1])))
        tile = self.grid[self.position[0]][self.position[1]]
        if tile == HOLE:
            return StepResult(self.render(), 0.0, True, {"success": False})
        progress = self.progress_reward * (before - self.distance[self.position])
        if tile == GOAL:
            return StepResult(self.render(), 1.0 + progress, True, {"success": True})
        return StepResult(self.render(), progress, False, {})
