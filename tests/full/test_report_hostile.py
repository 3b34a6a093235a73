"""The report of a hostile or unlucky run folder: built in bounded time and memory, every bad line listed, the
command writing only its own file and reading nothing through a link.

The folders are written by hand (test_report.write_run_folder, then damaged as the case says); the adversarial
ones of the bounds (a 1 MB target, 1,300 metric names, a 40,000-row step, a line longer than the cap) are the
folders docs/report.md measures. Their browser side is test_report_hostile_browser.py.
"""

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from full.test_report import embedded, jsonl, write_run_folder
from grpo_vlm import report, run_reader

ROOT = Path(__file__).resolve().parents[2]


def report_command(*argv, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "grpo_vlm.report", *map(str, argv)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def one_error(child: subprocess.CompletedProcess) -> str:
    assert child.returncode == 2 and "Traceback" not in child.stderr, child.stderr[-3000:]
    assert child.stderr.count("\n") == 1, child.stderr
    return child.stderr.strip()


def rewrite(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


# --- 2. text that is not what it seems ----------------------------------------------------------------------


def test_a_completion_with_a_lone_surrogate_shows_u_fffd_and_a_problem_note(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=1)
    lines = (folder / "rollouts.jsonl").read_text().splitlines()
    lines[0] = lines[0].replace('"completion": "answer', '"completion": "cut \\ud83d answer', 1)
    (folder / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    result = report_command(folder, "--out", tmp_path / "r.html")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    data = embedded((tmp_path / "r.html").read_text(encoding="utf-8"))
    row = data["rollouts"]["steps"][0]["groups"][0]["rows"][0]
    assert data["texts"][row[0]].startswith("cut \ufffd answer")
    note = "rollouts.jsonl:1: completion: not valid text (a lone surrogate at character 5); shown with U+FFFD"
    assert note in data["problems"]


@pytest.mark.parametrize(
    ("step", "why"),
    [
        ("9" * 5000, "not a record with an integer step"),  # read as null: beyond the float range
        ("9" * 20, "a step out of range (0 to 2**53)"),
        ("-3", "a step out of range"),
    ],
)
def test_a_step_that_no_number_of_the_page_holds_is_a_listed_bad_line(tmp_path, step, why):
    folder = write_run_folder(tmp_path / "run", steps=2)
    with (folder / "rollouts.jsonl").open("a") as f:
        f.write(f'{{"step": {step}, "group": 0, "completion": "x"}}\n')
    data = embedded(report.build_report(folder))
    assert any(p.startswith(f"rollouts.jsonl:17: {why}") for p in data["problems"]), data["problems"]
    assert [s["step"] for s in data["rollouts"]["steps"]] == [1, 2]


def test_a_target_nested_980_deep_is_a_listed_bad_line(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=2)
    records = jsonl(folder / "rollouts.jsonl")
    records[0]["target"] = {"answer": "box"}
    deep = json.dumps(records[0]).replace('"answer": "box"', '"answer": ' + "[" * 980 + "]" * 980)
    lines = (folder / "rollouts.jsonl").read_text().splitlines()
    (folder / "rollouts.jsonl").write_text("\n".join([deep, *lines[1:]]) + "\n")
    data = embedded(report.build_report(folder))
    assert "rollouts.jsonl:1: JSON nested too deeply (more than 32 levels)" in data["problems"]
    assert len(data["rollouts"]["steps"][0]["groups"][0]["rows"]) == 3  # its group's other rows


# --- 3. bounded in time and memory ------------------------------------------------------------------------


def test_a_1_mb_unbroken_target_is_cut_like_a_prompt(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=2)
    smiles = "C1=CC=C(C=C1)" * 80_000  # about 1 MB without a space
    for name in ("rollouts.jsonl", "eval_samples.jsonl"):
        records = jsonl(folder / name)
        for record in records:
            record["target"] = {"answer": smiles, "bbox": [4, 6, 30, 40]}
        rewrite(folder / name, records)
    page = report.build_report(folder)
    longest = max(len(run) for run in re.findall(r"(?:C1=CC=C\(C=C1\))+", page))
    assert longest <= report.MAX_TEXT
    assert len(page) < 3_000_000  # 16 groups and 4 pairs, each target cut to 4,000 characters
    group = embedded(page)["rollouts"]["steps"][0]["groups"][0]
    assert group["target"]["answer"].endswith(
        f"… [{len(smiles) - report.MAX_TEXT:,} more characters in the run's file]"
    )
    assert group["target"]["bbox"] == [4, 6, 30, 40]  # still drawn


def metrics_with_many_names(folder: Path, names: int = 1300, lines: int = 12) -> None:
    records = [
        {"step": s, "reward/mean": s / 10, "kl": 0.01} | {f"m{k:04d}": s * k / 7 for k in range(names)}
        for s in range(1, lines + 1)
    ]
    rewrite(folder / "metrics.jsonl", records)


def test_1300_metric_names_draw_at_most_24_panels_and_list_the_rest(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=2)
    metrics_with_many_names(folder)
    started = time.monotonic()
    page = report.build_report(folder)
    seconds = time.monotonic() - started
    charts = embedded(page)["charts"]
    assert len(charts["grid_keys"]) == report.MAX_PANELS == 24
    assert len(charts["rest"]) == 1300 - 24 and charts["rest"][0][:2] == ["m0024", 12]
    from PIL import Image  # the grid's PNG: 8 rows of 3 panels, not 434

    grid = Image.open(__import__("io").BytesIO(base64.b64decode(charts["grid"].split(",", 1)[1])))
    assert grid.size[1] <= 1400
    assert len(page) < 2_000_000 and seconds < 60


def test_a_step_of_40000_rows_keeps_its_first_4096(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=1, B=1, G=2)
    base = jsonl(folder / "rollouts.jsonl")[0]
    rows = [base | {"group": i // 8, "completion": f"row {i}"} for i in range(40_000)]
    rewrite(folder / "rollouts.jsonl", rows)
    data = embedded(report.build_report(folder))
    (step,) = data["rollouts"]["steps"]
    assert sum(len(g["rows"]) for g in step["groups"]) == report.MAX_STEP_ROWS == 4096
    assert "rollouts.jsonl: step 1 logged 40,000 rows; the first 4,096 are shown" in data["problems"]


def peak_bytes(folder: Path) -> tuple[dict, int]:
    """(the report's data, the peak of the memory Python allocated while building it)."""
    tracemalloc.start()
    try:
        data = embedded(report.build_report(folder))
        return data, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_line_longer_than_the_cap_is_listed_and_never_held(tmp_path, monkeypatch):
    """The 2 GB line of the issue, at 8 MB with a 1 MB cap: the same code path, the same ratio."""
    monkeypatch.setattr(run_reader, "MAX_LINE_BYTES", 1 << 20)
    folder = write_run_folder(tmp_path / "run", steps=2)
    _, without = peak_bytes(folder)
    lines = (folder / "rollouts.jsonl").read_text().splitlines()
    huge = lines[0].replace('"completion": "', '"completion": "' + "x" * (8 << 20), 1)
    (folder / "rollouts.jsonl").write_text("\n".join([huge, *lines[1:]]) + "\n")
    data, peak = peak_bytes(folder)
    assert "rollouts.jsonl:1: longer than 1 MB, not read" in data["problems"]
    assert sum(len(g["rows"]) for s in data["rollouts"]["steps"] for g in s["groups"]) == 15
    assert peak - without < 2 << 20, f"{peak - without:,} bytes more at the peak: the 8 MB line was held"


def test_a_long_metrics_file_is_thinned_for_the_curves_and_counted_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "MAX_CURVE_LINES", 1000)
    folder = write_run_folder(tmp_path / "run", steps=2)
    rewrite(
        folder / "metrics.jsonl",
        [{"step": s, "reward/mean": s, "kl": 0.1, "loss": -s} for s in range(1, 5001)],
    )
    data = embedded(report.build_report(folder))
    assert data["charts"]["grid_keys"] == ["loss"] and data["run"]["last_metrics"]["step"] == 5000
    assert any(
        p.startswith("metrics.jsonl: 5,000 lines; the curves draw every 8th") for p in data["problems"]
    )
    metrics = report.read_metrics(folder, run_reader.Problems())
    assert len(metrics.train.items) <= 1000 and metrics.keys["loss"].count == 5000


# --- 4. the command writes only its own file, and reads nothing through a link -----------------------------


@pytest.fixture
def run_folder(tmp_path):
    return write_run_folder(tmp_path / "run", steps=2)


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_out_never_replaces_a_file_of_yours_without_overwrite(tmp_path, run_folder):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    line = one_error(report_command(run_folder, "--out", notes))
    assert line.startswith(f"error: --out {notes}: exists and is not a report this command wrote")
    assert notes.read_text() == "my notes"
    assert report_command(run_folder, "--out", notes, "--overwrite").returncode == 0
    assert embedded(notes.read_text())["run"]["folder"] == "run"


@pytest.mark.parametrize("name", ["run.json", "metrics.jsonl", "thumbs/new.html", "report-copy.html"])
def test_out_never_writes_into_the_run_folder_but_its_report_overwrite_or_not(tmp_path, run_folder, name):
    before = snapshot(run_folder)
    for extra in ([], ["--overwrite"]):
        line = one_error(report_command(run_folder, "--out", run_folder / name, *extra))
        assert line.startswith(f"error: --out {run_folder / name}: inside the run folder {run_folder}")
    assert snapshot(run_folder) == before


def test_out_replaces_a_report_it_wrote_and_the_runs_own_report(tmp_path, run_folder):
    mine = tmp_path / "mine.html"
    for _ in range(2):  # the second time over the report the first wrote
        assert report_command(run_folder, "--out", mine).returncode == 0
    report.write_report(run_folder, run_folder / "report.html")  # as the trainer writes it
    assert report_command(run_folder, "--out", run_folder / "report.html").returncode == 0


def test_out_never_writes_through_a_symbolic_link(tmp_path, run_folder):
    target = tmp_path / "elsewhere.txt"
    target.write_text("kept")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    line = one_error(report_command(run_folder, "--out", link))
    assert line.startswith(f"error: --out {link}: a symbolic link, never written through")
    assert report_command(run_folder, "--out", link, "--overwrite").returncode == 0
    assert target.read_text() == "kept" and not link.is_symlink() and link.stat().st_size > 10_000


def test_out_that_is_a_folder_a_missing_folder_or_a_fifo_is_one_line_naming_it(tmp_path, run_folder):
    folder = tmp_path / "reports"
    folder.mkdir()
    assert one_error(report_command(run_folder, "--out", folder)) == (
        f"error: --out {folder}: a folder; name the file to write, e.g. {folder / 'report.html'}"
    )
    missing = tmp_path / "nowhere" / "r.html"
    assert one_error(report_command(run_folder, "--out", missing)) == (
        f"error: --out {missing}: {missing.parent} is not a folder (create it first)"
    )
    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo)
    line = one_error(report_command(run_folder, "--out", fifo, "--overwrite"))
    assert line.startswith(f"error: --out {fifo}: not a regular file")
    assert not list(tmp_path.glob(".*.tmp"))


def test_thumbs_that_is_a_link_to_another_folder_is_not_read(tmp_path, run_folder):
    elsewhere = tmp_path / "private"
    (run_folder / "thumbs").rename(elsewhere)
    (run_folder / "thumbs").symlink_to(elsewhere)
    data = embedded(report.build_report(run_folder))
    assert data["images"] == []
    entry = data["rollouts"]["steps"][0]["groups"][0]["images"][0]
    assert entry["t"] is None and "thumbs/ is a symbolic link, not read" in entry["why"]


def test_an_image_in_thumbs_that_is_a_link_is_not_read(tmp_path, run_folder):
    name = jsonl(run_folder / "rollouts.jsonl")[0]["thumbs"][0]["thumb"]
    secret = tmp_path / "secret.jpg"
    (run_folder / name).rename(secret)
    (run_folder / name).symlink_to(secret)
    data = embedded(report.build_report(run_folder))
    entry = data["rollouts"]["steps"][0]["groups"][0]["images"][0]
    assert entry["t"] is None and entry["why"] == f"{name}: a symbolic link, not read"
    secret_uri = base64.b64encode(secret.read_bytes()).decode()
    assert all(secret_uri not in uri for uri in data["images"])


def test_a_run_file_that_is_a_link_is_not_read(tmp_path, run_folder):
    other = tmp_path / "other-rollouts.jsonl"
    (run_folder / "rollouts.jsonl").rename(other)
    (run_folder / "rollouts.jsonl").symlink_to(other)
    data = embedded(report.build_report(run_folder))
    assert data["rollouts"]["steps"] == []
    assert any(p.startswith("rollouts.jsonl: a symbolic link, not read") for p in data["problems"])


# --- 5. defence in depth and honesty ------------------------------------------------------------------------


def test_the_policy_runs_only_the_pages_own_scripts_and_style(run_folder):
    page = report.build_report(run_folder)
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)[1]
    assert "unsafe-inline" not in policy and "base-uri 'none'" in policy and "form-action 'none'" in policy
    scripts = re.findall(r"<script>(.*?)</script>", page, re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", page, re.DOTALL)
    allowed = set(re.findall(r"'sha256-([^']+)'", policy))
    digest = lambda text: base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
    assert {digest(s) for s in scripts} | {digest(style)} == allowed and len(scripts) == 2


def test_a_plug_in_name_with_dollars_is_drawn_as_written(tmp_path, run_folder):
    name = "reward/judge$x^{2$y.py:judge/mean"  # mathtext would fail on "$x^{2$"
    rewrite(
        run_folder / "metrics.jsonl", [{"step": s, "reward/mean": 1.0, name: s / 3} for s in range(1, 13)]
    )
    charts = embedded(report.build_report(run_folder))["charts"]
    assert charts["grid_keys"] == [name]


def test_a_malformed_tool_call_record_is_one_problem_note(tmp_path, run_folder):
    records = jsonl(run_folder / "rollouts.jsonl")
    records[0]["turns"][0]["call"]["images"][0]["crop"] = "abc"
    rewrite(run_folder / "rollouts.jsonl", records)
    data = embedded(report.build_report(run_folder))
    notes = [p for p in data["problems"] if "tool call" in p]
    why = "images[0].crop is abc, not [x1, y1, x2, y2]"
    assert notes == [f"rollouts.jsonl:1: a tool call record of another shape ({why}), not shown"]
    turn = data["rollouts"]["steps"][0]["groups"][0]["rows"][0][6]["turns"][0]
    assert turn == {"text": "look"}  # shown without its call; the row's other turn keeps its call
