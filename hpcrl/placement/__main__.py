"""`python -m hpcrl.placement JOB [--cluster PROFILE] [--set KEY=VALUE ...] [--json]`: print the device map.

This is what `hpcrl plan` runs: it compiles the plan and submits nothing.
"""
from __future__ import annotations

import argparse
import json
import sys

from hpcrl.config import ConfigError, load_job, load_profile
from hpcrl.placement.compiler import compile_plan
from hpcrl.placement.errors import PlacementError
from hpcrl.placement.render import format_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcrl plan", description="Print the static device map of a job on a cluster.")
    parser.add_argument("job", help="job YAML, e.g. jobs/tiny_grpo.yaml")
    parser.add_argument("--cluster", help="cluster profile YAML (default: the embedded local profile)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job field, e.g. --set roles.actor_train.parallel.dp=4")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job, args.overrides)
        profile = load_profile(args.cluster)
        plan = compile_plan(job, profile)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PlacementError as exc:
        print(f"error: {args.job} on {profile.name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
