"""The command line of every script in scripts/, run as a user runs it (a subprocess): a user's mistake (a bad
flag, a missing file, a malformed line, a reward that fails) exits with status 2 and ONE line `error: ...`
naming the flag or file:line, with no traceback; an internal error keeps its traceback (status 1).

Most mistakes are caught before any model is loaded; the few that need the model use the tiny one in
assets/ (about a second to load).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, f"scripts/{script}", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def assert_user_error(result: subprocess.CompletedProcess, *named: str) -> str:
    """Exit status 2, one stderr line starting with 'error:' that names each of `named`, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for part in named:
        assert part in errors[0], errors[0]
    assert "Traceback" not in output, output[-3000:]
    return errors[0]


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


PROMPT = json.dumps({"prompt_id": "p1", "label": "通过"}, ensure_ascii=False)


@pytest.mark.parametrize(
    ("script", "args", "flag"),
    [
        ("evaluate.py", ["--batch-size", "0"], "--batch-size"),
        ("score_rollouts.py", ["--group-size", "1"], "--group-size"),
        ("mock_rollouts.py", ["--p-correct", "1.5"], "--p-correct"),
        ("train_offline.py", ["--demo", "--batch-size", "0"], "--batch-size"),
        ("bench.py", ["--config", "huge"], "--config"),
        ("make_tiny_vlm.py", ["--batch-size", "0"], "--batch-size"),
    ],
)
def test_a_bad_numeric_or_named_flag_exits_2_naming_the_flag_without_traceback(tmp_path, script, args, flag):
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPT)
    rollouts = write_lines(tmp_path / "rollouts.jsonl", json.dumps({"prompt_id": "p1", "text": "x"}))
    where = {  # every file a script writes goes under tmp_path, should a check ever let the run through
        "evaluate.py": ["--output", tmp_path / "eval.jsonl"],
        "score_rollouts.py": ["--rollouts", rollouts, "--prompts", prompts],
        "mock_rollouts.py": ["--prompts", prompts, "--output", tmp_path / "out.jsonl"],
        "train_offline.py": ["--output-dir", tmp_path / "run"],
        "bench.py": [],
        "make_tiny_vlm.py": ["--out", tmp_path / "tiny"],
    }[script]
    assert_user_error(run_script(script, *where, *args), flag)
    assert not (tmp_path / "run").exists() and not (tmp_path / "tiny").exists()


# --- evaluate.py -------------------------------------------------------------------------------------------


def test_evaluate_with_a_malformed_data_line_exits_2_naming_file_and_line_without_traceback(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", '{"prompt": "ok?", "label": "通过"}', '{"prompt": 3}')
    result = run_script("evaluate.py", "--data", data, "--reward", "label", "--output", tmp_path / "e.jsonl")
    assert_user_error(result, f"{data}:2:", "prompt")


def test_evaluate_with_a_reward_plugin_that_does_not_exist_exits_2_naming_the_flag(tmp_path):
    data = write_lines(tmp_path / "data.jsonl", '{"prompt": "ok?", "label": "通过"}')
    missing = tmp_path / "no_such_reward.py"
    result = run_script(
        "evaluate.py", "--data", data, "--reward", f"{missing}:score", "--output", tmp_path / "e.jsonl"
    )
    assert_user_error(result, "--reward", str(missing))


def test_evaluate_with_a_reward_failing_on_a_sample_exits_2_naming_file_and_line(tmp_path):
    # The plug-in declares no fields: line 2's missing `score` is found when it is scored, after generation.
    data = write_lines(
        tmp_path / "data.jsonl",
        '{"id": "a", "prompt": "ok?", "score": 1}',
        '{"id": "b", "prompt": "ok?", "answer": "1"}',
    )
    plugin = write_lines(
        tmp_path / "judge.py", "def judge(completion, sample):", "    return sample['score']"
    )
    output = tmp_path / "e.jsonl"
    args = ["--data", data, "--reward", f"{plugin}:judge", "--max-new-tokens", "2", "--output", output]
    assert_user_error(run_script("evaluate.py", *args), f"{data}:2:", "'score'")
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["a"]  # a rerun resumes


def test_evaluate_with_a_sample_lacking_a_field_its_reward_reads_exits_2_before_generating(tmp_path):
    # The label reward declares `label` (rewards.needs): line 2 has an answer only, found when the data loads.
    data = write_lines(
        tmp_path / "data.jsonl",
        '{"id": "a", "prompt": "ok?", "label": "通过"}',
        '{"id": "b", "prompt": "ok?", "answer": "1"}',
    )
    output = tmp_path / "e.jsonl"
    args = ["--data", data, "--reward", "label", "--max-new-tokens", "2", "--output", output]
    assert_user_error(run_script("evaluate.py", *args), f"{data}:2: label: reward 'label'")
    assert not output.exists()


def test_evaluate_into_an_output_damaged_before_its_last_line_exits_2_naming_file_and_line(tmp_path):
    output = tmp_path / "e.jsonl"
    args = ["--eval-size", "2", "--max-new-tokens", "2", "--output", output]
    first = run_script("evaluate.py", *args)  # its own output, its settings beside it: one it may continue
    assert first.returncode == 0, first.stderr[-3000:]
    second_line = output.read_text(encoding="utf-8").splitlines(keepends=True)[1]
    output.write_text("{not json\n" + second_line, encoding="utf-8")
    assert_user_error(run_script("evaluate.py", *args), f"{output}:1:", "--overwrite")


# --- score_rollouts.py, mock_rollouts.py -------------------------------------------------------------------


def test_score_rollouts_with_a_missing_rollouts_file_exits_2_naming_the_flag_and_file(tmp_path):
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPT)
    missing = tmp_path / "missing.jsonl"
    result = run_script("score_rollouts.py", "--rollouts", missing, "--prompts", prompts)
    assert_user_error(result, "--rollouts", str(missing))


def test_score_rollouts_with_a_malformed_prompts_line_exits_2_naming_file_and_line_without_traceback(
    tmp_path,
):
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPT, '{"prompt_id": "p2", "label": ')
    rollouts = write_lines(tmp_path / "rollouts.jsonl", json.dumps({"prompt_id": "p1", "text": "x"}))
    result = run_script("score_rollouts.py", "--rollouts", rollouts, "--prompts", prompts)
    assert_user_error(result, f"{prompts}:2:", "invalid JSON")
    assert not (tmp_path / "rollouts.scored.jsonl").exists()


def test_mock_rollouts_with_a_prompt_lacking_its_ground_truth_exits_2_naming_file_and_line(tmp_path):
    prompts = write_lines(tmp_path / "prompts.jsonl", PROMPT, '{"prompt_id": "p2"}')
    result = run_script("mock_rollouts.py", "--prompts", prompts, "--output", tmp_path / "out.jsonl")
    assert_user_error(result, f"{prompts}:2:", "label or an answer")
    assert not (tmp_path / "out.jsonl").exists()


def test_an_internal_error_in_a_script_keeps_its_traceback_and_exits_1(tmp_path):
    # A bug (here: the built-in task generator raising RuntimeError) is not the user's mistake.
    argv = ["scripts/mock_rollouts.py", "--write-prompts", "2", "--prompts", str(tmp_path / "p.jsonl")]
    code = f"""
import runpy, sys
sys.path.insert(0, {str(ROOT)!r})
from grpo_vlm import tasks
def broken(*args, **kwargs):
    raise RuntimeError("a bug in the task generator")
tasks.make_task = broken
sys.argv = {argv + ["--output", str(tmp_path / "out.jsonl")]!r}
runpy.run_path("scripts/mock_rollouts.py", run_name="__main__")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" in result.stderr and "RuntimeError: a bug in the task generator" in result.stderr
    assert not any(line.startswith("error:") for line in result.stderr.splitlines())


# --- train_offline.py --------------------------------------------------------------------------------------


def test_train_offline_with_a_malformed_scored_line_exits_2_naming_file_and_line_without_traceback(tmp_path):
    scored = write_lines(
        tmp_path / "scored.jsonl",
        '{"prompt": "a", "completions": ["x", "y"], "scores": [1.0, 0.0]}',
        '{"prompt": "b", "completions": ["x", "y"], "scores": [1.0, "high"]}',
    )
    result = run_script("train_offline.py", "--data", scored, "--output-dir", tmp_path / "run")
    assert_user_error(result, f"{scored}:2:", "scores[1]")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_offline_into_a_folder_holding_a_run_exits_2_asking_for_overwrite_and_keeps_the_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    metrics = write_lines(run / "metrics.jsonl", '{"epoch": 0}')
    result = run_script("train_offline.py", "--demo", "--output-dir", run)
    assert_user_error(result, str(run), "--overwrite")
    assert metrics.read_text() == '{"epoch": 0}\n'
