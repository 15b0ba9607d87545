"""The turns of env trajectories, found from their tokens: for step-level advantages (GiGPO).

A turn is a run of generated tokens (loss mask 1); the state it acted from is what the policy last
read from the env: the group's prompt (instructions and first observation) for the first turn, the
observation tokens before it for the others. Two turns of a group acted from the same state when
those tokens are equal, which needs no env-specific state and holds for any env whose observation
is its state (a grid game). For an env whose observation leaves out what came before
(TextEnv.observation_is_state false: guess-number's "higher"), a turn's state is its whole history,
the prompt and every token before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hpcrl.ragged import Ragged


@dataclass(frozen=True)
class Turns:
    token_turn: Tensor   # [N, T] long: the turn each response token belongs to, -1 outside any turn
    mask: Tensor         # [N, K] float: the sample has a turn k
    states: Tensor       # [N, K] long: the state a turn acted from, an id equal only within a group

    @classmethod
    def of(cls, prompt_ids: Ragged, response_ids: Ragged, loss_mask: Ragged, group_index: Tensor,
           history: bool = False) -> Turns:
        """`history`: a turn's state is everything before it, not the observation just before it."""
        count, width = len(response_ids), int(response_ids.lengths.max(initial=0))
        token_turn = np.full((count, width), -1, np.int64)
        state_of: dict[tuple[int, bytes], int] = {}
        per_sample: list[list[int]] = []
        for row in range(count):
            generated = np.asarray(loss_mask[row]) > 0
            edges = np.diff(np.concatenate([[0], generated.astype(np.int8), [0]]))
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            ids = np.asarray(response_ids[row])
            states = []
            for turn, (start, end) in enumerate(zip(starts, ends)):
                token_turn[row, start:end] = turn
                seen = (np.asarray(prompt_ids[row]) if turn == 0 else ids[:start] if history
                        else ids[ends[turn - 1]:start])
                key = (int(group_index[row]), seen.astype(np.int32).tobytes())
                states.append(state_of.setdefault(key, len(state_of)))
            per_sample.append(states)
        most = max((len(s) for s in per_sample), default=0)
        mask = np.zeros((count, most), np.float32)
        states = np.zeros((count, most), np.int64)
        for row, ids in enumerate(per_sample):
            mask[row, :len(ids)] = 1.0
            states[row, :len(ids)] = ids
        return cls(torch.from_numpy(token_turn), torch.from_numpy(mask), torch.from_numpy(states))

    def gather(self, token_values: Tensor) -> Tensor:
        """[N, T] token values -> [N, K]: each turn's sum."""
        out = torch.zeros(self.mask.shape, dtype=token_values.dtype)
        inside = self.token_turn >= 0
        rows = torch.arange(len(out)).unsqueeze(1).expand_as(self.token_turn)
        out.index_put_((rows[inside], self.token_turn[inside]), token_values[:, :self.token_turn.shape[1]][inside],
                       accumulate=True)
        return out

    def scatter(self, per_turn: Tensor, token_mask: Tensor) -> Tensor:
        """[N, K] turn values -> [N, T] on each turn's tokens (0 elsewhere), shaped like `token_mask`."""
        out = torch.zeros(token_mask.shape, dtype=per_turn.dtype)
        inside = self.token_turn >= 0
        rows = torch.arange(len(out)).unsqueeze(1).expand_as(self.token_turn)
        out[:, :self.token_turn.shape[1]][inside] = per_turn[rows[inside], self.token_turn[inside]]
        return out
