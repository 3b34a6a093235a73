"""Nothing the user owns is taken over: an output the project did not write is refused (one line naming the
file and the flag, status 2) unless --overwrite is given, a symbolic link is never followed onto another file
(outputs, lock files, a run folder's entries), and a FIFO never makes a command hang.

Real commands in child processes (each with a timeout: a hang fails the test), real files, symbolic links and
FIFOs; the user's files are compared byte for byte before and after.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from full.test_script_outputs import rollouts_and_prompts

ROOT = Path(__file__).resolve().parents[2]
EVALUATE = ["--device", "cpu", "--eval-size", "2", "--batch-size", "2", "--max-new-tokens", "4"]
TRAIN = ["--device", "cpu", "--train-size", "4", "--eval-size", "0", "--batch-size", "2", "--group-size", "2"]
TRAIN += ["--max-new-tokens", "4", "--eval-every", "1000"]
PROMPTS = [{"prompt_id": f"p{i}", "label": "通过" if i % 2 else "不通过"} for i in range(2)]


def command(argv: list, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    argv = [sys.executable, *map(str, argv)]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def script(name: str, *args, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return command([ROOT / "scripts" / name, *args], cwd, timeout)


def train_py(*args, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return command(["-m", "grpo_vlm", *TRAIN, *args], cwd, timeout)


def one_error_line(result: subprocess.CompletedProcess, status: int, *names) -> str:
    """The one `error:` line of a failed command (no traceback), which names each of `names`."""
    assert result.returncode == status, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for name in map(str, names):
        assert name in errors[0], errors[0]
    return errors[0]


def succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def photos_and_prompt(folder: Path) -> list:
    """The flags of summarize_photos.py for two groups of one photo each in `folder`."""
    for group in ("g1", "g2"):
        (folder / "photos" / group).mkdir(parents=True)
        Image.new("RGB", (28, 28), (200, 30, 30)).save(folder / "photos" / group / "a.png")
    (folder / "prompt.txt").write_text("What is in the photo?\n", encoding="utf-8")
    return ["--photos", folder / "photos", "--prompt-template", folder / "prompt.txt", "--device", "cpu"]


USER_FILES = {
    "one line": b'{"note": "my own line"}\n',
    "two lines": b'{"id": "a", "note": "first"}\n{"id": "b", "note": "second"}\n',
    "text without a newline": b"my notes",
}


# --------------------------------------------------------------------------------------------------
# An existing output the script did not write


@pytest.mark.parametrize("content", USER_FILES.values(), ids=USER_FILES.keys())
def test_evaluate_refuses_to_continue_a_users_file_and_leaves_it_byte_identical(tmp_path, content):
    notes = tmp_path / "notes.jsonl"
    notes.write_bytes(content)
    result = script("evaluate.py", *EVALUATE, "--output", notes, cwd=tmp_path)
    one_error_line(result, 2, notes, "--output", "--overwrite")
    assert notes.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]  # no settings file, no lock


def test_evaluate_with_overwrite_replaces_a_users_file_with_its_own_output(tmp_path):
    notes = tmp_path / "notes.jsonl"
    notes.write_bytes(USER_FILES["two lines"])
    succeeded(script("evaluate.py", *EVALUATE, "--output", notes, "--overwrite", cwd=tmp_path))
    lines = [json.loads(line) for line in notes.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 2 and all({"id", "source", "completions"} <= line.keys() for line in lines)
    succeeded(script("evaluate.py", *EVALUATE, "--output", notes, cwd=tmp_path))  # its own now: resumed


def test_evaluate_refuses_the_output_of_another_script(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path, PROMPTS)
    succeeded(script("score_rollouts.py", "--rollouts", rollouts, "--prompts", prompts, cwd=tmp_path))
    scored = tmp_path / "rollouts.scored.jsonl"
    before = digest(tmp_path)
    result = script("evaluate.py", *EVALUATE, "--output", scored, cwd=tmp_path)
    one_error_line(result, 2, scored, "--output", "--overwrite")
    assert digest(tmp_path) == before and not scored.with_suffix(".settings.json").exists()


def test_summarize_photos_refuses_to_continue_a_users_file_and_leaves_it_byte_identical(tmp_path):
    flags = photos_and_prompt(tmp_path)
    notes = tmp_path / "notes.jsonl"
    notes.write_bytes(b'{"group_id": "g1", "note": "mine"}\n')
    result = script("summarize_photos.py", *flags, "--output", notes, cwd=tmp_path)
    one_error_line(result, 2, notes, "--output", "--overwrite")
    assert notes.read_bytes() == b'{"group_id": "g1", "note": "mine"}\n'
    assert not notes.with_suffix(".settings.json").exists()


def test_score_rollouts_refuses_to_replace_a_users_file_unless_overwrite(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path, PROMPTS)
    flags = ["--rollouts", rollouts, "--prompts", prompts]
    notes = tmp_path / "notes.jsonl"
    notes.write_bytes(USER_FILES["one line"])
    result = script("score_rollouts.py", *flags, "--output", notes, cwd=tmp_path)
    one_error_line(result, 2, notes, "--output", "--overwrite")
    assert notes.read_bytes() == USER_FILES["one line"]
    assert not notes.with_suffix(".report.json").exists()

    succeeded(script("score_rollouts.py", *flags, "--output", notes, "--overwrite", cwd=tmp_path))
    assert len(notes.read_text(encoding="utf-8").splitlines()) == 4
    succeeded(script("score_rollouts.py", *flags, "--output", notes, cwd=tmp_path))  # its own: replaced


def test_score_rollouts_refuses_to_replace_a_users_report(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path, PROMPTS)
    report = tmp_path / "notes.json"
    report.write_bytes(b'{"mine": true}\n')
    result = script(
        "score_rollouts.py", "--rollouts", rollouts, "--prompts", prompts, "--report", report, cwd=tmp_path
    )
    one_error_line(result, 2, report, "--report", "--overwrite")
    assert report.read_bytes() == b'{"mine": true}\n'
    assert not (tmp_path / "rollouts.scored.jsonl").exists()


# --------------------------------------------------------------------------------------------------
# Symbolic links are never followed onto another file


@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
def test_a_symlinked_evaluate_output_is_refused_and_overwrite_replaces_the_link_not_the_target(
    tmp_path, dangling
):
    target, link = tmp_path / "mine" / "notes.txt", tmp_path / "out.jsonl"
    target.parent.mkdir()
    if not dangling:
        target.write_bytes(b"my notes\n")
    link.symlink_to(target)
    result = script("evaluate.py", *EVALUATE, "--output", link, cwd=tmp_path)
    one_error_line(result, 2, link, "--output", "symbolic link")
    assert link.is_symlink() and (
        target.read_bytes() == b"my notes\n" if not dangling else not target.exists()
    )

    succeeded(script("evaluate.py", *EVALUATE, "--output", link, "--overwrite", cwd=tmp_path))
    assert not link.is_symlink() and len(link.read_text(encoding="utf-8").splitlines()) == 2
    assert target.read_bytes() == b"my notes\n" if not dangling else not target.exists()


def test_a_symlinked_summarize_photos_output_is_refused(tmp_path):
    flags = photos_and_prompt(tmp_path)
    target, link = tmp_path / "notes.jsonl", tmp_path / "out.jsonl"
    target.write_bytes(b'{"group_id": "g1"}\n')
    link.symlink_to(target)
    result = script("summarize_photos.py", *flags, "--output", link, cwd=tmp_path)
    one_error_line(result, 2, link, "--output", "symbolic link")
    assert target.read_bytes() == b'{"group_id": "g1"}\n' and link.is_symlink()


def test_a_symlinked_score_rollouts_output_is_refused_and_overwrite_replaces_the_link(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path, PROMPTS)
    flags = ["--rollouts", rollouts, "--prompts", prompts]
    target, link = tmp_path / "notes.jsonl", tmp_path / "out.jsonl"
    target.write_bytes(USER_FILES["one line"])
    link.symlink_to(target)
    result = script("score_rollouts.py", *flags, "--output", link, cwd=tmp_path)
    one_error_line(result, 2, link, "--output", "symbolic link")
    assert target.read_bytes() == USER_FILES["one line"] and link.is_symlink()

    succeeded(script("score_rollouts.py", *flags, "--output", link, "--overwrite", cwd=tmp_path))
    assert not link.is_symlink() and len(link.read_text(encoding="utf-8").splitlines()) == 4
    assert target.read_bytes() == USER_FILES["one line"]


@pytest.mark.parametrize("tool", ["evaluate.py", "score_rollouts.py"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_lock_file_beside_an_output_that_is_a_symlink_or_fifo_is_refused(tmp_path, tool, kind):
    rollouts, prompts = rollouts_and_prompts(tmp_path, PROMPTS)
    output = tmp_path / "out.jsonl"
    lock, target = tmp_path / ".out.jsonl.lock", tmp_path / "mine.txt"
    target.write_bytes(b"precious\n")
    lock.symlink_to(target) if kind == "symlink" else os.mkfifo(lock)
    flags = EVALUATE if tool == "evaluate.py" else ["--rollouts", rollouts, "--prompts", prompts]
    result = script(tool, *flags, "--output", output, cwd=tmp_path, timeout=60)
    one_error_line(result, 2, lock)
    assert target.read_bytes() == b"precious\n" and not output.exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_run_folder_lock_that_is_a_symlink_or_fifo_is_refused(tmp_path, kind):
    out, target = tmp_path / "run", tmp_path / "mine.txt"
    out.mkdir()
    target.write_bytes(b"precious\n")
    (out / ".lock").symlink_to(target) if kind == "symlink" else os.mkfifo(out / ".lock")
    result = train_py("--steps", "1", "--output-dir", out, cwd=tmp_path, timeout=60)
    one_error_line(result, 2, out / ".lock")
    assert target.read_bytes() == b"precious\n" and sorted(p.name for p in out.iterdir()) == [".lock"]


def test_overwrite_of_a_run_whose_tensorboard_is_a_symlink_removes_the_link_not_the_users_folder(tmp_path):
    out, mine = tmp_path / "run", tmp_path / "my_logs"
    succeeded(train_py("--steps", "1", "--output-dir", out, cwd=tmp_path))
    mine.mkdir()
    (mine / "events.txt").write_bytes(b"my events\n")
    (mine / "sub").mkdir()
    (mine / "sub" / "more.txt").write_bytes(b"more\n")
    before = digest(mine)
    (out / "tensorboard").symlink_to(mine, target_is_directory=True)

    result = train_py("--steps", "1", "--output-dir", out, "--overwrite", cwd=tmp_path)
    succeeded(result)
    assert digest(mine) == before
    assert not (out / "tensorboard").is_symlink() and "tensorboard" in result.stdout  # listed as removed
    # The folder is this project's run folder afterwards: --resume and --overwrite both take it.
    succeeded(train_py("--steps", "2", "--resume", out, cwd=tmp_path))
    succeeded(train_py("--steps", "1", "--output-dir", out, "--overwrite", cwd=tmp_path))
    assert digest(mine) == before


# --------------------------------------------------------------------------------------------------
# FIFOs never make a command hang


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "--overwrite"])
def test_an_evaluate_output_that_is_a_fifo_is_refused_without_hanging(tmp_path, overwrite):
    fifo = tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    result = script(
        "evaluate.py", *EVALUATE, "--output", fifo, *(["--overwrite"] * overwrite), cwd=tmp_path, timeout=60
    )
    one_error_line(result, 2, fifo, "--output", "not a regular file")


def test_a_fifo_named_like_a_photo_is_refused_without_hanging(tmp_path):
    flags = photos_and_prompt(tmp_path)
    fifo = tmp_path / "photos" / "g1" / "b.jpg"
    os.mkfifo(fifo)
    result = script(
        "summarize_photos.py", *flags, "--output", tmp_path / "out.jsonl", cwd=tmp_path, timeout=60
    )
    one_error_line(result, 2, fifo, "not a regular file")


def test_overwrite_checks_every_removal_before_it_removes_anything(tmp_path, monkeypatch):
    """All or nothing: a folder --overwrite could not empty (a permission the tests, run as root, cannot take
    away: os.access says no) stops it before the first removal, naming that folder."""
    from grpo_vlm import checkpoints

    out = tmp_path / "run"
    (out / "adapter" / "deep").mkdir(parents=True)
    (out / "adapter" / "deep" / "w.bin").write_bytes(b"weights")
    (out / "run.json").write_text('{"run_id": "r1", "args": {}}\n', encoding="utf-8")
    (out / "metrics.jsonl").write_text('{"step": 0}\n', encoding="utf-8")
    before = digest(out)
    stuck = out / "adapter" / "deep"
    monkeypatch.setattr(checkpoints.os, "access", lambda path, mode: Path(path) != stuck)
    with pytest.raises(ValueError, match=f"--overwrite: cannot remove {stuck}: .*nothing was removed"):
        checkpoints.open_run_folder(out, "replace", "r2", 0, {})
    assert digest(out) == before
