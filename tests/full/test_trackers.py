"""Tests of trackers.py: TensorBoard for real when installed; wandb and trackio through stand-in modules."""

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from full.test_logs import ROOT, imports, realistic_records, rollout_inputs
from grpo_vlm import logs, trackers


def test_report_to_none_gives_no_tracker(tmp_path):
    assert trackers.open_tracker("none", tmp_path, {"lr": 1e-5}) is None
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["wandb", "trackio", "tensorboard"])
def test_missing_tracker_package_names_the_flag_and_the_pip_command(tmp_path, monkeypatch, kind):
    monkeypatch.setitem(sys.modules, kind, None)  # makes `import kind` fail as if not installed
    message = f"--report-to {kind} needs the {kind} package, which is not installed: pip install {kind}"
    with pytest.raises(ImportError) as error:
        trackers.open_tracker(kind, tmp_path, {})
    assert str(error.value) == message


ROWS = logs.rollout_records(**rollout_inputs([{"id": "a1"}, {"id": "b|2"}]))
ROWS[1]["completion"] = "line one\nline | two"


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is optional (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = trackers.open_tracker("tensorboard", tmp_path, {"lr": 1e-5, "output_dir": Path("runs/x")})
    records = realistic_records(steps=10, eval_every=5)
    for record in records[1:]:
        tracker.log(record, record["step"])
    tracker.log_completions(ROWS[:3], step=5)
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"reward/mean", "kl", "eval/accuracy"} <= set(scalars)
    assert "skipped" not in scalars and "step" not in scalars  # strings and the x axis are not scalars
    assert "loss" not in scalars  # its only value, the skipped step's, is NaN
    got = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert [s for s, _ in got] == list(range(1, 11))
    assert np.allclose([v for _, v in got], [r["reward/mean"] for r in records[1:]])  # float32 in the file
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("eval/accuracy")] == [(5, 0.55), (10, 0.7)]
    assert not any(math.isnan(e.value) for e in events.Scalars("reward/mean"))

    def text(tag):
        (event,) = events.Tensors(tag)
        return event.step, event.tensor_proto.string_val[0].decode()

    step, table = text("completions/text_summary")
    assert step == 5
    assert "| step | sample_id | group | reward | advantage | rewards | completion |" in table
    assert "line one<br>line \\| two" in table  # the completion's newline and pipe do not break the table
    assert "accuracy 0, format 1" in table
    assert '"lr": 1e-05' in text("config/text_summary")[1]


def fake_tracker_module(name: str, calls: list) -> types.ModuleType:
    """A stand-in for wandb / trackio that records the calls trackers.py makes (the real packages are not
    installed in CI, and would contact a server or write outside the test's directory)."""
    module = types.ModuleType(name)
    module.init = lambda **kwargs: calls.append(("init", kwargs))
    module.log = lambda metrics, step=None: calls.append(("log", metrics, step))
    module.finish = lambda: calls.append(("finish",))
    module.Table = lambda columns, data: ("table", columns, data)
    return module


@pytest.mark.parametrize("kind", ["wandb", "trackio"])
def test_wandb_and_trackio_receive_config_numeric_metrics_and_a_completions_table(
    tmp_path, monkeypatch, kind
):
    calls = []
    monkeypatch.setitem(sys.modules, kind, fake_tracker_module(kind, calls))
    tracker = trackers.open_tracker(kind, tmp_path / "run", {"lr": 1e-5}, run_name="run")
    tracker.log({"step": 3, "loss": float("nan"), "kl": 0.5, "skipped": "non-finite loss", "lr": 1e-5}, 3)
    tracker.log_completions(ROWS[:2], 3)
    tracker.close()
    init = {"project": "grpo-vlm", "config": {"lr": 1e-5}, "name": "run"}
    if kind == "wandb":
        init["dir"] = str(tmp_path / "run")
    assert calls[0] == ("init", init)
    assert calls[1] == ("log", {"kl": 0.5, "lr": 1e-5}, 3)  # no NaN, no strings, no "step"
    _, logged, step = calls[2]
    assert step == 3
    _, columns, data = logged["completions"]
    assert columns == ["step", "sample_id", "group", "reward", "advantage", "rewards", "completion"]
    assert data[0] == [7, "a1", 0, 2.0, 0.1 + 0.2, "accuracy 1, format 1", "text 0"]
    assert calls[3] == ("finish",)


def test_trackio_without_a_table_class_gets_the_completions_as_markdown(tmp_path, monkeypatch):
    calls = []
    module = fake_tracker_module("trackio", calls)
    del module.Table
    monkeypatch.setitem(sys.modules, "trackio", module)
    trackers.open_tracker("trackio", tmp_path, {}).log_completions(ROWS[:1], 4)
    _, logged, step = calls[-1]
    assert step == 4 and logged["completions"].startswith("| step | sample_id |")


def test_trackers_import_no_project_module_and_no_tracker_at_import_time():
    everywhere, top_level = imports(ROOT / "grpo_vlm" / "trackers.py")
    assert not everywhere & ({p.stem for p in ROOT.glob("*.py")} | {"grpo_vlm"})
    assert top_level <= set(sys.stdlib_module_names)  # each tracker's package only inside open_tracker
