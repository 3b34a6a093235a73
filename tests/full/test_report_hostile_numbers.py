"""Every file the project writes is strict JSON; every reader takes the NaN and Infinity an older run wrote.

A real run whose every step the trainer's guard skips (`--beta 1e300`: a non-finite loss), a box that only the
frame mapping makes infinite, a lone surrogate in a record, the readers (`--resume`, the report) on metrics
with NaN, Infinity and 1e308; each case fails on the code before strict writing.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from full.helpers import train_args
from full.test_report import embedded, write_run_folder
from grpo_vlm import grounding, logs, report, trainer

ROOT = Path(__file__).resolve().parents[2]


def strict_lines(path: Path) -> list[dict]:
    """Each line of `path` parsed as RFC 8259 JSON: NaN, Infinity and -Infinity refused."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path.name}: {constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text(encoding="utf-8").splitlines()]


def skipping_run(folder: Path, **flags) -> dict:
    """2 steps whose loss is not finite: beta 1e300 times a KL above 0 is inf (or NaN)."""
    options = dict(
        output_dir=str(folder), device="cpu", train_size=8, eval_size=4, batch_size=2, group_size=2
    )
    options |= dict(max_new_tokens=8, steps=2, eval_every=1, seed=0, beta=1e300) | flags
    return trainer.main(train_args(**options))


def test_a_skipped_step_is_written_as_null_with_its_reason_and_the_run_gets_its_report(tmp_path, capsys):
    folder = tmp_path / "run"
    skipping_run(folder)
    out = capsys.readouterr().out
    assert "report.html not written" not in out
    records = strict_lines(folder / "metrics.jsonl")
    skipped = [r for r in records if r.get("skipped")]
    assert skipped, "the guard skipped no step: the case does not hold"
    for record in skipped:
        assert record["loss"] is None and record["skipped"] == "non-finite loss"
        assert record["non_finite"]["loss"] in ("NaN", "Infinity", "-Infinity")
    for name in ("timings.jsonl", "rollouts.jsonl", "eval_samples.jsonl", "run.json"):
        if name == "run.json":
            json.loads((folder / name).read_text(), parse_constant=lambda c: pytest.fail(f"run.json: {c}"))
        else:
            strict_lines(folder / name)
    data = embedded((folder / "report.html").read_text())
    assert data["run"]["last_metrics"]["loss"] is None
    assert data["charts"]["main"].startswith("data:image/png")


def test_a_normal_line_is_written_as_before():
    record = {"step": 1, "loss": 0.045, "kl": 4.9e-05, "skipped": "", "label": "通过"}
    assert logs.json_line(record) == json.dumps(record, ensure_ascii=False)


def test_a_lone_surrogate_a_plugin_returned_is_written_as_u_fffd_and_named(tmp_path):
    logs.append_jsonl(tmp_path / "r.jsonl", {"step": 1, "turns": [{"text": "cut \ud83d emoji"}]})
    (record,) = strict_lines(tmp_path / "r.jsonl")
    assert record["turns"][0]["text"] == "cut \ufffd emoji" and record["not_text"] == ["turns.0.text"]


def test_a_box_that_only_the_frame_mapping_makes_infinite_is_no_box():
    sample = {"bbox": [0, 0, 10, 10], "grounding": {"frame": "relative1000", "original_size": [4000, 3000]}}
    completion = "[0, 0, 1e308, 1e308] and [100, 100, 200, 200]"
    assert grounding.predicted_boxes(completion, sample) == [(400.0, 300.0, 800.0, 600.0)]
    assert grounding.predicted_points("(1e308, 1)", sample) == []


HOSTILE_METRICS = [
    '{"step": 0, "eval/accuracy": NaN, "eval/reward": Infinity}',
    *(
        f'{{"step": {s}, "reward/mean": {0.1 * s}, "kl": 0.01, "loss": {(-1) ** s}e308}}'
        for s in range(1, 12)
    ),
    '{"step": 12, "reward/mean": 1.0, "kl": -Infinity, "loss": NaN, "skipped": "non-finite loss"}',
]


def test_the_report_reads_nan_infinity_and_1e308_as_an_older_run_wrote_them(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=12, B=1, G=2)
    (folder / "metrics.jsonl").write_text("\n".join(HOSTILE_METRICS) + "\n")
    run = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps(run | {"summary": {"wall_time_s": math.nan}}))
    rows = (folder / "rollouts.jsonl").read_text().splitlines()
    rows[0] = (
        rows[0].replace('"reward": ', '"reward": NaN, "old": ', 1).replace('"length": 5', '"length": 1e400')
    )
    rows[0] = rows[0].replace('"size": [64, 48]', '"size": [Infinity, 48]')
    rows[1] = rows[1].replace('"boxes_parsed": [[1.5', '"boxes_parsed": [[-Infinity')
    rows[0] = rows[0].replace('"answer": "box"', '"answer": NaN')
    (folder / "rollouts.jsonl").write_text("\n".join(rows) + "\n")
    evals = (folder / "eval_samples.jsonl").read_text().replace('"reward": 0.0', '"reward": NaN')
    (folder / "eval_samples.jsonl").write_text(evals)
    data = embedded(report.build_report(folder))
    assert data["run"]["last_metrics"]["loss"] is None and data["run"]["evals"] == []
    assert data["run"]["summary"] == {"wall_time_s": None}
    assert data["charts"]["main"] and data["charts"]["grid"] is None  # 1e308 is not drawn: no panel
    assert data["charts"]["rest"][0][:4] == ["loss", 11, -1e308, 1e308]
    group = data["rollouts"]["steps"][0]["groups"][0]
    assert group["rows"][0][1] is None and group["rows"][0][3] is None
    assert group["images"][0]["size"] is None and group["rows"][1][6]["boxes"] == []
    assert group["target"] == {"bbox": [4, 6, 30, 40], "answer": None}
    notes = [p for p in data["problems"] if "NaN, Infinity or beyond the float range" in p]
    assert {n.split(":")[0] for n in notes} == {
        "metrics.jsonl",
        "run.json",
        "rollouts.jsonl",
        "eval_samples.jsonl",
    }


def test_the_report_command_on_a_folder_with_nan_exits_0(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=12, B=1, G=2)
    (folder / "metrics.jsonl").write_text("\n".join(HOSTILE_METRICS) + "\n")
    command = [sys.executable, "-m", "grpo_vlm.report", str(folder), "--out", str(tmp_path / "r.html")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    json.loads(
        (tmp_path / "r.html").read_text().split("id=report-data>", 1)[1].split("</script>", 1)[0],
        parse_constant=lambda c: pytest.fail(f"the report's data holds {c}"),
    )


def test_a_resumed_run_over_metrics_an_older_version_wrote_with_nan_and_1e308_finishes(tmp_path):
    folder = tmp_path / "run"
    options = dict(
        output_dir=str(folder), device="cpu", train_size=8, eval_size=4, batch_size=2, group_size=2
    )
    options |= dict(max_new_tokens=8, eval_every=1, seed=0)
    trainer.main(train_args(**options, steps=2))
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    lines = [lines[0].replace('"eval/accuracy": 0.5', '"eval/accuracy": NaN'), *lines[1:]]
    lines[1] = lines[1].replace('"kl": ', '"kl": 1e308, "was": ', 1)
    lines[2] = lines[2].replace('"kl": ', '"kl": -1e308, "was": ', 1)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resumed = train_args(**options | dict(output_dir=None), steps=3, resume=str(folder))
    summary = trainer.main(resumed, {"--steps"})
    assert summary["steps"] == 3 and math.isfinite(summary["accuracy_start"])
    json.loads((folder / "run.json").read_text(), parse_constant=lambda c: pytest.fail(f"run.json: {c}"))
    assert (folder / "curves.png").stat().st_size > 10_000 and (folder / "report.html").is_file()
