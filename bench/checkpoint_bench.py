"""Checkpoint save / commit / load time and size for a training role's model + AdamW state.

Single process (process_group=None), what one DP rank of `actor_train` writes. Two models: the
tiny job's (jobs/tiny_grpo.yaml) and a ~100M-parameter Qwen2. "save" is DCP writing model +
optimizer (fsync'd); "commit" is the store hashing (SHA-256) and fsyncing every file, writing
the manifest and renaming; "verify" is latest_valid re-hashing it on resume; "load" is a fresh
model + optimizer restored from it (checked bit-exact). Load reads from the page cache, so it is
an upper bound for a cold parallel filesystem.

`--parallel` (the runtime's way): a ~300M-parameter Qwen2 sharded with FSDP2 over 1, 2 and 4 MPI
ranks (gloo); every rank writes its own DCP shards, then hashes and fsyncs its share of the files
(greedy by size, as runtime/checkpointing.py spreads them), and the aggregate GB/s of each is
printed next to the single writer's. On this machine the ranks share 2 cores and one disk.

    python bench/checkpoint_bench.py [--dir /scratch/x] [--threads 1] [--skip-100m] [--parallel]
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

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hpcrl.checkpoint import CheckpointStore
from hpcrl.checkpoint.model_state import load_train_state, save_train_state
from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.engines.hf_model import random_model

REPO = Path(__file__).resolve().parents[1]


def tiny_model() -> torch.nn.Module:
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml")
    return random_model(job.model, CharTokenizer(), job.seed)


def qwen2(hidden: int, intermediate: int, layers: int, heads: int) -> torch.nn.Module:
    """A Qwen2-shaped model with seeded random weights (4 KV heads, tied embeddings)."""
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4,
                         tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def model_100m() -> torch.nn.Module:
    return qwen2(768, 2048, 12, 12)


def model_300m() -> torch.nn.Module:
    return qwen2(1024, 2816, 24, 16)


def optimizer_step(model: torch.nn.Module) -> torch.optim.Optimizer:
    """One AdamW step on a small random batch, so exp_avg / exp_avg_sq / step exist."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def same(model: torch.nn.Module, opt: torch.optim.Optimizer, other: torch.nn.Module, other_opt) -> bool:
    params = all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    states = all(torch.equal(opt.state[a][k], other_opt.state[b][k])
                 for a, b in zip(model.parameters(), other.parameters()) for k in ("step", "exp_avg", "exp_avg_sq"))
    return params and states


def bench(name: str, make, root: Path, threads: int) -> dict:
    model = make()
    optimizer = optimizer_step(model)
    store = CheckpointStore(root / name, keep=1)
    t0 = time.perf_counter()
    tmp = store.begin(1)
    save_train_state(model, optimizer, tmp / "actor_train", thread_count=threads)
    t1 = time.perf_counter()
    ckpt = store.commit(1, tmp, "bench", {"actor_train": {"dp": 1}})
    t2 = time.perf_counter()
    assert store.latest_valid("bench").step == 1
    t3 = time.perf_counter()
    fresh = make()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    t4 = time.perf_counter()
    load_train_state(fresh, fresh_opt, ckpt.file("actor_train"))
    t5 = time.perf_counter()
    assert same(model, optimizer, fresh, fresh_opt), "loaded state differs from the saved state"
    mb = ckpt.manifest.total_bytes / 1e6
    return {"model": name, "params": sum(p.numel() for p in model.parameters()), "mb": mb, "save": t1 - t0,
            "commit": t2 - t1, "verify": t3 - t2, "load": t5 - t4}


def parallel_worker(root: Path) -> None:
    """One rank of the --parallel measurement (run under mpiexec): FSDP2 shards, DCP, hashing."""
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hpcrl.checkpoint.manifest import sha256_file
    from hpcrl.runtime.checkpointing import _shares
    from hpcrl.runtime.mpi_world import init_torch_distributed

    comm = MPI.COMM_WORLD
    init_torch_distributed("gloo")
    group = dist.new_group(list(range(comm.Get_size())))
    model = model_300m()
    if comm.Get_size() > 1:
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = optimizer_step(model)
    path = root / f"ranks-{comm.Get_size()}"
    dist.barrier()
    started = time.perf_counter()
    save_train_state(model, optimizer, path, group if comm.Get_size() > 1 else None)
    dist.barrier()
    saved = time.perf_counter()
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) if comm.Get_rank() == 0 else None
    shares = comm.bcast(_shares(path, names, list(range(comm.Get_size()))) if names is not None else None)
    mine = [sha256_file(path / name, fsync=True) for name in shares[comm.Get_rank()]]
    dist.barrier()
    hashed = time.perf_counter()
    nbytes = comm.allreduce(sum(entry.size for entry in mine))
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": comm.Get_size(), "gb": nbytes / 1e9, "save": saved - started,
                          "hash": hashed - saved}), flush=True)
    dist.destroy_process_group()


def parallel(root: Path) -> None:
    from hpcrl.launch.local import mpiexec_path

    rows = []
    for ranks in (1, 2, 4):
        out = subprocess.run([mpiexec_path(), "-n", str(ranks), sys.executable, __file__, "--worker", str(root)],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    single = rows[0]["gb"] / (rows[0]["save"] + rows[0]["hash"])
    print(f"{'ranks':>5} {'size GB':>8} {'save s':>7} {'hash s':>7} {'GB/s':>6} {'vs 1 writer':>11}")
    for r in rows:
        rate = r["gb"] / (r["save"] + r["hash"])
        print(f"{r['ranks']:>5} {r['gb']:>8.2f} {r['save']:>7.2f} {r['hash']:>7.2f} {rate:>6.2f} {rate / single:>10.2f}x")
    print("a ~300M-parameter Qwen2 + AdamW state, FSDP2 shards: every rank writes its own (DCP, fsync'd), then "
          "hashes and fsyncs its share of the files; GB/s = size / (save + hash)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary dir)")
    parser.add_argument("--threads", type=int, default=1, help="DCP writer threads")
    parser.add_argument("--skip-100m", action="store_true")
    parser.add_argument("--parallel", action="store_true", help="the 300M model on 1, 2 and 4 writer ranks")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        parallel_worker(args.worker)
        return
    if args.parallel:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="hpcrl-ckpt-bench-") as tmp:
            parallel(Path(tmp))
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    models = [("tiny_grpo", tiny_model)] + ([] if args.skip_100m else [("qwen2-100m", model_100m)])
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hpcrl-ckpt-bench-") as tmp:
        print(f"writing to {tmp} (DCP threads={args.threads}, torch {torch.__version__})", flush=True)
        rows = []
        for name, make in models:
            print(f"  {name} ...", flush=True)
            rows.append(bench(name, make, Path(tmp), args.threads))
    header = (f"{'model':<11} {'params':>12} {'size MB':>9} {'save s':>7} {'MB/s':>6} {'commit s':>8} "
              f"{'verify s':>8} {'load s':>7} {'MB/s':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:<11} {r['params']:>12,} {r['mb']:>9.1f} {r['save']:>7.3f} {r['mb'] / r['save']:>6.0f} "
              f"{r['commit']:>8.3f} {r['verify']:>8.3f} {r['load']:>7.3f} {r['mb'] / r['load']:>6.0f}")
    print("save: DCP write of model + AdamW state (fsync'd); commit: SHA-256 + fsync of every file, manifest, "
          "rename; verify: latest_valid's full re-hash; load: DCP read into a fresh model + optimizer "
          "(bit-exact, checked)")


if __name__ == "__main__":
    main()
