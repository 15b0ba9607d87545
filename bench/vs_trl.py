"""hpcrl against TRL's GRPOTrainer on the same job, side by side (TRL: `pip install -e '.[bench]'`).

The same job for both: the model (the job's Qwen2 config and its random initial weights, seed for
seed), the tokenizer (hpcrl's character tokenizer as a Hugging Face one), the prompts (the built-in
task's), the reward (hpcrl's `number` reward), group size, prompts per step, two optimizer steps per
batch (train.minibatches; TRL: steps_per_generation), lr and its cosine schedule to min_lr_ratio,
the clip range, KL to the reference as a k3 loss term (TRL's beta, without its importance-ratio
weighting), the entropy bonus, response length and temperature, the model's dtype (TRL's bf16
autocast is off for a float32 job) and activation checkpointing (train.recompute; TRL's default is
on). One difference stays: TRL's entropy bonus is a token mean over the batch, hpcrl's is
aggregated as the job's loss (algorithm.loss_agg, as verl does). TRL generates with transformers
(no vLLM), as hpcrl's native sampler does. Runs interleaved (hpcrl, TRL, hpcrl, TRL, ...), one at
a time, each in a process of its own.

Printed per system (means over the seeds and repetitions): samples/s over the steps after the
first five, wall time of the whole process, start-up (process start to the first step's start), and
the final reward (mean reward of the last 10% of the steps, at least 10); then hpcrl's ratio to TRL.
A run's rewards are a function of its seed (repetitions repeat them; they measure the timing): one
seed's final reward differs between the two systems by up to 0.06 either way, so compare rewards
over several seeds.

    .venv/bin/python bench/vs_trl.py [--job jobs/tiny_grpo.yaml] [--steps 200] [--repeats 2] [--seeds 1 2 3 4]
                                     [--layout colocated|job]
    .venv/bin/python bench/vs_trl.py --job jobs/tiny_longtail.yaml --steps 100     # the long-tail variant
    .venv/bin/python bench/vs_trl.py --check-gradient    # the two losses' gradients on one batch
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

from tiny_runs import run_job

STEADY_AFTER = 5   # RL steps left out of samples/s (warm-up), as bench/tiny_runs.py does
# hpcrl's layouts of the job's roles on one machine: the job's own (a rollout rank beside the
# trainer's), or rollout in the trainer's processes, sampling with its weights (no weight sync)
LAYOUTS = {"job": [], "colocated": ["roles.actor_infer.colocate_with=actor_train", "roles.actor_infer.parallel.dp=2"]}


def trl_run(job_path: str, steps: int, seed: int, out: Path) -> dict[str, float]:
    """TRL in a child process (its imports count, as hpcrl's do)."""
    started = time.time()
    subprocess.run([sys.executable, __file__, "--trl-child", job_path, str(steps), str(seed), str(out)], check=True,
                   env=dict(os.environ, HPCRL_BENCH_STARTED=str(started)), stdout=subprocess.DEVNULL)
    wall = time.time() - started
    record = json.loads(out.read_text())
    ends, rewards, per_step = record["step_ends"], record["rewards"], record["samples_per_step"]
    rl_ends = ends[record["updates_per_step"] - 1::record["updates_per_step"]]
    steady = rl_ends[STEADY_AFTER - 1:]
    return {"samples/s": per_step * (len(steady) - 1) / (steady[-1] - steady[0]),
            "final reward": fmean(rewards[-max(10 * record["updates_per_step"], len(rewards) // 10):]),
            "start-up s": record["train_begin"] - started, "wall s": wall}


def hpcrl_run(job_path: str, steps: int, seed: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    """hpcrl as a user runs it; start-up: the wall time outside the steps (launch to the first step,
    and the exit after the last, which is well under a second)."""
    from hpcrl.metrics import read_metrics

    summary = run_job(job_path, steps, seed, overrides, run_dir)
    inside = sum(r["time_step_s"] for r in read_metrics(run_dir / "metrics.jsonl"))
    return {"samples/s": summary["samples/s"], "final reward": summary["final reward"],
            "start-up s": summary["wall s"] - inside, "wall s": summary["wall s"]}


def trl_trainer(job_path: str, steps: int, seed: int, out: Path, overrides: tuple[str, ...] = (), callbacks=()):
    """(TRL's GRPOTrainer on the job's model, prompts and reward, the job) in this process."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.data.tasks import task_prompts
    from hpcrl.engines.hf_model import random_model
    from hpcrl.rewards.math import answer_reward

    job = load_job(job_path, [f"seed={seed}", *overrides])
    tokenizer = CharTokenizer()
    hf_tokenizer = tokenizer.to_hf()
    hf_tokenizer.padding_side = "left"
    model_dir = out.parent / f"{out.stem}-init"   # TRL builds its reference model from a path
    random_model(job.model, tokenizer, job.seed).save_pretrained(model_dir)
    prompts = task_prompts(job.task)
    data = Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})

    def reward(prompts, completions, completion_ids, answer, **_):
        return [answer_reward(text, ref, tokenizer.eos_token_id in ids)
                for text, ids, ref in zip(completions, completion_ids, answer)]

    algo, train = job.algorithm, job.train
    samples = train.prompts_per_step * algo.group_size
    config = GRPOConfig(
        output_dir=str(out.parent / "trl"), seed=seed, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=steps * train.minibatches,
        per_device_train_batch_size=samples // train.minibatches, steps_per_generation=train.minibatches,
        gradient_accumulation_steps=1, num_generations=algo.group_size, num_iterations=train.ppo_epochs,
        learning_rate=train.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": train.min_lr_ratio}, warmup_steps=0, weight_decay=train.weight_decay,
        max_grad_norm=train.grad_clip or 0.0, loss_type="grpo", beta=algo.kl_loss.coef, epsilon=algo.clip_low,
        epsilon_high=algo.clip_high, entropy_coef=algo.entropy_coef, max_completion_length=job.rollout.max_new_tokens,
        temperature=job.rollout.temperature, top_p=job.rollout.top_p, top_k=job.rollout.top_k,
        # TRL's own defaults that would make its job another one: bf16 autocast (the job's model is
        # float32), activation checkpointing (train.recompute), and its KL term weighted by the
        # importance ratio (DeepSeek-V3.2's; the job's is the plain k3 loss)
        bf16=job.model.dtype == "bfloat16", gradient_checkpointing=job.train.recompute,
        use_bias_correction_kl=False)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=hf_tokenizer, callbacks=list(callbacks))
    return trainer, job


def trl_child(job_path: str, steps: int, seed: int, out: Path) -> None:
    """TRL's GRPOTrainer on the job's model, data and reward; writes the step times and rewards."""
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(2)
    record = {"step_ends": [], "rewards": []}

    class Times(TrainerCallback):
        def on_train_begin(self, *_, **__):
            record["train_begin"] = time.time()

        def on_step_end(self, *_, **__):
            record["step_ends"].append(time.time())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                record["rewards"].append(logs["reward"])

    trainer, job = trl_trainer(job_path, steps, seed, out, callbacks=[Times()])
    record.update(samples_per_step=job.train.prompts_per_step * job.algorithm.group_size,
                  updates_per_step=job.train.minibatches)
    trainer.train()
    out.write_text(json.dumps(record))


def check_gradient(job_path: str, overrides: tuple[str, ...], out: Path) -> float:
    """The largest relative difference, over the parameters, between the gradients of TRL's
    `_compute_loss` and hpcrl's `policy_objective` on one batch: the job's float32 initial weights,
    two prompts' groups of random responses of 1-3 tokens, random advantages, and old and reference
    log-probs off the current ones by noise (so that the clip and the KL act)."""
    import numpy as np
    import torch

    from hpcrl.data import CharTokenizer
    from hpcrl.data.tasks import task_prompts
    from hpcrl.engines.batch import pack, response_logprobs
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.objective import policy_objective
    from hpcrl.ragged import Ragged

    trainer, job = trl_trainer(job_path, 1, 1, out, overrides)
    trainer.current_gradient_accumulation_steps = 1
    tokenizer, size = CharTokenizer(), 2 * job.algorithm.group_size
    # ours is built afresh, not deep-copied from theirs: accelerate binds the prepared model's forward
    # to that model object, so a copy's forward would still run (and put gradients on) the original
    theirs, ours = trainer.model, random_model(job.model, tokenizer, job.seed)
    theirs.train(), ours.train()
    generator = torch.Generator().manual_seed(0)
    prompts = task_prompts(job.task)
    batch = pack(Ragged.from_rows([tokenizer.encode(prompts[i // job.algorithm.group_size].text) for i in range(size)],
                                 np.int32),
                 Ragged.from_rows([torch.randint(3, tokenizer.vocab_size, (int(n),), generator=generator).numpy()
                                   for n in torch.randint(1, 4, (size,), generator=generator)], np.int32),
                 tokenizer.pad_token_id)
    mask, width = batch["response_mask"].float(), batch["response_ids"].shape[1]
    with torch.no_grad():
        current, _ = response_logprobs(ours, batch, job.rollout.temperature)
    old = (current + 0.3 * torch.randn(current.shape, generator=generator)) * mask
    ref = (current + 0.5 * torch.randn(current.shape, generator=generator)) * mask
    advantages = torch.randn(size, generator=generator)
    prompt_width = batch["input_ids"].shape[1] - width
    trainer._compute_loss(theirs, {
        "prompt_ids": batch["input_ids"][:, :prompt_width], "prompt_mask": batch["attention_mask"][:, :prompt_width],
        "completion_ids": batch["response_ids"], "completion_mask": batch["response_mask"],
        "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref}).backward()
    logprobs, entropy = response_logprobs(ours, batch, job.rollout.temperature, with_entropy=True)
    columns = {"old_logprobs": old, "ref_logprobs": ref, "advantages": advantages[:, None] * mask}
    policy_objective(logprobs, entropy, columns, mask, job, float(mask.sum()), size)[0].backward()
    return max(float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp(min=1e-12))
               for a, b in zip(theirs.parameters(), ours.parameters()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--layout", choices=LAYOUTS, default="colocated",
                        help="hpcrl's placement of the roles (the model, data and algorithm stay the job's)")
    parser.add_argument("--check-gradient", action="store_true",
                        help="only compare TRL's and hpcrl's loss gradients on one batch, with and without the "
                             "entropy bonus, and print the largest relative differences")
    parser.add_argument("--trl-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check_gradient:
        with tempfile.TemporaryDirectory() as tmp:
            for label, overrides in (("as the job", ()), ("without the entropy bonus", ("algorithm.entropy_coef=0",))):
                worst = check_gradient(args.job, overrides, Path(tmp) / f"check-{len(overrides)}")
                print(f"{args.job}, {label}: largest relative gradient difference, TRL against hpcrl: {worst:.2e}")
        return 0
    if args.trl_child:
        job_path, steps, seed, out = args.trl_child
        trl_child(job_path, int(steps), int(seed), Path(out))
        return 0
    results: dict[str, list[dict[str, float]]] = {"hpcrl": [], "TRL": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for repeat in range(args.repeats):
                results["hpcrl"].append(hpcrl_run(args.job, args.steps, seed, LAYOUTS[args.layout],
                                                  Path(tmp) / f"hpcrl-{seed}-{repeat}"))
                results["TRL"].append(trl_run(args.job, args.steps, seed, Path(tmp) / f"trl-{seed}-{repeat}.json"))
    print(f"{args.job}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))}, {args.repeats} interleaved "
          f"repetitions each (means); hpcrl layout: {args.layout}")
    print(f"{'':<14}{'hpcrl':>10}{'TRL':>10}{'hpcrl/TRL':>11}")
    for key in results["hpcrl"][0]:
        ours, theirs = (fmean(r[key] for r in results[name]) for name in ("hpcrl", "TRL"))
        print(f"{key:<14}{ours:>10.3f}{theirs:>10.3f}{ours / theirs:>11.2f}")
    runs_of = [(seed, repeat) for seed in args.seeds for repeat in range(args.repeats)]
    for name, runs in results.items():
        print(f"{name} per run: " + "; ".join(f"seed {seed}: {r['samples/s']:.0f} samples/s, reward {r['final reward']:.3f}"
                                              for (seed, _), r in zip(runs_of, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
