"""The run report (grpo_vlm/report.py) against the files of the run folder it shows.

Run folders are written by hand here, as the data contract describes them (run.json, metrics.jsonl,
rollouts.jsonl with prompts, targets, thumbnails, parsed boxes and tool turns, eval_samples.jsonl, thumbs/
made with PIL), and by a short real run of the trainer. What is checked: every logged step and group is in
the report with the numbers of rollouts.jsonl and metrics.jsonl; each image file is embedded once; sizes and
paths are bounded; damaged lines and missing thumbnails are said inline; a report of a folder held by a live
run changes nothing in it; the command's outputs and its one-line errors.
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from full.helpers import train_args
from grpo_vlm import checkpoints, report, trainer

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("accuracy", "format")


def thumb(folder: Path, colour: tuple, size: tuple = (64, 48)) -> dict:
    """A picture's thumbs/ files and its rollouts.jsonl entry, keyed as the contract says."""
    image = Image.new("RGB", size, colour)
    key = hashlib.sha256(f"{size[0]}x{size[1]}".encode() + image.tobytes()).hexdigest()[:16]
    (folder / "thumbs").mkdir(exist_ok=True)
    image.save(folder / "thumbs" / f"{key}.jpg", quality=85)
    seen = image.resize((56, 56))
    seen.save(folder / "thumbs" / f"{key}-seen.jpg", quality=90)
    names = {"thumb": f"thumbs/{key}.jpg", "seen": f"thumbs/{key}-seen.jpg"}
    return names | {"size": list(size), "seen_size": [56, 56]}


def sample_fields(folder: Path, index: int) -> dict:
    """A grounding sample's fields as rollouts.jsonl and eval_samples.jsonl give them (3 pictures in all)."""
    colour = [(200, 30, 30), (30, 200, 30), (30, 30, 200)][index % 3]
    return {
        "sample_id": f"s-{index}",
        "images": [f"/data/img-{index % 3}.png"],
        "thumbs": [thumb(folder, colour)],
        "prompt": f"find the box <{index}> & say </script> it",
        "target": {"bbox": [4, 6, 30, 40], "answer": "box"},
    }


def tool_turns(folder: Path) -> list[dict]:
    """A zoom call that returned a crop, then a call that was not JSON."""
    crop = {"crop": [0, 0, 32, 24], "size": [32, 24], "thumb": thumb(folder, (9, 9, 9))["thumb"]}
    call = {
        "name": "zoom",
        "arguments": {"box": [0, 0, 32, 24]},
        "error": None,
        "text": "ok",
        "images": [crop],
    }
    bad = {"name": None, "arguments": None, "error": "invalid_json", "text": "error", "images": []}
    return [{"text": "look", "call": call}, {"text": "x", "call": bad}]


def write_run_folder(folder: Path, *, steps: int = 3, B: int = 2, G: int = 4) -> Path:
    """A run folder of `steps` logged steps of B groups of G as the trainer writes it (every contract field),
    evaluations at step 0 and `steps`, and one tool call with a returned crop in each group's row 0."""
    folder.mkdir(parents=True, exist_ok=True)
    args = {"model": "tiny", "steps": steps, "group_size": G, "samples": {"task": "boxes", "train_size": 8}}
    (folder / "run.json").write_text(json.dumps({"run_id": "abc", "args": args, "finished": False}))
    metrics = [{"step": 0, "eval/accuracy": 0.25, "eval/reward": 1.0}]
    rollouts = []
    for step in range(1, steps + 1):
        metrics.append({"step": step, "reward/mean": 0.1 * step, "kl": 0.01 * step, "loss": -0.5 + step / 7})
        for g in range(B):
            for i in range(G):
                accuracy = float((step + g + i) % 2)
                record = {"step": step, "group": g, **sample_fields(folder, step * B + g)}
                record |= {"completion": f"answer {step}/{g}/{i} [1, 2, 30, 40]", "length": 5 + i}
                record |= {"rewards": {"accuracy": accuracy, "format": 1.0}, "reward": accuracy + 1.0}
                record |= {"advantage": (accuracy - 0.5) / 3.0, "truncated": i == G - 1}
                record |= {"boxes_parsed": [[1.5, 2.0, 30.0, 40.0]] if i else []}
                if g == B - 1:  # a zero-spread group
                    record |= {"rewards": {"accuracy": 1.0, "format": 1.0}, "reward": 2.0, "advantage": 0.0}
                if i == 0:
                    record["turns"] = tool_turns(folder)
                rollouts.append(record)
    metrics[-1] |= {"eval/accuracy": 0.75, "eval/reward": 1.5}
    evals = []
    for step, right in ((0, [0, 1, 0, 1]), (steps, [1, 0, 0, 1])):  # fixed, broken, still wrong, still right
        for index, correct in enumerate(right):
            record = {
                "step": step,
                "index": index,
                **sample_fields(folder, index),
                "completion": f"e{step}{index}",
            }
            record |= {"rewards": {"accuracy": float(correct)}, "reward": float(correct)}
            record |= {
                "correct": bool(correct),
                "length": 3,
                "truncated": False,
                "boxes_parsed": [[2, 2, 9, 9]],
            }
            evals.append(record)
    for name, records in (("metrics", metrics), ("rollouts", rollouts), ("eval_samples", evals)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    timings = [{"step": s, "rollout_s": 1.5} for s in range(1, steps + 1)]
    (folder / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timings))
    return folder


def embedded(page: str) -> dict:
    """The JSON blob of a report page."""
    blob = re.search(r"<script type=application/json id=report-data>(.*?)</script>", page, re.DOTALL)
    return json.loads(blob[1])


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_report_matches(folder: Path, data: dict) -> None:
    """Every logged step and group of rollouts.jsonl is in `data` with its numbers; the last metrics equal."""
    steps = {s["step"]: {g["group"]: g for g in s["groups"]} for s in data["rollouts"]["steps"]}
    records = jsonl(folder / "rollouts.jsonl")
    assert set(steps) == {r["step"] for r in records}
    position: dict[tuple, int] = {}  # a record's row in its group: its place among the group's lines
    for record in records:
        key = record["step"], record["group"]
        position[key] = position.get(key, -1) + 1
        group = steps[key[0]][key[1]]
        text, reward, adv, length, truncated, components, _ = group["rows"][position[key]]
        assert data["texts"][text] == record["completion"]
        assert (reward, adv, length, truncated) == (
            record["reward"],
            record["advantage"],
            record["length"],
            record["truncated"],
        )
        assert components == [record["rewards"][name] for name in data["rollouts"]["components"]]
        assert len(group["images"]) == len(record["images"])
    metrics = jsonl(folder / "metrics.jsonl")
    assert data["run"]["last_metrics"] == [r for r in metrics if r["step"] > 0][-1]
    assert data["run"]["evals"] == [[r["step"], r["eval/accuracy"]] for r in metrics if "eval/accuracy" in r]
    charts = data["charts"]
    for key in charts["grid_keys"]:  # drawn: at least MIN_CHART_POINTS values
        assert sum(key in r for r in metrics) >= report.MIN_CHART_POINTS
    for key, values in charts["tables"].items():  # fewer: the values themselves
        assert values == [[r["step"], r[key]] for r in metrics if key in r]
    assert {"loss", "eval/reward"} <= set(charts["grid_keys"]) | set(charts["tables"])


def test_report_holds_every_logged_step_group_and_number(tmp_path):
    folder = write_run_folder(tmp_path / "run")
    data = embedded(report.build_report(folder))
    assert_report_matches(folder, data)
    assert data["problems"] == []
    assert data["rollouts"]["components"] == list(COMPONENTS)
    group = data["rollouts"]["steps"][0]["groups"][0]
    assert data["texts"][group["prompt"]] == "find the box <2> & say </script> it"
    assert group["target"] == {"bbox": [4, 6, 30, 40], "answer": "box"}
    assert [g["zero_spread"] for g in data["rollouts"]["steps"][0]["groups"]] == [False, True]
    assert group["rows"][1][6]["boxes"] == [[1.5, 2.0, 30.0, 40.0]]
    call, bad = (turn["call"] for turn in group["rows"][0][6]["turns"])
    assert (call["name"], call["error"], bad["error"]) == ("zoom", None, "invalid_json")
    assert isinstance(call["images"][0]["t"], int)
    pairs = data["evals"]["pairs"]
    assert (data["evals"]["first"], data["evals"]["last"]) == (0, 3)
    assert [(p["before"]["correct"], p["after"]["correct"]) for p in pairs] == [
        (False, True),
        (True, False),
        (False, False),
        (True, True),
    ]
    assert data["texts"][pairs[0]["after"]["completion"]] == "e30"


def test_the_data_cannot_close_its_script_element(tmp_path):
    page = report.build_report(write_run_folder(tmp_path / "run"))
    blob = page.split("id=report-data>", 1)[1].split("</script>", 1)[0]
    assert "<" not in blob and "</script> it" in json.dumps(embedded(page))


def test_each_image_file_is_embedded_once(tmp_path):
    folder = write_run_folder(tmp_path / "run", steps=4)
    page = report.build_report(folder)
    data = embedded(page)
    names = re.findall(r'"(thumbs/[0-9a-f]+(?:-seen)?\.jpg)"', (folder / "rollouts.jsonl").read_text())
    names += re.findall(r'"(thumbs/[0-9a-f]+(?:-seen)?\.jpg)"', (folder / "eval_samples.jsonl").read_text())
    assert len(names) > 80 and len(set(names)) == 7  # 3 pictures and their -seen images, a crop's thumbnail
    assert len(data["images"]) == len(set(data["images"])) == 7
    for uri in data["images"]:
        assert page.count(uri.split(",", 1)[1]) == 1


def test_images_come_only_from_thumbs_and_are_bounded(tmp_path, monkeypatch):
    folder = write_run_folder(tmp_path / "run", steps=1, B=1, G=2)
    records = jsonl(folder / "rollouts.jsonl")
    big = folder / "thumbs" / "big.jpg"
    big.write_bytes(b"\xff\xd8\xff" + bytes(5000))
    (folder / "thumbs" / "text.jpg").write_text("not a picture")
    records[0]["thumbs"] = [
        {"thumb": "../run.json", "seen": "thumbs/big.jpg"},
        {"thumb": "thumbs/text.jpg", "seen": "/etc/passwd"},
        {"error": "image moved"},
    ]
    records[0]["images"] = ["a.png", "b.png", "c.png"]
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(report, "MAX_IMAGE_BYTES", 4000)
    data = embedded(report.build_report(folder))
    first, second, third = data["rollouts"]["steps"][0]["groups"][0]["images"]
    assert first["t"] is None and first["s"] is None and "not an image of thumbs/" in first["why"]
    assert second["t"] is None and "not a JPEG" in second["why"]
    assert third == {"ref": "c.png", "why": "not kept: image moved"}
    assert not any("root:" in base64 for base64 in data["images"])


def test_metrics_with_enough_values_are_drawn_in_one_figure(tmp_path):
    data = embedded(report.build_report(write_run_folder(tmp_path / "run", steps=12, B=1, G=2)))
    assert data["charts"]["grid_keys"] == ["loss"] and data["charts"]["grid"].startswith(
        "data:image/png;base64,"
    )
    assert list(data["charts"]["tables"]) == ["eval/reward"]  # 2 evaluations


def test_long_runs_keep_at_most_max_steps_spread_with_first_and_last(monkeypatch, tmp_path):
    steps = list(range(1, 1001))
    chosen = report.spread_steps(steps, {s: 128 for s in steps})
    assert len(chosen) == report.MAX_STEPS and chosen[0] == 1 and chosen[-1] == 1000
    assert len(report.spread_steps(steps, {s: 1024 for s in steps})) == report.MAX_ROWS // 1024
    monkeypatch.setattr(report, "MAX_STEPS", 3)
    data = embedded(report.build_report(write_run_folder(tmp_path / "run", steps=7, B=1, G=2)))
    assert [s["step"] for s in data["rollouts"]["steps"]] == [1, 4, 7]
    assert data["rollouts"]["left_out"] == [2, 3, 5, 6] and data["rollouts"]["logged"] == 7


def test_damaged_lines_and_a_missing_thumbnail_are_said_inline(tmp_path):
    folder = write_run_folder(tmp_path / "run")
    lines = (folder / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    (folder / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "reward')  # a torn last line
    with (folder / "rollouts.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    missing = jsonl(folder / "rollouts.jsonl")[0]["thumbs"][0]["thumb"]
    (folder / missing).unlink()
    page = report.build_report(folder)
    data = embedded(page)
    assert "metrics.jsonl:3: not JSON" in data["problems"]
    assert "metrics.jsonl:5: not JSON (a torn last line: a live run writing it?)" in data["problems"]
    assert "rollouts.jsonl:25: not a record with an integer step" in data["problems"]
    assert any(p.startswith("thumbs/: 1 image file(s) not in the report") for p in data["problems"])
    entry = data["rollouts"]["steps"][0]["groups"][0]["images"][0]
    assert entry["t"] is None and entry["why"] == f"{missing}: missing" and isinstance(entry["s"], int)
    assert [s["step"] for s in data["rollouts"]["steps"]] == [1, 2, 3]  # everything else still shown


def test_a_picture_the_runs_seen_budget_left_without_its_seen_copy_shows_its_thumbnail_and_no_problem(
    tmp_path,
):
    folder = write_run_folder(tmp_path / "run", steps=1)
    records = jsonl(folder / "rollouts.jsonl")
    for record in records:
        record["thumbs"] = [
            dict(t, seen=None) for t in record["thumbs"]
        ]  # as thumbnails.keep past its budget
    (folder / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = embedded(report.build_report(folder))
    entries = [e for g in data["rollouts"]["steps"][0]["groups"] for e in g["images"]]
    assert entries and all(isinstance(e["t"], int) and e["s"] is None and "why" not in e for e in entries)
    assert not any("thumbs/" in p for p in data["problems"])


def test_a_folder_from_an_earlier_version_shows_what_it_has(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    row = {"step": 1, "sample_id": "x", "group": 0, "images": ["<in-memory image 56x56>"], "completion": "a"}
    row |= {"rewards": {"label": 1.0}, "reward": 1.0, "advantage": 0.0, "length": 2, "truncated": False}
    (folder / "rollouts.jsonl").write_text(json.dumps(row) + "\n")
    data = embedded(report.build_report(folder))
    group = data["rollouts"]["steps"][0]["groups"][0]
    assert group["images"] == [{"ref": "<in-memory image 56x56>", "why": "not kept by this run"}]
    assert group["prompt"] is None and group["target"] is None and data["evals"] is None
    assert any(p.startswith("run.json: absent") for p in data["problems"])
    assert data["charts"]["main"] is None


def snapshot(folder: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def report_command(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m grpo_vlm.report ARGV...` run in `cwd`."""
    command = [sys.executable, "-m", "grpo_vlm.report", *argv]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_a_report_of_a_folder_a_live_run_holds_changes_nothing_in_it(tmp_path):
    folder = write_run_folder(tmp_path / "run")
    with checkpoints.run_folder_lock(folder, hold=True):  # the run's lock, held as a live run holds it
        with (folder / "metrics.jsonl").open("a") as f:
            f.write('{"step": 4, "re')  # the run is writing its next line
        before = snapshot(folder)
        elsewhere = tmp_path / "cwd"
        elsewhere.mkdir()
        result = report_command(str(folder), cwd=elsewhere)
        assert result.returncode == 0, result.stderr
        assert snapshot(folder) == before  # no byte, no modification time, no new file
    written = elsewhere / "report-run.html"
    assert result.stdout.strip() == "report-run.html" and written.is_file()
    assert "metrics.jsonl:5: not JSON (a torn last line" in written.read_text()


def test_out_writes_where_it_says(tmp_path):
    folder = write_run_folder(tmp_path / "run")
    dest = tmp_path / "sub" / "r.html"
    dest.parent.mkdir()
    result = report_command(str(folder), "--out", str(dest), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == str(dest)
    assert embedded(dest.read_text())["run"]["folder"] == "run"


@pytest.mark.parametrize("kind", ["missing", "not a run folder", "a file"])
def test_a_bad_run_folder_is_one_line_and_exit_2(tmp_path, kind):
    target = tmp_path / "nothing"
    if kind == "not a run folder":
        (target / "x").mkdir(parents=True)
    if kind == "a file":
        target.write_text("x")
    result = report_command(str(target), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(target) in result.stderr
    assert list(tmp_path.glob("report-*")) == []


def short_run(folder: Path, **overrides) -> dict:
    """A real run of the trainer: 2 steps of 2 prompts x 2 completions, evaluated after each (seconds)."""
    flags = dict(output_dir=str(folder), device="cpu", train_size=8, eval_size=4, batch_size=2, group_size=2)
    flags |= dict(max_new_tokens=8, steps=2, eval_every=1, seed=0)
    return trainer.main(train_args(**flags | overrides))


def test_a_real_run_writes_its_report(tmp_path):
    folder = tmp_path / "run"
    short_run(folder)
    data = embedded((folder / "report.html").read_text())
    assert_report_matches(folder, data)
    assert [len(s["groups"]) for s in data["rollouts"]["steps"]] == [2, 2]
    assert data["run"]["finished"] is True and data["run"]["last_step"] == 2


def test_a_report_that_cannot_be_built_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    def broken(run_dir, dest):
        raise RuntimeError("no report today")

    monkeypatch.setattr(report, "write_report", broken)
    summary = short_run(tmp_path / "run", eval_every=5)
    assert summary["steps"] == 2 and (tmp_path / "run" / "adapter").is_dir()
    assert not (tmp_path / "run" / "report.html").exists()
    assert "warning: report.html not written: RuntimeError: no report today" in capsys.readouterr().out


def test_the_report_is_a_file_of_the_run(tmp_path):
    assert "report.html" in checkpoints.RUN_FILES  # --overwrite removes it with the run


def test_run_json_records_each_start_with_its_command_and_the_report_shows_them(tmp_path):
    folder = tmp_path / "run"
    flags = dict(output_dir=str(folder), device="cpu", train_size=8, eval_size=4, batch_size=2, group_size=2)
    flags |= dict(max_new_tokens=8, eval_every=1, seed=0)
    trainer.main(train_args(**flags, steps=2), (), ["--steps", "2", "--output-dir", str(folder)])
    again = ["--resume", str(folder), "--steps", "3"]
    trainer.main(train_args(**flags | dict(output_dir=None), steps=3, resume=str(folder)), {"--steps"}, again)
    record = json.loads((folder / "run.json").read_text())
    starts = record["starts"]
    assert [s["from_step"] for s in starts] == [0, 2]
    assert starts[0]["command"] == f"python -m grpo_vlm --steps 2 --output-dir {folder}"
    assert starts[1]["command"] == f"python -m grpo_vlm --resume {folder} --steps 3"
    assert record["finished"] is True and record["summary"]["steps"] == 3
    assert record["summary"]["wall_time_s"] > 0
    data = embedded((folder / "report.html").read_text())
    assert data["run"]["starts"] == starts and data["run"]["summary"] == record["summary"]
