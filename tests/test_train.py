"""The reference trainer, train.py, end to end on the embedded tiny model: a step, a run, a resume; every flag
checked before anything loads; a run folder it did not write never touched.

`train_step` trains the LoRA parameters only (the base, the vision tower and the merger stay bit-identical),
`main` writes metrics.jsonl, checkpoint.pt (tensors and the flags) and a PEFT-format adapter, and a resumed
run continues exactly where an uninterrupted one would be, however it stopped.
"""

import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import data
import lora
import model_io
import rewards
import train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(batch_size=2, group_size=2, max_new_tokens=8, train_size=8, eval_size=4, eval_every=1)
TINY_FLAGS = ["--batch-size", "2", "--group-size", "2", "--max-new-tokens", "8", "--train-size", "8"]
TINY_FLAGS += ["--eval-size", "4"]


def run_command(*flags: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python train.py FLAGS`, as a user types it."""
    command = [sys.executable, str(ROOT / "train.py"), *flags]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


# --- a step and a run ---------------------------------------------------------------------------------------


def test_a_step_changes_the_lora_weights_only_and_reports_its_metrics():
    torch.manual_seed(0)
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2)
    args = train.Args(**TINY)
    samples = data.inspection_samples(2, seed=0)
    reward_fns = rewards.load_rewards(args.reward)
    metrics, completion_ids = train.train_step(
        model, tokenizer, image_processor, samples, reward_fns, optimizer, args
    )
    assert completion_ids.shape == (4, completion_ids.shape[1]) and completion_ids.shape[1] <= 8
    for key in ("loss", "grad_norm", "kl", "reward/mean", "reward/label/mean", "entropy", "frac_truncated"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    assert metrics["skipped"] is False
    after = dict(model.named_parameters())
    for name, value in base.items():  # LoRALinear keeps each base weight under base_layer
        module, _, leaf = name.rpartition(".")
        key = name if name in after else f"{module}.base_layer.{leaf}"
        assert torch.equal(after[key], value), name
    assert any(not torch.equal(after[n], v) for n, v in adapters.items())  # B moved off 0 (A too, via B)


def test_the_no_update_control_lr_0_trains_every_step_and_leaves_lora_where_it_started(tmp_path):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=2, lr=0.0, output_dir=str(out)))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    torch.manual_seed(train.Args().seed)  # LoRA's initialisation draws from the seed, as main's does
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    start = lora.lora_state_dict(model)
    assert state["step"] == 2 and state["lora"].keys() == start.keys()
    assert all(torch.equal(state["lora"][k], start[k]) for k in start)  # B is still exactly 0, A unmoved
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2] and all(x["grad_norm"] > 0 for x in lines[1:])


def test_main_writes_metrics_a_tensor_only_checkpoint_with_its_flags_and_the_adapter(tmp_path):
    out = tmp_path / "run"
    last = train.main(train.Args(**TINY, steps=2, output_dir=str(out)))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1] == last
    assert all(0 <= line["eval/accuracy"] <= 1 for line in lines)
    state = torch.load(out / "checkpoint.pt", weights_only=True)  # no pickled code: tensors and numbers
    assert state["step"] == 2 and set(state) == {"step", "settings", "lora", "optimizer", "scheduler", "rng"}
    assert state["settings"] == vars(train.Args(**TINY, steps=2, output_dir=str(out)))
    adapter = load_file(out / "adapter" / model_io.ADAPTER_WEIGHTS)  # PEFT's keys: the checkpoint's LoRA
    assert {k.removeprefix(model_io.PEFT_PREFIX) for k in adapter} == set(state["lora"])
    assert all(
        torch.equal(v, state["lora"][k.removeprefix(model_io.PEFT_PREFIX)]) for k, v in adapter.items()
    )
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoint.pt", "metrics.jsonl"]


def test_a_skipped_update_is_written_as_strict_json_with_null_and_the_reason(tmp_path):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, beta=1e300, output_dir=str(out)))  # k3 * 1e300: inf or NaN
    text = (out / "metrics.jsonl").read_text()
    records = [json.loads(line, parse_constant=pytest.fail) for line in text.splitlines()]  # no bare NaN
    assert records[-1]["skipped"] is True and records[-1]["loss"] is None


# --- resume: exactly the uninterrupted run ------------------------------------------------------------------


def stops_at(call: int, monkeypatch) -> None:
    """train_step raises KeyboardInterrupt at its `call`-th call, as Ctrl-C during that step would."""
    real, calls = train.train_step, []

    def stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", stopped)


@pytest.mark.parametrize("eval_every", [1, 2], ids=["stopped-after-a-checkpoint", "stopped-between"])
def test_a_stopped_run_resumed_writes_the_uninterrupted_runs_bytes(tmp_path, monkeypatch, capsys, eval_every):
    flags = dict(TINY, eval_every=eval_every, steps=4)
    train.main(train.Args(**flags, output_dir=str(tmp_path / "whole")))
    parts = tmp_path / "parts"
    stops_at(4, monkeypatch)  # during step 4: steps 1-3 logged, the checkpoint at step 3 (or step 2)
    with pytest.raises(KeyboardInterrupt):
        train.main(train.Args(**flags, output_dir=str(parts)))
    saved = 3 if eval_every == 1 else 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == f"stopped in step 4; {parts / 'checkpoint.pt'} is at step {saved}: add --resume"
    assert len((parts / "metrics.jsonl").read_text().splitlines()) == 4  # steps 0-3: one past the checkpoint
    monkeypatch.undo()
    train.main(train.Args(**flags, output_dir=str(parts), resume=True))  # step 3's line is written once
    assert (parts / "metrics.jsonl").read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()


def test_a_stop_right_after_a_checkpoint_is_written_loses_no_line_of_metrics(tmp_path, monkeypatch):
    flags = dict(TINY, eval_every=2, steps=4)
    train.main(train.Args(**flags, output_dir=str(tmp_path / "whole")))
    real_save = model_io.save_checkpoint

    def save_then_stop(path, *args, step, **kwargs):  # Ctrl-C the moment checkpoint.pt at step 2 is whole
        real_save(path, *args, step=step, **kwargs)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(model_io, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train.main(train.Args(**flags, output_dir=str(tmp_path / "parts")))
    monkeypatch.undo()
    train.main(train.Args(**flags, output_dir=str(tmp_path / "parts"), resume=True))
    whole = (tmp_path / "whole" / "metrics.jsonl").read_bytes()
    assert (tmp_path / "parts" / "metrics.jsonl").read_bytes() == whole


def test_a_run_continues_to_more_steps_and_a_finished_one_resumes_to_nothing(tmp_path):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    train.main(train.Args(**TINY, steps=2, output_dir=str(out), resume=True))
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    before = (out / "metrics.jsonl").read_bytes()
    train.main(train.Args(**TINY, steps=2, output_dir=str(out), resume=True))
    assert (out / "metrics.jsonl").read_bytes() == before
    with pytest.raises(ValueError, match=r"^--steps: the checkpoint is at step 2; give --steps >= it$"):
        train.main(train.Args(**TINY, steps=1, output_dir=str(out), resume=True))


@pytest.mark.parametrize(
    "changed, flag",
    [
        (dict(lora_r=4), "--lora-r 8, not 4"),
        (dict(group_size=4), "--group-size 2, not 4"),
        (dict(seed=1), "--seed 0, not 1"),
        (dict(loss_type="grpo"), "--loss-type dapo, not grpo"),
        (dict(batch_size=4), "--batch-size 2, not 4"),
    ],
)
def test_resume_with_other_settings_is_refused_naming_the_flag(tmp_path, changed, flag):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=rf"^--resume: the run was written with {flag}$"):
        train.main(train.Args(**(TINY | changed), steps=2, output_dir=str(out), resume=True))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("damage", ["cut", "emptied", "a text file"])
def test_resume_from_a_damaged_checkpoint_is_one_error_naming_it(tmp_path, damage):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    checkpoint = out / "checkpoint.pt"
    content = {"cut": checkpoint.read_bytes()[:1000], "emptied": b"", "a text file": b"not a checkpoint\n"}
    checkpoint.write_bytes(content[damage])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(checkpoint))} cannot be read as a checkpoint"):
        train.main(train.Args(**TINY, steps=2, output_dir=str(out), resume=True))


def test_a_full_disk_leaves_no_temporary_file_and_names_the_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = torch.save

    def full_after_step_0(state, path):  # the first checkpoint (step 0) fits; step 1's does not
        if state["step"] == 0:
            return real(state, path)
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_after_step_0)
    with pytest.raises(
        OSError, match=rf"^cannot write {re.escape(str(out / 'checkpoint.pt'))}: No space left"
    ):
        train.main(train.Args(**TINY, steps=2, output_dir=str(out)))
    assert "checkpoint.tmp" not in {p.name for p in out.iterdir()}
    assert model_io.load_checkpoint(out / "checkpoint.pt")["step"] == 0  # the previous checkpoint, whole


# --- the output folder: only a new or empty one, or its own run ---------------------------------------------


@pytest.mark.parametrize(
    "files, message",
    [
        ({"notes.txt": "mine"}, "notes.txt is no file of a run; choose a new or empty --output-dir"),
        ({"metrics.jsonl": "mine\n"}, "holds a run: continue it with --resume, or choose a new --output-dir"),
        ({"checkpoint.pt": "mine"}, "holds a run: continue it with --resume, or choose a new --output-dir"),
    ],
)
def test_a_folder_holding_other_files_is_refused_before_anything_loads_and_left_as_it_was(
    tmp_path, monkeypatch, files, message
):
    out = tmp_path / "run"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=re.escape(message)):
        train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_a_second_start_without_resume_is_refused_and_the_first_run_is_untouched(tmp_path):
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=f"^{re.escape(str(out))} holds a run: continue it with --resume"):
        train.main(train.Args(**TINY, steps=2, output_dir=str(out)))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    with pytest.raises(ValueError, match="new holds no checkpoint.pt to resume; start anew in an empty"):
        train.main(train.Args(**TINY, steps=1, output_dir=str(tmp_path / "new"), resume=True))


def test_nothing_is_written_through_a_symbolic_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="link is no file of a run"):
        train.main(train.Args(**TINY, steps=1, output_dir=str(tmp_path / "link")))
    out = tmp_path / "run"
    train.main(train.Args(**TINY, steps=1, output_dir=str(out)))
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(elsewhere / "theirs.jsonl")
    with pytest.raises(ValueError, match="metrics.jsonl is no file of a run"):
        train.main(train.Args(**TINY, steps=2, output_dir=str(out), resume=True))
    assert list(elsewhere.iterdir()) == []


# --- every flag checked before anything loads: one line naming it ------------------------------------------

NAN, INF = math.nan, math.inf
LR_RANGE = "--lr: must be a number in [0, 1) (AdamW moves a weight by about lr a step)"
BAD_FLAGS = [
    (dict(lr=NAN), f"{LR_RANGE}, got nan"),
    (dict(lr=1e30), f"{LR_RANGE}, got 1e+30"),  # would overflow the activations after one step
    (dict(lr=-1e-3), f"{LR_RANGE}, got -0.001"),
    (dict(dtype="float16"), "--dtype: must be auto, float32 or bfloat16, got float16"),
    (dict(clip_eps_high=1e308), "--clip-eps-high: must be a number in [0, 1e38), got 1e+308"),
    (dict(max_grad_norm=NAN), "--max-grad-norm: must be a number > 0, got nan"),
    (dict(lora_alpha=NAN), "--lora-alpha: must be a number > 0, got nan"),
    (dict(lora_r=0), "--lora-r: must be >= 1, got 0"),
    (dict(temperature=0.0), "--temperature: must be a number > 0, got 0.0"),
    (dict(temperature=NAN), "--temperature: must be a number > 0, got nan"),
    (dict(temperature=-1.0), "--temperature: must be a number > 0, got -1.0"),
    (dict(beta=NAN), "--beta: must be a number >= 0 (0 drops the KL term), got nan"),
    (dict(beta=-1.0), "--beta: must be a number >= 0 (0 drops the KL term), got -1.0"),
    (dict(batch_size=0), "--batch-size: must be >= 1, got 0"),
    (dict(group_size=0), "--group-size: must be >= 2: a completion is compared with its group, got 0"),
    (dict(group_size=1), "--group-size: must be >= 2: a completion is compared with its group, got 1"),
    (dict(eval_every=0), "--eval-every: must be >= 1, got 0"),
    (dict(steps=-1), "--steps: must be >= 1, got -1"),
    (dict(reward_weight=(1.0,)), "--reward-weight: needs one weight per --reward, got (1.0,)"),
    (dict(gate=("iou",)), "--gate: must name rewards of --reward, got ('iou',)"),
    (dict(top_p=0.0), "--top-p: must be in (0, 1], got 0.0"),
    (dict(clip_eps_low=1.0), "--clip-eps-low: must be in [0, 1), got 1.0"),
    (dict(loss_type="ppo"), "--loss-type: must be one of ('grpo', 'dapo', 'dr_grpo'), got ppo"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[m.split(":")[0] for _, m in BAD_FLAGS])
def test_a_bad_flag_is_refused_before_anything_loads_naming_it(tmp_path, monkeypatch, flags, message):
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(data, "inspection_samples", lambda *a, **k: pytest.fail("made the samples"))
    with pytest.raises(ValueError) as error:
        train.main(train.Args(**(TINY | flags), output_dir=str(tmp_path / "run")))
    assert str(error.value) == message
    assert not (tmp_path / "run").exists()


COMMAND_LINE_MISTAKES = [
    (["--lr", "nan"], f"error: {LR_RANGE}, got nan"),
    (["--beta", "-1"], "error: --beta: must be a number >= 0 (0 drops the KL term), got -1.0"),
    (["--data", "bad.jsonl", "--reward", "label"], "error: bad.jsonl:2:1: invalid JSON: Expecting value"),
    (["--reward", "label", "nope.py:judge"], "error: reward 'nope.py:judge': cannot import nope.py"),
]


@pytest.mark.parametrize(
    "flags, line", COMMAND_LINE_MISTAKES, ids=["lr-nan", "beta-negative", "bad-json-line", "missing-plug-in"]
)
def test_on_the_command_line_a_mistake_is_one_line_exit_2_no_traceback(
    tmp_path, monkeypatch, capsys, flags, line
):
    """train.py run as `__main__` in this process (the next test runs one case as its own process)."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok", "label": "通过"}\n}\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *flags, "--output-dir", str(tmp_path / "run")])
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and stderr.startswith(line) and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "run").exists()


def test_a_mistake_typed_in_a_terminal_is_one_line_on_stderr_and_exit_status_2(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok", "label": "通过"}\n}\n', encoding="utf-8")
    done = run_command("--data", "bad.jsonl", "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "error: bad.jsonl:2:1: invalid JSON: Expecting value\n", done.stderr
    assert not (tmp_path / "run").exists()


def test_ctrl_c_prints_one_line_with_the_step_and_how_to_continue(tmp_path):
    out = tmp_path / "run"
    flags = [*TINY_FLAGS, "--eval-every", "2", "--steps", "50", "--output-dir", str(out)]
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *flags], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert child.poll() is None and time.monotonic() < deadline, "the run ended before it was stopped"
        time.sleep(0.2)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"stopped in step \d+; {re.escape(str(out / 'checkpoint.pt'))} is at step \d+: add --resume", last
    )
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert os.path.getsize(out / "checkpoint.pt") > 0 and not (out / "checkpoint.tmp").exists()
