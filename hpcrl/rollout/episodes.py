"""An env round on a rollout rank: the scheduler's rows (a group's env seed and a sample seed each)
in, one finished trajectory per row out, as the columns the controller stores in its groups.

A group's rows share its first observation, which becomes the group's prompt; the rest of a
trajectory (actions and observations) is its response, with a loss mask that is 0 on observation
tokens. With `redundancy`, each group starts that many extra trajectories and keeps the first to
finish. A trajectory whose env failed (hung, raised, died) keeps its row with reward 0, a mask of
zeros (it trains nothing) and the code `failed:<kind>`; the others get `success` or `failure`.
Each turn's reward also sits on the last token of its action (`token_rewards`), for the step-level
advantages and discounted returns.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from hpcrl.ragged import Batch, Ragged
from hpcrl.rollout.multi_turn import MultiTurnRollout, Request, Trajectory


def play(rollout: MultiTurnRollout, env_seeds: np.ndarray, groups: np.ndarray, sample_seeds: np.ndarray,
         redundancy: int = 0) -> Batch:
    """Trajectories for the rows (`groups[i]`'s episode `env_seeds[i]`, drawn with `sample_seeds[i]`)."""
    rows_of: dict[int, list[int]] = defaultdict(list)
    for row, group in enumerate(groups.tolist()):
        rows_of[group].append(row)
    requests = []
    for group, rows in rows_of.items():
        requests += [Request(group, int(env_seeds[row]), int(sample_seeds[row])) for row in rows]
        requests += [Request(group, int(env_seeds[rows[0]]), int(sample_seeds[rows[0]]) * 7919 + extra + 1)
                     for extra in range(redundancy)]
    keep = len(groups) // max(len(rows_of), 1) if redundancy else None
    if redundancy and any(len(rows) != keep for rows in rows_of.values()):
        keep = None   # groups cut by the DP split hold different numbers of rows here: keep every trajectory
    played = rollout.run(requests, keep)
    chosen: dict[int, list[Trajectory]] = defaultdict(list)
    for t in sorted((t for t in played if not t.aborted), key=lambda t: t.failure is not None):
        chosen[t.request.group].append(t)
    columns: dict[str, list] = defaultdict(list)
    recorder = rollout.sampler.recorder   # router replay: each trajectory's routing travels with it
    for group, rows in rows_of.items():
        kept = chosen[group][:len(rows)]
        prompt = next((t.prompt_ids for t in kept if len(t.prompt_ids)), rollout.turns.placeholder())
        for t in kept:
            ids, mask, logprobs, token_rewards = t.tokens()
            if t.failure is not None:
                mask, token_rewards = np.zeros_like(mask), np.zeros_like(token_rewards)
            columns["prompt_ids"].append(prompt)
            columns["response_ids"].append(ids)
            columns["loss_mask"].append(mask)
            columns["behaviour_logprobs"].append(logprobs)
            columns["token_rewards"].append(token_rewards)
            columns["rewards"].append(0.0 if t.failure is not None else t.reward)
            columns["codes"].append(f"failed:{t.failure.split(':')[0]}" if t.failure is not None
                                    else "success" if t.success else "failure")
            columns["turns"].append(len(t.turn_tokens))
            columns["env_s"].append(sum(t.env_seconds))
            if recorder is not None:
                columns["routed_experts"].append(np.zeros(0, recorder.dtype) if t.routing is None
                                                 else t.routing.reshape(-1))
    order = np.argsort(np.concatenate([np.zeros(0, np.int64), *rows_of.values()]), kind="stable")
    out: Batch = {name: Ragged.from_arrays([columns[name][i] for i in order], dtype)
                  for name, dtype in (("prompt_ids", np.int32), ("response_ids", np.int32), ("loss_mask", bool),
                                      ("behaviour_logprobs", np.float32), ("token_rewards", np.float32))}
    if recorder is not None:
        out["routed_experts"] = Ragged.from_arrays([columns["routed_experts"][i] for i in order], recorder.dtype)
    out["rewards"] = np.array(columns["rewards"], np.float64)[order]
    out["codes"] = [columns["codes"][i] for i in order]
    for name, dtype in (("turns", np.int32), ("env_s", np.float64)):
        out[name] = np.array(columns[name], dtype)[order]
    return out
