"""Multi-turn rollout with env-level asynchrony against lock-step waves, on long-tailed env step times.

FrozenLake trajectories (the job's tiny model, random weights) whose every env step also waits a
time drawn from a long-tailed distribution (Pareto, shape 1.2, median about --median-ms, capped at
--cap-s), as tool calls, web pages and game engines answer. Env-level asynchrony: a trajectory's
next turn joins the decoding batch as soon as its env answers, and its action goes out as soon as
its turn ends. Lock-step: every turn of every env waits for the slowest (each wave generates, then
every env steps). The same seeds give the same trajectories in both (checked), so only the
scheduling differs. A third row adds env.group_redundancy (ROLL Flash's redundant environment
rollout): each group of 4 starts `--redundancy` extra trajectories on extra envs and keeps the
first 4 to finish, aborting the rest; its trajectories/s count the kept ones. Printed:
trajectories/s of each, and each one's ratio to lock-step.

    .venv/bin/python bench/agentic.py [--trajectories 32] [--turns 6] [--median-ms 20] [--cap-s 1] [--repeats 2]
                                      [--redundancy 1]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.data.tokenizer import env_characters
from hpcrl.engines.hf_model import random_model
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.envs import EnvSpec
from hpcrl.envs.host import EnvPool
from hpcrl.rollout.multi_turn import MultiTurnRollout, Request, TurnFormat

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--median-ms", type=float, default=20.0)
    parser.add_argument("--cap-s", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--redundancy", type=int, default=1, help="extra trajectories per group of 4 (third row)")
    args = parser.parse_args()
    spec = EnvSpec("slow_env:slow_frozenlake", {"median_ms": args.median_ms, "cap_s": args.cap_s})
    env = spec.build()
    tokenizer = CharTokenizer(env_characters(env))
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml")
    model = random_model(job.model, tokenizer, job.seed)
    turns = TurnFormat(tokenizer)
    requests = [Request(group=i // 4, env_seed=i // 4, sample_seed=i) for i in range(args.trajectories)]
    groups = (args.trajectories + 3) // 4
    redundant = requests + [Request(group=g, env_seed=g, sample_seed=10_000 + g * args.redundancy + extra)
                            for g in range(groups) for extra in range(args.redundancy)]
    redundancy = f"async, +{args.redundancy} per group"
    rates: dict[str, list[float]] = {"env-level async": [], "lock-step": [], redundancy: []}
    outputs: dict[str, list] = {}
    with EnvPool(spec, len(redundant), step_timeout_s=60) as pool:
        pool.call_all({i: ("reset", 0) for i in range(len(redundant))})   # processes started outside the timing
        for _ in range(args.repeats):
            for name in rates:
                lockstep = name == "lock-step"
                sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id, lockstep=lockstep)
                rollout = MultiTurnRollout(sampler, pool, env, turns, SamplingParams(4), max_turns=args.turns,
                                           turn_tokens=4, max_tokens=80, lockstep=lockstep)
                started = time.perf_counter()
                if name == redundancy:
                    played = rollout.run(redundant, keep=4)
                    kept = sum(not t.aborted for t in played)
                else:
                    outputs[name] = rollout.run(requests)
                    kept = args.trajectories
                rates[name].append(kept / (time.perf_counter() - started))
    failed = sum(t.failure is not None for name in outputs for t in outputs[name])
    same = all([a.tolist() for a in x.response_ids] == [a.tolist() for a in y.response_ids]
               for x, y in zip(outputs["env-level async"], outputs["lock-step"]))
    turns_done = np.mean([len(t.turn_tokens) for t in outputs["lock-step"]])
    print(f"{args.trajectories} FrozenLake trajectories, up to {args.turns} turns ({turns_done:.1f} on average), env step "
          f"Pareto(1.2) median {args.median_ms:g} ms capped at {args.cap_s:g} s; same trajectories in both: {same}; "
          f"failed: {failed}")
    for name, values in rates.items():
        print(f"{name:<22} {np.mean(values):8.2f} trajectories/s   ({', '.join(f'{v:.2f}' for v in values)})")
    for name in (n for n in rates if n != "lock-step"):
        print(f"ratio, {name:<22} {np.mean(rates[name]) / np.mean(rates['lock-step']):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
