"""Reward shaping that depends on the response, not on its correctness."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), [N] -> [N] (<= 0).

    A response within ``max_length - buffer`` tokens costs nothing; inside the last ``buffer``
    tokens the cost grows linearly to ``penalty`` at ``max_length``: a response that runs long is
    told so gradually, instead of being cut off with the same reward as a wrong answer.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_length - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer
