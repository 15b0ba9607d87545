"""Code reward: the response's program runs against the task's tests in the sandbox; reward = share passed.

The reference is JSON: {"tests": ["assert f(1) == 2", ...], "setup": "optional code run first"}. One
sandbox run per response: a harness compiles the program (a syntax error is "compile_error"), runs
it ("runtime_error" if it raises), then each test in the program's namespace, and reports the
results after a marker it reads from stdin, so that what the program prints cannot pose as results
(a program that inspects its caller's frames could still find the marker: the sandbox contains
what it does, not what it claims).
"""
from __future__ import annotations

import json
import re
import secrets

from hpcrl.rewards.base import Response, Scored
from hpcrl.rewards.sandbox import Limits, run_python

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_HARNESS = """\
import json, sys
marker = sys.stdin.readline().strip()
tests = json.loads(sys.stdin.read())
def report(outcome):
    sys.stdout.write("\\n" + marker + json.dumps(outcome) + "\\n")
    sys.stdout.flush()
try:
    program = compile(open("solution.py").read(), "solution.py", "exec")
except (SyntaxError, ValueError) as error:
    report({"compile_error": repr(error)})
    raise SystemExit(0)
namespace = {"__name__": "solution"}
try:
    exec(program, namespace)
except BaseException as error:
    report({"runtime_error": repr(error)})
    raise SystemExit(0)
passed = []
for test in tests:
    try:
        exec(test, namespace)
        passed.append(True)
    except BaseException:
        passed.append(False)
report({"passed": passed})
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
    result = json.loads(reports[-1])
    if "compile_error" in result:
        return Scored(0.0, "compile_error")
    if "runtime_error" in result:
        return Scored(0.0, "runtime_error")
    passed = result["passed"]
    share = sum(passed) / max(1, len(passed))
    return Scored(share, "ok" if share == 1.0 else "failed")
