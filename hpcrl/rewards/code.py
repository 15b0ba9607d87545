"""Code reward: the response's program runs against the task's tests in the sandbox; reward = share passed.

The reference is JSON in one of three forms, each may add {"setup": "code run first"}:
- asserts, {"tests": ["assert f(1) == 2", ...]}: the program runs once, then each assert in its namespace;
- standard input and output, as APPS, CodeContests, TACO and LiveCodeBench give them, {"inputs":
  ["1 2\\n", ...], "outputs": ["3\\n", ...]} (an input or output given as a list of lines is
  joined): the program runs once per test as __main__, sys.stdin and sys.stdout text over bytes (so
  .buffer works too) and file descriptor 0 on the input (open(0)), SystemExit with code 0 or None a
  normal end;
  the output matches as verl's prime_code (APPS's checker) compares, simplified: lines equal once
  trailing whitespace and trailing blank lines go, else token by token, where tokens that are not
  both integers may be numbers within numpy.allclose's tolerance (relative 1e-5, absolute 1e-8);
- calls, LeetCode style, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}: the program runs
  once, then each test calls the function (or that method of a new `Solution()`) with the input as
  arguments; its value, tuples read as lists, equals the output or, as verl reads APPS and TACO's
  wrapped outputs, the output's only element.
One sandbox run per response, its limits for all the tests together: a harness compiles the program
(a syntax error is "compile_error"), runs it where it runs once ("runtime_error" if it raises; a
stdin test that raises just fails), then the tests, and reports the results after a marker it reads
from stdin, so that what the program prints cannot pose as results. The harness keeps the marker
and the results in a function's locals, took what it calls after the program (exec, os.write, the
stream classes, the builtins it compares with) before it ran, and reports a plain digit per test (no
json module to patch): the program can neither call its report (`import __main__`) nor replace what
reports or compares. It still runs in the harness's process, though: a program that walks the
interpreter's frames (sys._getframe, a trace function) can find the marker, and one that returns
objects equal to everything passes `==` tests; the sandbox contains what a program does, not what
it claims.
"""
from __future__ import annotations

import json
import re
import secrets

from hpcrl.rewards.base import Response, Scored
from hpcrl.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```(?:python3?|py)?\s*\n(.*?)```", re.DOTALL)
_HARNESS = """\
import io, json, os, sys


def main(marker, form, tests, function=None, *, exec=exec, write=os.write, sys=sys, BytesIO=io.BytesIO,
         TextIOWrapper=io.TextIOWrapper, getattr=getattr, isinstance=isinstance, list=list, tuple=tuple,
         float=float, abs=abs, len=len, zip=zip, all=all, os_open=os.open, dup2=os.dup2, lseek=os.lseek,
         close=os.close, new_file=os.O_RDWR | os.O_CREAT | os.O_TRUNC):
    # the defaults are what runs after the program: taken now, before it can replace them
    def report(outcome):
        write(1, ("\\n" + marker + outcome + "\\n").encode())

    def asserted(program, namespace, test):
        exec(test, namespace)
        return True

    def called(program, namespace, test):
        given, expected = test
        solution = namespace.get("Solution")
        target = getattr(solution(), function) if solution is not None else namespace[function]
        got = plain(target(*given))
        return got == expected or [got] == expected

    def plain(value):
        return [plain(item) for item in value] if isinstance(value, (list, tuple)) else value

    def piped(program, namespace, test):
        given, expected = test
        printed = BytesIO()
        held = os_open("/tmp/.stdin", new_file, 0o600)   # file descriptor 0 too: open(0).read() reads the input
        write(held, given.encode())
        lseek(held, 0, 0)
        if held != 0:   # 0 itself when the last test's open(0) closed it
            dup2(held, 0)
            close(held)
        sys.stdin = TextIOWrapper(BytesIO(given.encode()), encoding="utf-8")
        sys.stdout = stdout = TextIOWrapper(printed, encoding="utf-8")
        try:
            exec(program, {"__name__": "__main__"})
        except SystemExit as end:
            if end.code not in (None, 0):
                return False
        stdout.flush()
        return same_output(printed.getvalue().decode("utf-8", "replace"), expected)

    def same_output(got, expected):
        # the rule in the module's docstring (verl's prime_code, simplified)
        got, expected = lines(got), lines(expected)
        return got == expected or (len(got) == len(expected) and all(
            same_tokens(mine.split(), theirs.split()) for mine, theirs in zip(got, expected)))

    def lines(text):
        found = [line.rstrip() for line in text.split("\\n")]
        while found and not found[-1]:
            found.pop()
        return found

    def same_tokens(got, expected):
        return len(got) == len(expected) and all(
            mine == theirs or near(mine, theirs) for mine, theirs in zip(got, expected))

    def near(got, expected):
        # a token that is not a number raises here: the test fails, as unequal tokens should
        if got.lstrip("+-").isdigit() and expected.lstrip("+-").isdigit():
            return False
        return abs(float(got) - float(expected)) <= 1e-8 + 1e-5 * abs(float(expected))

    try:
        program = compile(open("solution.py").read(), "solution.py", "exec")
    except (SyntaxError, ValueError):
        return report("compile_error")
    namespace = {"__name__": "solution"}
    if form != "stdin":
        try:
            exec(program, namespace)
        except BaseException:
            return report("runtime_error")
    check = {"assert": asserted, "call": called, "stdin": piped}[form]
    passed = []
    for test in tests:
        try:
            passed.append("1" if check(program, namespace, test) else "0")
        except BaseException:
            passed.append("0")
    report("".join(passed))


main(sys.stdin.readline().strip(), **json.loads(sys.stdin.read()))
"""


def extract_program(text: str) -> str:
    """The last fenced code block of the response, or the whole response when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _harness_task(task: dict | list) -> dict:
    """What the harness runs, from a reference in any of its forms: the form, the tests (an assert or
    an input and its expected output each) and the function a call-based test calls."""
    if isinstance(task, list):
        return {"form": "assert", "tests": task}
    if "tests" in task:
        return {"form": "assert", "tests": task["tests"]}
    tests = [[given, expected] for given, expected in zip(task["inputs"], task["outputs"], strict=True)]
    if task.get("fn_name"):   # datasets leave it empty or null for stdin tests
        return {"form": "call", "tests": tests, "function": task["fn_name"]}
    return {"form": "stdin", "tests": [[_lines(given), _lines(expected)] for given, expected in tests]}


def _lines(text: str | list) -> str:
    """A stdin test's input or output: APPS and TACO give some as lists of lines (joined, as verl's
    prime_code joins them)."""
    return "\n".join(map(str, text)) if isinstance(text, list) else text


def code_reward(response: Response, reference: str, wall_s: float = 10.0, cpu_s: int = 5,
                memory_mb: int = 1024) -> Scored:
    """The share of `reference`'s tests the program passes; outcome codes: ok (all passed), failed
    (some failed), compile_error, runtime_error, timeout, memory, output (past the output limit)."""
    task = json.loads(reference)
    program = (task.get("setup", "") + "\n" if isinstance(task, dict) else "") + extract_program(response.text)
    marker = secrets.token_hex(16)
    outcome = run_python(_HARNESS, stdin=marker + "\n" + json.dumps(_harness_task(task)),
                         limits=Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb),
                         files={"solution.py": program})
    if outcome.status in ("timeout", "memory", "output"):
        return Scored(0.0, outcome.status)
    reports = [line[len(marker):] for line in outcome.stdout.splitlines() if line.startswith(marker)]
    if not reports:   # the harness never reported: the program ended the process
        return Scored(0.0, "runtime_error")
    result = reports[-1]
    if result in ("compile_error", "runtime_error"):
        return Scored(0.0, result)
    share = result.count("1") / max(1, len(result))   # a digit per test: 1 passed, 0 failed
    return Scored(share, "ok" if share == 1.0 else "failed")
