"""Code reward: the response's program runs against the task's tests in the sandbox; reward = share passed.

The reference is JSON: {"tests": ["assert f(1) == 2", ...], "setup": "optional code run first"}. One
sandbox run per response: a harness compiles the program (a syntax error is "compile_error"), runs
it ("runtime_error" if it raises), then each test in the program's namespace, and reports the
results after a marker it reads from stdin, so that what the program prints cannot pose as results.
The harness keeps the marker and the results in a function's locals, took what it calls after the
program (exec, os.write) before it ran, and reports a plain digit per test (no json module to
patch): the program can neither call its report (`import __main__`) nor replace what reports. It
still runs in the harness's process, though: a program that walks the interpreter's frames
(sys._getframe, a trace function) can find the marker, and one that returns objects equal to
everything passes `==` tests; the sandbox contains what a program does, not what it claims.
"""
from __future__ import annotations

import json
import re
import secrets

from hpcrl.rewards.base import Response, Scored
from hpcrl.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```(?:python3?|py)?\s*\n(.*?)```", re.DOTALL)
_HARNESS = """\
import json, os, sys


def main(marker, tests, run=exec, write=os.write):
    def report(outcome):
        write(1, ("\\n" + marker + outcome + "\\n").encode())

    try:
        program = compile(open("solution.py").read(), "solution.py", "exec")
    except (SyntaxError, ValueError):
        return report("compile_error")
    namespace = {"__name__": "solution"}
    try:
        run(program, namespace)
    except BaseException:
        return report("runtime_error")
    passed = []
    for test in tests:
        try:
            run(test, namespace)
            passed.append("1")
        except BaseException:
            passed.append("0")
    report("".join(passed))


main(sys.stdin.readline().strip(), json.loads(sys.stdin.read()))
"""


def extract_program(text: str) -> str:
    """The last fenced code block of the response, or the whole response when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def code_reward(response: Response, reference: str, wall_s: float = 10.0, cpu_s: int = 5,
                memory_mb: int = 1024) -> Scored:
    """The share of `reference`'s tests the program passes; outcome codes: ok (all passed), failed
    (some failed), compile_error, runtime_error, timeout, memory, output (past the output limit)."""
    task = json.loads(reference)
    tests = task["tests"] if isinstance(task, dict) else task
    program = (task.get("setup", "") + "\n" if isinstance(task, dict) else "") + extract_program(response.text)
    marker = secrets.token_hex(16)
    outcome = run_python(_HARNESS, stdin=marker + "\n" + json.dumps(tests),
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
