"""The RLVR job through `hpcrl run`: two domains mixed, a reward worker on its own rank scoring math
with math-verify and code in the sandbox, evaluation per domain, and the export of its checkpoint."""
from __future__ import annotations

import json

import pytest
from conftest import hpcrl

from hpcrl.metrics import read_metrics


@pytest.fixture(scope="module")
def mix_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mix")
    result = hpcrl("run", "jobs/tiny_rlvr_mix.yaml", "--run-dir", str(run_dir), "--set", "train.steps=2",
                   "--set", "eval.every=2", "--set", "eval.max_prompts=8", "--set", "train.prompts_per_step=16",
                   "--set", "checkpoint.every=2", "--set", "log.tensorboard=false", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def test_each_domain_is_scored_by_its_reward_on_the_reward_workers_rank(mix_run):
    run_dir, metrics = mix_run
    plan = json.loads((run_dir / "plan.json").read_text())
    ranks = {name: role["ranks"] for name, role in plan["roles"].items()}
    assert len(ranks["reward"]) == 1 and not set(ranks["reward"]) & {r for n, rs in ranks.items() if n != "reward"
                                                                      for r in rs}
    seen = {key for m in metrics for key in m}
    assert {"reward_mean/math", "accuracy/math"} <= seen
    math_codes = {k.rsplit("/", 1)[1] for k in seen if k.startswith("reward_codes/math/")}
    assert math_codes <= {"ok", "wrong", "no_answer"} and math_codes
    code_codes = {k.rsplit("/", 1)[1] for k in seen if k.startswith("reward_codes/code/")}
    assert code_codes <= {"ok", "failed", "compile_error", "runtime_error", "timeout", "memory", "output"}


def test_the_start_and_the_last_step_are_evaluated_per_domain_and_exported(mix_run, tmp_path):
    run_dir, metrics = mix_run
    assert [m["step"] for m in metrics] == [0, 1, 2] and "eval/math/greedy_reward" in metrics[0]
    last = metrics[-1]
    for domain in ("math", "code"):
        for key in ("greedy_reward", "sampled_reward", "pass@1", "pass@4"):
            assert 0.0 <= last[f"eval/{domain}/{key}"] <= 1.0
        assert last[f"eval/{domain}/pass@4"] >= last[f"eval/{domain}/pass@1"]
    exported = hpcrl("export", str(run_dir), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.chat_template and "<|assistant|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
