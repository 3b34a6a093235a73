"""An output that cannot be written (no space left, read-only filesystem, permission denied) stops the run
with one line naming the file and the cause, exit status 74; what was half-written is removed, the previous
checkpoint stays intact, and --resume goes on once the cause is gone.

The full disk is real where this machine lets a test mount a small tmpfs (root, Linux); everywhere else
each kind of write fails by an injected ENOSPC at the system call, in-process."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import model_io
from full.helpers import train_args
from grpo_vlm import checkpoints, cli, logs, trainer

ROOT = Path(__file__).resolve().parents[2]
FLAGS = dict(batch_size=2, group_size=2, max_new_tokens=8, eval_every=1000, train_size=16, eval_size=4)
FLAGS |= dict(warmup_steps=1, seed=3)
NO_SPACE = os.strerror(errno.ENOSPC)


def opened_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def fail_on(monkeypatch, function: str, matches, error: int = errno.ENOSPC) -> None:
    """Make os.<function>(fd, ...) raise `error` (as the kernel reports it: no file name) for the file
    descriptors whose path `matches`; os.write first writes half its bytes, as a disk that fills up does."""
    real = getattr(os, function)

    def failing(fd, *rest):
        if matches(opened_path(fd)):
            if function == "write":
                real(fd, bytes(rest[0])[: len(rest[0]) // 2])
            raise OSError(error, os.strerror(error))
        return real(fd, *rest)

    monkeypatch.setattr(os, function, failing)


def nth_call(n: int, name: str):
    """A `matches` for fail_on: true from the n-th call on whose path contains `name`."""
    calls = []

    def matches(path: str) -> bool:
        calls.extend([1] if name in path else [])
        return name in path and len(calls) >= n

    return matches


def leftovers(out: Path) -> list[str]:
    """Temporary files and folders anywhere below `out` (none may be left behind)."""
    return [str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith((".tmp", ".old"))]


def assert_logs_whole(out: Path) -> None:
    for name in ("metrics.jsonl", "timings.jsonl", "rollouts.jsonl"):
        text = (out / name).read_text()
        assert text.endswith("\n"), name
        [json.loads(line) for line in text.splitlines()]  # every line whole


# Each kind of write, made to fail at step 2 (of 2, a checkpoint every step): the call that fails, on the
# n-th call for a path containing what; the file the message names; the newest checkpoint left intact.
STATE = "checkpoint-000002.tmp/trainer_state.pt"
KINDS = {
    "checkpoint": ("fsync", 1, STATE, STATE, "checkpoint-000001"),
    "final adapter": (
        "fsync",
        1,
        "adapter/.adapter_model",
        "adapter/adapter_model.safetensors",
        "checkpoint-000002",
    ),
    "metrics": ("write", 3, "metrics.jsonl", "metrics.jsonl", "checkpoint-000001"),
    "rollouts": ("write", 2, "rollouts.jsonl", "rollouts.jsonl", "checkpoint-000001"),  # step 2's rows
}


@pytest.mark.parametrize("kind", [*KINDS, "curves"])
def test_a_full_disk_at_each_kind_of_write_is_one_line_naming_the_file_and_leaves_nothing_half_written(
    tmp_path, monkeypatch, kind
):
    out = tmp_path / "run"
    if kind == "curves":  # matplotlib writes through Python's file objects: fail its savefig half-way

        def half_a_png(figure, path, **options):
            Path(path).write_bytes(b"\x89PNG\r\n\x1a\n")
            raise OSError(errno.ENOSPC, NO_SPACE)

        monkeypatch.setattr(logs.Figure, "savefig", half_a_png)
        named, intact = "curves.png", "checkpoint-000002"
    else:
        function, n, what, named, intact = KINDS[kind]
        fail_on(monkeypatch, function, nth_call(n, what))
    with pytest.raises(cli.WriteFailed) as failed:
        trainer.main(train_args(output_dir=str(out), steps=2, save_every=1, **FLAGS))
    monkeypatch.undo()
    go_on = f"the newest checkpoint, {intact}, is intact; once the cause is gone: "
    go_on += f"python -m grpo_vlm --resume {out}"
    assert str(failed.value) == f"cannot write {out / named}: {NO_SPACE}; {go_on}"
    assert leftovers(out) == []
    assert [p.name for p in checkpoints.list_checkpoints(out)][-1] == intact
    assert checkpoints.verify_checkpoint(out / intact) is None
    assert_logs_whole(out)
    assert not (out / "curves.png").exists()

    assert trainer.main(train_args(resume=str(out), steps=2, save_every=1, **FLAGS))["steps"] == 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        2,
    ]
    assert (out / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_a_failed_checkpoint_write_names_the_file_removes_the_temporary_folder_and_keeps_the_previous_one(
    tmp_path, monkeypatch, error
):
    def write_adapter(folder: Path) -> None:
        (folder / model_io.ADAPTER_WEIGHTS).write_bytes(b"weights")

    checkpoints.save_checkpoint(
        tmp_path / "checkpoint-1", write_adapter=write_adapter, state={"step": 1}, keep_last=1
    )
    fail_on(monkeypatch, "fsync", lambda path: path.endswith(checkpoints.STATE_FILE), error)
    said = rf"^cannot write .*checkpoint-2.tmp/trainer_state.pt: {os.strerror(error)}$"
    with pytest.raises(cli.WriteFailed, match=said), cli.writing(tmp_path / "checkpoint-2"):
        checkpoints.save_checkpoint(
            tmp_path / "checkpoint-2", write_adapter=write_adapter, state={"step": 2}, keep_last=1
        )
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert checkpoints.verify_checkpoint(tmp_path / "checkpoint-1") is None


def test_a_jsonl_append_that_fails_half_way_cuts_the_file_back_to_its_last_whole_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    logs.append_jsonl(path, {"step": 1})
    before = path.read_bytes()
    fail_on(monkeypatch, "write", lambda p: p == str(path))
    with pytest.raises(OSError, match=rf"{NO_SPACE}: '{path}'"):
        logs.append_jsonl(path, {"step": 2, "text": "x" * 1000})
    monkeypatch.undo()
    assert path.read_bytes() == before


def mount_tmpfs(folder: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 900 KB tmpfs: room for one checkpoint of the tiny model (about 540 KB), the logs, thumbnails and
    report.html (about 300 KB at step 2), not for a second checkpoint."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    try:
        mount_tmpfs(folder, "900k")
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"this machine does not let a test mount a tmpfs ({e})")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_real_full_disk_at_a_checkpoint_exits_74_with_one_line_and_resume_goes_on_once_there_is_room(
    small_disk,
):
    out = small_disk / "run"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    command = [sys.executable, "-m", "grpo_vlm", *flags, "--steps=6", "--save-every=2"]
    child = subprocess.run(
        [*command, "--output-dir", str(out)], check=False, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 74, child.stderr[-3000:]
    errors = [line for line in child.stderr.splitlines() if "error" in line.lower()]
    go_on = "the newest checkpoint, checkpoint-000002, is intact; once the cause is gone: python -m grpo_vlm"
    failed = f"{out}/checkpoint-000004.tmp/adapter_model.safetensors: {NO_SPACE}"
    assert errors == [f"error: cannot write {failed}; {go_on} --resume {out}"]
    assert "Traceback" not in child.stderr
    assert leftovers(out) == []
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000002"]
    assert checkpoints.verify_checkpoint(out / "checkpoint-000002") is None

    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    child = subprocess.run(
        [*command, "--resume", str(out)], check=False, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        *range(7)
    ]
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000004", "checkpoint-000006"]
    shutil.rmtree(out)
