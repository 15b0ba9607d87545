"""The plan's memory estimate against what a training step really allocates (CPU: the torch engine,
and the megatron engine's attention scores).

Each case is a fresh process (bench/memory.py's probe) that loads a Qwen2-shaped model from
safetensors, trains two steps (the first allocates gradients and Adam's state, as every later
step finds them) and reports its resident-memory peak above the process baseline; the plan's
estimate for that job must lie within 30% of it, at two model sizes and two micro-batch sizes.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import memory as bench_memory  # noqa: E402  (bench/memory.py: the probe this test runs)

SAMPLES, PROMPT, RESPONSE = 8, 192, 64


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    found = {}
    for layers in (4, 8):
        overrides = bench_memory.model_overrides(256, 704, layers, 4, 2, 8192, PROMPT + RESPONSE)
        overrides += [f"rollout.max_new_tokens={RESPONSE}", f"train.prompts_per_step={SAMPLES}",
                      "algorithm.group_size=1", "train.minibatches=1", "algorithm.kl_loss.coef=0"]
        model_dir = bench_memory.write_model(overrides, tmp_path_factory.mktemp(f"layers{layers}"))
        shape = SimpleNamespace(samples=SAMPLES, prompt=PROMPT, response=RESPONSE)
        for micro in (8, 2):
            [found[layers, micro]] = bench_memory.measure("torch dp1", Path(model_dir),
                                                          [*overrides, f"train.micro_batch_size={micro}"], shape)
    return found


@pytest.mark.parametrize("layers", [4, 8])
@pytest.mark.parametrize("micro", [8, 2])
def test_the_estimate_is_within_30_percent_of_the_measured_peak(measured, layers, micro):
    found = measured[layers, micro]
    assert 0.7 < found["estimate"] / found["step_peak"] < 1.3, found


def test_activations_are_what_changes_with_the_micro_batch(measured):
    for layers in (4, 8):
        whole, quarter = measured[layers, 8], measured[layers, 2]
        assert whole["step_peak"] > quarter["step_peak"] * 1.3, (whole, quarter)
        assert whole["estimate_parts"]["activations"] == pytest.approx(4 * quarter["estimate_parts"]["activations"])


def test_building_the_engine_never_holds_more_than_its_weights_and_one_layer(measured):
    for found in measured.values():
        assert found["startup_peak"] <= found["shard"] + found["layer"], found


def test_the_megatron_estimate_counts_the_attention_scores_its_layers_keep(tmp_path):
    """megatron-core's local attention keeps each layer's [heads/tp, S, S] softmax output for the
    backward: with 16 heads over tp 2 and 1024-token sequences that is most of a step's peak (an
    estimate of the linear terms alone was a quarter of it)."""
    pytest.importorskip("megatron.core")
    prompt, response = 992, 32
    overrides = bench_memory.model_overrides(256, 704, 4, 16, 4, 1024, prompt + response)
    overrides += [f"rollout.max_new_tokens={response}", "train.prompts_per_step=1", "algorithm.group_size=1",
                  "train.minibatches=1", "train.micro_batch_size=1", "algorithm.kl_loss.coef=0"]
    model_dir = bench_memory.write_model(overrides, tmp_path)
    found = bench_memory.measure("megatron tp2", Path(model_dir), overrides,
                                 SimpleNamespace(samples=1, prompt=prompt, response=response))
    worst = max(found, key=lambda rank: rank["step_peak"])
    assert worst["estimate_parts"]["attention scores"] > worst["step_peak"] / 2, worst
    assert 0.7 < worst["estimate"] / worst["step_peak"] < 1.3, worst
