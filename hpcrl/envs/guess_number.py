"""Guess the number, with higher/lower feedback: the shortest agentic task that needs memory of
earlier turns (binary search finds any of 0-15 in at most 5 guesses, 3.4 on average)."""
from __future__ import annotations

import math

from hpcrl.envs.base import StepResult, TextEnv


class GuessNumber(TextEnv):
    action_format = "a whole number"
    alphabet = "".join(sorted(set("0123456789- higher lower correct not a number guess")))
    observation_is_state = False   # "higher" after 7 and after 3 are other states: the history is

    def __init__(self, low: int = 0, high: int = 15, invalid_reward: float = 0.0, guess_cost: float = 0.0,
                 information_reward: float = 0.0):
        """`guess_cost` > 0 takes that much for every wrong guess: the game is to find the number in
        as few guesses as possible, and with a success worth 1 whenever it comes, a policy that
        finds it in seven guesses scores as one that finds it in three.

        `information_reward` pays that much per bit a guess takes off the numbers the feedback so
        far allows (log2 of how many were left over how many are left): potential-based shaping
        (Ng et al. 1999, the potential being minus the bits still unknown), so it changes no
        optimal policy of undiscounted returns, but each turn is paid for what it alone found out.
        A guess the feedback had already ruled out earns nothing, the middle of the interval earns
        most in expectation, and every success earns the same total, log2(high - low + 1) bits."""
        if high < low:
            raise ValueError(f"guess_number: high {high} is below low {low}")
        self.low, self.high = low, high
        self.invalid_reward = invalid_reward
        self.guess_cost = guess_cost
        self.information_reward = information_reward
        self.system_prompt = f"guess {low}-{high}"
        self.secret = low
        self.allowed = (low, high)   # the numbers the feedback so far leaves possible

    def reset(self, seed: int) -> str:
        """Seeds take the numbers in turn (env.seeds = 16 covers 0-15 once each)."""
        self.secret = self.low + seed % (self.high - self.low + 1)
        self.allowed = (self.low, self.high)
        return "guess"

    def step(self, action: str) -> StepResult:
        try:
            guess = int(action.strip())
        except ValueError:
            return self.invalid(action, "not a number")
        shaping = self.information_reward * self._narrow(guess)
        if guess == self.secret:
            return StepResult("correct", 1.0 + shaping, True, {"success": True})
        return StepResult("higher" if guess < self.secret else "lower", shaping - self.guess_cost, False, {})

    def _narrow(self, guess: int) -> float:
        """Narrow `allowed` by the feedback `guess` gets; returns the bits it found out."""
        low, high = self.allowed
        if guess == self.secret:
            self.allowed = (guess, guess)
        elif guess < self.secret:
            self.allowed = (max(low, guess + 1), high)
        else:
            self.allowed = (low, min(high, guess - 1))
        return math.log2((high - low + 1) / (self.allowed[1] - self.allowed[0] + 1))
