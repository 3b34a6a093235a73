"""train.py's command line at its edges: one run per folder, flags checked before anything is written,
one-line errors with exit status 2, clean stops by signal (130) at any moment, rollouts.jsonl, help.

Runs use the embedded tiny model with small settings (a second or two each); the subprocess tests run the real
`python -m grpo_vlm` and deliver real signals, from inside the child at a chosen moment (a patched function
sends the signal to its own process, so the moment is exact and the test does not depend on timing).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import model_io
from full.helpers import train_args
from grpo_vlm import checkpoints, cli, lora_config, trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(device="cpu", train_size=32, eval_size=4, batch_size=2, group_size=4, max_new_tokens=8, seed=0)


def small_args(output_dir: Path | None, **overrides) -> trainer.Args:
    return train_args(output_dir=None if output_dir is None else str(output_dir), **{**SMALL, **overrides})


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder`, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run_train(*flags: str, cwd: Path, preamble: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m grpo_vlm FLAGS` in a child process; `preamble` runs first (to patch a function in train)."""
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['train.py', *{list(flags)!r}]\n"
        "import tyro\nfrom grpo_vlm import cli, trainer\n"
        + preamble
        + "\ncli.run(trainer.main, tyro.cli(trainer.Args))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


SMALL_FLAGS = ["--device", "cpu", "--train-size", "32", "--eval-size", "4", "--batch-size", "2"]
SMALL_FLAGS += ["--group-size", "4", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer.main(small_args(out, steps=3, save_every=1, keep_last=2))
    return out


# --- one run per folder -------------------------------------------------------------------------------------


def test_resume_continues_the_copy_in_its_own_folder_and_leaves_the_default_folders_run_untouched(
    finished_run, tmp_path, monkeypatch
):
    # The scenario: a finished run in the default folder (runs/grpo), and a copy of an interrupted run
    # elsewhere, resumed with the printed hint (no --output-dir).
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "runs" / "grpo"
    shutil.copytree(finished_run, default)
    interrupted = tmp_path / "copy"
    shutil.copytree(finished_run, interrupted)
    for old in checkpoints.list_checkpoints(interrupted)[1:]:  # interrupted after its step-2 checkpoint
        shutil.rmtree(old)
    before = tree_digest(default)
    trainer.main(small_args(None, steps=3, save_every=1, keep_last=2, resume=str(interrupted)))
    assert tree_digest(default) == before  # the other run: every file byte for byte
    steps = [json.loads(line)["step"] for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # continued in the copy, step 3 redone once
    assert [p.name for p in checkpoints.list_checkpoints(interrupted)] == [
        "checkpoint-000002",
        "checkpoint-000003",
    ]


def test_resume_refuses_an_output_dir_other_than_the_resumed_runs_folder(finished_run, tmp_path):
    with pytest.raises(cli.UsageError, match="--output-dir: --resume continues"):
        trainer.main(small_args(tmp_path / "elsewhere", steps=4, resume=str(finished_run)))
    assert not (tmp_path / "elsewhere").exists()


def test_keep_last_pruning_never_deletes_another_runs_checkpoint(tmp_path):
    out = tmp_path / "run"
    trainer.main(small_args(out, steps=1, eval_size=0))
    foreign = out / "checkpoint-000000"  # a stray checkpoint of some other run, older than any of ours
    shutil.copytree(out / "checkpoint-000001", foreign)
    (foreign / "checkpoint.json").write_text(json.dumps({"run_id": "another-run", "step": 0}))
    trainer.main(
        small_args(
            out, steps=4, save_every=1, keep_last=1, eval_size=0, resume=str(out / "checkpoint-000001")
        )
    )
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000000", "checkpoint-000004"]


def test_a_start_that_fails_in_its_first_step_does_not_block_the_corrected_command(tmp_path):
    out = tmp_path / "run"
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text("def reward(completion, sample):\n    raise RuntimeError('plug-in bug')\n")
    with pytest.raises(RuntimeError, match="plug-in bug"):
        trainer.main(small_args(out, steps=2, reward=(f"{plugin}:reward",)))
    summary = trainer.main(small_args(out, steps=2))  # the corrected command: no --overwrite, no --resume
    assert summary["steps"] == 2


# --- flags and files checked before anything is written -----------------------------------------------------


BAD_FLAGS = {
    "--batch-size": dict(batch_size=0),
    "--group-size": dict(group_size=1),
    "--max-new-tokens": dict(max_new_tokens=0),
    "--lr": dict(lr=-1.0),
    "--steps": dict(steps=0),
    "--eval-every": dict(eval_every=0),
    "--clip-eps-low": dict(clip_eps_low=1.5),
    "--beta": dict(beta=-0.1),
    "--temperature": dict(temperature=0.0),
    "--dtype": dict(dtype="float16"),
    "--kl-target-low/--kl-target-high": dict(kl_target_low=0.1),
    "--data": dict(data=("missing.jsonl",), reward=("label",)),
    "--reward": dict(data=(str(ROOT / "README.md"),)),
}


@pytest.mark.parametrize("flag", BAD_FLAGS)
def test_a_bad_flag_is_refused_by_name_before_anything_is_written(tmp_path, monkeypatch, flag):
    monkeypatch.setattr(
        model_io, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check")
    )
    with pytest.raises(cli.UsageError, match=f"^{flag}: "):
        trainer.main(small_args(tmp_path / "run", **BAD_FLAGS[flag]))
    assert not (tmp_path / "run").exists()


EXACT_MESSAGES = [
    (dict(delta=1.2), "--delta: must be > 1 + --clip-eps-high, got 1.2"),  # grpo.py's, field names as flags
    (
        dict(temperature=0.0),
        "--temperature: must be > 0: at 0 every completion of a group is the same, got 0.0",
    ),
    (dict(adv_clip=0.0), "--adv-clip: must be > 0, got 0.0"),
    (dict(kl_target_low=0.2, kl_target_high=0.1), "--kl-target-low: must be >= 0 and < --kl-target-high"),
    (dict(lora_dropout=1.0), "--lora-dropout: must be in [0, 1), got 1.0"),
    (dict(reward_timeout=-1.0), "--reward-timeout: must be a positive number of seconds, got -1.0"),
]


@pytest.mark.parametrize(("flags", "message"), EXACT_MESSAGES)
def test_each_settings_group_is_refused_with_the_flag_in_every_place_it_is_named(flags, message):
    with pytest.raises(cli.UsageError) as error:
        trainer.check_args(small_args(None, **flags))
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"lora_last_k": 0}, "--lora-last-k: must be >= 1, got 0"),
        ({"lora_r": 0}, "--lora-r: must be >= 1, got 0"),
        ({"lora_alpha": -1.0}, "--lora-alpha: must be a number > 0, got -1.0"),
        ({"lora_dropout": 1.0}, "--lora-dropout: must be in [0, 1), got 1.0"),
    ],
)
def test_lora_settings_check_names_the_flag_and_the_value(setting, message):
    lora_config.LoRAConfig().check()  # the command line's defaults pass
    with pytest.raises(ValueError) as error:
        lora_config.LoRAConfig(**setting).check()
    assert str(error.value) == message


def test_a_run_json_with_a_setting_in_its_former_group_resumes_with_it():
    # The adaptive-KL band was part of the loss's group: a run recorded then keeps its band on --resume.
    recorded = {"loss": {"beta": 0.1, "kl_target_low": 0.01, "kl_target_high": 0.2}, "lora": {"lora_r": 4}}
    args = checkpoints.settings_from_record(recorded, trainer.Args)
    assert (args.loss.beta, args.kl_band.kl_target_low, args.kl_band.kl_target_high) == (0.1, 0.01, 0.2)
    assert args.lora.lora_r == 4 and args.kl_band.kl_adapt_factor == 1.5  # what it lacks: the default


def test_an_output_dir_that_is_a_file_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    monkeypatch.setattr(
        model_io, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check")
    )
    with pytest.raises(cli.UsageError, match="--output-dir: .* is a file"):
        trainer.main(small_args(target))
    assert target.read_text() == "mine"


def test_a_user_error_exits_2_with_one_line_and_no_traceback(tmp_path):
    child = run_train("--batch-size", "0", "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert child.returncode == 2, child.stderr
    assert "Traceback" not in child.stdout + child.stderr
    assert child.stderr.strip().splitlines() == ["error: --batch-size: must be >= 1 prompt per step, got 0"]
    assert not (tmp_path / "run").exists()


def test_bad_data_exits_2_naming_file_and_line_without_traceback(tmp_path):
    bad = tmp_path / "trainer.jsonl"
    bad.write_text('{"id": "a", "prompt": "x", "label": "通过"}\n{"id": "b", "prompt": 3}\n')
    child = run_train(
        "--data", str(bad), "--reward", "label", "--output-dir", str(tmp_path / "run"), cwd=tmp_path
    )
    assert child.returncode == 2, child.stderr
    assert "Traceback" not in child.stdout + child.stderr
    (line,) = child.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"{bad}:2" in line
    assert not (tmp_path / "run").exists()


# --- signals at any moment ----------------------------------------------------------------------------------

SIGNAL_DURING = {
    "model loading": "real = trainer.model_io.load_model\n"
    "def load(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
    "trainer.model_io.load_model = load",
    "the step-0 evaluation": "real = trainer.evaluate\n"
    "def evaluate(*a, **k):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return real(*a, **k)\n"
    "trainer.evaluate = evaluate",
}


@pytest.mark.parametrize("after_s", [0.5, 2.0])
def test_ctrl_c_while_the_imports_run_exits_130_without_a_traceback_and_writes_nothing(tmp_path, after_s):
    """`python -m grpo_vlm` interrupted in its first seconds (torch and transformers importing, or set-up)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "grpo_vlm", "--output-dir", str(out), *SMALL_FLAGS]
    child = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stdout + stderr
    assert not out.exists()


@pytest.mark.parametrize("moment", SIGNAL_DURING)
def test_a_signal_before_the_first_step_stops_with_130_and_leaves_nothing(tmp_path, moment):
    preamble = "import os, signal\n" + SIGNAL_DURING[moment]
    child = run_train(*SMALL_FLAGS, "--output-dir", str(tmp_path / "run"), cwd=tmp_path, preamble=preamble)
    assert child.returncode == 130, child.stderr[-2000:]
    assert "Traceback" not in child.stdout + child.stderr
    assert "nothing was written" in child.stderr
    assert not (tmp_path / "run").exists()


def test_a_signal_during_a_step_exits_130_after_a_checkpoint_and_says_how_to_continue(tmp_path):
    preamble = (
        "import os, signal\nreal = trainer.policy_update\n"
        "def update(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
        "trainer.policy_update = update"
    )
    out = tmp_path / "run"
    child = run_train(*SMALL_FLAGS, "--steps", "3", "--output-dir", str(out), cwd=tmp_path, preamble=preamble)
    assert child.returncode == 130, child.stderr[-2000:]
    assert "Traceback" not in child.stdout + child.stderr
    assert f"--resume {out}" in child.stderr
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]


# --- what the run keeps and says ----------------------------------------------------------------------------


def test_rollouts_jsonl_keeps_every_completion_with_its_rewards_and_is_trimmed_on_resume(tmp_path):
    out = tmp_path / "run"
    trainer.main(small_args(out, steps=2, save_every=1, eval_size=0))
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8  # B * G = 8 completions a step
    first = rows[0]
    assert list(first) == [
        "step",
        "sample_id",
        "group",
        "images",
        "completion",
        "rewards",
        "reward",
        "advantage",
        "length",
        "truncated",
        "prompt",
        "target",
        "thumbs",
    ]
    assert set(first["rewards"]) == {"label", "format"} and first["images"]
    assert all(1 <= r["length"] <= 8 for r in rows)
    # A resume from the step-1 checkpoint redoes step 2: its lines are replaced, not duplicated.
    shutil.rmtree(out / "checkpoint-000002")
    trainer.main(small_args(out, steps=2, save_every=1, eval_size=0, resume=str(out)))
    again = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1] * 8 + [2] * 8
    assert again == rows  # the resumed step draws the same completions (exact resume)


def test_steps_without_learning_signal_are_flagged_with_a_hint(tmp_path, capsys):
    plugin = tmp_path / "constant.py"
    plugin.write_text("def reward(completion, sample):\n    return 1.0\n")
    trainer.main(small_args(tmp_path / "run", steps=3, eval_size=0, reward=(f"{plugin}:reward",)))
    printed = capsys.readouterr().out
    assert printed.count("no learning signal") == 3
    assert "3 steps in a row without a learning signal" in printed and "--group-size" in printed


def test_help_describes_every_builtin_reward_and_when_reward_is_required():
    child = subprocess.run(
        [sys.executable, "-m", "grpo_vlm", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0
    text = " ".join(child.stdout.split())
    assert "REQUIRED with --data" in text
    for name in (
        "label:",
        "format:",
        "exact_match:",
        "answer_match:",
        "numeric_match:",
        "think_answer_format:",
    ):
        assert name in text, name
    assert "iou:" in text
    for name in ("box_iou_mean, box_f1:", "point_in_box, point_in_region, negative_points:", "count:"):
        assert name in text, name


class CreatesFile:
    """Unpickled with weights_only=False, this runs Path.touch: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_checkpoint_whose_state_would_run_code_is_never_loaded_on_resume(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    marker = tmp_path / "ran"
    state = run / "checkpoint-000003" / checkpoints.STATE_FILE
    torch.save({"step": 3, "payload": CreatesFile(marker)}, state)
    torch.save({"step": 3, "payload": CreatesFile(marker)}, live := tmp_path / "live.pt")
    named = str(run / "checkpoint-000003")
    with pytest.raises(cli.UsageError, match=r"checkpoint-000003 is damaged \(trainer_state.pt is .* bytes"):
        trainer.main(small_args(run, steps=4, resume=named))  # its manifest does not know the file
    (state.parent / checkpoints.OWNER_FILE).write_text('{"run_id": null, "step": 3}')  # an older checkpoint's
    with pytest.raises(cli.UsageError, match="refusing to load"):
        trainer.main(small_args(run, steps=4, resume=named))
    trainer.main(small_args(run, steps=4, resume=str(run)))  # a run folder: its newest checkpoint that loads
    assert "warning: checkpoint-000003 is damaged (" in capsys.readouterr().out
    assert not marker.exists()
    torch.load(live, weights_only=False)  # the payload is live: the old loader would have run it
    assert marker.exists()


def test_cli_run_maps_user_errors_and_stops_to_exit_statuses_and_keeps_tracebacks_for_bugs(capsys):
    def usage(_):
        raise cli.UsageError("--x: bad")

    def stopped(_):
        raise cli.Stopped("stopped by SIGINT before training started; nothing was written")

    def bug(_):
        raise KeyError("a bug")

    for main, status in ((usage, 2), (stopped, 130)):
        with pytest.raises(SystemExit) as exit_info:
            cli.run(main, None)
        assert exit_info.value.code == status
    assert "error: --x: bad" in capsys.readouterr().err
    with pytest.raises(KeyError):  # not swallowed: the traceback is the report of a bug
        cli.run(bug, None)


def test_cli_user_errors_names_the_missing_file():
    with pytest.raises(cli.UsageError, match="nowhere.jsonl"), cli.user_errors("--data: "):
        open(os.path.join("nowhere", "nowhere.jsonl"))  # noqa: SIM115


# sys.exit(0) in a plug-in would otherwise end the run with status 0, as if it had finished.
@pytest.mark.parametrize(
    "body, raised",
    [
        ("return 1 / 0", "ZeroDivisionError: division by zero"),
        ("sys.exit(0)", "SystemExit: 0"),
    ],
)
def test_a_failing_reward_plug_in_exits_2_naming_the_reward_and_its_file_line_without_traceback(
    tmp_path, body, raised
):
    plugin = tmp_path / "judge.py"
    plugin.write_text(f"import sys\n\ndef judge(completion, sample):\n    {body}\n")
    out = tmp_path / "run"
    flags = [
        *SMALL_FLAGS,
        "--eval-size",
        "0",
        "--reward",
        "label",
        f"{plugin}:judge",
        "--output-dir",
        str(out),
    ]
    child = run_train(*flags, cwd=tmp_path)
    assert child.returncode == 2, child.stderr[-2000:]
    assert "Traceback" not in child.stdout + child.stderr
    (line,) = [line for line in child.stderr.splitlines() if line.startswith("error:")]
    assert child.stderr.rstrip().endswith(line)  # the last word, and the only error line
    assert f"reward '{plugin}:judge'" in line and f"): {raised} (at {plugin}:4)" in line
    assert not checkpoints.list_checkpoints(out)
