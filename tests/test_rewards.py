"""Reward functions by domain: answer extraction, math-verify equivalence, code in the sandbox, choice,
format and instruction rules, user-defined rewards, and what a failing reward costs (its sample only)."""
from __future__ import annotations

import json
import signal
import sys
import types

import numpy as np
import pytest

from hpcrl.data import CharTokenizer
from hpcrl.ragged import Ragged
from hpcrl.rewards import REWARDS, Response, RewardSpec, Scored, reward_function, score_batch
from hpcrl.rewards.answers import extract_answer
from hpcrl.rewards.code import code_reward, extract_program
from hpcrl.rewards.math import math_reward
from hpcrl.rewards.text_rules import choice_reward, format_reward, ifeval_reward


def said(text: str, stopped: bool = True) -> Response:
    return Response(text, stopped)


@pytest.mark.parametrize("text, found", [
    (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{a} then \boxed{b^{2}}", "b^{2}"),
    ("she has 3 then 1,250 coins", "1250"),
    ("#### 42\n", "42"),
    ("no number here", None),
    (r"so $x = \frac{3}{2}$ for 2 of them", r"so $x = \frac{3}{2}$ for 2 of them"),   # for math-verify
    (r"it costs \$5 for 2", "2"),   # an escaped dollar opens no LaTeX
])
def test_the_final_answer_is_the_last_boxed_then_hashes_then_latex_whole_then_last_number(text, found):
    assert extract_answer(text) == found


@pytest.mark.parametrize("response, reference, code", [
    (r"The answer is $\frac{3}{2}$.", "2", "wrong"),
    (r"The answer is $\sqrt{2}$.", "2", "wrong"),
    (r"So the answer is \(2^{10}\).", "10", "wrong"),
    (r"The answer is $\frac{1}{2}$.", "1/2", "ok"),
    (r"We have $x+1=3$, so \[x = 2\]", "2", "ok"),
])
def test_a_latex_answer_outside_a_box_is_read_whole_not_by_its_last_digit(response, reference, code):
    assert math_reward(said(response), reference) == Scored(float(code == "ok"), code)


def test_integers_past_a_floats_precision_are_compared_exactly():
    assert math_reward(said(r"\boxed{12345678901234567891}"), "12345678901234567890") == Scored(0.0, "wrong")
    assert math_reward(said(r"\boxed{12345678901234567890}"), "12345678901234567890.0") == Scored(1.0, "ok")


@pytest.mark.parametrize("response, reference", [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{6}{4}}", "3/2"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{3\text{ cm}}", "3"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{50\%}", "0.5"),
    ("The answer is 7.", "7"),
])
def test_math_answers_equal_up_to_form_are_correct(response, reference):
    assert math_reward(said(response), reference) == Scored(1.0, "ok")


@pytest.mark.parametrize("response, reference, code", [
    (r"\boxed{\frac{1}{3}}", "0.5", "wrong"),
    (r"\boxed{0.333}", r"\frac{1}{3}", "wrong"),
    (r"\boxed{-2}", "2", "wrong"),
    ("I do not know", "2", "no_answer"),
])
def test_math_answers_that_differ_are_wrong(response, reference, code):
    assert math_reward(said(response), reference) == Scored(0.0, code)


TESTS = json.dumps({"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]})


@pytest.mark.parametrize("program, reward, code", [
    ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, "ok"),
    ("def add(a, b):\n    return a + b if a > 0 else 1\n", 2 / 3, "failed"),
    ("def add(a, b)\n    return a + b", 0.0, "compile_error"),
    ("raise ValueError('no')", 0.0, "runtime_error"),
    ("import os\nos._exit(0)", 0.0, "runtime_error"),
    ("def add(a, b):\n    while True:\n        pass", 0.0, "timeout"),
    ("print('\\n' + 'x' * 64)\ndef add(a, b):\n    return 99", 0.0, "failed"),   # printing cannot pose as results
])
def test_code_runs_against_its_tests_in_the_sandbox(program, reward, code):
    assert code_reward(said(program), TESTS, wall_s=3.0, cpu_s=1) == pytest.approx(Scored(reward, code))


def test_a_python3_fence_is_read_as_the_program():
    assert extract_program("Here:\n```python3\ndef add(a, b):\n    return a + b\n```") == \
        "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("forgery", [
    "import __main__, os\n__main__.report({'passed': [True, True, True]})\nos._exit(0)",
    "import builtins\nbuiltins.exec = lambda *args, **kwargs: None",   # every test would run as nothing
    "import json\njson.dumps = lambda *args, **kwargs: '{\"passed\": [true, true, true]}'",
])
def test_a_program_cannot_reach_the_harness_to_forge_its_results(forgery):
    assert code_reward(said(forgery), TESTS, wall_s=3.0, cpu_s=1).reward == 0.0


STDIN_TESTS = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})


@pytest.mark.parametrize("program, reward, code", [
    ("a, b = map(int, input().split())\nprint(a + b)", 1.0, "ok"),
    ("def main():\n    print(sum(map(int, input().split())))\nif __name__ == '__main__':\n    main()", 1.0, "ok"),
    ("a, b = map(int, input().split())\nprint(a + b if a == 1 else a - b)", 0.5, "failed"),
    ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1 if a == 5 else 0)", 0.5, "failed"),
    ("a, b = map(int, input().split())\nprint(a + b + 0 // (a - 5))", 0.5, "failed"),   # raises in the second
    ("a, b = map(int, input().split())\nprint(a + b)\nwhile a == 5:\n    pass", 0.0, "timeout"),
    ("a, b = map(int, input().split()\nprint(a + b)", 0.0, "compile_error"),
])
def test_a_stdin_program_runs_once_per_input_and_earns_the_share_of_outputs_it_matches(program, reward, code):
    assert code_reward(said(program), STDIN_TESTS, wall_s=3.0, cpu_s=1) == pytest.approx(Scored(reward, code))


@pytest.mark.parametrize("program", [
    "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.buffer.write(b'%d\\n' % (a + b))",
    "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(0)",
    "import sys\nprint(sum(map(int, sys.stdin.readline().split())))\nexit()",
    "a, b = map(int, open(0).read().split())\nprint(a + b)",   # competitive programming's file descriptor 0
])
def test_a_stdin_program_may_read_and_write_text_or_bytes_and_exit_cleanly(program):
    assert code_reward(said(program), STDIN_TESTS, wall_s=3.0, cpu_s=1) == Scored(1.0, "ok")


def test_stdin_tests_given_as_lists_of_lines_are_joined_as_verl_joins_them():
    tests = json.dumps({"inputs": [["1", "2"], ["3", "4"]], "outputs": [["3"], ["7"]]})
    assert code_reward(said("print(int(input()) + int(input()))"), tests, wall_s=3.0, cpu_s=1) == Scored(1.0, "ok")


@pytest.mark.parametrize("printed, expected, matches", [
    ("print('3 4   ')\nprint()\nprint()", "3 4\n", True),   # trailing spaces and blank lines
    ("print('3 4')", "3 4  \n\n", True),
    ("print(1 / 3, 2.0)", "0.333333 2\n", True),   # numbers within numpy.allclose's tolerance
    ("print(0.3334, 2)", "0.333333 2\n", False),
    ("print(12345678901234567891)", "12345678901234567890\n", False),   # integers exactly
    ("print(3)\nprint(4)", "3 4\n", False),   # lines stay lines
    ("print('three')", "3\n", False),
])
def test_stdout_matches_up_to_trailing_whitespace_and_float_rounding(printed, expected, matches):
    reference = json.dumps({"inputs": [""], "outputs": [expected]})
    assert code_reward(said(printed), reference, wall_s=3.0, cpu_s=1).reward == float(matches)


@pytest.mark.parametrize("forgery", [
    "import os\nos.write(1, ('\\n' + '0' * 32 + '11\\n').encode())",   # marker-like text on the real stdout
    "import __main__\n__main__.main('0' * 32, 'stdin', [])",
    "import builtins\nbuiltins.all = lambda *args: True\nbuiltins.len = lambda *args: 0\nprint(0)",   # what compares
    "import io\nio.BytesIO = type('Printed', (io.BytesIO,), {'getvalue': lambda self: b'3'})",
])
def test_a_stdin_program_cannot_reach_the_harness_to_forge_its_results(forgery):
    assert code_reward(said(forgery), STDIN_TESTS, wall_s=3.0, cpu_s=1).reward == 0.0


CALL_TESTS = json.dumps({"fn_name": "pair", "inputs": [[1, 2], [3, 4]], "outputs": [[1, 2], [[3, 4]]]})


@pytest.mark.parametrize("program, reward, code", [
    ("def pair(a, b):\n    return [a, b]", 1.0, "ok"),
    ("def pair(a, b):\n    return (a, b)", 1.0, "ok"),   # a tuple is a list, and APPS wraps outputs in one
    ("class Solution:\n    def pair(self, a, b):\n        return [a, b]", 1.0, "ok"),
    ("class Solution:\n    def pair(self, a, b):\n        return [a, b] if a == 1 else [b, a]", 0.5, "failed"),
    ("def other(a, b):\n    return [a, b]", 0.0, "failed"),
    ("def pair(a, b):\n    return [a, b]\nraise ValueError('no')", 0.0, "runtime_error"),
    ("class Solution:\n    def pair(self, a, b)\n        return [a, b]", 0.0, "compile_error"),
])
def test_call_based_tests_call_the_function_or_the_solution_method(program, reward, code):
    assert code_reward(said(program), CALL_TESTS, wall_s=3.0, cpu_s=1) == pytest.approx(Scored(reward, code))


@pytest.mark.parametrize("text, reference", [
    ("The answer is definitely B.", "B"),
    ("The answer is clearly (A)", "A"),
    ("Answer: each option fails except D", "D"),
    ("So the answer is (C).", "C"),
    ("ANSWER: J", "J"),
])
def test_a_choice_is_a_capital_letter_standing_alone(text, reference):
    assert choice_reward(said(text), reference) == Scored(1.0, "ok")


def test_choice_format_and_instruction_rules():
    assert choice_reward(said("Thinking... the answer is (C)."), "C") == Scored(1.0, "ok")
    assert choice_reward(said("B"), "C") == Scored(0.0, "wrong")
    assert format_reward(said("<think>add them</think> 7"), "") == Scored(1.0, "ok")
    assert format_reward(said("7"), "").code == "wrong_format"
    assert format_reward(said("<think>add them</think> 7", stopped=False), "").code == "truncated"
    rules = json.dumps([{"rule": "max_words", "n": 3}, {"rule": "lowercase"}, {"rule": "contains", "word": "yes"}])
    assert ifeval_reward(said("yes indeed"), rules) == Scored(1.0, "ok")
    assert ifeval_reward(said("Yes it is so"), rules) == pytest.approx(Scored(1 / 3, "broke_rules"))


def test_a_user_reward_by_dotted_path_and_what_its_failures_cost(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.length = lambda response, reference, target=3: float(len(response.text) == target)
    module.broken = lambda response, reference: 1 / 0
    module.slow = lambda response, reference: __import__("time").sleep(5)
    module.nan = lambda response, reference: float("nan")
    # one that takes SIGALRM for itself: the time limits after it still hold
    module.rude = lambda response, reference: float(signal.signal(signal.SIGALRM, signal.SIG_IGN) is not None)
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    tokenizer = CharTokenizer()
    responses = Ragged.from_rows([tokenizer.encode("123", add_bos=False) + [tokenizer.eos_token_id]] * 5, np.int32)
    specs = {"ok": RewardSpec(reward_function("my_rewards:length"), {"target": 3}),
             "broken": RewardSpec(reward_function("my_rewards:broken")),
             "rude": RewardSpec(reward_function("my_rewards:rude")),
             "slow": RewardSpec(reward_function("my_rewards:slow"), timeout_s=0.2),
             "nan": RewardSpec(reward_function("my_rewards:nan"))}
    rewards, codes = score_batch(tokenizer, responses, [""] * 5, list(specs), specs)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert codes == ["ok", "reward_error", "ok", "reward_timeout", "reward_error"]
    with pytest.raises(ValueError, match="unknown reward 'maths': use one of number, math, code"):
        reward_function("maths")
    with pytest.raises(ValueError, match="cannot import it"):
        reward_function("no_such_module:f")
    assert set(REWARDS) == {"number", "math", "code", "choice", "format", "ifeval", "judge"}


def test_a_judge_model_reads_the_response_and_scores_it():
    """The shipped starting policy (it adds and subtracts bare numbers) as the judge: its score is the
    value of the expression it is shown, so it must have read the response."""
    from conftest import REPO

    from hpcrl.data.tokenizer import HFTokenizer

    model = str(REPO / "data" / "rlvr" / "format-model")
    template = "<|system|>Answer with the number in \\boxed{{}}.\n<|user|>{response} = ?\n<|assistant|>"
    spec = RewardSpec(reward_function("judge"), {"model": model, "template": template, "scale": 10,
                                                 "max_new_tokens": 8})
    tokenizer = HFTokenizer(model)
    responses = Ragged.from_rows([tokenizer.encode(text, add_bos=False) + [tokenizer.eos_token_id]
                                  for text in ("3 + 4", "2 + 2", "9 - 1")], np.int32)
    rewards, codes = score_batch(tokenizer, responses, ["", "", ""], ["judged"] * 3, {"judged": spec})
    assert rewards.tolist() == pytest.approx([0.7, 0.4, 0.8]) and codes == ["ok"] * 3


def test_a_deterministic_reward_scores_each_distinct_input_once_and_a_plain_one_every_sample():
    """A group's repeated response is scored once by a pure reward (the built-in rule ones are), and
    every copy gets its score; the same prompt, response and reference with another prompt, another
    reference, or an ungiven stop are other inputs. A reward not marked deterministic sees every sample."""
    tokenizer = CharTokenizer()
    seen = []

    def counting(response, reference):
        seen.append((response.prompt, response.text, response.stopped, reference))
        return float(response.text == reference)

    texts = [("7", True), ("7", True), ("12", True), ("7", True), ("7", False), ("7", True), ("7", True)]
    responses = Ragged.from_rows([tokenizer.encode(t, add_bos=False) + ([tokenizer.eos_token_id] if stop else [])
                                  for t, stop in texts], np.int32)
    prompts = Ragged.from_rows([tokenizer.encode(p) for p in ["3+4="] * 5 + ["2+5=", "3+4="]], np.int32)
    references = ["7", "7", "7", "7", "7", "7", "8"]
    assert all(REWARDS[name].deterministic for name in ("number", "math", "choice", "format", "ifeval"))
    assert not getattr(REWARDS["code"], "deterministic", False)
    three_plus_four, two_plus_five = (tokenizer.decode(tokenizer.encode(p)) for p in ("3+4=", "2+5="))
    first_of_each = [(three_plus_four, "7", True, "7"), (three_plus_four, "12", True, "7"),
                     (three_plus_four, "7", False, "7"), (two_plus_five, "7", True, "7"),
                     (three_plus_four, "7", True, "8")]
    for pure, calls in ((True, first_of_each), (False, None)):
        counting.deterministic = pure
        seen.clear()
        rewards, codes = score_batch(tokenizer, responses, references, ["d"] * 7, {"d": RewardSpec(counting)}, prompts)
        assert rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0] and codes == ["ok"] * 7
        assert seen == calls if pure else len(seen) == 7


def test_a_batched_reward_that_fails_costs_its_domains_samples_only(monkeypatch):
    module = types.ModuleType("batch_rewards")

    def broken(responses, references):
        raise RuntimeError("judge is down")

    def short(responses, references):   # a judge that lost a score: none of its domain's is trusted
        return [1.0] * (len(responses) - 1)

    broken.batched = short.batched = True
    module.broken, module.short = broken, short
    monkeypatch.setitem(sys.modules, "batch_rewards", module)
    tokenizer = CharTokenizer()
    responses = Ragged.from_rows([tokenizer.encode("7", add_bos=False)] * 3, np.int32)
    for judge in ("broken", "short"):
        specs = {"judged": RewardSpec(reward_function(f"batch_rewards:{judge}")),
                 "plain": RewardSpec(reward_function("number"))}
        rewards, codes = score_batch(tokenizer, responses, ["7", "7", "7"], ["judged", "plain", "judged"], specs)
        assert codes == ["reward_error", "wrong", "reward_error"] and rewards[0] == rewards[2] == 0.0


def test_the_repeat_task_cut_at_its_answers_length_scores_nothing_for_its_digits():
    """task.stop_at_answer_length cuts a response one token past its answer: without a stop it scores 0
    (partial credit for its digits would pay a policy that never writes <eos>); stopped ones score as before."""
    from conftest import REPO
    from hpcrl.config import load_job
    from hpcrl.rewards.scoring import reward_specs

    job = load_job(REPO / "jobs" / "tiny_longtail.yaml", ["task.stop_at_answer_length=true"])
    spec = reward_specs(job)["repeat"]
    score = lambda text, stopped: spec.function(Response(text, stopped), "777", **spec.args)
    assert score("7777", False) == Scored(0.0, "cut")
    assert score("777", True) == Scored(1.0, "ok")
    assert score("778", True).reward == pytest.approx(0.5 * 3 / 4)
    plain = reward_specs(load_job(REPO / "jobs" / "tiny_longtail.yaml", ["task.stop_at_answer_length=false"]))["repeat"]
    assert plain.function(Response("7777", False), "777", **plain.args).reward == pytest.approx(0.5 * 3 / 4)
