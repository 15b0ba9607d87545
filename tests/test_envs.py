"""The text environments of agentic RL and the process host that replaces envs that hang or fail."""
from __future__ import annotations

import math
import time
from collections import deque

import pytest

from hpcrl.envs import EnvSpec, StepResult
from hpcrl.envs.base import MOVES, parse_move
from hpcrl.envs.frozenlake import FrozenLake, frozenlake_maps
from hpcrl.envs.guess_number import GuessNumber
from hpcrl.envs.host import EnvFailure, EnvPool
from hpcrl.envs.sokoban import Sokoban
from hpcrl.envs.tools import ToolEnv, calculate


def shortest_solution(env, seed: int, max_depth: int = 12) -> list[str] | None:
    """Breadth-first search over action sequences, replaying each from reset (envs are deterministic)."""
    queue = deque([[]])
    seen = set()
    while queue:
        actions = queue.popleft()
        for move in MOVES:
            env.reset(seed)
            result = None
            for action in [*actions, move]:
                result = env.step(action)
            if result.info.get("success"):
                return [*actions, move]
            if not result.done and len(actions) + 1 < max_depth and result.observation not in seen:
                seen.add(result.observation)
                queue.append([*actions, move])
    return None


def test_frozenlake_has_a_fixed_set_of_solvable_maps_and_its_rules():
    maps = frozenlake_maps()
    assert len(maps) == 8 and len({(tuple(g), s) for g, s in maps}) == 8
    assert maps == frozenlake_maps(), "the same maps on every rank"
    env = FrozenLake()
    for seed in range(8):
        assert shortest_solution(env, seed) is not None, seed
    assert env.reset(3) == env.reset(11), "a seed picks a map"
    observation = env.reset(0)
    assert observation.count("P") == 1 and len(observation.split()) == 4
    assert set(observation) <= set(env.alphabet)
    invalid = env.step("jump")
    assert invalid.info["invalid"] and invalid.observation == observation and not invalid.done
    # a move is its letter or its word; a lone lowercase letter is not (the vocabulary has d and r, not u, l)
    assert [parse_move(a) for a in ("R", " R ", "right", "Up", "down.")] == [MOVES[m] for m in "RRRUD"]
    assert [parse_move(a) for a in ("r", "d", "u", "", "x")] == [None] * 5
    assert invalid.reward == 0.0
    penalised = EnvSpec("frozenlake", {"invalid_reward": -0.1}).build()
    penalised.reset(0)
    assert penalised.step("jump").reward == -0.1 and penalised.step("R").reward >= 0   # a format penalty
    # walking into a hole ends the episode without reward; off the grid the player stays
    grid, (row, col) = maps[0]
    for move, (dr, dc) in MOVES.items():
        r, c = row + dr, col + dc
        env.reset(0)
        result = env.step(move)
        if not (0 <= r < 4 and 0 <= c < 4):
            assert result.observation == observation and not result.done
        elif grid[r][c] == "O":
            assert result.done and result.reward == 0 and result.info["success"] is False


def test_frozenlake_progress_reward_pays_for_steps_towards_the_goal_and_a_success_pays_most():
    env = FrozenLake(progress_reward=0.1)
    for seed in range(8):
        plan = shortest_solution(env, seed)
        env.reset(seed)
        rewards = [env.step(move).reward for move in plan]
        assert rewards[:-1] == pytest.approx([0.1] * (len(plan) - 1)) and rewards[-1] == pytest.approx(1.1)
        # a step back takes the progress back, a step into a wall earns nothing: no cycle pays
        env.reset(seed)
        there, back = env.step(plan[0]).reward, env.step({"U": "D", "D": "U", "L": "R", "R": "L"}[plan[0]]).reward
        assert there + back == pytest.approx(0.0)
    grid, (row, col) = frozenlake_maps()[0]
    into_hole = next(m for m, (dr, dc) in MOVES.items()
                     if 0 <= row + dr < 4 and 0 <= col + dc < 4 and grid[row + dr][col + dc] == "O")
    env.reset(0)
    assert env.step(into_hole).reward == 0.0, "a hole earns nothing, progress or not"
    assert FrozenLake().reset(0) == env.reset(0), "the shaping changes rewards only"


def test_sokoban_rooms_are_solvable_unsolved_and_pushes_follow_the_rules():
    env = Sokoban()
    for seed in range(6):
        first = env.reset(seed)
        assert "B" in first and first.count("P") + first.count("Q") == 1 and set(first) <= set(env.alphabet)
        plan = shortest_solution(env, seed, max_depth=14)
        assert plan is not None, seed
        env.reset(seed)
        *middle, last = [env.step(a) for a in plan]
        assert last.done and last.reward == 1.0 and "X" in last.observation and "B" not in last.observation
        assert not any(r.done for r in middle)
    assert env.reset(4) == Sokoban().reset(4)
    # a wall stops the player: from any start, enough moves up end at the top wall
    env.reset(0)
    results = [env.step("U") for _ in range(6)]
    assert results[-1].info.get("blocked") or results[-1].done


def test_guess_number_feedback_lets_binary_search_win_in_under_four_guesses_on_average():
    env = GuessNumber(0, 15)
    counts = []
    for seed in range(64):
        env.reset(seed)
        low, high, turns, result = 0, 15, 0, None
        while result is None or not result.done:
            guess = (low + high) // 2
            result = env.step(str(guess))
            turns += 1
            if result.observation == "higher":
                low = guess + 1
            elif result.observation == "lower":
                high = guess - 1
        assert result.reward == 1.0 and result.info["success"] and turns <= 5
        assert set(result.observation) <= set(env.alphabet)
        counts.append(turns)
    assert sum(counts) / len(counts) < 4
    assert env.step("eleven").info["invalid"]
    assert {env.reset(seed) and env.secret for seed in range(16)} == set(range(16)), "16 seeds: every number"
    costly = GuessNumber(0, 15, guess_cost=0.1)
    costly.reset(5)
    assert [costly.step(guess).reward for guess in ("8", "2", "5")] == [-0.1, -0.1, 1.0]


def test_guess_number_information_reward_pays_bits_found_out_and_the_same_total_for_every_success():
    env = GuessNumber(0, 15, information_reward=0.25)
    env.reset(5)
    middle = env.step("7")                 # 16 numbers -> 0-6: log2(16/7) bits
    assert middle.observation == "lower" and middle.reward == pytest.approx(0.25 * math.log2(16 / 7))
    assert env.step("9").reward == 0.0     # ruled out already: nothing found out
    assert env.step("0").reward == pytest.approx(0.25 * math.log2(7 / 6))   # an edge: little
    totals = []
    for guesses in (("7", "3", "5"), ("0", "1", "2", "3", "4", "5"), ("5",), ("15", "9", "12", "4", "5")):
        env.reset(5)
        results = [env.step(guess) for guess in guesses]
        assert results[-1].info["success"] and not any(r.done for r in results[:-1])
        totals.append(sum(r.reward for r in results))
    assert totals == pytest.approx([1.0 + 0.25 * 4] * 4), "potential-based: 4 bits whatever the path"
    env.reset(5)
    assert env.step("x").reward == 0.0 and env.allowed == (0, 15), "an unparsable action changes nothing"


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculate("12*(3+4)-5") == "79"
    assert calculate("7/2") == "3.5" and calculate("2**10") == "1024"
    assert calculate("1/0").startswith("error")
    assert calculate("__import__('os').system('true')").startswith("error: only numbers")
    assert calculate("2**100000").startswith("error: exponent")


def test_tool_env_answers_calls_and_scores_the_answer():
    env = ToolEnv(tools=("calc",))
    question = env.reset(5)
    assert calculate(question) == env.result
    shown = env.step(f"calc: {question}")
    assert shown.observation == env.result and not shown.done and shown.info["tool"] == "calc"
    assert env.step("python: print(1)").info["invalid"], "a tool the env was not given"
    wrong = env.step("answer: -1")
    assert wrong.done and wrong.reward == 0
    env.reset(5)
    right = env.step(f"answer: {env.result}")
    assert right.done and right.reward == 1.0 and right.info["success"]


def test_tool_env_runs_python_in_the_sandbox():
    env = ToolEnv(tools=("python",), python_wall_s=5)
    env.reset(1)
    printed = env.step("python: import socket, os\nprint(sum(range(10)), os.getcwd())")
    assert printed.observation.split() == ["45", "/tmp/sandbox"] and printed.info["status"] == "ok"
    blocked = env.step("python: import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert blocked.info["status"] == "error" and "error" in blocked.observation


def test_a_gymnasium_env_through_the_adapter():
    env = EnvSpec("envs_for_tests:gym_frozenlake").build()
    assert env.reset(0) == "0 0"
    assert env.step("R").observation == "0 1"
    assert env.step("fly").info["invalid"]
    path = ["R", "R", "D", "D", "D", "R"]   # the default 4x4 map, around its holes
    env.reset(0)
    results = [env.step(a) for a in path]
    assert results[-1].done and results[-1].reward == 1.0 and results[-1].observation == "3 3"


def test_an_unknown_env_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown env 'frozen_lake': use one of frozenlake, sokoban"):
        EnvSpec("frozen_lake").build()
    with pytest.raises(ValueError, match="cannot import it"):
        EnvSpec("no_such_module:make").build()


def test_a_hung_a_raising_and_a_dead_env_are_replaced_while_the_others_go_on():
    """Four envs step together: one sleeps forever, one raises, one exits; each is killed and
    counted after at most the step timeout, the healthy one answers at once, and the slots serve
    new envs on the next reset (while the healthy env is the same one)."""
    with EnvPool(EnvSpec("envs_for_tests:misbehaving"), 4, step_timeout_s=2.0) as pool:
        assert pool.call_all({i: ("reset", i) for i in range(4)}) == {i: f"seed {i} reset 1" for i in range(4)}
        for index, action in enumerate(["ok", "hang", "raise", "die"]):
            pool.submit(index, "step", action)
        started = time.monotonic()
        answers, arrived = {}, {}
        while pool.pending():
            for index, answer in pool.collect():
                answers[index], arrived[index] = answer, time.monotonic() - started
        assert answers[0] == StepResult("step 1", 0.0, False, {}) and arrived[0] < 2.0, "not held up by the hang"
        waited = time.monotonic() - started
        assert isinstance(answers[1], EnvFailure) and answers[1].kind == "hung" and "2 s" in answers[1].reason
        assert answers[2] == EnvFailure("raised", "ValueError: the env broke")
        assert isinstance(answers[3], EnvFailure) and answers[3].kind == "died" and "code 3" in answers[3].reason
        assert 2.0 <= waited < 30, "the hang costs the step timeout, not forever"
        assert pool.failures == {"hung": 1, "raised": 1, "died": 1}
        again = pool.call_all({i: ("reset", 9) for i in range(4)})
        assert [again[i] for i in range(4)] == ["seed 9 reset 2", "seed 9 reset 1", "seed 9 reset 1", "seed 9 reset 1"]
