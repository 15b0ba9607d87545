"""The `hpcrl` command line: plan, run, submit, status, report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcrl.config import ConfigError, load_job, load_profile

EPILOG = """\
examples:
  hpcrl run jobs/tiny_grpo.yaml                      # train here (CPU, mpirun, the local profile)
  hpcrl run jobs/tiny_grpo.yaml --set train.steps=5  # any field can be overridden
  hpcrl plan jobs/qwen2.5-7b-grpo.yaml --cluster clusters/example-4x8-h100.yaml
  hpcrl submit jobs/tiny_grpo.yaml --cluster clusters/slurm-local.yaml --dry-run
  hpcrl status                                       # every run under runs/
  hpcrl report runs/tiny-grpo                        # reward curve -> runs/tiny-grpo/report.png

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
    from hpcrl.placement import compile_plan

    job = load_job(args.job, args.overrides)
    profile = load_profile(args.cluster)
    return job, profile, compile_plan(job, profile)


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcrl.placement import format_plan

    _, _, plan = _load(args)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hpcrl.launch.local import run_local

    job, profile, plan = _load(args)
    if profile.scheduler != "local":
        raise ConfigError(args.cluster, [f"scheduler is {profile.scheduler!r}: use `hpcrl submit` for it, "
                                         "or `hpcrl run` with a local profile"])
    run_dir = Path(args.run_dir or Path("runs") / job.name)
    code = run_local(job, profile, args.cluster, plan, run_dir)
    if code == 0:
        print(f"hpcrl: done. Metrics: {run_dir / 'metrics.jsonl'}; plot them with `hpcrl report {run_dir}`")
    else:
        print(f"hpcrl: the run failed (exit code {code}); the cause is printed above by rank 0", file=sys.stderr)
    return code


def cmd_report(args: argparse.Namespace) -> int:
    from hpcrl.metrics import report_main

    return report_main(args.run_dir)


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
    run.set_defaults(func=cmd_run)

    report = sub.add_parser("report", help="plot a run's reward curve to report.png",
                            description="Read RUN_DIR/metrics.jsonl, print a summary, write RUN_DIR/report.png.")
    report.add_argument("run_dir", help="a run directory, e.g. runs/tiny-grpo")
    report.set_defaults(func=cmd_report)
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
