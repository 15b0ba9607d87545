"""Tasks, datasets and chat templates, tokenizers, the number reward, and the resumable domain sampler."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO

from hpcrl.data import CharTokenizer, ResumableSampler, SamplerState, addition_prompts
from hpcrl.rewards import answer_reward
from hpcrl.runtime.dispatch import concat_batches, split_batch


def test_tokenizer_round_trip_and_eos():
    tok = CharTokenizer()
    ids = tok.encode("12+34=")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:] + [tok.eos_token_id] + tok.encode("9", add_bos=False)) == "12+34="
    with pytest.raises(ValueError, match="not in the task vocabulary"):
        tok.encode("x")


def test_addition_prompts_are_all_pairs():
    prompts = addition_prompts(1)
    assert len(prompts) == 100 and prompts[34].text == "3+4=" and prompts[34].answer == "7"


def test_repeat_prompts_have_long_tailed_answer_lengths():
    """The long-tail task: "d*n=" -> d written n times, the answer of n digits listed about 64/n times."""
    from hpcrl.data.tasks import repeat_prompts

    prompts = repeat_prompts(64)
    lengths = np.array([len(p.answer) for p in prompts])
    assert {(p.text, p.answer) for p in prompts} >= {("7*3=", "777"), ("0*64=", "0" * 64)}
    assert lengths.max() == 64 and np.median(lengths) <= 8 and np.percentile(lengths, 90) >= 32
    assert sum(p.text == "5*1=" for p in prompts) == 64 and sum(p.text == "5*64=" for p in prompts) == 1


def test_a_task_field_of_another_task_is_an_error(tmp_path):
    from hpcrl.config import ConfigError, load_job

    with pytest.raises(ConfigError, match="task.max_count applies to the repeat task, not to addition"):
        load_job(REPO / "jobs" / "tiny_grpo.yaml", ["task.max_count=8"])
    job = load_job(REPO / "jobs" / "tiny_longtail.yaml")
    assert (job.task.name, job.task.max_count, job.task.digits) == ("repeat", 64, None)
    assert load_job(REPO / "jobs" / "tiny_grpo.yaml").task.digits == 1


def test_reward_exact_partial_and_empty():
    assert answer_reward("46", "46", stopped=True) == 1.0
    assert answer_reward("46", "46", stopped=False) == pytest.approx(0.5 * 2 / 3)  # no stop
    assert answer_reward("41", "46", stopped=True) == pytest.approx(0.5 * 2 / 3)  # '4' and the stop
    assert answer_reward("7", "46", stopped=True) == 0.0
    assert answer_reward("", "7", stopped=False) == 0.0


def test_sampler_resumes_exactly_from_its_state():
    items = list(range(10))
    straight = ResumableSampler(items, seed=3)
    batches = [straight.next_batch(4) for _ in range(5)]
    first = ResumableSampler(items, seed=3)
    head = [first.next_batch(4) for _ in range(2)]
    resumed = ResumableSampler(items, seed=3, state=SamplerState(**vars(first.state)))
    assert head + [resumed.next_batch(4) for _ in range(3)] == batches
    assert sorted(batches[0] + batches[1] + batches[2][:2]) == items, "each epoch visits every item once"


def test_split_and_concat_keep_sample_order():
    batch = {"a": list(range(7)), "b": list("abcdefg")}
    shards = split_batch(batch, 3)
    assert [len(s["a"]) for s in shards] == [2, 2, 3]
    assert concat_batches(shards) == batch


# ---- datasets, chat template, domain mixing ---------------------------------------------------

RLVR = REPO / "data" / "rlvr"


def _mixed_job(tmp_path, *overrides: str):
    from hpcrl.config import load_job

    (tmp_path / "job.yaml").write_text(f"""\
name: mix
model: {{path: {RLVR / 'format-model'}}}
datasets:
  - {{path: {RLVR / 'math_train.jsonl'}, tag: math, chat: true, system_prompt: "Answer in \\\\boxed{{}}."}}
  - {{path: {RLVR / 'code_train.jsonl'}, tag: code, answer_key: tests, reward: code, template: "Task: {{prompt}}"}}
domain_interleave_probs: {{math: 3, code: 1}}
roles: {{actor_train: {{}}, actor_infer: {{}}}}
""")
    return load_job(tmp_path / "job.yaml", list(overrides))


def test_datasets_load_with_templates_and_the_tokenizers_chat_template(tmp_path):
    from hpcrl.data import load_prompts, load_tokenizer

    job = _mixed_job(tmp_path)
    tokenizer = load_tokenizer(job.model)
    train, held = load_prompts(job, tokenizer)
    assert held == {} and len(train["math"]) == 2000 and len(train["code"]) == 16
    math = train["math"][0]
    assert math.text.startswith("<|system|>Answer in \\boxed{}.\n<|user|>") and math.text.endswith("\n<|assistant|>")
    assert math.domain == "math" and math.answer.isdigit()
    code = train["code"][0]
    assert code.text.startswith("Task: Write a Python function") and json.loads(code.answer)["tests"]
    # held-out prompts for evaluation leave training
    train, held = load_prompts(_mixed_job(tmp_path, "eval.every=10", "eval.holdout=5"), tokenizer)
    assert len(held["math"]) == 5 and len(train["math"]) == 1995 and not set(held["math"]) & set(train["math"])
    assert len({p.text for p in train["math"]}) == 1995, "the shipped problems are all different"


def test_a_dataset_file_must_have_its_columns_and_a_chat_dataset_a_chat_template(tmp_path):
    from hpcrl.config.job import DatasetConfig
    from hpcrl.data.datasets import dataset_prompts

    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"has no column \['prompt'\] \(its columns: question, answer\)"):
        dataset_prompts(DatasetConfig(path=str(path)), CharTokenizer())
    with pytest.raises(ValueError, match="the built-in character tokenizer has no chat template"):
        dataset_prompts(DatasetConfig(path=str(path), prompt_key="question", chat=True), CharTokenizer())
    parquet = tmp_path / "d.parquet"
    import datasets

    datasets.Dataset.from_list([{"question": "2+2?", "answer": 4}]).to_parquet(str(parquet))
    [prompt] = dataset_prompts(DatasetConfig(path=str(parquet), prompt_key="question", tag="p"), CharTokenizer())
    assert (prompt.text, prompt.answer, prompt.domain) == ("2+2?", "4", "p")


def test_domains_are_mixed_by_their_shares_and_resume_exactly():
    from hpcrl.data import DomainSampler

    prompts = {"math": list(range(100)), "code": list(range(1000, 1010)), "chat": list(range(2000, 2050))}
    shares = {"math": 0.6, "code": 0.1, "chat": 0.3}
    sampler = DomainSampler(prompts, seed=4, shares=shares)
    drawn = sampler.next_batch(2000)
    for domain, share in shares.items():
        observed = sum(x in prompts[domain] for x in drawn) / len(drawn)
        assert abs(observed - share) < 0.05 * share + 0.01, (domain, observed)
    state = json.loads(json.dumps(sampler.state_dict()))   # as the checkpoint stores it
    expected = sampler.next_batch(50)
    resumed = DomainSampler(prompts, seed=4, shares=shares)
    resumed.load_state_dict(state)
    assert resumed.next_batch(50) == expected


def test_per_domain_metrics_count_rewards_and_outcome_codes():
    """Accuracy counts the verifier's full marks before the length shaping: under DAPO a right
    answer in the overlong buffer (shaped 0.8) is still right; a partial credit (0.5) is not."""
    from hpcrl.rollout.lifecycle import Group
    from hpcrl.runtime.scoring import domain_metrics

    def group(domain, rewards, codes, outcomes):
        g = Group(0, 1, np.zeros(1, np.int32), "", len(rewards), domain)
        g.rewards, g.codes, g.outcomes = np.array(rewards), codes, np.array(outcomes)
        return g

    metrics = domain_metrics([group("math", [0.8, -0.2], ["ok", "no_answer"], [1.0, 0.0]),
                              group("code", [0.5, 1.0], ["failed", "ok"], [0.5, 1.0])])
    assert metrics["reward_mean/math"] == pytest.approx(0.3) and metrics["accuracy/math"] == 0.5
    assert metrics["reward_mean/code"] == 0.75 and metrics["accuracy/code"] == 0.5
    assert metrics["reward_codes/math/no_answer"] == 0.5 and metrics["reward_codes/code/failed"] == 0.5


def test_the_shipped_data_and_tokenizer_are_what_the_script_makes(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(REPO / "scripts" / "make_rlvr_data.py"), "--out", str(tmp_path),
                             "--no-model"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("math_train.jsonl", "math_eval.jsonl", "code_train.jsonl", "code_eval.jsonl",
                 "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (RLVR / name).read_bytes(), name



def test_a_chat_template_that_writes_bos_itself_gives_one_bos_as_apply_chat_template_does(tmp_path):
    """Llama-3's, Mistral's and Gemma's templates start with `{{ bos_token }}`: the prompt's ids are
    apply_chat_template's, not a second `<bos>` in front of them."""
    from transformers import AutoTokenizer

    from hpcrl.data import HFTokenizer

    hf = AutoTokenizer.from_pretrained(RLVR / "format-model")
    hf.chat_template = "{{ bos_token }}" + hf.chat_template
    hf.save_pretrained(tmp_path)
    tokenizer = HFTokenizer(str(tmp_path))
    ids = tokenizer.encode(tokenizer.chat_prompt("1+1?", "Answer in \\boxed{}."))
    expected = hf.apply_chat_template([{"role": "system", "content": "Answer in \\boxed{}."},
                                       {"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                      return_dict=False)
    assert ids == list(expected) and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.encode("1+1?")[:1] == [tokenizer.bos_token_id], "plain text still starts with <bos>"


def test_a_response_ends_at_every_eos_the_models_generation_config_lists(tmp_path):
    """Instruct models list their end of turn in generation_config.json beside the tokenizer's
    `<eos>` (Llama-3: <|eot_id|> and <|end_of_text|>), and transformers' generate stops at each:
    so do the sampler, the decoding the verifier reads, and the scorer's `stopped`."""
    import torch
    from transformers import AutoTokenizer

    from hpcrl.data import HFTokenizer
    from hpcrl.engines.hf_model import random_model
    from hpcrl.config import load_job
    from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
    from hpcrl.ragged import Ragged
    from hpcrl.rewards.registry import reward_function
    from hpcrl.rewards.scoring import RewardSpec, score_batch

    AutoTokenizer.from_pretrained(RLVR / "format-model").save_pretrained(tmp_path)
    tokenizer = HFTokenizer(str(tmp_path))
    end_of_turn = tokenizer.encode("<|user|>", add_bos=False)[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_turn, tokenizer.eos_token_id]}))
    tokenizer = HFTokenizer(str(tmp_path))
    assert tokenizer.stop_token_ids == (tokenizer.eos_token_id, end_of_turn)
    assert tokenizer.decode(tokenizer.encode("42", add_bos=False) + [end_of_turn, 7]) == "42"

    model = random_model(load_job(REPO / "jobs" / "tiny_grpo.yaml").model, tokenizer, 0)

    def likelier_end_of_turn(module, inputs, logits: torch.Tensor) -> torch.Tensor:
        logits[..., end_of_turn] += 5.0
        return logits

    model.lm_head.register_forward_hook(likelier_end_of_turn)
    generated = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id).generate(
        Ragged.from_rows([tokenizer.encode("1+1=")] * 8, np.int32), SamplingParams(max_new_tokens=64),
        torch.Generator().manual_seed(0))
    ends = [int(row[-1]) for row in generated.response_ids]
    assert end_of_turn in ends and all(end in tokenizer.stop_token_ids for end in ends), ends
    specs = {"n": RewardSpec(reward_function("number"), {"require_stop": True})}
    rewards, codes = score_batch(tokenizer, Ragged.from_rows([tokenizer.encode("42", add_bos=False) + [end_of_turn]],
                                                             np.int32), ["42"], ["n"], specs)
    assert (rewards.tolist(), codes) == ([1.0], ["ok"]), "the scorer counts the response as stopped"
    # a chat prompt holds an end of turn after each message: a reward that reads it (a judge) gets it whole
    prompt = Ragged.from_rows([tokenizer.encode("Be brief.") + [end_of_turn] + tokenizer.encode("1+1=", add_bos=False)],
                              np.int32)
    specs = {"n": RewardSpec(lambda response, reference: float(response.prompt.endswith("1+1=")))}
    assert score_batch(tokenizer, Ragged.from_rows([[end_of_turn]], np.int32), ["2"], ["n"], specs, prompt)[0][0] == 1
