"""Controller time and bytes sent per step at a realistic batch, with workers that compute nothing.

Nine MPI ranks on this machine: rank 0 runs hpcrl's real `Controller` (scheduler, dispatch,
advantages, the weight-sync calls) on a batch of 512 samples (64 prompts x 8) with 1024-token
prompts and 2048-token responses; ranks 1-8 run the real worker loop (`serve`: the replica
broadcast of each batch, replies from the result ranks only) with stand-in roles that return
precomputed responses, log-probs and rewards: no model compute. The layout is a real plan:
`actor_train` and `reference` (megatron, tp=2 pp=2 dp=2: 2 replicas of 4 ranks), `actor_infer`
(vllm, tp=4 dp=2) and `reward` (dp=8) on the same 8 GPUs of one node.

"Raw columns" are the bytes of the token columns a step must move at least: what each call
carries once (prompts to rollout, responses to the reward workers, prompts + responses to the
trainer and the reference, and the train batch with its three per-token float columns).
"before" is the data path of hpcrl before the packed data plane, replayed on the same ranks and
batch: Python lists pickled to every rank of a replica, replies from every rank, and the
controller's per-token Python loops (the log-prob gap, advantages to lists).

    .venv/bin/python bench/data_plane.py [--steps 5] [--prompts 64 --group 8 --prompt-len 1024 --response-len 2048]
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RANKS = 9


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=2048)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def job_and_profile(args: argparse.Namespace, workdir: Path):
    """The job (prompts from a file of `prompt-len`-token prompts) and a one-node, 8-GPU profile."""
    from hpcrl.config import load_job, load_profile

    with open(workdir / "prompts.jsonl", "w") as out:
        for i in range(args.prompts * 2):
            out.write(json.dumps({"prompt": str(i).rjust(args.prompt_len - 1, "7"), "answer": "1"}) + "\n")
    (workdir / "job.yaml").write_text(f"""
name: data-plane-bench
dataset: {{path: {workdir / 'prompts.jsonl'}}}
model: {{hidden_size: 64, num_layers: 4, num_heads: 4, num_kv_heads: 2, max_position_embeddings: 4096}}
algorithm: {{group_size: {args.group}, kl_loss: {{coef: 0.001}}}}
train: {{steps: {args.steps + 1}, prompts_per_step: {args.prompts}}}
rollout: {{max_new_tokens: {args.response_len}}}
checkpoint: {{every: 0}}
log: {{tensorboard: false, print_every: 1000}}
roles:
  actor_train: {{engine: megatron, parallel: {{tp: 2, pp: 2, dp: 2}}}}
  actor_infer: {{engine: vllm, parallel: {{tp: 4, dp: 2}}, colocate_with: actor_train}}
  reference: {{engine: megatron, colocate_with: actor_train}}
  reward: {{parallel: {{dp: 8}}, colocate_with: actor_train}}
""")
    (workdir / "cluster.yaml").write_text("name: one-node\nscheduler: local\nnodes: 1\ndevices_per_node: 8\n"
                                          "device: cuda\ndevice_memory_gb: 80\n")
    return load_job(workdir / "job.yaml"), load_profile(str(workdir / "cluster.yaml"))


class StandIns:
    """The roles of one worker rank, answering with precomputed columns of the right shapes."""

    def __init__(self, response_len: int, sync_stage_group, sources):
        import numpy as np

        from hpcrl.ragged import Ragged
        from hpcrl.runtime.weight_sync import StagedWeights, WeightReceiver, WeightServer

        self.response_len = response_len
        self.rng = np.random.default_rng(0)
        self.cache: dict[tuple, object] = {}
        self.np, self.Ragged = np, Ragged
        self.staged = StagedWeights()   # empty: this bench moves no weights (see bench/weight_sync.py)
        self.receiver = WeightReceiver()
        self.sources = sources
        if sync_stage_group is not None:
            self.server = WeightServer(self.staged, sync_stage_group)

    def _rows(self, rows: int, dtype, low: float, high: float):
        key = (rows, dtype)
        if key not in self.cache:
            values = self.rng.uniform(low, high, rows * self.response_len).astype(dtype)
            self.cache[key] = self.Ragged(values, self.np.arange(rows + 1, dtype=self.np.int64) * self.response_len)
        return self.cache[key]

    # actor_infer
    def generate(self, batch, step, attempt=0):
        rows = len(batch["prompt_ids"])
        return {"response_ids": self._rows(rows, self.np.int32, 3, 12), "behaviour_logprobs": self._rows(
            rows, self.np.float32, -3, 0), "finished": self.np.ones(rows, dtype=bool)}

    def receive_weights(self, digest):
        from hpcrl.runtime.weight_sync import Source

        sources = [Source(local=self.staged) if g is None else Source(g, s) for _, g, s in self.sources]
        for _ in self.receiver.receive(sources):
            pass

    # actor_train, reference
    def logprobs(self, batch):
        return {"old_logprobs": self._rows(len(batch["prompt_ids"]), self.np.float32, -3, 0)}

    def train_step(self, batch, lr):
        return {"metrics": [{"loss": 0.0}]}

    def stage_weights(self, version, digest):
        self.staged.version = version
        return None

    # reward
    def score(self, batch):
        return {"rewards": self.rng.integers(0, 2, len(batch["response_ids"])).astype(self.np.float64)}


class Reference(StandIns):
    def logprobs(self, batch):
        return {"ref_logprobs": self._rows(len(batch["prompt_ids"]), self.np.float32, -3, 0)}


def legacy_step(comm, layout, prompt_ids: list[list[int]], group: int) -> tuple[float, int]:
    """One step of the old data path on the controller: (controller CPU seconds, bytes sent).

    As hpcrl did it before: each call pickles its replica's shard of Python lists to every rank of
    the replica, every rank replies, and the controller pads lists row by row into tensors and
    turns results back into lists (advantages, the KL), and loops over tokens for the log-prob gap."""
    import pickle

    import torch

    cpu, sent = time.process_time(), 0

    def call(role: str, method: str, batch: dict) -> dict:
        nonlocal sent
        target = layout.roles[role]
        shards = _split_lists(batch, target.dp_size)
        for rank in target.ranks:
            message = (method, shards[target.dp_index(rank)])
            sent += len(pickle.dumps(message, protocol=5))
            comm.send(message, dest=rank, tag=21)
        replies = {rank: comm.recv(source=rank, tag=22) for rank in target.ranks}
        first = [replies[target.data_leader(d)] for d in range(target.dp_size)]
        return {k: [x for reply in first for x in reply[k]] for k in first[0]}

    def right_pad(rows: list[list[float]]) -> torch.Tensor:   # the old engines/batch.py
        out = torch.zeros((len(rows), max(len(r) for r in rows)))
        for i, row in enumerate(rows):
            out[i, :len(row)] = torch.tensor(row)
        return out

    generated = call("actor_infer", "generate", {"prompt_ids": prompt_ids})
    call("reward", "score", {"response_ids": generated["response_ids"], "answers": ["1"] * len(prompt_ids)})
    sequences = {"prompt_ids": prompt_ids, "response_ids": generated["response_ids"]}
    old = call("actor_train", "logprobs", sequences)["logprobs"]
    ref = call("reference", "logprobs", sequences)["logprobs"]
    lengths = [len(r) for r in old]
    mask = right_pad([[1.0] * n for n in lengths])
    rewards = torch.rand(len(old))
    per_sequence = (rewards.view(-1, group) - rewards.view(-1, group).mean(1, keepdim=True)).view(-1)
    advantages = [row[:n] for row, n in zip((per_sequence[:, None] * mask).tolist(), lengths)]
    kl = float(((right_pad(old) - right_pad(ref)) * mask).sum() / mask.sum())
    gap = max(abs(a - b) for o, b_row in zip(old, generated["behaviour_logprobs"]) for a, b in zip(o, b_row))
    call("actor_train", "train", {**sequences, "old_logprobs": old, "ref_logprobs": ref, "advantages": advantages})
    del kl, gap
    return time.process_time() - cpu, sent


def _split_lists(batch: dict, parts: int) -> list[dict]:
    size = len(next(iter(batch.values())))
    bounds = [size * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i]:bounds[i + 1]] for k, v in batch.items()} for i in range(parts)]


def legacy_worker(comm, response_len: int) -> None:
    """The old worker side: every rank gets its replica's lists, every rank replies with lists."""
    import numpy as np

    rng = np.random.default_rng(0)
    while True:
        method, shard = comm.recv(source=0, tag=21)
        if method == "stop":
            return
        rows = len(next(iter(shard.values())))
        floats = rng.uniform(-3, 0, (rows, response_len)).astype(np.float32).tolist()
        if method == "generate":
            reply = {"response_ids": rng.integers(3, 12, (rows, response_len)).tolist(), "behaviour_logprobs": floats}
        elif method == "logprobs":
            reply = {"logprobs": floats}
        elif method == "score":
            reply = {"rewards": rng.integers(0, 2, rows).astype(float).tolist()}
        else:
            reply = {"metrics": [{"loss": 0.0}]}
        comm.send(reply, dest=0, tag=22)


def main() -> int:
    args = parse()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:  # started plainly: become the nine ranks
        from hpcrl.launch.local import mpiexec_path

        with tempfile.TemporaryDirectory() as workdir:
            return subprocess.call([mpiexec_path(), "-n", str(RANKS), sys.executable, __file__, *sys.argv[1:],
                                    "--workdir", workdir], env={**os.environ, "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    from hpcrl.checkpoint import PreemptionSignal
    from hpcrl.data import CharTokenizer
    from hpcrl.placement import compile_plan
    from hpcrl.runtime.groups import build_process_groups
    from hpcrl.runtime.layout import world_layout
    from hpcrl.runtime.mpi_world import TRAFFIC, init_torch_distributed

    torch.set_num_threads(1)
    rank = comm.Get_rank()
    workdir = Path(args.workdir)
    job, profile = job_and_profile(args, workdir) if rank == 0 else (None, None)
    job, profile = comm.bcast((job, profile), root=0)
    layout = world_layout(compile_plan(job, profile))
    init_torch_distributed("gloo")
    groups = build_process_groups(layout, rank, job.rollout.sync_timeout_s)
    if rank != 0:
        from hpcrl.runtime.worker import serve

        sync = layout.sync
        stage = sync.sources.index(rank) if rank in sync.sources else None
        sources = [(s, None if src == rank else groups.sync[s], src) for s, src in enumerate(sync.sources)
                   ] if rank in sync.loaders else []
        roles = StandIns(args.response_len, groups.sync.get(stage), sources)
        serve({"actor_train": roles, "actor_infer": roles, "reward": roles,
               "reference": Reference(args.response_len, None, [])}, groups.replica)
        legacy_worker(comm, args.response_len)
        dist.destroy_process_group()
        return 0

    from hpcrl.runtime.controller import Controller

    def measure(steps: int, name: str) -> tuple[float, int, float, Controller]:
        run_job = job.model_copy(update={"train": job.train.model_copy(update={"steps": steps})})
        controller = Controller(run_job, layout, CharTokenizer(), workdir / name, PreemptionSignal())
        cpu, sent, wall = time.process_time(), TRAFFIC.bytes, time.perf_counter()
        controller.run()
        return time.process_time() - cpu, TRAFFIC.bytes - sent, time.perf_counter() - wall, controller

    measure(1, "warm-up")  # first messages, caches
    one, many = measure(1, "one"), measure(1 + args.steps, "many")
    cpu, sent, wall = ((b - a) / args.steps for a, b in zip(one[:3], many[:3]))
    many[3].shutdown()   # the workers leave `serve` for the old data path below
    samples = args.prompts * args.group
    p, r = args.prompt_len, args.response_len
    # Per call, the token columns it carries (4-byte ids and floats, 8-byte offsets per packed column):
    # generate: prompts (+ 8-byte budgets); reward: responses; logprobs x 2: prompts + responses;
    # train: prompts, responses, old and ref log-probs, advantages. Back: responses and their
    # log-probs, two log-prob columns.
    tokens_out = p + r + 2 * (p + r) + (p + r) + 3 * r
    raw_out = samples * (4 * tokens_out + 8 * 11 + 8)
    raw_in = samples * 4 * (r + r + 2 * r)
    prompt_ids = [[7] * p for _ in range(samples)]
    legacy_cpu, legacy_sent = [], 0
    for _ in range(2):
        spent, legacy_sent = legacy_step(comm, layout, prompt_ids, args.group)
        legacy_cpu.append(spent)
    for worker in range(1, RANKS):
        comm.send(("stop", None), dest=worker, tag=21)
    print(f"batch: {samples} samples ({args.prompts} prompts x {args.group}), {p}-token prompts, {r}-token "
          f"responses; 8 worker ranks, actor_train/reference 2 replicas of tp=2 pp=2, actor_infer 2 x tp=4")
    print(f"raw token columns per step: {raw_out / 1e6:.1f} MB out, {raw_in / 1e6:.1f} MB back")
    print(f"{'':<44}{'before':>10}{'after':>10}")
    print(f"{'controller bytes sent per step (MB)':<44}{legacy_sent / 1e6:>10.1f}{sent / 1e6:>10.1f}")
    print(f"{'  / raw columns':<44}{legacy_sent / raw_out:>10.2f}{sent / raw_out:>10.2f}"
          "   (target <= 1.2: each replica's shard once, not once per rank)")
    print(f"{'controller CPU seconds per step':<44}{min(legacy_cpu):>10.3f}{cpu:>10.3f}   (target < 0.5)")
    print(f"{'wall seconds per step (workers idle)':<44}{'':>10}{wall:>10.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
