"""The smaller edges around a run: flags that would overflow mid-run, a built-in task too large for memory,
data text that is no text, a model folder whose weights file is cut, a plug-in that calls os._exit, and a
score_rollouts line whose step cannot key a group. Each is the real command where a command reads the input,
and one line naming the flag, the file or the plug-in, never a traceback.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from full.helpers import train_args
from grpo_vlm import cli, trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-qwen2.5-vl"
SMALL = ["--steps", "2", "--batch-size", "2", "--group-size", "2", "--train-size", "8", "--eval-size", "0"]
SMALL += ["--max-new-tokens", "8", "--device", "cpu"]


def command(*argv, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, *map(str, argv)]
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def error_line(child: subprocess.CompletedProcess) -> str:
    """The one `error:` line of a command that exited 2, with no traceback."""
    assert child.returncode == 2 and "Traceback" not in child.stderr, child.stderr[-3000:]
    (line,) = [line for line in child.stderr.splitlines() if line.startswith("error:")]
    return line


# --- flags that would overflow later: refused before anything loads ---------------------------------------

OVERFLOWING = {
    "--lr 1e30": (dict(lr=1e30), "--lr: must be in [0, 1)"),
    "--clip-eps-high 1e308": (dict(clip_eps_high=1e308), "--clip-eps-high: must be a number in [0, 1e38)"),
    "--delta 1e308": (dict(delta=1e308), "--delta: must be at most 1e+30"),
    "--adv-clip 1e308": (dict(adv_clip=1e308), "--adv-clip: must be at most 1e+30"),
    "--reward-weight 1e308 1": (dict(reward_weight=(1e308, 1.0)), "--reward-weight: must be at most 1e+30"),
    "--weight-decay 1e308": (
        dict(weight_decay=1e308),
        "--weight-decay: must be >= 0 with --lr x --weight-decay",
    ),
    "--max-grad-norm inf": (dict(max_grad_norm=float("inf")), "--max-grad-norm: must be a finite number"),
    "--kl-adapt-factor nan": (
        dict(kl_adapt_factor=float("nan")),
        "--kl-adapt-factor: must be a finite number",
    ),
}


@pytest.mark.parametrize("case", OVERFLOWING)
def test_a_flag_that_would_overflow_in_the_step_is_refused_by_name(case):
    flags, message = OVERFLOWING[case]
    with pytest.raises(cli.UsageError) as error:
        trainer.check_args(train_args(**flags))
    assert str(error.value).startswith(message)


def test_the_command_refuses_lr_1e30_in_one_line_before_the_model_loads(tmp_path):
    line = error_line(command("-m", "grpo_vlm", "--lr", "1e30", "--output-dir", tmp_path / "run"))
    why = "must be in [0, 1) (0: the no-update control; e.g. 2e-5 on real models)"
    assert line == f"error: --lr: {why}, got 1e+30"
    assert not (tmp_path / "run").exists()


def test_a_built_in_task_larger_than_memory_is_refused_as_lora_r_is(tmp_path):
    child = command("-m", "grpo_vlm", "--train-size", 10**12, "--output-dir", tmp_path / "run", timeout=60)
    line = error_line(child)
    assert line.startswith(
        "error: --train-size: 1,000,000,000,000 training and 200 held-out samples of --task "
    )
    assert "more than 80% of this machine's" in line and not (tmp_path / "run").exists()


def test_the_default_sizes_pass_the_memory_check():
    trainer.check_args(train_args())


# --- data: text that is no text ---------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "at"), [("id", 2), ("prompt", 6)])
def test_a_lone_surrogate_in_training_data_is_refused_when_it_loads(tmp_path, field, at):
    sample = {"id": "s1", "prompt": "look \ud800", "label": "通过"} | (
        {"id": "s\ud800x"} if field == "id" else {}
    )
    if field == "id":
        sample["prompt"] = "look"
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps(sample) + "\n"
    )  # ensure_ascii: the file holds the escape "\ud800", as JS writes
    child = command(
        "-m", "grpo_vlm", *SMALL, "--data", data, "--reward", "label", "--output-dir", tmp_path / "run"
    )
    assert (
        error_line(child) == f"error: {data}:1: {field}: not valid text (a lone surrogate at character {at})"
    )
    assert not (tmp_path / "run").exists()


# --- a model folder whose weights file is cut --------------------------------------------------------------


def test_a_model_folder_whose_weights_file_is_cut_names_the_file(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for path in TINY.iterdir():
        (folder / path.name).symlink_to(path)
    weights = (TINY / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    child = command("-m", "grpo_vlm", "--dry-run", "--model", folder, "--output-dir", tmp_path / "run")
    line = error_line(child)
    assert line.startswith(f"error: {folder}: a weights file is unreadable: {folder / 'model.safetensors'} (")


# --- a plug-in that calls os._exit -----------------------------------------------------------------------


def test_a_reward_file_that_calls_os_exit_while_imported_is_its_failure(tmp_path):
    plugin = tmp_path / "judge.py"
    plugin.write_text("import os\nos._exit(0)\n\ndef judge(completion, sample):\n    return 1.0\n")
    child = command(
        "-m", "grpo_vlm", "--dry-run", "--reward", "label", f"{plugin}:judge", "--output-dir", tmp_path / "r"
    )
    assert (
        error_line(child)
        == f"error: --reward: {plugin}:judge: the plug-in file called os._exit(0) while it was imported"
    )


def test_a_tool_that_calls_os_exit_stops_the_run_with_2_naming_it(tmp_path):
    plugin = tmp_path / "plug.py"
    plugin.write_text("import os\n\ndef zoom(arguments, sample):\n    os._exit(0)\n")
    tools = ["--model", ROOT / "assets" / "tiny-qwen2.5-vl-tools", "--task", "inspection-zoom"]
    tools += ["--max-tool-calls", "1", "--tools", f"{plugin}:zoom"]
    child = command(
        "-m", "grpo_vlm", *SMALL[:-4], "--max-new-tokens", "48", *tools, "--output-dir", tmp_path / "run"
    )
    line = error_line(child)
    assert line.startswith(f"error: tool '{plugin}:zoom' called os._exit(0) (at {plugin}:4)")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["finished"] is False


def test_os_exit_is_itself_again_after_a_plug_in_call():
    real = os._exit
    with pytest.raises(cli.PluginExit, match=r"called os._exit\(3\)"):
        cli.call_plugin("reward function", lambda: os._exit(3), (), {})
    assert os._exit is real


# --- score_rollouts: a step that cannot key a group ------------------------------------------------------


def test_score_rollouts_reports_a_line_whose_step_is_a_list_and_scores_the_others(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "p1", "label": "通过"}, ensure_ascii=False) + "\n")
    lines = [{"step": 1, "prompt_id": "p1", "text": "通过\n理由: 无"} for _ in range(7)]
    lines.insert(3, {"step": [1], "prompt_id": "p1", "text": "通过"})
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines)
        + '{"step": NaN, "prompt_id": "p1", "text": "x", "meta": 1}\n'
    )
    child = command("scripts/score_rollouts.py", "--rollouts", rollouts, "--prompts", prompts)
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr[-3000:]
    assert f"{rollouts}:4: step must be an integer or a string, got list [1]" in child.stderr
    assert f"{rollouts}:9: step must be an integer or a string, got float nan" in child.stderr
    report = json.loads((tmp_path / "rollouts.scored.report.json").read_text())
    assert report["counts"] == {"lines": 9, "scored": 7, "bad": 2, "groups": 1}


# --- evaluate: an output an older version wrote with NaN and Infinity ---------------------------------------


def test_evaluate_continues_an_output_whose_lines_hold_nan_and_writes_a_strict_summary(tmp_path):
    out = tmp_path / "eval.jsonl"
    argv = ["scripts/evaluate.py", "--eval-size", "2", "--batch-size", "2", "--max-new-tokens", "8"]
    argv += ["--output", out]
    assert command(*argv).returncode == 0
    lines = out.read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0])
    first["total"] = [float("nan")]
    first["rewards"] = {name: [float("inf")] for name in first["rewards"]}
    lines[0] = json.dumps(first, ensure_ascii=False)  # NaN and Infinity, as json.dumps writes them by default
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    child = command(*argv)  # every sample done: the summary of the file as it is
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr[-3000:]
    summary = json.loads(
        (tmp_path / "eval.summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"summary: {c}")
    )
    assert summary["reward/mean"] == json.loads(lines[1])["total"][0]
