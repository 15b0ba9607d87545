"""The `hpcrl` command line: plan, run, submit, status, cancel, report, export."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcrl.config import ConfigError, load_job, load_profile
from hpcrl.config.constants import EXIT_REFUSED, EXIT_REQUEUE, EXIT_STOPPED

EPILOG = """\
examples:
  hpcrl run jobs/tiny_grpo.yaml                      # train here (CPU, mpirun, the local profile)
  hpcrl run jobs/tiny_grpo.yaml --set train.steps=5  # any field can be overridden
  hpcrl plan jobs/qwen2.5-7b-grpo.yaml --cluster clusters/example-4x8-h100.yaml
  hpcrl submit jobs/tiny_grpo.yaml --cluster clusters/slurm-local.yaml --dry-run
  hpcrl status                                       # every run under runs/
  hpcrl cancel runs/tiny-grpo                        # stop it (here or in Slurm) after a checkpoint
  hpcrl report runs/tiny-grpo                        # reward curve -> runs/tiny-grpo/report.png
  hpcrl export runs/tiny-grpo --out tiny-hf          # the trained policy as a Hugging Face model

A job YAML describes the experiment and runs unchanged on any cluster profile; the profile
(clusters/*.yaml) describes the machine: nodes, devices, memory, Slurm partition and limits.
"""


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML, e.g. jobs/tiny_grpo.yaml")
    parser.add_argument("--cluster", metavar="PROFILE", default=None,
                        help="cluster profile YAML (default: clusters/local.yaml, this machine)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job field, e.g. --set train.steps=20 (repeatable)")


def _load(args: argparse.Namespace):
    from hpcrl.placement import PlacementError, compile_plan

    job = load_job(args.job, args.overrides)
    profile = load_profile(args.cluster)
    try:
        return job, profile, compile_plan(job, profile)
    except PlacementError as exc:
        raise ConfigError(args.job, [str(exc)]) from None


def _resume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--restart", action="store_true",
                        help="if RUN_DIR holds a run but no checkpoint it can resume from, start it over from step 0 "
                        "(its metrics move to metrics.superseded.jsonl); without it such a start is refused")
    parser.add_argument("--allow-config-change", action="append", default=[], metavar="KEY",
                        help="resume although the job's KEY (e.g. algorithm.kl_loss.coef, or a section: rollout) differs "
                        "from the checkpoint's (repeatable)")


def _resume_options(args: argparse.Namespace):
    from hpcrl.launch.local import ResumeOptions

    return ResumeOptions(args.restart, tuple(args.allow_config_change))


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcrl.placement import format_plan

    _, _, plan = _load(args)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hpcrl.launch.local import run_local
    from hpcrl.launch.lock import RunLockError

    job, profile, plan = _load(args)
    if profile.scheduler != "local":
        raise ConfigError(args.cluster, [f"scheduler is {profile.scheduler!r}: use `hpcrl submit` for it, "
                                         "or `hpcrl run` with a local profile"])
    run_dir = Path(args.run_dir or Path("runs") / job.name)
    try:
        code = run_local(job, profile, args.cluster, plan, run_dir, _resume_options(args))
    except RunLockError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if code == 0:
        print(f"hpcrl: done. Metrics: {run_dir / 'metrics.jsonl'}; plot them with `hpcrl report {run_dir}`")
    elif code in (EXIT_REQUEUE, EXIT_STOPPED):
        print("hpcrl: stopped as asked after saving a checkpoint; the same command resumes it", file=sys.stderr)
    elif code == EXIT_REFUSED:
        print("hpcrl: the run refused to start; the reason is printed above", file=sys.stderr)
    else:
        print(f"hpcrl: the run failed (exit code {code}); the cause is printed above by rank 0", file=sys.stderr)
    return code


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcrl.launch.scheduler import find_tool
    from hpcrl.launch.slurm import SubmitError, describe_submission, describe_sweep, prepare_submission
    from hpcrl.placement import format_plan

    submission = prepare_submission(args.job, args.cluster, args.overrides, args.chain, args.run_dir,
                                    resume=_resume_options(args))
    if args.dry_run:
        print(submission.script, end="")
        print()
        print(format_plan(submission.plan))
        if submission.sweep:
            print(f"sweep: {len(submission.sweep)} array tasks, each in its own run directory")
            print(describe_sweep(submission.sweep))
        sbatch = find_tool("sbatch")
        where = f"sbatch is {sbatch}" if sbatch else "sbatch not found on this machine"
        print(f"dry run: nothing written or submitted ({where}); the script would go to {submission.script_path}")
        return 0
    if (submission.run_root / "metrics.jsonl").exists() and submission.kind != "sweep":
        print(f"hpcrl: note: {submission.run_root} already holds a run: the job resumes from its newest "
              "checkpoint there (use --run-dir for a fresh run)")
    try:
        job_id = submission.submit()
    except SubmitError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 1
    print(describe_submission(submission, job_id))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from hpcrl.launch.status import status_main

    return status_main(args.run_dirs, as_json=args.json)


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpcrl.launch.cancel import CancelError, cancel

    try:
        print(f"hpcrl: {cancel(args.run_dir)}")
    except CancelError as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from hpcrl.metrics import report_main

    return report_main(args.run_dir)


def cmd_export(args: argparse.Namespace) -> int:
    from hpcrl.checkpoint import CheckpointError, CheckpointStore
    from hpcrl.data.tokenizer import load_tokenizer
    from hpcrl.engines.export import export_policy
    from hpcrl.engines.model_files import ModelFiles

    run_dir = Path(args.run_dir)
    if not (run_dir / "job.yaml").is_file():
        raise ValueError(f"{run_dir}: no job.yaml (not a run directory written by hpcrl run or hpcrl submit)")
    job = load_job(run_dir / "job.yaml")
    store = CheckpointStore(run_dir)
    found = [(step, path) for step, path in store.steps() if args.step is None or step == args.step]
    if not found:
        which = f"step-{args.step}" if args.step is not None else "any checkpoint"
        have = ", ".join(str(step) for step, _ in store.steps()) or "none"
        raise ValueError(f"{store.root}: no {which} (checkpoints here: {have}); set checkpoint.every in the job to "
                         "keep some")
    step, path = found[0]
    try:
        store.verify(path)
    except CheckpointError as exc:
        raise ValueError(f"{path}: {exc}") from None
    out = export_policy(job, run_dir, path, load_tokenizer(job.model, job.env), Path(args.out))
    count = ModelFiles(out).numel()
    print(f"hpcrl: exported step {step} ({job.engine('actor_train')} engine, {count / 1e6:.2f}M parameters, "
          f"{job.model.dtype}) to {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcrl", description="Train LLMs with reinforcement learning as "
                                     "plain Slurm + MPI batch jobs.", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="compile and print the device map (nothing runs)",
                          description="Compile where every role lives in every stage and print it. Impossible "
                          "plans are rejected with the reason.")
    _job_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="train on this machine with mpiexec",
                         description="Validate the job, compile the plan, then start 1 controller + N worker "
                         "ranks with mpiexec. Metrics go to runs/<name>/metrics.jsonl and TensorBoard.")
    _job_arguments(run)
    run.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default: runs/<name>)")
    _resume_arguments(run)
    run.set_defaults(func=cmd_run)

    submit = sub.add_parser("submit", help="submit the job to Slurm (sbatch), or show the script with --dry-run",
                            description="Validate the job and the cluster profile, compile the plan, write "
                            "RUN_DIR/job.sbatch from templates/job.sbatch.j2 and submit it with sbatch. A job with "
                            "a sweep: block becomes one job array (a run directory per combination).")
    _job_arguments(submit)
    for action in submit._actions:
        if action.dest == "cluster":
            action.required, action.help = True, "Slurm cluster profile YAML, e.g. clusters/slurm-local.yaml"
    submit.add_argument("--dry-run", action="store_true",
                        help="print the batch script and the plan; write and submit nothing (works without Slurm)")
    submit.add_argument("--chain", type=int, default=1, metavar="K",
                        help="K array tasks that run one after another, each resuming from the newest checkpoint")
    submit.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default: runs/<name>)")
    _resume_arguments(submit)
    submit.set_defaults(func=cmd_submit)

    status = sub.add_parser("status", help="state, progress and last reward of submitted runs",
                            description="For each run: its Slurm job (squeue/scontrol, sacct where accounting "
                            "runs, else the run's own files), the step reached, the last reward_mean, restarts.")
    status.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories (default: every run under runs/)")
    status.add_argument("--json", action="store_true", help="print the rows as JSON")
    status.set_defaults(func=cmd_status)

    cancel = sub.add_parser("cancel", help="stop a run, here or in Slurm, after it saves a checkpoint",
                            description="Stop the run that holds RUN_DIR (its .hpcrl.lock says who): a Slurm job is "
                            "cancelled with scancel (its ranks save a checkpoint if they can within KillWait; it is "
                            "not requeued), an `hpcrl run` here saves at the end of the current step and stops. "
                            "Running `hpcrl run` or `hpcrl submit` on RUN_DIR again resumes it.")
    cancel.add_argument("run_dir", help="the run directory, e.g. runs/tiny-grpo")
    cancel.set_defaults(func=cmd_cancel)

    report = sub.add_parser("report", help="plot a run's reward curve to report.png",
                            description="Read RUN_DIR/metrics.jsonl, print a summary, write RUN_DIR/report.png.")
    report.add_argument("run_dir", help="a run directory, e.g. runs/tiny-grpo")
    report.set_defaults(func=cmd_report)

    export = sub.add_parser("export", help="write a run's trained policy as a Hugging Face model directory",
                            description="Read the newest verified checkpoint of RUN_DIR (or step N) of any engine "
                            "(torch DCP at any DP size, DeepSpeed ZeRO, Megatron TP/PP shards) and write config.json, "
                            "model.safetensors (5 GB shards and an index for a larger model), the tokenizer and "
                            "generation_config.json to DIR, tensor by tensor: what transformers "
                            "and vLLM load.")
    export.add_argument("run_dir", help="the run directory, e.g. runs/tiny-grpo")
    export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    export.add_argument("--out", required=True, metavar="DIR", help="the model directory to write (replaced)")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as exc:
        print(f"hpcrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
