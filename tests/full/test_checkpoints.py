"""checkpoints.py: checkpoints are atomic and restore the RNG exactly, pruning keeps only the run's own, a
resume takes the newest intact checkpoint of its run; a resumed run's logs are cut back to its checkpoint."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_vlm import checkpoints

# --- checkpoints --------------------------------------------------------------------------------------------


def write_adapter_file(folder: Path) -> None:
    (folder / "adapter_model.safetensors").write_bytes(b"weights")


def save(
    run: Path, step: int, keep_last: int | None = None, write_adapter=write_adapter_file, run_id=None
) -> Path:
    return checkpoints.save_checkpoint(
        run / f"checkpoint-{step}",
        write_adapter=write_adapter,
        state={"step": step},
        keep_last=keep_last,
        run_id=run_id,
    )


def draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


def test_set_rng_state_restores_torch_python_and_numpy_streams_exactly():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    draws()
    saved = checkpoints.rng_state()
    first = draws()
    draws()
    checkpoints.set_rng_state(saved)
    assert draws() == first


def test_keep_last_prunes_older_checkpoints_in_numeric_order(tmp_path):
    for step in (8, 9, 10, 11):  # 'checkpoint-10' < 'checkpoint-9' as strings: the order must be numeric
        save(tmp_path, step, keep_last=2)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-10", "checkpoint-11"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-11"]


def test_keep_last_with_a_run_id_prunes_only_that_runs_older_checkpoints(tmp_path):
    save(tmp_path, 1, run_id="run-a")
    save(tmp_path, 2, run_id="run-a")
    save(tmp_path, 3, run_id="run-b")
    save(tmp_path, 4, run_id="run-b")
    save(tmp_path, 5)  # written without a run id: nobody's to prune
    save(tmp_path, 6, keep_last=1, run_id="run-a")
    kept = [f"checkpoint-{s}" for s in (3, 4, 5, 6)]
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == kept
    assert [checkpoints.checkpoint_run_id(tmp_path / f"checkpoint-{s}") for s in (3, 4, 5, 6)] == [
        "run-b",
        "run-b",
        None,
        "run-a",
    ]
    owner = json.loads((tmp_path / "checkpoint-6" / "checkpoint.json").read_text())
    assert (owner["run_id"], owner["step"], sorted(owner["files"])) == (
        "run-a",
        6,
        ["adapter_model.safetensors", checkpoints.STATE_FILE],
    )
    save(tmp_path, 7, keep_last=1, run_id="run-b")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [f"checkpoint-{s}" for s in (5, 6, 7)]


def test_resume_takes_a_run_folders_newest_checkpoint_or_the_one_named_and_refuses_another_runs(tmp_path):
    for step in (1, 2):
        state = {"step": step, "run_id": "run-a"}
        checkpoints.save_checkpoint(
            tmp_path / f"checkpoint-{step}", write_adapter=write_adapter_file, state=state, keep_last=None
        )
    checkpoint, state, run_id, report = checkpoints.checkpoint_to_resume(tmp_path, tmp_path)
    assert (checkpoint.name, state["step"], run_id, report) == ("checkpoint-2", 2, "run-a", None)
    assert checkpoints.checkpoint_to_resume(tmp_path / "checkpoint-1", tmp_path)[1]["step"] == 1
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "run-b"}))  # the folder now holds another run
    with pytest.raises(ValueError, match="checkpoint-2 belongs to another run"):
        checkpoints.checkpoint_to_resume(tmp_path, tmp_path)


def test_leftover_tmp_folder_from_a_crash_is_ignored_and_replaced_on_the_next_save(tmp_path):
    (tmp_path / "run.json").write_text('{"run_id": "r"}')
    save(tmp_path, 1, run_id="r")
    leftover = tmp_path / "checkpoint-2.tmp"
    leftover.mkdir()
    (leftover / "half_written.bin").write_bytes(b"partial")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-1"]
    folder = save(tmp_path, 2)
    assert not leftover.exists()
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_model.safetensors",
        checkpoints.OWNER_FILE,
        checkpoints.STATE_FILE,
    ]
    assert checkpoints.load_checkpoint(folder)["step"] == 2


def test_failing_write_adapter_leaves_the_previous_checkpoint_intact_and_no_final_folder(tmp_path):
    def crash(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    save(tmp_path, 1, keep_last=1)
    with pytest.raises(RuntimeError, match="disk full"):
        save(tmp_path, 2, keep_last=1, write_adapter=crash)
    assert not (tmp_path / "checkpoint-2").exists()
    with pytest.raises(RuntimeError, match="disk full"):  # re-saving the same step must not lose it either
        save(tmp_path, 1, keep_last=1, write_adapter=crash)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "adapter_model.safetensors").read_bytes() == b"weights"
    assert checkpoints.load_checkpoint(tmp_path / "checkpoint-1")["step"] == 1


def test_load_checkpoint_of_a_folder_without_state_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        checkpoints.load_checkpoint(tmp_path)


def test_a_leftover_temporary_checkpoint_folder_is_removed_when_the_run_folder_opens_and_never_resumed(
    tmp_path,
):
    (tmp_path / "run.json").write_text('{"run_id": "r"}')
    save(tmp_path, 1, run_id="r")
    leftover = tmp_path / "checkpoint-2.tmp"  # a save killed before the rename that completes it
    leftover.mkdir()
    (leftover / checkpoints.STATE_FILE).write_bytes(b"half")
    assert checkpoints.check_run_folder(tmp_path, resume=str(tmp_path), overwrite=False) == "resume"
    checkpoint, state, run_id, _ = checkpoints.checkpoint_to_resume(tmp_path, tmp_path)
    assert (checkpoint.name, state["step"]) == ("checkpoint-1", 1)
    checkpoints.open_run_folder(tmp_path, "resume", run_id, 1, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "run.json"]


@pytest.mark.parametrize(
    "owner", [b"{not json", b"[1, 2]", b"\xff\xfe"], ids=["not-json", "a-list", "not-utf8"]
)
def test_a_checkpoint_whose_owner_file_is_unreadable_is_no_runs_to_prune_and_saving_goes_on(tmp_path, owner):
    save(tmp_path, 1, run_id="run-a")
    (tmp_path / "checkpoint-1" / checkpoints.OWNER_FILE).write_bytes(owner)
    assert checkpoints.checkpoint_run_id(tmp_path / "checkpoint-1") is None
    for step in (2, 3):
        save(tmp_path, step, keep_last=1, run_id="run-a")
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3"]


# --- logs cut back on resume --------------------------------------------------------------------------------


def test_trim_jsonl_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "label": "通过", "loss": s / 3}, ensure_ascii=False) for s in range(6)]
    # the crash cut the last line inside a 3-byte UTF-8 character
    torn = json.dumps({"step": 6, "label": "通过"}, ensure_ascii=False).encode()[:-4]
    path.write_bytes(("\n".join(lines) + "\n").encode() + torn)
    checkpoints.trim_jsonl(path, last_step=3)
    assert path.read_text(encoding="utf-8") == "\n".join(lines[:4]) + "\n"  # kept lines byte for byte
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left behind


def test_trim_jsonl_drops_a_torn_line_even_below_the_step_and_ignores_a_missing_file(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"step": 1, "completion": "a"}\n{"step": 2, "compl')
    checkpoints.trim_jsonl(path, last_step=10)
    assert path.read_text() == '{"step": 1, "completion": "a"}\n'
    checkpoints.trim_jsonl(tmp_path / "absent.jsonl", last_step=3)
    assert not (tmp_path / "absent.jsonl").exists()
