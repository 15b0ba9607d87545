#!/usr/bin/env bash
# The GPU check of the megatron and vllm engines: the memory check (a ~0.4B Qwen2 loaded from safetensors
# straight onto the GPU by the torch and megatron engines, their peak against the plan's estimate), a few
# GRPO steps of a tiny Qwen2 on one GPU (scripts/gpu_check.py says what is checked), then, with two
# GPUs or more, `hpcrl run` with the trainer and rollout on GPUs of their own (the staged, pinned weight
# sync; NCCL to vLLM). Two uses:
#
#   scripts/gpu_check.sh --prepare   here, where pip reaches PyPI: download the wheels the GPU machine
#                                    lacks (megatron-core, pydantic; Python 3.12, x86-64) into
#                                    build/gpu_wheels/ (git-ignored). vLLM is not among them: its wheel
#                                    and CUDA libraries are far over what travels to a machine that has
#                                    no registry, so there it runs only where it is installed already.
#   scripts/gpu_check.sh [ARGS]      on the GPU machine: install those wheels (if present) into
#                                    /tmp/site and run scripts/gpu_check.py ARGS (e.g. --steps 5).
#
# With the device tool: run(command="scripts/gpu_check.sh", carry=["build/gpu_wheels"], timeout_s=540).
# Each failure stops the script at once with a line starting "gpu_check: FAIL:".
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu_wheels
PYTHON=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$WHEELS"
    # One version of each; the GPU machine's Python is 3.12 (see the device notes), its torch,
    # numpy, packaging, transformers, pyyaml and mpi4py are already there.
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" \
        megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0
    ls -l "$WHEELS"
    du -sh "$WHEELS"
    exit 0
fi

fail() { echo "gpu_check: FAIL: $*"; exit 1; }
command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this machine has no NVIDIA GPU (or no driver)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi cannot reach the GPU"
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "$PYTHON's torch sees no CUDA device"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || fail "installing the carried wheels from $WHEELS failed"
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
else
    echo "gpu_check: no wheels in $WHEELS (run scripts/gpu_check.sh --prepare and carry it): using what is installed"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
"$PYTHON" scripts/gpu_check.py "$@"

# The runtime itself on two GPUs: the trainer (megatron) on one, rollout on the other, one step
# ahead (max_staleness 1). The trainer stages its weights in pinned host memory and each push goes
# straight to vLLM's worker over NCCL (or, for the native sampler, through host memory); the
# controller compares the digests of the trainer and the rollout after every sync and stops the
# run on a difference.
GPUS=$(nvidia-smi -L | wc -l)
if (( GPUS < 2 )); then
    echo "gpu_check: $GPUS GPU: the runtime on separate trainer and rollout GPUs (and the NCCL push to vLLM) is NOT CHECKED"
    exit 0
fi
ROLLOUT=native
"$PYTHON" -c 'import vllm' 2>/dev/null && ROLLOUT=vllm
RUN=$(mktemp -d /tmp/hpcrl-gpu-run.XXXXXX)
printf 'name: gpu-check\nscheduler: local\nnodes: 1\ndevices_per_node: 2\ndevice: cuda\ndevice_memory_gb: 40\n' \
    > "$RUN/cluster.yaml"
"$PYTHON" -m hpcrl run jobs/tiny_grpo.yaml --cluster "$RUN/cluster.yaml" --run-dir "$RUN/run" \
    --set train.steps=4 --set roles.actor_train.engine=megatron --set roles.actor_train.parallel.dp=1 \
    --set roles.reference.engine=megatron --set roles.actor_infer.engine=$ROLLOUT --set log.check_weights=true \
    --set rollout.max_staleness=1 --set log.tensorboard=false --set checkpoint.every=0 \
    || fail "hpcrl run on 2 GPUs (rollout: $ROLLOUT) failed"
"$PYTHON" - "$RUN/run/metrics.jsonl" <<'EOF' || fail "the 2-GPU run's metrics are wrong"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
for r in rows:
    assert r["digest_actor_infer"] == r["digest_actor_train"][:1], r
print(f"gpu_check: 2-GPU run: 4 steps, rollout weights equal the trainer's after every sync; sync "
      f"{max(r['time_sync_s'] for r in rows) * 1e3:.0f} ms at most, stage "
      f"{max(r['time_stage_s'] for r in rows) * 1e3:.0f} ms at most")
EOF
echo "gpu_check: PASS: the runtime on 2 GPUs with $ROLLOUT rollout"
