"""Entry point of every MPI rank: `python -m hpcrl.runtime --job J --cluster C --run-dir D`.

Rank 0 becomes the controller, every other rank a worker hosting the roles the plan gives it.
Started by `hpcrl run` (mpiexec) or by the batch script of `hpcrl submit` (srun).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from hpcrl.runtime.supervisor import SUPERVISED_ENV, supervise

if __name__ == "__main__" and os.environ.get(SUPERVISED_ENV) != "1":
    sys.exit(supervise(sys.argv[1:]))   # the rank runs as this process's child: see supervisor.py

# Before anything slow (MPI, torch): SIGUSR1's default action would kill the rank before it could
# checkpoint, and the handler stays installed until the process has exited.
from hpcrl.checkpoint import PreemptionSignal  # noqa: E402

PREEMPTION = PreemptionSignal().install()
STARTED = __import__("time").time()   # when this world started: older exit records are an earlier one's

from hpcrl.runtime import startup  # noqa: E402

startup.spawned()
startup.mark("python started")
from hpcrl.runtime.mpi_world import COMM, CONTROLLER, abort, barrier, report_and_wait  # noqa: E402

startup.mark("MPI")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.runtime", description=__doc__)
    parser.add_argument("--job", required=True, help="the resolved job YAML written by the launcher")
    parser.add_argument("--cluster", default=None, help="cluster profile YAML (default: the local profile)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--restart", action="store_true",
                        help="start over from step 0 if no checkpoint can be resumed (else: refuse)")
    parser.add_argument("--allow-config-change", action="append", default=[], metavar="KEY",
                        help="a job field that may differ from the checkpoint's (repeatable)")
    return parser.parse_args(argv)


def _load_on_controller(args: argparse.Namespace):
    """Rank 0 reads and validates the files and compiles the plan; the others receive the result."""
    from hpcrl.config import load_job, load_profile
    from hpcrl.placement import compile_plan
    from hpcrl.runtime.layout import world_layout

    payload = None
    if COMM.Get_rank() == CONTROLLER:
        try:
            _hold_run_dir(Path(args.run_dir))
            job, profile = load_job(args.job), load_profile(args.cluster)
            layout = world_layout(compile_plan(job, profile))
            if layout.world_size != COMM.Get_size():
                raise SystemExit(f"hpcrl: the plan needs {layout.world_size} ranks (1 controller + "
                                 f"{layout.world_size - 1} workers) but {COMM.Get_size()} were started")
            payload = (job, profile, layout)
        except BaseException:
            payload = traceback.format_exc()
    barrier()   # the workers sleep while the controller works (a blocking bcast would spin)
    payload = COMM.bcast(payload, root=CONTROLLER)
    if isinstance(payload, str):
        if COMM.Get_rank() == CONTROLLER:
            abort(f"hpcrl: the controller could not start:\n{payload}")
        barrier()  # wait for the abort
    return payload


def _refuse(run_dir: Path, message: str) -> None:
    """End the world with EXIT_REFUSED: nothing a restart would change. Under Slurm, first leave
    RUN_DIR/ranks/refused-<job id> for the batch script, which srun's exit code (that of the peers
    the abort killed) would otherwise tell it a failure to retry."""
    from hpcrl.config.constants import EXIT_REFUSED, REFUSED_MARKER

    _leave_marker(run_dir, REFUSED_MARKER, message + "\n")
    abort(message, EXIT_REFUSED)


def _leave_marker(run_dir: Path, marker: str, text: str = "") -> None:
    """Under Slurm, RUN_DIR/ranks/<marker><job id> for the batch script (hpcrl.config.constants:
    the refusal, the formed world). Never fails: the marker only refines what the script decides."""
    from hpcrl.config.constants import RANK_EXITS_DIR

    job_id = os.environ.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        try:
            (run_dir / RANK_EXITS_DIR).mkdir(parents=True, exist_ok=True)
            (run_dir / RANK_EXITS_DIR / f"{marker}{job_id}").write_text(text)
        except OSError:
            pass


def _hold_run_dir(run_dir: Path) -> None:
    """The controller makes sure the run directory is this run's: `hpcrl run` and `hpcrl submit` took
    its lock for these ranks (their token is in the environment); a rank started by hand takes it
    now. Held by another live run: refuse, with EXIT_REFUSED (nothing to retry)."""
    from hpcrl.launch.lock import TOKEN_ENV, Holder, RunLockError, acquire, slurm_job_key

    try:
        note = acquire(run_dir, Holder.here("job", slurm_job_key(), os.environ.get(TOKEN_ENV)))
    except RunLockError as exc:
        _refuse(run_dir, f"hpcrl: {exc}")
    if note:
        print(f"hpcrl: {note}", file=sys.stderr, flush=True)


def _watch(job, layout, run_dir: Path):
    """Every rank tells rank 0 its host and PID (written to RUN_DIR/ranks.json); the controller installs
    the watchdog, every worker starts its heartbeat (busy with "setup" until it serves calls)."""
    import json
    import socket
    import time

    from hpcrl.runtime.watchdog import Heartbeat, RankInfo, Watchdog

    rank = COMM.Get_rank()
    everyone = COMM.allgather((socket.gethostname(), os.getpid()))
    if rank != CONTROLLER:
        heartbeat = Heartbeat(job.watchdog.heartbeat_s)
        heartbeat.activity = ("setup", time.monotonic())
        return heartbeat
    from hpcrl.runtime.dispatch import install_watchdog

    ranks = {r: RankInfo(host, pid, ",".join(layout.roles_on(r))) for r, (host, pid) in enumerate(everyone) if r}
    (run_dir / "ranks.json").write_text(json.dumps({str(r): vars(info) for r, info in ranks.items()}, indent=1))
    from hpcrl.config.constants import WORLD_MARKER

    _leave_marker(run_dir, WORLD_MARKER)   # every rank started and MPI joined them: later failures may restart
    watchdog = Watchdog(job.watchdog, ranks, run_dir, since=STARTED)
    install_watchdog(watchdog)
    return watchdog


def _initial_weights(job, tokenizer, run_dir: Path, rank: int):
    """The files every engine loads: `model.path`, or the job's random model, written once by the
    first worker while the others wait (no other rank builds the full model). Not the controller:
    it never imports transformers, which costs each process seconds of start-up."""
    if rank == CONTROLLER:
        barrier()
        return None
    from hpcrl.engines.model_files import ModelFiles, model_dir, write_random_init

    startup.mark("transformers imported")
    if job.model.path is None and rank == CONTROLLER + 1:
        write_random_init(job, tokenizer, run_dir)
        startup.mark("random initial weights written")
    barrier()
    return ModelFiles(model_dir(job, run_dir))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    job, profile, layout = _load_on_controller(args)
    startup.mark("plan")
    import torch.distributed as dist

    from hpcrl.data import load_tokenizer
    from hpcrl.runtime.groups import build_process_groups
    from hpcrl.runtime.mpi_world import (bind_workers_to_cores, init_torch_distributed, open_doorbells,
                                         require_threads, set_cpu_threads, wait_sends)

    startup.mark("torch imported")

    rank = COMM.Get_rank()
    role = "controller" if rank == CONTROLLER else ",".join(layout.roles_on(rank))
    try:
        require_threads()
        open_doorbells()
        watch = _watch(job, layout, Path(args.run_dir))
        set_cpu_threads()
        if profile.device == "cpu":   # env pools and reward sandboxes are processes of their ranks
            bind_workers_to_cores(job.env is None and "reward" not in layout.roles_on(rank))
        if profile.device == "cuda" and rank != CONTROLLER:
            import torch

            torch.cuda.set_device(layout.local_device[rank])
        init_torch_distributed("nccl" if profile.device == "cuda" else "gloo")
        groups = build_process_groups(layout, rank, job.rollout.sync_timeout_s)
        startup.mark("torch.distributed")
        tokenizer = load_tokenizer(job.model, job.env)
        weights = _initial_weights(job, tokenizer, Path(args.run_dir), rank)
        startup.mark("initial weights")
        if rank == CONTROLLER:
            from hpcrl.runtime.controller import Controller

            from hpcrl.checkpoint import ConfigMismatchError
            from hpcrl.config.constants import AUTOMATIC_RESTART_ENV
            from hpcrl.runtime.checkpointing import RefusedError

            controller = Controller(job, layout, tokenizer, Path(args.run_dir), PREEMPTION, args.restart,
                                    args.allow_config_change, os.environ.get(AUTOMATIC_RESTART_ENV) == "1")
            startup.mark("controller built")
            try:
                code = controller.run()
            except (RefusedError, ConfigMismatchError) as exc:   # nothing a restart would change
                _refuse(Path(args.run_dir), f"hpcrl: {exc}")
            controller.shutdown()
        else:
            from hpcrl.runtime.roles import ROLE_CLASSES, RoleContext
            from hpcrl.runtime.interrupts import drain_interrupts
            from hpcrl.runtime.worker import serve

            peers: dict[str, object] = {}
            device = f"cuda:{layout.local_device[rank]}" if profile.device == "cuda" else "cpu"
            sync = layout.sync
            direct = profile.device == "cuda" and sync.direct_to_vllm(layout)
            stage = sync.sources.index(rank) if rank in sync.sources else None
            sources = [(s, None if src == rank else groups.sync[s], src) for s, src in enumerate(sync.sources)
                       ] if rank in sync.loaders else []
            envs = _env_assignment(layout, rank)
            # the trainer first (a rollout that samples with its weights takes them from it), the
            # rollout last (vLLM sizes its pool by the device memory the other roles left free)
            for name in sorted(layout.roles_on(rank), key=lambda role: (role != "actor_train", role == "actor_infer")):
                replica = layout.roles[name].replica_of(rank)
                if name == "actor_infer" and name in groups.replica:
                    # vLLM's TP workers start on the GPUs of the replica's other ranks: the roles
                    # built there must have moved off (vLLM checks the free memory as it starts)
                    dist.barrier(group=groups.replica[name][0])
                ctx = RoleContext(job, tokenizer, weights, groups.dp.get(name), groups.dp_index[name], peers, device,
                                  groups.megatron.get(name), replica[0] == rank,
                                  tuple(layout.local_device[r] for r in replica),
                                  sync_stage=stage if name == "actor_train" else None,
                                  sync_send_group=groups.sync.get(stage) if name == "actor_train" else None,
                                  sync_sources=sources if name == "actor_infer" else [],
                                  sync_loaders=tuple(sync.loaders), sync_direct=direct,
                                  shared_weights=layout.shared_weights, context_groups=groups.context.get(name),
                                  **envs.get(name, {}))
                peers[name] = ROLE_CLASSES[name](ctx)
                if name in layout.movable:   # the controller brings it back for its first stage
                    peers[name].offload()
                startup.mark(f"{name} built")
            serve(peers, groups.replica, heartbeat=watch)
            drain_interrupts()   # one sent as its round ended: MPICH's finalize fails on a message never read
            watch.stop()
            code = 0
        wait_sends()
        dist.destroy_process_group()
        return code
    except BaseException:
        if rank == CONTROLLER:
            abort(f"hpcrl: the controller (rank 0) failed:\n{traceback.format_exc()}\nhpcrl: aborting all ranks.")
        report_and_wait(role, "setup")


def _env_assignment(layout, rank: int) -> dict[str, dict]:
    """With env ranks (roles.env): this rank's env rank as a rollout replica leader, or the rollout
    leaders it serves as an env rank (hpcrl.runtime.env_workers); nothing without them."""
    from hpcrl.runtime.env_workers import clients_of, env_rank_of

    if "env" not in layout.roles:
        return {}
    infer = layout.roles["actor_infer"]
    leaders = [r for r in infer.ranks if infer.replica_of(r)[0] == r]
    env_ranks = sorted(layout.roles["env"].ranks)
    found: dict[str, dict] = {}
    if rank in leaders:
        found["actor_infer"] = {"env_rank": env_rank_of(rank, leaders, env_ranks)}
    if rank in env_ranks:
        found["env"] = {"env_clients": clients_of(rank, leaders, env_ranks)}
    return found


if __name__ == "__main__":
    from hpcrl.runtime.mpi_world import leave

    leave(main())
