"""A tool env for tool-integrated reasoning: the policy answers an arithmetic question and may first
call a calculator or run Python in the sandbox, seeing each tool's output as the next observation.

Actions: `calc: <expression>`, `python: <program>` (what it prints comes back), `answer: <value>`
(ends the episode; reward 1 when it equals the question's result).
"""
from __future__ import annotations

import ast
import operator

import numpy as np

from hpcrl.envs.base import StepResult, TextEnv
from hpcrl.rewards.sandbox import Limits, bwrap_path, run_python

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}
MAX_EXPONENT = 64
TOOLS = ("calc", "python")


def calculate(expression: str) -> str:
    """An arithmetic expression's value (numbers, + - * / // % ** and parentheses; nothing else is
    evaluated, so model text never reaches eval), or the error."""
    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent above {MAX_EXPONENT}")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError("only numbers and + - * / // % ** ( ) are allowed")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


class ToolEnv(TextEnv):
    action_format = "calc: <expression> | python: <program> | answer: <value>"

    def __init__(self, digits: int = 3, terms: int = 3, tools: tuple[str, ...] = TOOLS, python_wall_s: float = 5.0):
        unknown = set(tools) - set(TOOLS)
        if unknown:
            raise ValueError(f"tool env: unknown tools {sorted(unknown)}; choose from {list(TOOLS)}")
        if "python" in tools:
            bwrap_path()   # refuses at once, with the fix, where model-written code could not be sandboxed
        self.digits, self.terms, self.tools = digits, terms, tuple(tools)
        self.limits = Limits(wall_s=python_wall_s, cpu_s=max(1, int(python_wall_s)))
        self.system_prompt = f"compute the value; tools: {', '.join(self.tools)}; then answer: <value>"
        self.question, self.result = "", ""

    def reset(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        numbers = [str(int(n)) for n in rng.integers(10 ** (self.digits - 1), 10 ** self.digits, self.terms)]
        signs = [str(s) for s in rng.choice(["+", "-", "*"], self.terms - 1)]
        self.question = numbers[0] + "".join(f"{s}{n}" for s, n in zip(signs, numbers[1:]))
        self.result = calculate(self.question)
        return self.question

    def step(self, action: str) -> StepResult:
        tool, _, argument = action.partition(":")
        tool = tool.strip().lower()
        if tool == "answer":
            correct = calculate(argument) == self.result
            return StepResult("correct" if correct else "wrong", float(correct), True, {"success": correct})
        if tool not in self.tools:
            return self.invalid(action, f"unknown action; use {self.action_format}")
        if tool == "calc":
            return StepResult(calculate(argument), 0.0, False, {"tool": "calc"})
        outcome = run_python(argument.lstrip(), limits=self.limits)   # "python: print(1)": the space is not code
        shown = outcome.stdout if outcome.status == "ok" else f"{outcome.status}: {outcome.stderr[-300:]}"
        return StepResult(shown[-500:], 0.0, False, {"tool": "python", "status": outcome.status})
