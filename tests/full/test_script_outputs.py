"""What the scripts in scripts/ write, and when they refuse to: never over one of their inputs, one process
per output, a run that processed nothing or little is not a success, an output that cannot be written is one
line and status 74 (found before the slow work), and a Ctrl-C at any moment is status 130 without a
traceback. Real files and processes; tmpfs mounts for read-only and full disks (skipped where mount is not
permitted: tests run as root, which ignores file permissions).
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from grpo_vlm import cli
from scripts import evaluate, mock_rollouts, outputs, score_rollouts, summarize_photos, train_offline

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [{"prompt_id": f"p{i}", "label": "通过" if i % 2 else "不通过"} for i in range(4)]


def write_lines(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def rollouts_and_prompts(folder: Path, prompts: list[dict] = PROMPTS) -> tuple[Path, Path]:
    """prompts.jsonl and rollouts.jsonl in `folder`: two rollouts of each prompt."""
    rollouts = [{"prompt_id": p["prompt_id"], "text": f"通过\n理由: {k}"} for p in prompts for k in range(2)]
    return write_lines(folder / "rollouts.jsonl", rollouts), write_lines(folder / "prompts.jsonl", prompts)


def run_script(script: str, *args, cwd=ROOT) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "scripts" / script), *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def one_error_line(result: subprocess.CompletedProcess, status: int) -> str:
    assert result.returncode == status, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------
# An output never replaces an input


def photo_folder(tmp_path: Path) -> Path:
    for group in ("g1", "g2"):
        (tmp_path / "photos" / group).mkdir(parents=True)
        Image.new("RGB", (28, 28), (200, 30, 30)).save(tmp_path / "photos" / group / "1.png")
    (tmp_path / "prompt.txt").write_text("What is in the photo?\n", encoding="utf-8")
    return tmp_path / "photos"


def refusals(tmp: Path) -> dict[str, tuple]:
    """case -> (main, Args, the two flags the refusal must name)."""
    rollouts, prompts = rollouts_and_prompts(tmp)
    (tmp / "link.jsonl").symlink_to(rollouts)
    data = write_lines(tmp / "data.jsonl", [{"id": "a", "prompt": "ok?", "label": "通过"}])
    photos = photo_folder(tmp)
    plugin = tmp / "rm.py"
    plugin.write_text("def score(completion, sample):\n    return 1.0\n", encoding="utf-8")
    score = lambda **kw: score_rollouts.Args(rollouts=str(rollouts), prompts=str(prompts), **kw)
    stage_a = dict(photos=str(photos), prompt_template=str(tmp / "prompt.txt"), device="cpu")
    scored = dict(data=str(data), val_data=str(data), device="cpu")
    return {
        "score --output = --rollouts": (
            score_rollouts,
            score(output=str(rollouts)),
            "--output",
            "--rollouts",
        ),
        "score --report = --prompts": (score_rollouts, score(report=str(prompts)), "--report", "--prompts"),
        "score --cache = --prompts": (score_rollouts, score(cache=str(prompts)), "--cache", "--prompts"),
        "score --output = a link to --rollouts": (
            score_rollouts,
            score(output=str(tmp / "link.jsonl")),
            "--output",
            "--rollouts",
        ),
        "score --output = --reward's file": (
            score_rollouts,
            score(output=str(plugin), reward=(f"{plugin}:score",)),
            "--output",
            "--reward",
        ),
        "score --report = --output": (
            score_rollouts,
            score(output=str(tmp / "o.jsonl"), report=str(tmp / "o.jsonl")),
            "--report",
            "--output",
        ),
        "evaluate --output = --data, --overwrite": (
            evaluate,
            evaluate.Args(data=(str(data),), output=str(data), overwrite=True),
            "--output",
            "--data",
        ),
        "evaluate --output = a link to --data": (
            evaluate,
            evaluate.Args(data=(str(tmp / "link.jsonl"),), output=str(rollouts)),
            "--output",
            "--data",
        ),
        "summarize --output inside --photos": (
            summarize_photos,
            summarize_photos.Args(**stage_a, output=str(photos / "summaries.jsonl"), overwrite=True),
            "--output",
            "--photos",
        ),
        "summarize --output = a photo": (
            summarize_photos,
            summarize_photos.Args(**stage_a, output=str(photos / "g1" / "1.png")),
            "--output",
            "--photos",
        ),
        "summarize --output = --labels": (
            summarize_photos,
            summarize_photos.Args(**stage_a, labels=str(data), output=str(data)),
            "--output",
            "--labels",
        ),
        "mock --output = --prompts": (
            mock_rollouts,
            mock_rollouts.Args(prompts=str(prompts), output=str(prompts)),
            "--output",
            "--prompts",
        ),
        "train_offline --output-dir holds --data": (
            train_offline,
            train_offline.Args(**scored, output_dir=str(tmp), overwrite=True),
            "--output-dir",
            "--data",
        ),
    }


@pytest.fixture(scope="module")
def refusal_folder(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("refusals")
    return tmp, refusals(tmp)


REFUSAL_CASES = [
    "score --output = --rollouts",
    "score --report = --prompts",
    "score --cache = --prompts",
    "score --output = a link to --rollouts",
    "score --output = --reward's file",
    "score --report = --output",
    "evaluate --output = --data, --overwrite",
    "evaluate --output = a link to --data",
    "summarize --output inside --photos",
    "summarize --output = a photo",
    "summarize --output = --labels",
    "mock --output = --prompts",
    "train_offline --output-dir holds --data",
]


@pytest.mark.parametrize("case", REFUSAL_CASES)
def test_an_output_over_one_of_the_scripts_inputs_is_refused_naming_both_flags_and_nothing_is_written(
    refusal_folder, case
):
    tmp, cases = refusal_folder
    script, args, output_flag, input_flag = cases[case]
    before = snapshot(tmp)
    with pytest.raises(cli.UsageError) as refused:
        script.main(args)
    message = str(refused.value)
    assert message.startswith(output_flag) and input_flag in message, message
    assert snapshot(tmp) == before


def test_the_command_line_refusal_is_one_line_with_status_2_even_with_overwrite(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", [{"id": "a", "prompt": "ok?", "label": "通过"}])
    result = run_script("evaluate.py", "--data", data, "--reward", "label", "--output", data, "--overwrite")
    line = one_error_line(result, 2)
    assert f"--output {data}" in line and f"--data {data}" in line
    assert data.read_text(encoding="utf-8") == '{"id": "a", "prompt": "ok?", "label": "通过"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]


# --------------------------------------------------------------------------------------------------
# One process per output


SLOW_REWARD = """
import os, time
def score(completion, sample):
    if os.environ.get("SLOW_REWARD"):
        time.sleep(600)
    return 1.0
"""


def wait_for_lock_record(lock: Path, pid: int, child: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None:
        if lock.exists() and f'"pid": {pid}' in lock.read_text(encoding="utf-8"):
            return
        time.sleep(0.1)
    raise AssertionError(f"the first process never took its lock (status {child.poll()})")


def test_a_second_evaluate_on_one_output_is_refused_at_once_and_a_killed_holder_does_not_block(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", [{"id": i, "prompt": "ok?", "label": "通过"} for i in "ab"])
    plugin = tmp_path / "slow.py"
    plugin.write_text(SLOW_REWARD, encoding="utf-8")
    output = tmp_path / "eval" / "out.jsonl"
    argv = ["--data", data, "--reward", f"{plugin}:score", "--max-new-tokens", "2", "--device", "cpu"]
    argv = [str(a) for a in [*argv, "--output", output]]
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), *argv],
        env={**os.environ, "SLOW_REWARD": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_lock_record(output.with_name(".out.jsonl.lock"), first.pid, first)
        started = time.time()
        second = run_script("evaluate.py", *argv, "--overwrite")  # --overwrite would remove its lines
        line = one_error_line(second, 2)
        assert f"--output {output}" in line and f"pid {first.pid}" in line and "started" in line
        assert time.time() - started < 30  # before any model is loaded
        assert first.poll() is None
    finally:
        first.kill()  # SIGKILL: the kernel releases the lock
        first.wait()
    third = run_script("evaluate.py", *argv)
    assert third.returncode == 0, third.stderr[-3000:]
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["a", "b"]


@pytest.mark.parametrize("script", ["score_rollouts", "summarize_photos", "train_offline", "evaluate"])
def test_an_output_held_by_another_process_is_refused_naming_the_holder_before_any_work(tmp_path, script):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    out = tmp_path / "out"
    if script == "score_rollouts":
        module, args = (
            score_rollouts,
            score_rollouts.Args(str(rollouts), str(prompts), cache=str(out / "c.db")),
        )
        lock, flag = tmp_path / ".rollouts.scored.jsonl.lock", "--output"
    elif script == "summarize_photos":
        photos = photo_folder(tmp_path)
        output = out / "s.jsonl"
        module = summarize_photos
        args = summarize_photos.Args(photos=str(photos), prompt_template=str(tmp_path / "prompt.txt"))
        args.output, args.device = str(output), "cpu"
        lock, flag = out / ".s.jsonl.lock", "--output"
    elif script == "train_offline":
        module, args = train_offline, train_offline.Args(demo=True, output_dir=str(out), device="cpu")
        lock, flag = out / ".lock", "--output-dir"
    else:
        module = evaluate
        args = evaluate.Args(adapter=None, output=str(out / "e.jsonl"), eval_size=1)
        lock, flag = out / ".e.jsonl.lock", "--output"
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = cli.hold_lock(lock, "a test")  # another open file description: flock refuses it as another's
    try:
        before = snapshot(tmp_path)
        with pytest.raises(cli.UsageError) as refused:
            module.main(args)
        assert str(refused.value).startswith(flag) and f"pid {os.getpid()}" in str(refused.value)
        assert snapshot(tmp_path) == before
    finally:
        holder.close()


# --------------------------------------------------------------------------------------------------
# A failure is never a success


def test_score_rollouts_that_scores_nothing_exits_2_with_the_count_and_keeps_the_previous_output(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    assert run_script("score_rollouts.py", "--rollouts", rollouts, "--prompts", prompts).returncode == 0
    scored = tmp_path / "rollouts.scored.jsonl"
    good = scored.read_bytes()
    plugin = tmp_path / "strings.py"
    plugin.write_text("def score(completion, sample):\n    return 'high'\n", encoding="utf-8")
    argv = ["--rollouts", rollouts, "--prompts", prompts, "--reward", f"{plugin}:score"]
    line = one_error_line(run_script("score_rollouts.py", *argv), 2)
    assert "0 of 8 lines scored, 8 bad" in line and "returned 'high'" in line and "nothing written" in line
    assert scored.read_bytes() == good


def test_score_rollouts_with_more_than_half_of_the_lines_bad_is_a_failure_at_most_half_is_not(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    lines = rollouts.read_text(encoding="utf-8").splitlines()
    for n_bad, fails in ((4, False), (5, True)):  # of 8 lines
        bad = [json.dumps({"prompt_id": "nobody", "text": "x"})] * n_bad
        write_lines(rollouts, [json.loads(line) for line in lines[: 8 - n_bad] + bad])
        args = score_rollouts.Args(str(rollouts), str(prompts), output=str(tmp_path / f"{n_bad}.jsonl"))
        if fails:
            with pytest.raises(cli.UsageError, match="3 of 8 lines scored, 5 bad .*unknown prompt_id"):
                score_rollouts.main(args)
            assert not (tmp_path / f"{n_bad}.jsonl").exists()
        else:
            assert score_rollouts.main(args)["counts"]["scored"] == 4


def test_summarize_photos_that_skips_every_group_exits_2_with_the_count(tmp_path):
    photos = photo_folder(tmp_path)
    for group in ("g1", "g2"):
        (photos / group / "1.png").write_bytes(b"not a png")
    args = summarize_photos.Args(photos=str(photos), prompt_template=str(tmp_path / "prompt.txt"))
    args.output, args.device, args.skip_bad_groups = str(tmp_path / "out" / "s.jsonl"), "cpu", True
    with pytest.raises(cli.UsageError, match=r"--photos: 2 of 2 groups skipped, 0 in .*1\.png"):
        summarize_photos.main(args)
    assert json.loads((tmp_path / "out" / "s.skipped.json").read_text())["groups"][0]["group_id"] == "g1"


# --------------------------------------------------------------------------------------------------
# The reward cache's errors are the cache's


def test_a_cache_that_is_not_a_database_or_holds_a_non_number_is_named_not_the_reward(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    cache = tmp_path / "cache.sqlite"
    cache.write_bytes(b"garbage, not sqlite" * 100)
    args = score_rollouts.Args(str(rollouts), str(prompts), cache=str(cache))
    with pytest.raises(cli.UsageError, match=f"^--cache {cache}: file is not a database"):
        score_rollouts.main(args)
    cache.unlink()
    score_rollouts.main(args)
    with sqlite3.connect(cache) as conn:
        conn.execute("UPDATE reward SET value = 'abc'")  # sqlite keeps text in a REAL column
    conn.close()
    with pytest.raises(cli.UsageError, match=f"^--cache {cache}: holds 'abc' for reward"):
        score_rollouts.main(args)


def test_a_cache_locked_by_another_program_is_named_not_the_reward(tmp_path):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    cache = tmp_path / "cache.sqlite"
    other = sqlite3.connect(cache, isolation_level=None)
    other.execute("CREATE TABLE IF NOT EXISTS reward (key TEXT PRIMARY KEY, value REAL NOT NULL)")
    other.execute("BEGIN EXCLUSIVE")  # e.g. the sqlite3 shell in the middle of a transaction
    try:
        args = score_rollouts.Args(str(rollouts), str(prompts), cache=str(cache))
        with pytest.raises(cli.UsageError, match=f"^--cache {cache}: database is locked"):
            score_rollouts.main(args)
    finally:
        other.close()


# --------------------------------------------------------------------------------------------------
# An output that cannot be written


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs at tmp_path/fs (unmounted afterwards), or a skip where mounting is not permitted."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], check=False
    )
    if mounted.returncode != 0:
        pytest.skip("mount is not permitted here (a read-only or full file system needs a tmpfs)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


COUNTING_REWARD = """
from pathlib import Path
def score(completion, sample):
    with open({calls!r}, "a") as f:
        f.write("call\\n")
    return 1.0
"""


def test_a_read_only_output_folder_is_found_before_any_reward_is_computed(tmp_path, tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    plugin = tmp_path / "counting.py"
    plugin.write_text(COUNTING_REWARD.format(calls=str(tmp_path / "calls.txt")), encoding="utf-8")
    output = tmpfs / "scored.jsonl"
    argv = ["--rollouts", rollouts, "--prompts", prompts, "--reward", f"{plugin}:score", "--output", output]
    line = one_error_line(run_script("score_rollouts.py", *argv), 74)
    assert line == f"error: cannot write {output}: Read-only file system"
    assert not (tmp_path / "calls.txt").exists()


def test_a_full_disk_is_one_line_with_status_74_and_leaves_no_partial_file(tmp_path, tmpfs):
    rollouts, prompts = rollouts_and_prompts(tmp_path)
    big = [{"prompt_id": "p1", "text": "通过\n理由: " + "很长" * 4000} for _ in range(8)]  # > 64 KiB scored
    write_lines(rollouts, big)
    output = tmpfs / "scored.jsonl"
    argv = ["--rollouts", rollouts, "--prompts", prompts, "--output", output, "--cache", tmp_path / "c.db"]
    line = one_error_line(run_script("score_rollouts.py", *argv), 74)
    assert line == f"error: cannot write {output}: No space left on device"
    assert sorted(p.name for p in tmpfs.iterdir()) == [".scored.jsonl.lock", ".scored.report.json.lock"]


def test_a_line_that_does_not_fit_on_the_disk_is_cut_back_off_leaving_whole_lines(tmpfs):
    path = tmpfs / "out.jsonl"
    with path.open("a", encoding="utf-8") as f, pytest.raises(OSError, match="No space left"):
        for i in range(1000):
            outputs.append_line(f, {"id": i, "text": "x" * 1000})
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and [json.loads(line)["id"] for line in text.splitlines()] == list(range(i))


# --------------------------------------------------------------------------------------------------
# Ctrl-C at any moment


def slow_reward(folder: Path) -> Path:
    """A reward plug-in that takes half a second a call: the scoring outlasts the Ctrl-C on a fast machine."""
    plugin = folder / "slow.py"
    plugin.write_text(
        "import time\n\n\ndef judge(completion, sample):\n    time.sleep(0.5)\n    return 1.0\n"
    )
    return plugin


def script_commands(tmp_path: Path) -> dict[str, list[str]]:
    rollouts, prompts = rollouts_and_prompts(tmp_path / "in")
    photos = photo_folder(tmp_path / "in")
    out = tmp_path / "out"
    return {
        "evaluate.py": ["--eval-size", "4", "--output", out / "e.jsonl"],
        "score_rollouts.py": ["--rollouts", rollouts, "--prompts", prompts, "--output", out / "s.jsonl"]
        + [
            "--reward",
            "label",
            f"{slow_reward(tmp_path / 'in')}:judge",
            "--cache",
            tmp_path / "in" / "c.sqlite",
        ],
        "summarize_photos.py": ["--photos", photos, "--prompt-template", tmp_path / "in" / "prompt.txt"]
        + ["--output", out / "a.jsonl"],
        "train_offline.py": ["--demo", "--output-dir", out],
        "mock_rollouts.py": ["--prompts", write_lines(tmp_path / "in" / "many.jsonl", PROMPTS * 10_000)]
        + ["--output", out / "r.jsonl"],  # a few seconds of work
        "compare_variants.py": ["--out", out, "--seeds", "0", "--variants", "grpo", "--steps", "2"],
    }


@pytest.mark.parametrize("after_s", [0.5, 2.0])
@pytest.mark.parametrize(
    "script",
    ["evaluate.py", "score_rollouts.py", "summarize_photos.py", "train_offline.py", "mock_rollouts.py"]
    + ["compare_variants.py"],
)
def test_ctrl_c_soon_after_start_exits_130_without_a_traceback_and_writes_nothing(tmp_path, script, after_s):
    argv = [str(a) for a in script_commands(tmp_path)[script]]
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / script), *argv],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a terminal's Ctrl-C reaches as a whole
    )
    time.sleep(after_s)
    os.killpg(child.pid, signal.SIGINT)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 130, (stdout + stderr)[-3000:]
    assert "Traceback" not in stdout + stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "out").rglob("*"))
    assert written == [], written
