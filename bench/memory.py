"""Peak memory per trainer rank, measured, next to the plan's estimate: does a rank hold only its shard?

A Qwen2-shaped model of ~300M parameters (random weights written once to safetensors in a
temporary directory and loaded through `model.path`, as a real checkpoint is) is trained for one
step on CPU ranks (gloo) by each engine layout: torch dp=1, torch/FSDP2 dp=2, DeepSpeed ZeRO-3
dp=1 and dp=2, Megatron tp=2; on request (--engines) Megatron dp=2 and ep=2 of a Qwen2-MoE model
(--experts), and torch with cp=2. Each rank measures its resident memory (Linux VmRSS, and the peak VmHWM,
reset between phases through /proc/self/clear_refs) above the process baseline taken after the
imports, before any model is built:

- start-up peak: building the engine from the files, next to what the engine holds once built
  (its weight shard, and the buffers it allocates up front: Megatron's gradient buffer, ZeRO's
  fp32 partitions); it must exceed that by no more than the largest unit loaded whole (a decoder
  layer, or the embedding): nothing materialises the whole model,
- held between steps (after a first short step): weights, gradients, master weights, optimizer
  state,
- step peak of the next step: the same plus activations and logits of the micro-batches,

and prints them next to the full model's bytes and the plan's estimate (hpcrl.placement.memory)
for the same role. With dp=2, held memory must be at most 0.6x that of the same engine at dp=1
(FSDP2 against torch dp=1: its dp=1 is plain torch). ZeRO-3 keeps an fp32 master copy even of
fp32 weights, so it holds 20 bytes per parameter where torch holds 16; `--dtype bfloat16` is the
layout jobs run (bf16 weights and gradients, fp32 masters and Adam state in every engine).

    python bench/memory.py [--dtype bfloat16] [--layers 24] [--samples 4] [--prompt 96] [--response 32] [--micro 2]
    python bench/memory.py --experts 8 --layers 8 --engines "megatron dp2" "megatron ep2"
    python bench/memory.py --prompt 1024 --response 1024 --micro 1 --engines "torch dp1" "torch cp2"
    python bench/memory.py probe --engine torch --model-dir D --json OUT [--set key=value ...]
        (one measurement; under mpiexec for dp or tp > 1; used by tests/test_memory_estimate.py)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
ENGINES = {  # name -> (job overrides, ranks)
    "torch dp1": (["roles.actor_train.engine=torch", "roles.actor_train.parallel.dp=1"], 1),
    "fsdp2 dp2": (["roles.actor_train.engine=torch", "roles.actor_train.fsdp=true",
                   "roles.actor_train.parallel.dp=2"], 2),
    "zero3 dp1": (["roles.actor_train.engine=deepspeed", "roles.actor_train.zero_stage=3",
                   "roles.actor_train.parallel.dp=1"], 1),
    "zero3 dp2": (["roles.actor_train.engine=deepspeed", "roles.actor_train.zero_stage=3",
                   "roles.actor_train.parallel.dp=2"], 2),
    "megatron tp2": (["roles.actor_train.engine=megatron", "roles.actor_train.parallel.tp=2",
                      "roles.actor_train.parallel.dp=1"], 2),
    # a mixture-of-experts model (--experts): experts replicated over 2 DP ranks, or split over 2 EP ranks
    "megatron dp2": (["roles.actor_train.engine=megatron", "roles.actor_train.parallel.dp=2"], 2),
    "megatron ep2": (["roles.actor_train.engine=megatron", "roles.actor_train.parallel.ep=2",
                      "roles.actor_train.parallel.dp=2"], 2),
    # each sequence's positions split over 2 ranks (context parallelism), against torch dp1
    "torch cp2": (["roles.actor_train.engine=torch", "roles.actor_train.parallel.cp=2",
                   "roles.actor_train.parallel.dp=1"], 2),
}
DEFAULT_ENGINES = ["torch dp1", "fsdp2 dp2", "zero3 dp1", "zero3 dp2", "megatron tp2"]


# glibc serves allocations below its mmap threshold from the heap and keeps what is freed there;
# the threshold grows with every large block freed (up to 32 MiB), so a rank that frees many
# mid-sized tensors (ZeRO's defragmentation, Adam's temporaries) keeps their pages: VmHWM would
# count memory freed long ago. A fixed 1 MiB threshold maps every tensor above it on its own and
# unmaps it when freed, so resident memory follows the live tensors, which is what the plan
# estimates (and what a GPU allocator's allocated bytes count).
LIVE_BYTES_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 20)}


def _status(field: str) -> int:
    """A /proc/self/status size in bytes (VmRSS: resident now, VmHWM: peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS


def _release() -> None:
    """Hand freed heap memory back to the OS, so that VmRSS counts live tensors only."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _warm_up_runtime() -> None:
    """One tiny training step before the baseline: torch maps its kernels' libraries and scratch
    buffers on first use (~100 MB of RSS that belongs to the process, not to any model)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(2, 8, dtype=torch.long), labels=torch.ones(2, 8, dtype=torch.long)).loss.backward()
    optimizer.step()
    del model, optimizer
    _release()


def model_overrides(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                    context: int) -> list[str]:
    return [f"model.hidden_size={hidden}", f"model.intermediate_size={intermediate}", f"model.num_layers={layers}",
            f"model.num_heads={heads}", f"model.num_kv_heads={kv_heads}", f"model.vocab_size={vocab}",
            f"model.max_position_embeddings={context}", "model.tie_word_embeddings=true"]


def write_model(overrides: list[str], directory: Path) -> Path:
    """The job's random model as HF files (what the controller writes), in `directory`."""
    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.model_files import write_random_init

    return write_random_init(load_job(REPO / "jobs" / "tiny_grpo.yaml", overrides), CharTokenizer(), directory)


def probe(args: argparse.Namespace) -> None:
    """One rank's measurement (run by every rank of an mpiexec world): see the module doc."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.model_files import ModelFiles
    from hpcrl.engines.torch_trainer import Samples
    from hpcrl.placement.memory import ModelShape, estimate_role_memory
    from hpcrl.ragged import Ragged

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml", [f"model.path={args.model_dir}", *args.set])
    role = job.roles.actor_train
    engine_name = job.engine("actor_train")
    ranks = role.parallel.dp * role.parallel.tp * role.parallel.pp * role.parallel.cp
    distributed = ranks > 1 or engine_name == "deepspeed"   # DeepSpeed needs a group, also of one rank
    world = 1
    if distributed:
        from hpcrl.runtime.mpi_world import init_torch_distributed

        init_torch_distributed("gloo")
        world = dist.get_world_size()
    rank = dist.get_rank() if distributed else 0
    group = dist.new_group(list(range(world))) if distributed else None
    # the engine's library is imported before the baseline, like torch and transformers
    importlib.import_module({"megatron": "megatron.core", "deepspeed": "deepspeed"}.get(engine_name, "transformers"))
    tokenizer = CharTokenizer()
    files = ModelFiles(job.model.path)
    rng = np.random.default_rng(rank)
    n, p, r = args.samples, args.prompt, args.response
    prompts = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, p) for _ in range(n)], np.int32)
    responses = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, r) for _ in range(n)], np.int32)
    zeros = Ragged.from_rows([np.zeros(r, np.float32) for _ in range(n)], np.float32)
    samples = Samples(prompts, responses, {"old_logprobs": zeros.with_values(zeros.values - 3.0),
                                           "advantages": zeros.with_values(rng.standard_normal(n * r).astype(np.float32))})
    _warm_up_runtime()
    baseline = _status("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    if engine_name == "megatron":
        from hpcrl.engines.megatron.engine import MegatronTrainer
        from hpcrl.engines.megatron.groups import new_role_groups, role_rank_groups

        groups = new_role_groups(role_rank_groups(role.parallel.model_dump(), list(range(world))), rank)
        engine = MegatronTrainer(files, job, tokenizer.pad_token_id, groups)
        local = sum(p.numel() * p.element_size() for p in engine.gpt.parameters())
    elif engine_name == "deepspeed":
        from hpcrl.engines.deepspeed_engine import DeepSpeedTrainer

        engine = DeepSpeedTrainer(files, job, tokenizer.pad_token_id, group, zero_stage=job.zero_stage("actor_train"))
        local = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    else:
        from torch.distributed.tensor import DTensor

        from hpcrl.engines.torch_trainer import TorchTrainer

        context = (group, group) if role.parallel.cp > 1 else None   # cp over every rank (dp = 1)
        engine = TorchTrainer(files, job, tokenizer.pad_token_id, None if context else group, fsdp=role.fsdp,
                              context_groups=context)
        local = sum((q.to_local() if isinstance(q, DTensor) else q).numel() * q.element_size()
                    for q in engine.module.parameters())
    startup_s = time.perf_counter() - started
    startup_peak = _status("VmHWM") - baseline
    _release()
    built = _status("VmRSS") - baseline
    # a first step on two short samples allocates the gradients and Adam's state, as every step
    # after the first finds them: what the rank holds between steps
    rows = np.arange(min(2, n))
    short = Samples(Ragged.from_rows([q[:2] for q in prompts.take(rows)], np.int32),
                    Ragged.from_rows([q[:1] for q in responses.take(rows)], np.int32),
                    {k: Ragged.from_rows([q[:1] for q in v.take(rows)], np.float32) for k, v in samples.columns.items()})
    engine.train_step(short, job.train.lr)
    _release()
    held = _status("VmRSS") - baseline
    _reset_peak()
    started = time.perf_counter()
    engine.train_step(samples, job.train.lr)
    step_s = time.perf_counter() - started
    step_peak = _status("VmHWM") - baseline
    shape = ModelShape.from_model(job.model)
    estimate = estimate_role_memory("actor_train", job, shape, role.parallel)
    element = 2 if job.model.dtype != "float32" else 4
    largest = max(files.numel("model.layers.0."), files.numel("model.embed_tokens."), files.numel("lm_head."))
    found = {"rank": rank, "startup_peak": startup_peak, "built": built, "held": held, "step_peak": step_peak,
             "shard": local, "layer": files.numel("model.layers.0.") * element, "largest_unit": largest * element,
             "full": files.numel() * element,
             "estimate": estimate.total, "estimate_parts": dict(estimate.parts), "startup_s": startup_s,
             "step_s": step_s}
    everyone = [found]
    if distributed:
        everyone = [None] * world
        dist.all_gather_object(everyone, found)
    if rank == 0:
        Path(args.json).write_text(json.dumps(everyone))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def measure(engine: str, model_dir: Path, overrides: list[str], shape: argparse.Namespace) -> list[dict]:
    """Run the probe for one engine layout (under mpiexec when it has several ranks)."""
    from hpcrl.launch.local import mpiexec_path

    extra, ranks = ENGINES[engine]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "found.json"
        command = [sys.executable, __file__, "probe", "--model-dir", str(model_dir), "--json", str(out),
                   "--samples", str(shape.samples), "--prompt", str(shape.prompt), "--response", str(shape.response)]
        for item in [*overrides, *extra]:
            command += ["--set", item]
        command = [mpiexec_path(), "-n", str(ranks), *command]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks)),
               "PYTHONWARNINGS": "ignore", **LIVE_BYTES_MALLOC}
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
        if result.returncode != 0:
            raise SystemExit(f"{engine}: the probe failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=4, help="samples per rank")
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--micro", type=int, default=2, help="train.micro_batch_size")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model.dtype: bfloat16 computes in bf16 over fp32 master weights")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen2-MoE model with this many experts (top-2, "
                        "each expert --intermediate / 2 wide)")
    parser.add_argument("--engines", nargs="*", default=DEFAULT_ENGINES, choices=list(ENGINES))
    args = parser.parse_args()
    overrides = model_overrides(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab,
                                args.prompt + args.response)
    # the expert sizes build the model; the ranks read them from its config.json (model.path)
    experts = ([f"model.num_experts={args.experts}", f"model.moe_intermediate_size={args.intermediate // 2}"]
               if args.experts else [])
    overrides += ["model.arch=qwen2_moe"] if args.experts else []
    overrides += [f"model.dtype={args.dtype}", f"train.micro_batch_size={args.micro}",
                  f"rollout.max_new_tokens={args.response}",
                  f"train.prompts_per_step={args.samples}", "algorithm.group_size=1", "train.minibatches=1",
                  "train.ppo_epochs=1", "algorithm.kl_loss.coef=0"]
    with tempfile.TemporaryDirectory(prefix="hpcrl-memory-") as tmp:
        model_dir = write_model(overrides + experts, Path(tmp))
        rows = {}
        for engine in args.engines:
            rows[engine] = measure(engine, model_dir, overrides, args)
            print(f"measured {engine}", flush=True)
    full = rows[args.engines[0]][0]["full"]
    print(f"\nmodel: {full / GIB:.2f} GB of weights ({args.layers} layers, hidden {args.hidden}); "
          f"{args.dtype}; {args.samples} samples x ({args.prompt} + {args.response}) tokens per rank, micro-batch {args.micro}")
    print("GB above the process baseline, per rank (worst rank):")
    print(f"{'engine':>14} {'shard':>6} {'built':>6} {'start-up':>9} {'excess':>7} {'held':>6} {'step peak':>10} "
          f"{'estimate':>9} {'est/meas':>9} {'step s':>7}")
    for engine, found in rows.items():
        worst = max(found, key=lambda f: f["step_peak"])
        excess = max(f["startup_peak"] - f["built"] for f in found)
        print(f"{engine:>14} {worst['shard'] / GIB:6.2f} {worst['built'] / GIB:6.2f} "
              f"{max(f['startup_peak'] for f in found) / GIB:9.2f} {excess / GIB:7.2f} {worst['held'] / GIB:6.2f} "
              f"{worst['step_peak'] / GIB:10.2f} {worst['estimate'] / GIB:9.2f} "
              f"{worst['estimate'] / worst['step_peak']:9.2f} {worst['step_s']:7.1f}")
    unit = rows[args.engines[0]][0]
    print(f"(excess: start-up peak above what the engine holds once built; the largest unit loaded whole is "
          f"{unit['largest_unit'] / GIB:.2f} GB, a decoder layer {unit['layer'] / GIB:.3f} GB)")
    for sharded, whole in (("fsdp2 dp2", "torch dp1"), ("zero3 dp2", "zero3 dp1"), ("megatron ep2", "megatron dp2")):
        if whole in rows and sharded in rows:
            ratio = max(f["held"] for f in rows[sharded]) / rows[whole][0]["held"]
            print(f"{sharded} holds {ratio:.2f}x of {whole}'s state per rank (weights, gradients, optimizer)")
    if "torch cp2" in rows and "torch dp1" in rows:
        def activations(found):   # what a step adds to the held state, on the worst rank
            return max(f["step_peak"] - f["held"] for f in found)
        print(f"torch cp2 adds {activations(rows['torch cp2']) / activations(rows['torch dp1']):.2f}x of torch dp1's "
              f"step memory above the held state per rank (activations and logits)")
    print("\nthe estimate's parts (GB) for each layout:")
    for engine, found in rows.items():
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in found[0]["estimate_parts"].items() if v)
        print(f"  {engine}: {parts}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        parser = argparse.ArgumentParser(prog="bench/memory.py probe")
        parser.add_argument("probe")
        parser.add_argument("--model-dir", required=True)
        parser.add_argument("--json", required=True)
        parser.add_argument("--samples", type=int, default=4)
        parser.add_argument("--prompt", type=int, default=96)
        parser.add_argument("--response", type=int, default=32)
        parser.add_argument("--set", action="append", default=[])
        probe(parser.parse_args())
    else:
        main()
