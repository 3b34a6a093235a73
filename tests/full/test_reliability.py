"""Fault injection and bad input: a run is never lost, and never fails without saying exactly why.

Each fault is injected for real where that is possible (a signal delivered to the process, `os._exit` in
the middle of a file write, NaN out of the loss, a reward that raises) and each test asserts that the run
either continues correctly or stops with the documented message, with every file already written intact.
The guarantees themselves are listed in the README ("Reliability").
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import grpo
import lora
import model_io
from full.helpers import train_args
from grpo_vlm import checkpoints, cli, objectives, trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(
    batch_size=2,
    group_size=2,
    train_size=16,
    eval_size=4,
    eval_every=2,
    max_new_tokens=12,
    warmup_steps=1,
    seed=3,
)


def small_args(out: Path, **overrides) -> trainer.Args:
    return train_args(output_dir=str(out), **{**SMALL, **overrides})


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` but the lock file (it names its latest holder): 'nothing already
    written is damaged' made checkable."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != checkpoints.LOCK_FILE
    }


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer.main(small_args(out, steps=2, save_every=1))
    return out


# --------------------------------------------------------------------------------------------------
# 1. Interruption and resume


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_step_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one_bit_for_bit(
    tmp_path, monkeypatch, signum
):
    trainer.main(small_args(tmp_path / "whole", steps=4, save_every=100))

    # The same run, with a real SIGTERM delivered to this process in the middle of step 2.
    real_update, calls = trainer.policy_update, []

    def update_then_signal(*args, **kwargs):
        stats = real_update(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)  # arrives while step 2 is still running
        return stats

    monkeypatch.setattr(trainer, "policy_update", update_then_signal)
    cut = tmp_path / "cut"
    previous_handler = signal.getsignal(signum)
    with pytest.raises(SystemExit, match=rf"stopped after step 2 \({signum.name}\).*--resume"):
        trainer.main(small_args(cut, steps=4, save_every=100))
    assert signal.getsignal(signum) is previous_handler  # the handler is not left behind
    assert [p.name for p in checkpoints.list_checkpoints(cut)] == ["checkpoint-000002"]
    monkeypatch.setattr(trainer, "policy_update", real_update)

    trainer.main(small_args(cut, steps=4, save_every=100, resume=str(cut)))
    assert (cut / "metrics.jsonl").read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()
    whole, resumed = adapter_tensors(tmp_path / "whole" / "adapter"), adapter_tensors(cut / "adapter")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint_loadable_and_resumable(tmp_path):
    out = tmp_path / "run"
    # A child process that dies (os._exit: no cleanup, no finally) half-way through writing the state file
    # of its second checkpoint.
    script = f"""
import os, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from grpo_vlm import checkpoints, files, trainer
real_write, calls = files.write_file, []
def dying_write(path, content, **kwargs):
    calls.extend([path] if path.name == checkpoints.STATE_FILE else [])
    if len(calls) == 2:
        with open(path, "wb") as f:
            f.write(content[: len(content) // 2])
        os._exit(9)
    return real_write(path, content, **kwargs)
files.write_file = dying_write
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from full.helpers import train_args
trainer.main(train_args(output_dir={str(out)!r}, steps=4, save_every=1, **{SMALL!r}))
"""
    child = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 9, child.stderr[-2000:]
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]
    state = checkpoints.load_checkpoint(out / "checkpoint-000001")
    assert state["step"] == 1
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]  # step 2 was logged, its checkpoint never completed

    trainer.main(small_args(out, steps=3, save_every=1, resume=str(out)))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # step 2 was dropped and redone, nothing duplicated
    assert not list(out.glob("*.tmp"))


def test_a_kill_during_evaluation_output_loses_no_line_and_duplicates_none(tmp_path):
    output = tmp_path / "eval.jsonl"
    command = [sys.executable, str(ROOT / "scripts" / "evaluate.py"), "--task", "inspection"]
    command += ["--eval-size", "6", "--batch-size", "2", "--output", str(output)]
    # The child writes half of its fourth line, then dies without flushing anything else.
    script = f"""
import json, os, runpy, sys
sys.argv = {command[1:]!r}
sys.path.insert(0, {str(ROOT / "scripts")!r})
import evaluate
real, count = evaluate.outputs.append_line, []
def dying_append(f, record):
    count.append(1)
    if len(count) == 4:
        f.write(json.dumps(record)[:20])
        f.flush()
        os._exit(9)
    real(f, record)
evaluate.outputs.append_line = dying_append
evaluate.main(evaluate.tyro.cli(evaluate.Args))
"""
    child = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 9, child.stderr[-2000:]
    assert not output.read_text().endswith("\n")  # the torn line is really there

    rerun = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 6


# --------------------------------------------------------------------------------------------------
# 3. Numerical guards


def nan_loss_on_calls(calls_to_poison: set[int]):
    real_loss, seen = objectives.grpo_loss, []

    def poisoned(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        seen.append(1)
        return (loss * float("nan"), stats) if len(seen) in calls_to_poison else (loss, stats)

    return poisoned


def test_a_nan_loss_skips_the_optimizer_step_logs_the_cause_and_training_continues(tmp_path, monkeypatch):
    monkeypatch.setattr(objectives, "grpo_loss", nan_loss_on_calls({2}))  # the loss of step 2
    out = tmp_path / "run"
    trainer.main(small_args(out, steps=3, save_every=1, keep_last=3))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in records[1:]] == ["", "non-finite loss", ""]
    before, after = adapter_tensors(out / "checkpoint-000001"), adapter_tensors(out / "checkpoint-000002")
    assert all(torch.equal(before[k], after[k]) for k in before)  # step 2 changed no weight
    step3 = adapter_tensors(out / "checkpoint-000003")
    assert any(not torch.equal(after[k], step3[k]) for k in after)  # step 3 trained again


def test_too_many_non_finite_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(objectives, "grpo_loss", nan_loss_on_calls(set(range(1, 100))))
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"stopped after step 2 \(2 bad steps in a row\)"):
        trainer.main(small_args(out, steps=10, save_every=100, max_bad_steps=1))
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000002"]


def test_a_zero_variance_group_gives_zero_advantage_not_nan():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv = grpo.group_advantages(rewards, 2)
    assert torch.equal(adv[:2], torch.zeros(2)) and torch.isfinite(adv).all()


def test_empty_and_truncated_completions_are_counted_and_mask_truncated_drops_them(tmp_path, monkeypatch):
    real_sample = grpo.sample_completions

    def eos_first_or_never(model, inputs, **kwargs):
        ids = torch.full_like(real_sample(model, inputs, **kwargs), 7)  # 7 is plain text: rows never stop
        ids[::2, 0] = kwargs["eos_token_id"][0]  # every other row is an end of turn alone (empty)
        return ids

    monkeypatch.setattr(grpo, "sample_completions", eos_first_or_never)
    real_score, lengths_seen = trainer.rewards.score, []

    def recording_score(*args, completion_lengths, **kwargs):
        lengths_seen.extend(completion_lengths)
        return real_score(*args, completion_lengths=completion_lengths, **kwargs)

    monkeypatch.setattr(trainer.rewards, "score", recording_score)
    out = tmp_path / "run"
    # generate's sampler (patched above): the shared-prefill sampler would record a trunk for other tokens.
    trainer.main(small_args(out, steps=1, eval_size=0, mask_truncated=True, shared_prefill=False))
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["frac_empty"] == 0.5 and record["frac_truncated"] == 0.5
    # Rewards (e.g. DAPO's overlong penalty) see the real token counts, before truncated rows are masked.
    assert lengths_seen[0::2] == [1, 1] and all(n > 1 for n in lengths_seen[1::2]), lengths_seen


# --------------------------------------------------------------------------------------------------
# Faults from user code: a reward that raises


def test_a_reward_that_raises_stops_the_run_naming_it_and_keeps_earlier_files_intact(tmp_path):
    plugin = tmp_path / "flaky_judge.py"
    plugin.write_text(
        "calls = []\n"
        "def judge(completion, sample):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 4:  # step 1 scores 4 completions; the first call of step 2 fails\n"
        "        raise ConnectionError('judge service unreachable')\n"
        "    return 1.0\n"
    )
    out = tmp_path / "run"
    args = small_args(out, steps=3, save_every=1, eval_size=0, reward=("label", f"{plugin}:judge"))
    with pytest.raises(ConnectionError, match="unreachable") as info:
        trainer.main(args)
    assert any("reward" in note and "judge" in note for note in info.value.__notes__)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert checkpoints.load_checkpoint(out / "checkpoint-000001")["step"] == 1


# --------------------------------------------------------------------------------------------------
# 2. Bad input: a clear error before any training, and the existing run untouched


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (the JSONL lines, a regex the error message must match); writes the images they use."""
    good_image = tmp / "ok.png"
    Image.new("RGB", (56, 56), "gray").save(good_image)
    (tmp / "empty.png").write_bytes(b"")
    (tmp / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    big = tmp / "big.png"
    Image.new("RGB", (1400, 1400), "gray").save(big)
    ok = '{"images": ["ok.png"], "prompt": "inspect", "label": "通过"}'
    cases = {
        "invalid JSON line": (
            ['{"prompt": "a", "label": "通过"}', '{"prompt": "b",'],
            r"bad\.jsonl:2:\d+: invalid JSON",
        ),
        "missing prompt": ([ok, '{"images": [], "label": "通过"}'], r"bad\.jsonl:2: .*'prompt'"),
        "empty dataset": ([], r"bad\.jsonl: dataset is empty"),
        "unknown field type": (
            [ok, '{"images": "ok.png", "prompt": "a"}'],
            r"bad\.jsonl:2: images: must be a list",
        ),
        "missing image": (
            ['{"images": ["nope.png"], "prompt": "a"}'],
            r"bad\.jsonl:1: images: 'nope\.png' not found",
        ),
        "zero-size image": (
            ['{"images": ["empty.png"], "prompt": "a", "label": "通过"}'],
            r"bad\.jsonl:1: .*empty\.png is an empty",
        ),
        "corrupt image": (
            ['{"images": ["corrupt.png"], "prompt": "a", "label": "通过"}'],
            r"bad\.jsonl:1: .*corrupt\.png cannot be",
        ),
        "image tokens cut by the prompt limit": (
            ['{"images": ["big.png"], "prompt": "a", "label": "通过"}'],
            r"bad\.jsonl:1: prompt is \d+ tokens .* max_prompt_length is 20",
        ),
    }
    return cases


DATA_CASES = [
    "invalid JSON line",
    "missing prompt",
    "empty dataset",
    "unknown field type",
    "missing image",
    "zero-size image",
    "corrupt image",
    "image tokens cut by the prompt limit",
]


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_stops_before_training_naming_file_and_line_and_damages_nothing(
    finished_run, tmp_path, case
):
    lines, pattern = bad_inputs(tmp_path)[case]
    data_file = write_jsonl(tmp_path / "bad.jsonl", lines)
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = tree_digest(run)
    args = small_args(
        run, steps=3, overwrite=True, data=(str(data_file),), reward=("label",), max_prompt_length=20
    )
    with pytest.raises((ValueError, FileNotFoundError), match=pattern):
        trainer.main(args)
    assert tree_digest(run) == before


def test_a_large_image_is_resized_to_the_processors_pixel_budget_not_rejected(tmp_path):
    _, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    Image.new("RGB", (1400, 1400), "gray").save(tmp_path / "big.png")
    sample = {"images": [str(tmp_path / "big.png")], "prompt": "a", "_where": "big:1"}
    batch = trainer.data.prepare_prompts([sample], tokenizer, image_processor, device="cpu")
    t, h, w = batch.inputs["image_grid_thw"][0].tolist()
    max_pixels = image_processor.size["longest_edge"]
    assert t * h * w * image_processor.patch_size**2 <= max_pixels


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"reward": ("no_such_reward",)}, r"no_such_reward"),
        ({"reward": ("not_a_module_xyz:fn",)}, r"not_a_module_xyz"),
        ({"model": "/definitely/not/a/model"}, r"/definitely/not/a/model"),
        ({"lora_last_k": 7}, r"last_k"),
        ({"lora_r": 4, "resume": "run"}, r"--lora-r recorded 8, given 4"),  # a resumed run keeps r = 8
    ],
    ids=[
        "unknown reward",
        "plug-in that does not import",
        "missing model path",
        "K above the block count",
        "resumed with another LoRA rank",
    ],
)
def test_bad_configuration_stops_with_a_clear_message_and_damages_nothing(
    finished_run, tmp_path, overrides, pattern
):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = tree_digest(run)
    with pytest.raises((ValueError, FileNotFoundError), match=pattern):
        where = {"resume": str(run)} if "resume" in overrides else {"overwrite": True}
        trainer.main(small_args(run, steps=3, **{**overrides, **where}))
    assert tree_digest(run) == before


def test_a_plug_in_with_the_wrong_signature_or_a_nan_value_is_named(tmp_path):
    plugin = tmp_path / "bad_rewards.py"
    plugin.write_text(
        "def one_arg(completion):\n    return 1.0\n"
        "def nan(completion, sample):\n    return float('nan')\n"
        "def text(completion, sample):\n    return 'good'\n"
    )
    with pytest.raises(ValueError, match="one_arg"):
        trainer.main(small_args(tmp_path / "a", steps=1, reward=(f"{plugin}:one_arg",)))
    for name in ("nan", "text"):
        with pytest.raises(ValueError, match=rf"reward '{plugin}:{name}' returned .* completion 0"):
            trainer.main(small_args(tmp_path / name, steps=1, eval_size=0, reward=(f"{plugin}:{name}",)))


def test_an_output_dir_holding_another_run_is_refused_unless_resume_or_overwrite(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = tree_digest(run)
    with pytest.raises(cli.UsageError, match="already holds a run"):
        trainer.main(small_args(run, steps=1))
    assert tree_digest(run) == before


def test_a_model_without_recognisable_decoder_blocks_is_refused_by_name():
    with pytest.raises(ValueError, match="Linear"):
        lora.find_decoder_blocks(torch.nn.Linear(2, 2))
