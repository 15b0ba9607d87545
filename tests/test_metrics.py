"""hpcrl.metrics on real files: JSONL durability and resume, TensorBoard events, report, progress."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hpcrl.metrics import (
    METRICS_FILE,
    SUPERSEDED_FILE,
    MetricsLog,
    StepProgress,
    StepRecorder,
    TensorBoardLog,
    format_step_line,
    read_metrics,
    report_main,
    sparkline,
    summarize,
    write_report,
)


def _records(n: int) -> list[dict]:
    return [{"step": s, "reward_mean": s / 10, "reward_std": 0.1, "kl": 0.001 * s, "loss": -0.01 * s,
             "samples_per_s": 8.0, "time_step_s": 2.0} for s in range(1, n + 1)]


# --- jsonl -----------------------------------------------------------------------------------


def test_jsonl_append_and_read(tmp_path):
    path = tmp_path / "runs" / "a" / METRICS_FILE
    with MetricsLog(path) as log:
        for r in _records(3):
            log.write(r)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["step"] == 1
    assert read_metrics(path) == _records(3)
    with MetricsLog(path) as log:  # reopening without resume appends
        log.write({"step": 4, "reward_mean": 0.4, "note": "x"})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_jsonl_numpy_and_torch_scalars(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / METRICS_FILE
    with MetricsLog(path) as log:
        log.write({"step": 1, "a": np.float32(0.5), "b": np.int64(3), "c": [1, 2]})
    assert read_metrics(path) == [{"step": 1, "a": 0.5, "b": 3, "c": [1, 2]}]


def test_jsonl_resume_supersedes_atomically_and_loses_nothing(tmp_path):
    path = tmp_path / METRICS_FILE
    with MetricsLog(path) as log:
        for r in _records(10):
            log.write(r)
    with MetricsLog(path, resume_step=6) as log:
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
        for r in _records(10)[6:]:
            log.write(r)
    steps = [r["step"] for r in read_metrics(path)]
    assert steps == list(range(1, 11))  # every step exactly once
    superseded = tmp_path / SUPERSEDED_FILE
    assert [r["step"] for r in read_metrics(superseded)] == [7, 8, 9, 10], "the recomputed steps' first records"
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE, SUPERSEDED_FILE]  # no temp file left
    with MetricsLog(path, fresh=True):
        pass
    assert read_metrics(path) == [] and len(read_metrics(superseded)) == 14, "a fresh start moves them all"
    with MetricsLog(path, resume_step=2, restored=[{"step": 1, "reward_mean": 0.5}, {"step": 2}]) as log:
        assert log.rebuilt == 2 and [r["step"] for r in read_metrics(path)] == [1, 2]
    with MetricsLog(tmp_path / "new" / METRICS_FILE, resume_step=3):  # resume with no file yet
        pass
    assert read_metrics(tmp_path / "new" / METRICS_FILE) == []


def test_jsonl_torn_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    with MetricsLog(path) as log:
        log.write({"step": 1, "reward_mean": 0.1})
    with open(path, "a") as f:
        f.write('{"step": 2, "rew')  # the job was killed mid-write
    assert read_metrics(path) == [{"step": 1, "reward_mean": 0.1}]
    with MetricsLog(path) as log:  # appending cuts the torn tail first
        log.write({"step": 2, "reward_mean": 0.2})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with open(path, "a") as f:
        f.write("garbage\n{\"step\": 3}\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:3"):
        read_metrics(path)


# --- tensorboard -----------------------------------------------------------------------------


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)], acc.Tags()["scalars"]


def test_tensorboard_scalars_readable(tmp_path):
    torch = pytest.importorskip("torch")
    with TensorBoardLog(tmp_path / "tb") as tb:
        n = tb.log(1, {"step": 1, "reward_mean": 0.25, "kl": torch.tensor(0.5), "name": "x",
                       "flag": True, "vec": [1, 2]})
        tb.log(2, {"reward_mean": 0.75, "kl": 0.125})
    assert n == 2
    points, tags = _scalars(tmp_path / "tb", "reward_mean")
    assert sorted(tags) == ["kl", "reward_mean"]
    assert points == [(1, 0.25), (2, 0.75)]
    assert _scalars(tmp_path / "tb", "kl")[0] == [(1, 0.5), (2, 0.125)]


# --- recorder --------------------------------------------------------------------------------


def test_recorder_resume_records_each_step_once(tmp_path, capsys):
    run = tmp_path / "runs" / "demo"
    with StepRecorder(run, total_steps=8, print_every=4, tensorboard=True) as rec:
        for r in _records(6):  # preempted after step 6; checkpoint was at step 4
            rec.record(r["step"], r)
    with StepRecorder(run, total_steps=8, print_every=4, tensorboard=True, resume_step=4) as rec:
        for r in _records(8)[4:]:
            rec.record(r["step"], {k: v + 1 if k == "reward_mean" else v for k, v in r.items()})
    records = read_metrics(run / METRICS_FILE)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[4]["reward_mean"] == pytest.approx(1.5)  # the resumed run's value
    points, _ = _scalars(run / "tensorboard", "reward_mean")
    assert [s for s, _ in points] == list(range(1, 9))  # TensorBoard purged the cut-short tail
    assert points[5][1] == pytest.approx(1.6)
    out = capsys.readouterr().out
    assert "step 8/8  reward 1.8" in out
    assert out.strip().splitlines()[-1].startswith("reward_mean ")  # sparkline covers all 8 steps
    assert "first 0.1  last 1.8  best 1.8 @ step 8" in out


def test_recorder_fresh_run_restarts_files_and_without_tensorboard(tmp_path, capsys):
    run = tmp_path / "run"
    with StepRecorder(run, 3, 1, tensorboard=False) as rec:
        for r in _records(3):
            rec.record(r["step"], r)
    with StepRecorder(run, 3, 1, tensorboard=False, show_progress=False) as rec:
        rec.record(1, {"reward_mean": 9.0})
    assert read_metrics(run / METRICS_FILE) == [{"step": 1, "reward_mean": 9.0}]
    assert not (run / "tensorboard").exists()


# --- progress --------------------------------------------------------------------------------


def test_sparkline_known_sequence():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([7, 0]) == "█▁"
    assert sparkline([2, 2, 2]) == "▄▄▄"
    assert sparkline([0, math.nan, 1]) == "▁ █"
    assert sparkline(list(range(100)), width=10) == "▁▂▃▃▄▅▆▆▇█"  # bin means 4.5, 14.5, ..., 94.5
    assert sparkline([]) == ""


def test_step_line_format():
    line = format_step_line(20, 100, {"reward_mean": 0.43, "kl": 0.002, "loss": -0.01, "samples_per_s": 7.91})
    assert line == "step 20/100  reward 0.43  kl 0.002  loss -0.01  7.9 samples/s"
    assert format_step_line(1, 5, {"loss": 1.0}) == "step 1/5  loss 1"


def test_progress_prints_every_n_steps(capsys):
    bar = StepProgress(10, print_every=3)
    for s in range(1, 11):
        bar.update(s, {"reward_mean": s / 10, "kl": 0.002, "loss": -0.01, "samples_per_s": 7.9})
    bar.close()
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == ["3/10", "6/10", "9/10", "10/10"]
    assert lines[0] == "step 3/10  reward 0.3  kl 0.002  loss -0.01  7.9 samples/s"
    assert lines[-1] == "reward_mean ▁▂▃▃▄▅▆▆▇█  first 0.1  last 1  best 1 @ step 10"
    assert "10/10" in captured.err  # the bar itself goes to stderr


def test_progress_disabled_prints_nothing(capsys):
    bar = StepProgress(4, print_every=1, enabled=False)
    for s in range(1, 5):
        bar.update(s, {"reward_mean": 1.0})
    bar.close()
    assert capsys.readouterr() == ("", "")


# --- report ----------------------------------------------------------------------------------


def test_report_png_and_summary(tmp_path, capsys):
    run = tmp_path / "runs" / "demo"
    with MetricsLog(run / METRICS_FILE) as log:
        for r in _records(30):
            log.write(r)
    png = write_report(run)
    assert png == run / "report.png" and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = summarize(read_metrics(run / METRICS_FILE))
    assert (s.steps, s.first_step, s.last_step) == (30, 1, 30)
    assert s.reward_first10 == pytest.approx(0.55)  # mean of 0.1..1.0
    assert s.reward_last10 == pytest.approx(2.55)  # mean of 2.1..3.0
    assert (s.reward_best, s.reward_best_step) == (pytest.approx(3.0), 30)
    assert s.total_time_s == pytest.approx(60.0)
    png.unlink()
    assert report_main(str(run)) == 0
    out = capsys.readouterr().out
    assert "30 steps (1-30), 1m 00s of step time" in out
    assert "first-10 0.55  last-10 2.55  best 3 @ step 30" in out
    assert f"report: {png}" in out and png.exists()


def test_report_main_missing_or_empty(tmp_path, capsys):
    assert report_main(str(tmp_path / "nope")) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text("")
    assert report_main(str(tmp_path)) == 2
    assert "has not finished a step" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


def test_import_is_light():
    """Login nodes: importing hpcrl.metrics must not pull in torch, matplotlib or tqdm."""
    code = ("import sys, hpcrl.metrics; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_report_plots_reward_by_domain_and_evaluation_and_prints_the_last_evaluation(tmp_path, capsys):
    from hpcrl.metrics.report import report_main

    with (tmp_path / "metrics.jsonl").open("w") as out:
        for step in range(1, 21):
            record = {"step": step, "reward_mean": step / 20, "reward_mean/math": step / 20,
                      "reward_mean/code": 0.1, "moe_load_max": 1.5, "moe_load_min": 0.5}
            if step % 10 == 0:
                record.update({"eval/math/greedy_reward": step / 25, "eval/math/pass@4": step / 22})
            out.write(json.dumps(record) + "\n")
    assert report_main(str(tmp_path)) == 0
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "eval/math/greedy_reward  0.8 (step 20)" in capsys.readouterr().out
    from hpcrl.metrics.report import _multi_curve_panels, by_step, read_metrics

    records = by_step(read_metrics(tmp_path / "metrics.jsonl"))
    panels = dict((label, keys) for keys, label in _multi_curve_panels(records))
    assert panels == {"reward by domain": ["reward_mean/math", "reward_mean/code"],
                      "evaluation": ["eval/math/greedy_reward", "eval/math/pass@4"],
                      "expert load (1: balanced)": ["moe_load_max", "moe_load_min"]}
