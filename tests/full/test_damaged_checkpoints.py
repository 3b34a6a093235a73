"""A checkpoint proves it is whole: checkpoint.json lists the size and SHA-256 of every other file, and
--resume verifies them. A damaged newest checkpoint is reported and the newest intact one is used; none
intact, or a damaged one named explicitly, is one line and exit 2, never a traceback."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_io
from full.helpers import train_args
from grpo_vlm import checkpoints, cli, trainer

ROOT = Path(__file__).resolve().parents[2]
FLAGS = dict(batch_size=2, group_size=2, max_new_tokens=8, eval_every=1000, train_size=16, eval_size=4)
FLAGS |= dict(warmup_steps=1, seed=3, steps=4, save_every=2)
FILES = (model_io.ADAPTER_WEIGHTS, model_io.ADAPTER_CONFIG, checkpoints.STATE_FILE, checkpoints.OWNER_FILE)


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` but the lock file (it names its latest holder)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != checkpoints.LOCK_FILE
    }


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoint-000002 and checkpoint-000004; copy it before damaging it."""
    out = tmp_path_factory.mktemp("whole") / "run"
    trainer.main(train_args(output_dir=str(out), **FLAGS))
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000002", "checkpoint-000004"]
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def cut(path: Path, how: str) -> None:
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2] if how == "half" else b"")


def test_a_checkpoint_records_the_size_and_sha256_of_each_of_its_files(two_checkpoints):
    folder = two_checkpoints / "checkpoint-000004"
    manifest = json.loads((folder / checkpoints.OWNER_FILE).read_text())
    assert manifest["step"] == 4 and sorted(manifest["files"]) == sorted(FILES[:3])
    for name, record in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoints.verify_checkpoint(folder) is None


def test_verify_checkpoint_names_the_file_and_what_is_wrong(two_checkpoints, tmp_path):
    folder = copy_of(two_checkpoints, tmp_path) / "checkpoint-000004"
    state = folder / checkpoints.STATE_FILE
    size = state.stat().st_size
    data = bytearray(state.read_bytes())
    data[size // 2] ^= 1  # one bit flipped: the size still matches
    state.write_bytes(bytes(data))
    assert (
        checkpoints.verify_checkpoint(folder)
        == f"{checkpoints.STATE_FILE}: its SHA-256 differs from the manifest's"
    )
    state.write_bytes(b"x" * 812)
    said = f"{checkpoints.STATE_FILE} is 812 bytes, the manifest says {size:,}"
    assert checkpoints.verify_checkpoint(folder) == said
    state.unlink()
    assert checkpoints.verify_checkpoint(folder) == f"{checkpoints.STATE_FILE} is missing"
    (folder / checkpoints.OWNER_FILE).write_text("[1, 2]")  # foreign JSON: no manifest to trust
    assert checkpoints.verify_checkpoint(folder) == f"{checkpoints.OWNER_FILE} is unreadable"
    (folder / checkpoints.OWNER_FILE).write_text('{"run_id": "a", "step": 4}')  # an older checkpoint's
    assert checkpoints.verify_checkpoint(folder) is None


@pytest.mark.parametrize("how", ["half", "empty"])
@pytest.mark.parametrize("name", FILES)
def test_a_newest_checkpoint_file_cut_short_or_emptied_is_reported_and_the_older_one_resumes_to_the_end(
    two_checkpoints, tmp_path, capsys, name, how
):
    run = copy_of(two_checkpoints, tmp_path)
    size = (run / "checkpoint-000004" / name).stat().st_size
    cut(run / "checkpoint-000004" / name, how)
    trainer.main(train_args(output_dir=None, resume=str(run), **FLAGS))
    printed = capsys.readouterr().out
    if name == checkpoints.OWNER_FILE:
        why = f"{name} is unreadable"
    else:
        why = f"{name} is {size // 2 if how == 'half' else 0:,} bytes, the manifest says {size:,}"
    redone = "resuming from checkpoint-000002: steps 3-4 will be redone"
    assert f"warning: checkpoint-000004 is damaged ({why}); {redone}\n" in printed
    # Steps 3 and 4 trained again from checkpoint-000002 give the same bytes as the first time.
    assert (run / "metrics.jsonl").read_bytes() == (two_checkpoints / "metrics.jsonl").read_bytes()
    assert checkpoints.verify_checkpoint(run / "checkpoint-000004") is None  # written anew


def resume_in_a_process(run: Path, resume: Path) -> subprocess.CompletedProcess:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    command = [sys.executable, "-m", "grpo_vlm", "--resume", str(resume), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_with_every_checkpoint_damaged_resume_stops_with_one_line_naming_each_and_exit_2(
    two_checkpoints, tmp_path
):
    run = copy_of(two_checkpoints, tmp_path)
    cut(run / "checkpoint-000004" / checkpoints.STATE_FILE, "empty")
    cut(run / "checkpoint-000002" / model_io.ADAPTER_WEIGHTS, "half")
    before = tree_digest(run)
    child = resume_in_a_process(run, run)
    assert child.returncode == 2, child.stderr
    errors = [line for line in child.stderr.splitlines() if "error" in line.lower()]
    weights = (two_checkpoints / "checkpoint-000002" / model_io.ADAPTER_WEIGHTS).stat().st_size
    state = (two_checkpoints / "checkpoint-000004" / checkpoints.STATE_FILE).stat().st_size
    newest = f"checkpoint-000004 ({checkpoints.STATE_FILE} is 0 bytes, the manifest says {state:,})"
    older = f"checkpoint-000002 ({model_io.ADAPTER_WEIGHTS} is {weights // 2:,} bytes, the manifest says"
    older += f" {weights:,})"
    assert errors == [f"error: --resume: no intact checkpoint in {run}: {newest}; {older}"]
    assert "Traceback" not in child.stderr
    assert tree_digest(run) == before


def test_a_damaged_checkpoint_named_explicitly_is_refused_not_replaced_by_another(two_checkpoints, tmp_path):
    run = copy_of(two_checkpoints, tmp_path)
    cut(run / "checkpoint-000004" / model_io.ADAPTER_CONFIG, "empty")
    with pytest.raises(
        cli.UsageError, match=r"checkpoint-000004 is damaged \(adapter_config.json is 0 bytes"
    ):
        trainer.main(train_args(output_dir=None, resume=str(run / "checkpoint-000004"), **FLAGS))


def test_a_checkpoint_without_a_manifest_resumes_and_a_cut_adapter_there_is_one_line_naming_it(
    two_checkpoints, tmp_path
):
    run = copy_of(two_checkpoints, tmp_path)
    for folder in checkpoints.list_checkpoints(run):  # as an older version wrote them: nothing to verify
        (folder / checkpoints.OWNER_FILE).write_text(json.dumps({"run_id": None, "step": 0}))
    weights = run / "checkpoint-000004" / model_io.ADAPTER_WEIGHTS
    cut(weights, "half")
    with pytest.raises(cli.UsageError, match=rf"{weights}: unreadable \(.*\); is it damaged or cut short\?$"):
        trainer.main(train_args(output_dir=None, resume=str(run), **{**FLAGS, "steps": 5}))  # one more step
    weights.write_bytes((two_checkpoints / "checkpoint-000004" / model_io.ADAPTER_WEIGHTS).read_bytes())
    assert trainer.main(train_args(output_dir=None, resume=str(run), **{**FLAGS, "steps": 5}))["steps"] == 5


def test_a_foreign_state_file_in_a_checkpoint_without_a_manifest_is_named_not_a_traceback(
    two_checkpoints, tmp_path
):
    run = copy_of(two_checkpoints, tmp_path)
    folder = run / "checkpoint-000004"
    (folder / checkpoints.OWNER_FILE).unlink()  # nothing to verify
    torch.save([1, 2, 3], folder / checkpoints.STATE_FILE)  # a torch file, but no trainer state
    with pytest.raises(ValueError, match=r"trainer_state.pt: not a trainer state \(a list, not a dict\)"):
        checkpoints.checkpoint_to_resume(folder, run)
