"""Seconds and GB/s of one trainer -> rollout weight sync, next to a bare broadcast of the same bytes.

Three MPI ranks over gloo on this machine: rank 0 holds a Qwen2-shaped model of about 200M
parameters (fp32, random weights) as a trainer's stage leader would, ranks 1 and 2 are two
rollout replicas (native sampler models). The sync is hpcrl's own path: `StagedWeights.stage`
(the trainer's host copy), then `push` -> `WeightReceiver.receive`, bucket by bucket with two
buckets in flight, straight into the sampler's weights (its `landing_buffer`, made at the first sync).
The baseline is one `torch.distributed.broadcast` of a flat tensor of the same bytes on the same
ranks, received into a preallocated buffer (no load). Each is repeated and the median taken (the
first sync, which allocates the buffers, is printed apart); the loaded weights are checked bit for
bit.

    .venv/bin/mpiexec -n 3 .venv/bin/python bench/weight_sync.py [--hidden 1024 --layers 12] [--repeats 3]
    (or `.venv/bin/python bench/weight_sync.py`, which starts the three ranks itself)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from statistics import median

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def build(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                         tie_word_embeddings=False, max_position_embeddings=2048)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model.requires_grad_(False)


def timed(fn, group) -> float:
    import torch.distributed as dist

    dist.barrier(group=group)
    started = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - started


def main() -> int:
    args = parse()
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:  # started plainly: become the three ranks
        from hpcrl.launch.local import mpiexec_path

        return subprocess.call([mpiexec_path(), "-n", "3", sys.executable, __file__, *sys.argv[1:]],
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    from hpcrl.engines.native_sampler import NativeSampler
    from hpcrl.runtime.mpi_world import init_torch_distributed
    from hpcrl.engines.digests import weights_digest
    from hpcrl.runtime.weight_sync import Source, StagedWeights, WeightReceiver, push

    rank = MPI.COMM_WORLD.Get_rank()
    torch.set_num_threads(1)
    init_torch_distributed("gloo")
    group = dist.new_group([0, 1, 2], backend="gloo")
    model = build(args.hidden, args.layers, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        trained = [(n, p) for n, p in model.named_parameters()]
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the trainer's weights differ from the rollout's, so a sync is visible
            for _, p in trained:
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)
        staged = StagedWeights()
        stage_s = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            staged.stage(trained, 1)
            stage_s.append(time.perf_counter() - started)
        sync_fn = lambda: push(staged, group, 0)  # noqa: E731
    else:
        sampler = NativeSampler(model, stop_ids=(2,), pad_id=0)
        receiver = WeightReceiver(sampler.landing_buffer)

        def sync_fn() -> None:
            for bucket, landed in receiver.receive([Source(group, 0)]):
                if not landed:
                    sampler.load_weights(bucket)
    sync_s = [timed(sync_fn, group) for _ in range(args.repeats + 1)]
    digest = weights_digest(model.named_parameters())
    digests = MPI.COMM_WORLD.gather(digest, root=0)

    flat = torch.empty(nbytes // 4, dtype=torch.float32)
    if rank == 0:
        flat.normal_()
    bare_s = [timed(lambda: dist.broadcast(flat, src=0, group=group), group) for _ in range(args.repeats)]
    if rank == 0:
        gb = nbytes / 1e9
        sync, bare = median(sync_s[1:]), median(bare_s)
        print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {params / 1e6:.0f}M "
              f"parameters, {gb:.2f} GB fp32; 1 trainer rank -> 2 rollout ranks over gloo, {args.repeats} repeats")
        print(f"{'':<34}{'seconds':>9}{'GB/s':>8}")
        print(f"{'stage (trainer host copy)':<34}{median(stage_s):>9.3f}{gb / median(stage_s):>8.2f}")
        print(f"{'first sync (allocates buffers)':<34}{sync_s[0]:>9.3f}{gb / sync_s[0]:>8.2f}")
        print(f"{'sync: push -> receive -> load':<34}{sync:>9.3f}{gb / sync:>8.2f}")
        print(f"{'bare dist.broadcast, same bytes':<34}{bare:>9.3f}{gb / bare:>8.2f}")
        print(f"sync throughput / bare broadcast: {bare / sync:.2f}x (target >= 0.8x)")
        print(f"rollout weights equal the trainer's bit for bit: {len(set(digests)) == 1}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
