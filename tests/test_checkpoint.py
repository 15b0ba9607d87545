"""hpcrl.checkpoint on real files, real HDF5 and real torch.distributed (gloo, 2 processes)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpcrl.checkpoint import (Checkpoint, CheckpointStore, ConfigMismatchError, PreemptionSignal, config_changes,
                              config_hash, requeue_slurm_job)
from hpcrl.checkpoint.h5 import RunState, load_run_state, save_run_state
from hpcrl.checkpoint.model_state import load_train_state, save_train_state
from hpcrl.checkpoint.rng import capture_rng, load_rng, restore_rng, save_rng
from hpcrl.checkpoint.signals import run_ignoring_sigterm

REPO = Path(__file__).resolve().parents[1]


# -- store: atomic commit, pruning, verification ----------------------------------------------------

def _write(tmp: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)


def _commit(store: CheckpointStore, step: int, files: dict[str, bytes] | None = None, chash: str = "h") -> Checkpoint:
    tmp = store.begin(step)
    _write(tmp, files or {"model/__0_0.distcp": os.urandom(4096) + bytes([step % 256]), "rng/rank-0.json": b"{}"})
    return store.commit(step, tmp, chash, {"world": 3, "actor_train": {"dp": 2}}, {"note": step})


def test_commit_is_atomic_and_prunes_to_keep(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    _commit(store, 10)
    tmp = store.begin(20)
    assert tmp.name == f".step-20.tmp-{os.getpid()}" and tmp.parent == tmp_path / "checkpoints"
    _write(tmp, {"model/__0_0.distcp": b"x" * 100, "model/.metadata": b"meta", "rng/rank-0.json": b"{}"})
    # not visible until committed: a reader (status on a login node) still sees step 10 only
    assert [s for s, _ in store.steps()] == [10]
    assert store.latest_valid(clean=False).step == 10
    ckpt = store.commit(20, tmp, "abc", {"world": 3}, {"sampler": [0, 5]})
    assert not tmp.exists() and ckpt.path == tmp_path / "checkpoints" / "step-20"
    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["step"] == 20 and manifest["config_hash"] == "abc"
    assert manifest["layout"] == {"world": 3} and manifest["extra"] == {"sampler": [0, 5]}
    assert set(manifest["files"]) == {"model/__0_0.distcp", "model/.metadata", "rng/rank-0.json"}
    assert manifest["files"]["model/__0_0.distcp"]["size"] == 100
    import hashlib
    assert manifest["files"]["model/.metadata"]["sha256"] == hashlib.sha256(b"meta").hexdigest()
    _commit(store, 30)
    _commit(store, 40)
    assert [s for s, _ in store.steps()] == [40, 30]
    assert store.scratch_dirs() == []
    latest = store.latest_valid("h")
    assert latest.step == 40 and latest.manifest.extra == {"note": 40} and store.skipped == []


def test_truncated_and_bit_flipped_files_are_skipped_with_a_message(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (10, 20, 30):
        _commit(store, step)
    truncated = tmp_path / "checkpoints/step-30/model/__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    flipped = tmp_path / "checkpoints/step-20/model/__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[2000] ^= 0x10
    flipped.write_bytes(bytes(data))
    latest = store.latest_valid("h")
    assert latest.step == 10
    kept = " (not loaded, not pruned)"
    assert store.skipped == [
        "checkpoints/step-30: model/__0_0.distcp: 1000 bytes, the manifest says 4097 (truncated); skipped, kept as "
        "checkpoints/step-30.corrupt" + kept,
        "checkpoints/step-20: model/__0_0.distcp: SHA-256 mismatch (corrupt); skipped, kept as "
        "checkpoints/step-20.corrupt" + kept,
    ]
    # the evidence stays, renamed out of the way: never loaded, never counted or removed by pruning
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10", "step-20.corrupt",
                                                                            "step-30.corrupt"]
    # status view: read-only, every problem listed (without the job's renaming)
    flipped = tmp_path / "checkpoints/step-40"
    _commit(store, 40)
    (flipped / "manifest.json").unlink()
    scan = store.scan()
    assert [(e.step, e.problem is None) for e in scan] == [(40, False), (10, True)]
    assert store.latest_valid(clean=False).step == 10 and flipped.exists(), "hpcrl status renames nothing"


def test_missing_file_missing_and_broken_manifest_are_skipped(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (1, 2, 3, 4):
        _commit(store, step)
    (tmp_path / "checkpoints/step-4/rng/rank-0.json").unlink()
    (tmp_path / "checkpoints/step-3/manifest.json").unlink()
    (tmp_path / "checkpoints/step-2/manifest.json").write_text('{"format_version": 1, "step": ')
    assert store.latest_valid(clean=False).step == 1
    assert store.skipped[0] == "checkpoints/step-4: rng/rank-0.json: missing; skipped"
    assert store.skipped[1] == "checkpoints/step-3: manifest.json missing (incomplete write); skipped"
    assert store.skipped[2].startswith("checkpoints/step-2: manifest.json unreadable: not valid JSON")
    # nothing usable at all
    (tmp_path / "checkpoints/step-1/manifest.json").unlink()
    assert store.latest_valid(clean=False) is None and len(store.skipped) == 4


def test_partial_tmp_dir_is_ignored_and_cleaned(tmp_path):
    store = CheckpointStore(tmp_path)
    _commit(store, 10)
    partial = tmp_path / "checkpoints" / ".step-20.tmp-424242"
    _write(partial, {"model/__0_0.distcp": b"half", "manifest.json": b"{}"})
    assert store.latest_valid(clean=False).step == 10 and partial.exists()  # status: read-only
    assert store.latest_valid().step == 10 and not partial.exists()        # the job: cleans up
    assert store.skipped == [] and "interrupted write" in store.warnings[0]
    # begin() also clears leftovers of an earlier attempt
    _write(partial, {"x": b"1"})
    tmp = store.begin(20)
    assert not partial.exists() and tmp.exists()


def test_rewriting_a_step_after_resume_replaces_it_and_drops_the_abandoned_future(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for step in (10, 20, 30):
        _commit(store, step)
    (tmp_path / "checkpoints/step-30/manifest.json").unlink()  # damaged: the run resumes from 20
    assert store.latest_valid().step == 20
    new = _commit(store, 25, {"a": b"new"})  # a newer step-30 would be a leftover of the old attempt
    assert [s for s, _ in store.steps()] == [25, 20, 10]
    _commit(store, 20, {"a": b"again"})      # same step again: replaced atomically
    assert (tmp_path / "checkpoints/step-20/a").read_bytes() == b"again"
    assert new.path.exists() is False        # step-25 > 20 belonged to the abandoned attempt
    assert store.latest_valid().step == 20 and store.scratch_dirs() == []


def test_config_hash_ignores_safe_fields_and_mismatch_is_refused(tmp_path):
    job = {"name": "t", "seed": 1, "train": {"steps": 100, "lr": 0.003}, "checkpoint": {"every": 20, "keep": 2},
           "log": {"tensorboard": True}, "roles": {"actor_train": {"parallel": {"dp": 2, "tp": 1}}}}
    longer = json.loads(json.dumps(job))
    longer["train"]["steps"] = 300
    longer["checkpoint"]["keep"] = 5
    longer["roles"]["actor_train"]["parallel"]["dp"] = 1
    assert config_hash(longer) == config_hash(job)
    changed = json.loads(json.dumps(job))
    changed["train"]["lr"] = 0.001
    assert config_hash(changed) != config_hash(job)
    assert config_hash(changed, ignore=("train",)) == config_hash(job, ignore=("train",))
    assert config_changes(job, changed) == ["train.lr: 0.003 -> 0.001"]

    store = CheckpointStore(tmp_path)
    tmp = store.begin(20)
    _write(tmp, {"a": b"1"})
    store.commit(20, tmp, config_hash(job), {}, {"config": job})
    assert store.latest_valid(config_hash(longer)).step == 20
    with pytest.raises(ConfigMismatchError, match=r"step-20 was written by a different job configuration.*"
                                                  r"changed train.lr: 0.003 -> 0.001"):
        store.latest_valid(config_hash(changed), config=changed)
    with pytest.raises(ConfigMismatchError, match="--allow-config-change train.lr"):
        store.latest_valid(config_hash(changed), config=changed, allowed_changes=["algorithm"])
    with pytest.warns(UserWarning, match="resuming anyway"):
        assert store.latest_valid(config_hash(changed), config=changed, allowed_changes=["train.lr"]).step == 20
    with pytest.warns(UserWarning, match="resuming anyway"):
        assert store.latest_valid(config_hash(changed), config=changed, allowed_changes=["train"]).step == 20


def test_store_and_manifest_do_not_import_torch():
    code = ("import sys, hpcrl.checkpoint as c; c.CheckpointStore('.').scan(); "
            "assert not {'torch', 'h5py'} & set(sys.modules), sorted({'torch', 'h5py'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# -- model + optimizer state with DCP: DP=1 -> DP=2 (DDP over gloo) -> DP=1 --------------------------

def _tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 11))


def _train(model: torch.nn.Module, forward: torch.nn.Module, optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 5), generator=gen)
        logits = forward(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _snapshot(model: torch.nn.Module, optimizer) -> dict:
    names = {p: n for n, p in model.named_parameters()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def _assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys() and a["state"].keys() == b["state"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for name in a["state"]:
        assert set(a["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][name][key], b["state"][name][key]), (name, key)
    assert a["groups"] == b["groups"]


def _dp2_worker(rank: int, root: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    root_path = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{root_path / 'pg'}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1], backend="gloo")
        model = _tiny_model(seed=99)  # a different init: everything must come from the DP=1 checkpoint
        ddp = DistributedDataParallel(model, process_group=group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)  # lr too: param_groups are restored
        load_train_state(ddp, optimizer, root_path / "dp1", group)
        _assert_same(_snapshot(model, optimizer), torch.load(root_path / "dp1.pt"))
        _train(model, ddp, optimizer, steps=3, seed=100 + rank)  # different data per rank, averaged by DDP
        # the checkpoint protocol: rank 0 begins, broadcasts the path, all write, barrier, rank 0 commits
        store = CheckpointStore(root_path / "run", keep=2)
        box = [str(store.begin(7)) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        tmp = Path(box[0])
        save_train_state(ddp, optimizer, tmp / "actor_train", group)
        save_rng(tmp, rank)
        dist.barrier(group)
        if rank == 0:
            store.commit(7, tmp, "hash", {"actor_train": {"dp": 2}})
            torch.save(_snapshot(model, optimizer), root_path / "dp2.pt")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def test_dcp_resumes_bit_exact_across_dp_sizes(tmp_path):
    # DP=1 (one process, no process group at all) saves ...
    model = _tiny_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    _train(model, model, optimizer, steps=2, seed=0)
    save_train_state(model, optimizer, tmp_path / "dp1")
    torch.save(_snapshot(model, optimizer), tmp_path / "dp1.pt")
    # ... DP=2 (DDP over gloo, 2 processes) loads it, trains, saves through the store ...
    mp.spawn(_dp2_worker, args=(str(tmp_path),), nprocs=2, join=True)
    ckpt = CheckpointStore(tmp_path / "run").latest_valid("hash")
    assert ckpt is not None and ckpt.step == 7
    names = set(ckpt.manifest.files)
    assert {"actor_train/.metadata", "actor_train/__0_0.distcp", "actor_train/__1_0.distcp",
            "rng/rank-0.json", "rng/rank-1.json"} <= names
    # ... and DP=1 loads that, bit for bit.
    fresh = _tiny_model(seed=2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01, weight_decay=0.1)
    load_train_state(fresh, fresh_optimizer, ckpt.file("actor_train"))
    saved = torch.load(tmp_path / "dp2.pt")
    _assert_same(_snapshot(fresh, fresh_optimizer), saved)
    assert int(saved["state"]["1.weight"]["step"]) == 5
    # training continues from there exactly as the saver would have
    _train(fresh, fresh, fresh_optimizer, steps=1, seed=5)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_saving_a_never_stepped_optimizer_changes_nothing_it_learns(tmp_path):
    """An actor saved during PPO's critic warm-up: get_state_dict materialises Adam's state with a
    step of its own, which its first real update would count (step 2's bias correction). Saved and
    resumed, or only saved, it takes the same first step as an optimizer never saved."""
    never_saved = _tiny_model(seed=1)
    never_optimizer = torch.optim.AdamW(never_saved.parameters(), lr=0.01)
    saved = _tiny_model(seed=1)
    saved_optimizer = torch.optim.AdamW(saved.parameters(), lr=0.01)
    save_train_state(saved, saved_optimizer, tmp_path / "warmup")
    resumed = _tiny_model(seed=2)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    load_train_state(resumed, resumed_optimizer, tmp_path / "warmup")
    for model, optimizer in ((never_saved, never_optimizer), (saved, saved_optimizer), (resumed, resumed_optimizer)):
        _train(model, model, optimizer, steps=1, seed=3)
    expected = _snapshot(never_saved, never_optimizer)
    _assert_same(_snapshot(saved, saved_optimizer), expected)
    _assert_same(_snapshot(resumed, resumed_optimizer), expected)


def test_dcp_load_refuses_a_different_model(tmp_path):
    model = _tiny_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, model, optimizer, steps=1, seed=0)
    save_train_state(model, optimizer, tmp_path / "ck")
    other = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    with pytest.raises(RuntimeError, match="different model"):
        load_train_state(other, torch.optim.AdamW(other.parameters()), tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match=".metadata missing"):
        load_train_state(model, optimizer, tmp_path / "nothing")


# -- RNG -------------------------------------------------------------------------------------------

def _draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_capture_restore_and_files_reproduce_the_streams(tmp_path):
    random.gauss(0, 1)  # leaves a cached gaussian in both generators: part of the state
    np.random.randn()
    state = capture_rng()
    first = _draw()
    restore_rng(state)
    assert _draw() == first
    path = save_rng(tmp_path, rank=3)
    assert path == tmp_path / "rng" / "rank-3.json"
    expected = _draw()
    _draw()
    assert load_rng(tmp_path, rank=3) is True
    assert _draw() == expected
    assert load_rng(tmp_path, rank=4) is False  # a rank the saving run did not have


# -- HDF5: rollout buffer, metrics, controller state ---------------------------------------------

def test_h5_round_trip_of_ragged_columns_metrics_and_controller(tmp_path):
    buffer = {
        "prompt_ids": [[1, 5, 6, 7], [1, 9], [], [1, 2, 3, 4, 5, 6, 7, 8, 9]],
        "old_logprobs": [[-0.1, -2.5e-8, -13.25], [], [-0.3333333333333333], [0.0]],
        "rewards": [1.0, 0.0, -0.5, 0.25],
        "group": [0, 0, 1, 1],
        "stopped": [True, False, True, True],
        "answers": ["7", "12", "", "é9"],
        "stage/version": [3, 3, 4, 4],
        "ints_as_rows": [(1, 2), (3,), (), (4,)],
    }
    metrics = [{"step": 1, "reward/mean": 0.25, "loss": -0.01, "note": "warmup"},
               {"step": 2, "reward/mean": 0.5, "loss": 0.02, "kl": 1e-4, "clipped": False},
               {"step": 3, "reward/mean": 0.75, "kl": 2e-4, "clipped": True}]
    controller = {"step": 3, "sampler": {"epoch": 1, "position": 48}, "policy_version": 3,
                  "pending": [[0, 1], [2]], "name": "tiny-grpo", "best": None}
    path = save_run_state(tmp_path / "state.h5", buffer, metrics, controller)
    back = load_run_state(path)
    expected = {**buffer, "ints_as_rows": [[1, 2], [3], [], [4]]}
    assert back.buffer == expected and list(back.buffer) == list(buffer)
    assert back.metrics == metrics and back.controller == controller
    assert type(back.buffer["prompt_ids"][0][0]) is int and type(back.buffer["stopped"][0]) is bool
    assert type(back.metrics[0]["step"]) is int and type(back.buffer["old_logprobs"][0][0]) is float
    import h5py
    with h5py.File(path) as f:  # ragged as flat values + offsets
        assert f["buffer/c0/values"].shape == (15,) and f["buffer/c0/offsets"][()].tolist() == [0, 4, 6, 6, 15]
    assert load_run_state(save_run_state(tmp_path / "empty.h5")) == RunState()
    with pytest.raises(TypeError, match="column 'bad': mixes lists and scalars"):
        save_run_state(tmp_path / "bad.h5", {"bad": [[1], 2]})


# -- signals and requeue ---------------------------------------------------------------------------

def _wait_for(predicate, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_preemption_signal_sets_a_flag_and_keeps_the_first_signal():
    before = signal.getsignal(signal.SIGUSR1)
    flag = PreemptionSignal().install()
    try:
        assert flag.install() is flag and not flag.requested and flag.signal_name is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: flag.requested)
        assert flag.signal_name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # harmless: no exit, first signal kept
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: flag.count == 3)
        assert flag.signal_name == "SIGUSR1"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_scontrol_requeue_outlives_the_sigterm_its_requeue_sends_to_the_job():
    # Slurm SIGTERMs every process of a requeued job, the scontrol that asked included: it must
    # still exit with its own status, or an accepted requeue reads as a failed one (exit -15)
    result = run_ignoring_sigterm(["/bin/sh", "-c", 'kill -TERM $$; echo "still here"'], timeout=10)
    assert (result.returncode, result.stdout) == (0, "still here\n")
    killed = subprocess.run(["/bin/sh", "-c", 'kill -TERM $$; echo "still here"'], capture_output=True)
    assert killed.returncode == -signal.SIGTERM  # what it guards against: the default disposition


def test_requeue_is_false_outside_slurm_and_bounded_when_scontrol_hangs(monkeypatch, caplog):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue_slurm_job() is False
    # scontrol retries a missing slurm.conf for 60 s: the call must give up at its timeout
    monkeypatch.setenv("SLURM_JOB_ID", "999999999")
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    if subprocess.run(["which", "scontrol"], capture_output=True).returncode != 0:
        pytest.skip("scontrol not installed")
    started = time.monotonic()
    assert requeue_slurm_job(timeout=1.5) is False
    assert time.monotonic() - started < 5
    assert "scontrol requeue 999999999 did not answer within 1.5 s" in caplog.text


def test_a_state_written_before_outcomes_were_kept_reads_its_rewards_as_them(tmp_path):
    """Format 3 (before each sample kept its verifier outcome beside the shaped reward) still
    resumes: with no shaping told apart, the rewards are the outcomes."""
    import h5py

    from hpcrl.checkpoint.h5 import load_run_state, save_run_state

    path = save_run_state(tmp_path / "state.h5", buffer={"rewards": np.array([1.0, np.nan])})
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 3
    buffer = load_run_state(path).buffer
    np.testing.assert_array_equal(buffer["outcomes"], buffer["rewards"])
