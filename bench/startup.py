"""Where the start-up of a run goes, rank by rank: `hpcrl run` for one step, then RUN_DIR/startup.json.

Prints, for every rank, each phase with the time since mpiexec started when it ended and what it
took, and the wall time of the whole `hpcrl run` (launch, start-up, one step, exit).

    .venv/bin/python bench/startup.py [--job jobs/tiny_grpo.yaml] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sets = ["train.steps=1", "log.tensorboard=false", "checkpoint.every=0", *args.overrides]
        command = [sys.executable, "-m", "hpcrl", "run", args.job, "--run-dir", tmp]
        started = time.perf_counter()
        subprocess.run(command + [x for s in sets for x in ("--set", s)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        table = json.loads((Path(tmp) / "startup.json").read_text())
    for rank, entry in table.items():
        print(f"rank {rank} ({entry['roles']})")
        for phase in entry["phases"]:
            print(f"  {phase['phase']:<32}{phase['at_s']:>7.2f} s{phase['took_s']:>+8.2f} s")
    print(f"{args.job}: first step can start at {table['0']['phases'][-1]['at_s']:.2f} s after mpiexec; "
          f"`hpcrl run` of one step took {wall:.2f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
