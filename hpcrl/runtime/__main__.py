"""Entry point of every MPI rank: `python -m hpcrl.runtime --job J --cluster C --run-dir D`.

Rank 0 becomes the controller, every other rank a worker hosting the roles the plan gives it.
Started by `hpcrl run` (mpiexec) or by the batch script of `hpcrl submit` (srun).
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

# Before anything slow (MPI, torch): SIGUSR1's default action would kill the rank before it could
# checkpoint, and the handler stays installed until the process has exited.
from hpcrl.checkpoint import PreemptionSignal

PREEMPTION = PreemptionSignal().install()

from hpcrl.runtime.mpi_world import COMM, CONTROLLER, abort, report_and_wait  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.runtime", description=__doc__)
    parser.add_argument("--job", required=True, help="the resolved job YAML written by the launcher")
    parser.add_argument("--cluster", default=None, help="cluster profile YAML (default: the local profile)")
    parser.add_argument("--run-dir", required=True)
    return parser.parse_args(argv)


def _load_on_controller(args: argparse.Namespace):
    """Rank 0 reads and validates the files and compiles the plan; the others receive the result."""
    from hpcrl.config import load_job, load_profile
    from hpcrl.placement import compile_plan
    from hpcrl.runtime.layout import world_layout

    payload = None
    if COMM.Get_rank() == CONTROLLER:
        try:
            job, profile = load_job(args.job), load_profile(args.cluster)
            layout = world_layout(compile_plan(job, profile))
            if layout.world_size != COMM.Get_size():
                raise SystemExit(f"hpcrl: the plan needs {layout.world_size} ranks (1 controller + "
                                 f"{layout.world_size - 1} workers) but {COMM.Get_size()} were started")
            payload = (job, profile, layout)
        except BaseException:
            payload = traceback.format_exc()
    payload = COMM.bcast(payload, root=CONTROLLER)
    if isinstance(payload, str):
        if COMM.Get_rank() == CONTROLLER:
            abort(f"hpcrl: the controller could not start:\n{payload}")
        COMM.Barrier()  # wait for the abort
    return payload


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    job, profile, layout = _load_on_controller(args)
    import torch.distributed as dist

    from hpcrl.data import load_tokenizer
    from hpcrl.runtime.groups import build_process_groups
    from hpcrl.runtime.mpi_world import init_torch_distributed, set_cpu_threads, wait_sends
    from hpcrl.runtime.roles import ROLE_CLASSES, RoleContext

    rank = COMM.Get_rank()
    role = "controller" if rank == CONTROLLER else ",".join(layout.roles_on(rank))
    try:
        set_cpu_threads()
        if profile.device == "cuda" and rank != CONTROLLER:
            import torch

            torch.cuda.set_device(layout.local_device[rank])
        init_torch_distributed("nccl" if profile.device == "cuda" else "gloo")
        groups = build_process_groups(layout, rank, job.rollout.sync_timeout_s)
        tokenizer = load_tokenizer(job.model.path)
        if rank == CONTROLLER:
            from hpcrl.runtime.controller import Controller

            controller = Controller(job, layout, tokenizer, Path(args.run_dir), PREEMPTION)
            code = controller.run()
            controller.shutdown()
        else:
            from hpcrl.runtime.worker import serve

            peers: dict[str, object] = {}
            device = f"cuda:{layout.local_device[rank]}" if profile.device == "cuda" else "cpu"
            sync = layout.sync
            direct = profile.device == "cuda" and sync.direct_to_vllm(layout)
            stage = sync.sources.index(rank) if rank in sync.sources else None
            sources = [(s, None if src == rank else groups.sync[s], src) for s, src in enumerate(sync.sources)
                       ] if rank in sync.loaders else []
            for name in layout.roles_on(rank):
                replica = layout.roles[name].replica_of(rank)
                ctx = RoleContext(job, tokenizer, groups.dp.get(name), groups.dp_index[name], peers, device,
                                  groups.megatron.get(name), replica[0] == rank,
                                  tuple(layout.local_device[r] for r in replica),
                                  sync_stage=stage if name == "actor_train" else None,
                                  sync_send_group=groups.sync.get(stage) if name == "actor_train" else None,
                                  sync_sources=sources if name == "actor_infer" else [],
                                  sync_loaders=tuple(sync.loaders), sync_direct=direct)
                peers[name] = ROLE_CLASSES[name](ctx)
            serve(peers, groups.replica)
            code = 0
        wait_sends()
        dist.destroy_process_group()
        return code
    except BaseException:
        if rank == CONTROLLER:
            abort(f"hpcrl: the controller (rank 0) failed:\n{traceback.format_exc()}\nhpcrl: aborting all ranks.")
        report_and_wait(role, "setup")


if __name__ == "__main__":
    sys.exit(main())
