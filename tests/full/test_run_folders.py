"""Run folders: one writer per folder, run.json as the folder's marker, --resume as the recorded run, and a
run stopped in the user's code (a failing or slow reward plug-in) that leaves a checkpoint to continue from.

Processes, signals and files are real where the behaviour is about them: `python -m grpo_vlm` in a child
process on the embedded tiny model, a reward plug-in that waits on a file so that the test decides when a
run is busy, SIGTERM and SIGKILL delivered by the operating system.
"""

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from full.helpers import train_args
from grpo_vlm import checkpoints, cli, trainer

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--device",
    "cpu",
    "--train-size",
    "16",
    "--eval-size",
    "0",
    "--batch-size",
    "2",
    "--group-size",
    "2",
]
FLAGS += ["--max-new-tokens", "8", "--eval-every", "1000"]
SMALL = dict(train_size=16, eval_size=0, batch_size=2, group_size=2, max_new_tokens=8, eval_every=1000)


def train_py(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "grpo_vlm", *flags]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def start_train_py(*flags: str, cwd: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "grpo_vlm", *flags]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, child: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert child.poll() is None, child.communicate()[1][-2000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` but the lock file (it holds its latest holder's pid)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != checkpoints.LOCK_FILE
    }


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def waiting_reward(tmp_path: Path) -> tuple[str, Path, Path]:
    """A plug-in (its --reward spec) that, while the file `hold` exists, touches `waiting` and waits."""
    hold, waiting = tmp_path / "hold", tmp_path / "waiting"
    plugin = tmp_path / "waiting_reward.py"
    plugin.write_text(
        "import os, time\n"
        "def judge(completion, sample):\n"
        f"    while os.path.exists({str(hold)!r}):\n"
        f"        open({str(waiting)!r}, 'w').close()\n"
        "        time.sleep(0.05)\n"
        "    return float(len(completion) % 2)\n"
    )
    return f"{plugin}:judge", hold, waiting


def test_a_second_process_on_a_running_folder_is_refused_and_a_killed_holder_blocks_nothing(tmp_path):
    reward, hold, waiting = waiting_reward(tmp_path)
    out = tmp_path / "run"
    hold.touch()
    first = start_train_py(*FLAGS, "--steps", "2", "--reward", reward, "--output-dir", str(out), cwd=tmp_path)
    wait_for(waiting, first)  # the first run is inside step 1, its run.json written
    # A second run on the folder, and one that would --overwrite it, started while the first trains.
    second = start_train_py(*FLAGS, "--steps", "3", "--output-dir", str(out), cwd=tmp_path)
    replacing = start_train_py(*FLAGS, "--output-dir", str(out), "--overwrite", cwd=tmp_path)
    for child in (second, replacing):
        _, stderr = child.communicate(timeout=300)
        assert child.returncode == 2, stderr[-2000:]
        holder = json.loads((out / ".lock").read_text())
        assert holder["pid"] == first.pid
        assert stderr.strip() == (  # one line, naming the folder and its holder
            f"error: run folder {out} is in use by another process (pid {first.pid} on {holder['host']}, "
            f"started {holder['started']}); one writer at a time: wait for it to end, stop it, or choose "
            "another output"
        )
    hold.unlink()
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    assert steps_of(out / "metrics.jsonl") == [0, 1, 2]  # the first run's steps only
    assert steps_of(out / "rollouts.jsonl") == [1] * 4 + [2] * 4
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert checkpoints.checkpoint_run_id(out / "checkpoint-000002") == run_id

    # A holder killed with SIGKILL (no clean-up at all) leaves no stale lock: the same command starts again.
    killed = tmp_path / "killed"
    hold.touch()
    waiting.unlink()
    child = start_train_py(
        *FLAGS, "--steps", "1", "--reward", reward, "--output-dir", str(killed), cwd=tmp_path
    )
    wait_for(waiting, child)
    child.kill()
    child.communicate(timeout=60)
    hold.unlink()
    again = train_py(*FLAGS, "--steps", "1", "--reward", reward, "--output-dir", str(killed), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "replaced the previous run: removed" in again.stdout
    assert steps_of(killed / "metrics.jsonl") == [0, 1]


def test_resume_with_only_the_folder_continues_the_recorded_run_and_refuses_a_changed_flag(tmp_path, capsys):
    out = tmp_path / "run"
    first = train_py(*FLAGS, "--steps", "2", "--output-dir", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    recorded, before = json.loads((out / "run.json").read_text()), tree_digest(out)

    # The command line of `python -m grpo_vlm --resume DIR ...` (trainer.command_line), in this process.
    refused = ["--resume", str(out), "--steps", "4", "--batch-size", "16", "--lr", "0.001"]
    with pytest.raises(cli.UsageError) as error:
        trainer.main(trainer.command_line(refused))
    assert str(error.value) == (
        f"--resume {out}: these flags differ from the recorded run: --batch-size recorded 2, given 16; "
        "--lr recorded 0.002, given 0.001"
    )
    assert tree_digest(out) == before  # nothing written

    resumed = train_py("--resume", str(out), "--steps", "4", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert steps_of(out / "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert steps_of(out / "rollouts.jsonl") == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # B * G = 4 each
    recorded["args"]["steps"] = 4
    now = json.loads((out / "run.json").read_text())
    started, summary = now.pop("starts"), now.pop("summary")
    assert now == {k: v for k, v in recorded.items() if k not in ("starts", "summary")}  # but for --steps
    assert started[0] == recorded["starts"][0] and started[1]["from_step"] == 2 and summary["steps"] == 4
    assert started[1]["command"] == f"python -m grpo_vlm --resume {out} --steps 4"

    before = tree_digest(out)
    capsys.readouterr()
    assert trainer.main(trainer.command_line(["--resume", str(out)])) == {}
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"{out}: the run is finished at step 4; to train further: python -m grpo_vlm --resume {out} "
        "--steps M (M > 4)"
    )
    assert tree_digest(out) == before


def test_a_signal_during_a_slow_reward_stops_at_once_with_the_last_finished_steps_checkpoint(tmp_path):
    waiting, plugin = tmp_path / "waiting", tmp_path / "slow.py"
    plugin.write_text(
        "import time\ncalls = 0\n"
        "def judge(completion, sample):\n"
        "    global calls\n    calls += 1\n"
        "    if calls > 4:  # step 2 (4 completions a step): ten minutes, were it not for the signal\n"
        f"        open({str(waiting)!r}, 'w').close()\n"
        "        time.sleep(600)\n"
        "    return 1.0\n"
    )
    out = tmp_path / "run"
    flags = ("--steps", "3", "--reward", f"{plugin}:judge", "--output-dir", str(out))
    child = start_train_py(*FLAGS, *flags, cwd=tmp_path)
    wait_for(waiting, child)
    sent = time.time()
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr[-2000:]
    assert time.time() - sent < 10
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "stopped by SIGTERM while a reward function ran; checkpoint of step 1 written. Continue with: "
        f"python -m grpo_vlm --resume {out}"
    )
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]
    assert steps_of(out / "metrics.jsonl") == [0, 1]


def test_a_reward_that_fails_mid_run_leaves_a_checkpoint_and_the_fixed_run_resumes_bit_for_bit(tmp_path):
    broken = tmp_path / "broken"
    plugin = tmp_path / "flaky.py"
    plugin.write_text(
        "import os\ncalls = 0\n"
        "def judge(completion, sample):\n"
        "    global calls\n    calls += 1\n"
        f"    if calls > 4 and os.path.exists({str(broken)!r}):  # from step 2 on (4 completions a step)\n"
        "        raise ValueError('judge is broken')\n"
        "    return float(len(completion) % 2)\n"
    )
    flags = dict(SMALL, steps=3, reward=(f"{plugin}:judge",), save_every=100)
    trainer.main(train_args(output_dir=str(tmp_path / "whole"), **flags))

    out = tmp_path / "run"
    broken.touch()
    with pytest.raises(ValueError, match="judge is broken") as failure:
        trainer.main(train_args(output_dir=str(out), **flags))
    assert failure.value.user_message.endswith(
        f"checkpoint of step 1 written. Once that is fixed, continue with: python -m grpo_vlm --resume {out}"
    )
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]
    broken.unlink()
    trainer.main(train_args(output_dir=str(out), resume=str(out), **flags))
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_a_folder_without_run_json_is_never_written_into_even_with_overwrite(tmp_path):
    out = tmp_path / "mine"
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text('{"step": 0, "mine": true}\n')
    (out / "report.html").write_text("<html>my own report</html>")
    for name in ("adapter", "checkpoint-best", "tensorboard", "thumbs"):
        (out / name).mkdir()
        (out / name / "notes.txt").write_text("my own file")
    before = tree_digest(out)
    for overwrite in (False, True):
        with pytest.raises(cli.UsageError, match=f"{out} is not a run folder of this project"):
            trainer.main(train_args(output_dir=str(out), overwrite=overwrite, steps=1, **SMALL))
        assert tree_digest(out) == before
        assert sorted(p.name for p in out.iterdir()) == sorted(
            ["adapter", "checkpoint-best", "tensorboard", "thumbs"]
            + ["metrics.jsonl", "report.html", "rollouts.jsonl"]
        )  # not even a lock file is left


def test_overwrite_removes_only_the_runs_own_files_and_lists_them(tmp_path, capsys):
    out = tmp_path / "run"
    trainer.main(train_args(output_dir=str(out), steps=1, **SMALL))
    foreign = out / "checkpoint-000099"  # another run's checkpoint, and a file of the user's
    checkpoints.save_checkpoint(
        foreign, write_adapter=lambda d: None, state={"step": 99}, keep_last=None, run_id="x"
    )
    (out / "notes.txt").write_text("mine")
    (out / "report.html").write_text("<html>the run's report</html>")  # the trainer's, at a checkpoint
    capsys.readouterr()
    trainer.main(train_args(output_dir=str(out), steps=1, overwrite=True, **SMALL))
    printed = capsys.readouterr().out
    assert (
        "replaced the previous run: removed adapter, checkpoint-000001, curves.png, metrics.jsonl, "
        "report.html, rollouts.jsonl, run.json, thumbs, timings.jsonl" in printed
    )
    assert "; left in place (not the run's own): checkpoint-000099, notes.txt" in printed
    assert checkpoints.checkpoint_run_id(foreign) == "x" and (out / "notes.txt").read_text() == "mine"


def test_an_unusable_output_folder_or_run_json_is_one_line_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(cli.UsageError, match=f"^--output-dir: {tmp_path / 'file'} is a file, not a folder$"):
        trainer.main(train_args(output_dir=str(tmp_path / "file" / "sub"), steps=1, **SMALL))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{garbage")
    garbage = f"^{tmp_path / 'run' / 'run.json'}: not a run record of this project"
    for command_line in (["--resume", str(tmp_path / "run")], ["--output-dir", str(tmp_path / "run")]):
        with pytest.raises(cli.UsageError, match=garbage):
            trainer.main(trainer.command_line(command_line))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file", "run", "run.json"]
