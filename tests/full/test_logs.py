"""Tests of logs.py: rollout records, the progress line and the curves PNG."""

import ast
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from grpo_vlm import logs

ROOT = Path(__file__).resolve().parents[2]


# --- rollout records --------------------------------------------------------------------------------------


def rollout_inputs(samples):
    """B = 2 prompts, G = 3 completions each: N = 6 rows."""
    return dict(
        step=7,
        samples=samples,
        texts=[f"text {i}" for i in range(6)],
        components={"accuracy": [1.0, 0.0, 1.0, 0.0, 0.0, 0.0], "format": [1, 1, 0.5, 1, 1, 1]},
        reward=[2.0, 1.0, 1.5, 1.0, 1.0, 1.0],
        adv=[0.1 + 0.2, -1 / 3, 1 / 7, 0.0, 0.0, 0.0],
        lengths=[5, 9, 12, 3, 3, 3],
        truncated=[False, False, True, False, False, False],
        group_size=3,
    )


def test_rollout_records_have_one_line_per_completion_with_every_field():
    samples = [
        {"id": "a1", "images": ["img/a1_0.png", Path("img/a1_1.png")]},
        {"images": [Image.new("RGB", (8, 6))]},
    ]
    rows = logs.rollout_records(**rollout_inputs(samples))
    assert len(rows) == 6
    expected_keys = ["step", "sample_id", "group", "images", "completion", "rewards", "reward", "advantage"]
    assert all(list(row) == [*expected_keys, "length", "truncated"] for row in rows)
    assert [row["group"] for row in rows] == [0, 0, 0, 1, 1, 1]
    assert [row["sample_id"] for row in rows] == ["a1"] * 3 + [None] * 3  # the second sample has no id
    assert rows[0]["images"] == ["img/a1_0.png", "img/a1_1.png"]
    assert rows[3]["images"] == ["<in-memory image 8x6>"]  # synthetic tasks hold PIL images, not paths
    assert rows[2] == {
        "step": 7,
        "sample_id": "a1",
        "group": 0,
        "images": ["img/a1_0.png", "img/a1_1.png"],
        "completion": "text 2",
        "rewards": {"accuracy": 1.0, "format": 0.5},
        "reward": 1.5,
        "advantage": 1 / 7,
        "length": 12,
        "truncated": True,
    }
    # JSON round trip keeps every float exactly (full precision, not rounded)
    assert json.loads(json.dumps(rows)) == rows
    assert json.loads(json.dumps(rows[0]))["advantage"] == 0.1 + 0.2


def test_rollout_records_accept_one_sample_per_row_and_refuse_mismatched_lengths():
    per_prompt = [{"id": "a"}, {"id": "b"}]
    per_row = [s for s in per_prompt for _ in range(3)]  # what train.py's Rollout.samples holds
    assert logs.rollout_records(**rollout_inputs(per_row)) == logs.rollout_records(
        **rollout_inputs(per_prompt)
    )
    with pytest.raises(ValueError, match="adv"):
        logs.rollout_records(**{**rollout_inputs(per_prompt), "adv": [0.0] * 5})
    with pytest.raises(ValueError, match="samples"):
        logs.rollout_records(**rollout_inputs(per_prompt[:1]))


# --- progress ---------------------------------------------------------------------------------------------


def test_format_duration_reads_like_a_clock():
    assert [logs.format_duration(s) for s in (0, 45, 59.6, 126, 3725, 90000)] == [
        "0s",
        "45s",
        "1m00s",
        "2m06s",
        "1h02m",
        "25h00m",
    ]
    assert logs.format_duration(float("nan")) == "?"
    assert logs.format_duration(-1) == "?"


def test_progress_line_shows_kl_and_accuracy_only_when_known():
    record = {"step": 40, "reward/mean": 1.2344, "kl": 0.01234, "skipped": "", "frac_zero_std_groups": 0.25}
    line = logs.progress_line(40, 100, record, seconds_per_step=2.1, eta_seconds=126, accuracy=0.76)
    assert line == "step  40/100  reward 1.234  kl 0.0123  acc 0.760  2.1 s/step  ETA 2m06s"
    no_kl = {k: v for k, v in record.items() if k != "kl"}
    line = logs.progress_line(3, 100, no_kl, seconds_per_step=0.25, eta_seconds=24.25, accuracy=None)
    assert line == "step   3/100  reward 1.234  0.25 s/step  ETA 24s"


def test_progress_line_flags_skipped_steps_and_steps_without_signal():
    record = {"step": 5, "reward/mean": 0.0, "skipped": "non-finite loss", "frac_zero_std_groups": 1.0}
    line = logs.progress_line(5, 10, record, seconds_per_step=1.0, eta_seconds=5, accuracy=None)
    assert line.endswith(
        "ETA 5s  SKIPPED (non-finite loss)  no learning signal (every group's rewards equal)"
    )


def test_progress_redraws_only_on_a_terminal(capsys):
    logs.print_progress("step 1/2", tty=True)
    logs.print_progress("step 2/2", tty=True)
    assert capsys.readouterr().out == "\rstep 1/2\x1b[K\rstep 2/2\x1b[K"  # in place, no newline
    logs.print_progress("step 1/2", tty=False)
    logs.print_progress("step 2/2", tty=False)
    assert capsys.readouterr().out == "step 1/2\nstep 2/2\n"  # one plain line each in a log file


# --- curves -----------------------------------------------------------------------------------------------


def realistic_records(steps=100, eval_every=25):
    """Noisy reward around 1.2, KL rising from 0 to 0.03, an evaluation at step 0 and every eval_every."""
    rng = np.random.default_rng(0)
    records = [{"step": 0, "eval/accuracy": 0.4, "eval/reward": 0.5}]
    for s in range(1, steps + 1):
        r = {"step": s, "reward/mean": 1.2 + rng.normal(0, 0.15), "kl": 0.03 * s / steps, "skipped": ""}
        if s % eval_every == 0:
            r["eval/accuracy"] = 0.4 + 0.3 * s / steps
        records.append(r)
    skipped = records[min(63, steps)]
    skipped.update(skipped="non-finite loss", loss=float("nan"))
    return records


def labelled(ax, label: str) -> list:
    """The lines of a panel drawn under `label` (their legend entry)."""
    return [line for line in ax.get_lines() if line.get_label() == label]


def evaluation_marks(ax) -> list[float]:
    """The steps of a panel's dotted evaluation marks."""
    marks = [c for c in ax.collections if c.get_label() == "evaluation"]
    return sorted(float(segment[0][0]) for c in marks for segment in c.get_segments())


def step_ticks(ax) -> list[float]:
    """The ticks of the step axis that lie inside the panel (the locator also places some beyond it)."""
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def blank_border(pixels: np.ndarray, width: int = 4) -> bool:
    """Nothing drawn within `width` pixels of the image's edge: no label or line was clipped."""
    edges = [pixels[:width], pixels[-width:], pixels[:, :width], pixels[:, -width:]]
    return all((edge == 255).all() for edge in edges)


def test_curves_show_accuracy_points_evaluation_marks_skipped_steps_and_a_smoother_average():
    records = realistic_records()
    reward, accuracy, kl = logs.curves_figure(records).axes
    assert [ax.get_title(loc="left") for ax in (reward, accuracy, kl)] == [p[1] for p in logs.PANELS]
    # one accuracy point per evaluation (steps 0, 25, 50, 75, 100), each labelled with its value
    (points,) = accuracy.get_lines()
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert list(zip(points.get_xdata(), points.get_ydata())) == evals
    assert [t.get_text() for t in accuracy.texts] == [f"{v:.2f}" for _, v in evals]
    # the evaluation steps are marked on the reward and KL panels, the skipped step on the reward panel
    assert evaluation_marks(reward) == evaluation_marks(kl) == [0, 25, 50, 75, 100]
    (crosses,) = labelled(reward, "skipped step")
    assert list(crosses.get_xdata()) == [63] and not labelled(kl, "skipped step")
    # every step thin and light, the moving average thick, drawn after it (on top), and smoother
    (raw,), (smooth,) = labelled(reward, "every step"), labelled(reward, "EMA over 10 steps")
    assert (raw.get_color(), smooth.get_color()) == (logs.RAW, logs.SMOOTH)
    assert smooth.get_linewidth() > raw.get_linewidth()
    assert reward.get_lines().index(smooth) > reward.get_lines().index(raw)
    assert list(raw.get_xdata()) == list(range(1, 101))
    assert np.ptp(smooth.get_ydata()) < 0.7 * np.ptp(raw.get_ydata())
    legend = [t.get_text() for t in reward.get_legend().get_texts()]
    assert legend == ["every step", "EMA over 10 steps", "evaluation", "skipped step"]
    # the headers give the last value (and the last average) of each curve
    last = logs.short(records[-1]["reward/mean"])
    assert (
        reward.get_title(loc="right") == f"last {last} at step 100, EMA {logs.short(smooth.get_ydata()[-1])}"
    )
    assert accuracy.get_title(loc="right") == "last 0.7 at step 100"
    assert kl.get_title(loc="right").startswith("last 0.03 at step 100, EMA ")


def test_curves_png_is_written_with_nothing_clipped(tmp_path):
    path = tmp_path / "run" / "curves.png"
    logs.plot_curves(realistic_records(), path)
    image = Image.open(path)
    assert image.format == "PNG" and image.size == (900, 840)
    assert blank_border(np.asarray(image.convert("RGB")))


@pytest.mark.parametrize(
    "records",
    [
        [{"step": 1, "reward/mean": 1234.5678, "kl": 0.0}],  # one step
        [{"step": s, "reward/mean": 1.0} for s in range(1, 41)],  # constant reward, no KL, no evaluation
        [{"step": s, "reward/mean": -1234.5678 + 61.7 * s, "kl": -1e-3 * s} for s in range(1, 42)],
        [{"step": 0, "eval/accuracy": 1.0}],  # only the evaluation before training
        [],
    ],
    ids=["one-step", "constant-no-kl-no-eval", "large-and-negative", "eval-only", "empty"],
)
def test_curves_of_edge_cases_say_what_is_missing_and_save_without_clipping(tmp_path, records):
    figure = logs.curves_figure(records)
    for ax, (key, *_) in zip(figure.axes, logs.PANELS):
        logged = any(key in r for r in records)
        assert (logs.EMPTY_PANEL[key] in [t.get_text() for t in ax.texts]) == (not logged), key
        assert bool(ax.get_lines()) == logged, key
    logs.plot_curves(records, tmp_path / "curves.png")
    pixels = np.asarray(Image.open(tmp_path / "curves.png").convert("RGB"))
    assert pixels.shape == (840, 900, 3)
    assert blank_border(pixels)


def test_step_ticks_are_whole_and_round_and_accuracy_spans_0_to_1():
    def axes_of(records):
        figure = logs.curves_figure(records)
        figure.draw_without_rendering()  # autoscales the limits and places the ticks
        return figure.axes

    *_, kl = axes_of(realistic_records())
    assert step_ticks(kl) == [0, 20, 40, 60, 80, 100]
    *_, kl = axes_of([{"step": s, "kl": 0.01 * s} for s in range(1, 4)])
    assert step_ticks(kl) == [1, 2, 3]  # no 1.5 or 2.5
    *_, kl = axes_of([{"step": 1, "kl": 0.0}])
    assert step_ticks(kl) == [1]  # one step: one tick, not 0.96 ... 1.04
    for value in (0.45, 1.0, 0.0):  # a constant accuracy is not blown up to fill the panel
        _, accuracy, _ = axes_of([{"step": 0, "eval/accuracy": value}, {"step": 5, "eval/accuracy": value}])
        lo, hi = accuracy.get_ylim()
        assert -0.1 < lo <= 0 and 1.1 <= hi < 1.2  # room above 1 for the value labels
        assert list(accuracy.get_yticks()) == [0, 0.25, 0.5, 0.75, 1]


# --- imports ----------------------------------------------------------------------------------------------


def imports(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names of the modules `path` imports anywhere, and of those it imports at module scope."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    everywhere, top_level = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            everywhere |= {n.split(".")[0] for n in names}
            if node in tree.body:
                top_level |= {n.split(".")[0] for n in names}
    return everywhere, top_level


def test_logs_imports_no_project_module_and_no_tracker_at_import_time():
    everywhere, top_level = imports(ROOT / "grpo_vlm" / "logs.py")
    assert not everywhere & ({p.stem for p in ROOT.glob("*.py")} | {"grpo_vlm"})
    assert top_level - set(sys.stdlib_module_names) <= {"matplotlib"}


def test_a_steps_rows_reach_each_file_in_one_write_and_one_fsync(tmp_path, monkeypatch):
    """metrics, timings and every completion of a step: one write and one fsync per file, whole lines."""
    synced = []
    monkeypatch.setattr(logs.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    log = logs.StepLog(tmp_path, None, 0.0, 0, 10, 10, 2, 1.0)  # no progress line at step 1
    completions = [{"step": 1, "completion": f"row {i}"} for i in range(8)]
    log.step({"step": 1, "skipped": "", "frac_zero_std_groups": 0.0}, {"step": 1}, completions, 0)
    names = sorted(Path(path).name for path in synced)
    assert names == ["metrics.jsonl", "rollouts.jsonl", "timings.jsonl"]
    lines = (tmp_path / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["completion"] for line in lines] == [f"row {i}" for i in range(8)]
