"""Bad input found when it loads, one line each: reward fields, slow rewards, huge images, malformed adapters,
plug-in files that exit while they are imported."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
import lora
import model_io
import rewards
from full.helpers import train_args
from grpo_vlm import adapters, cli, dataset, scoring, trainer

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = scoring.BUILTIN_REWARDS
TINY = dict(steps=1, batch_size=2, group_size=2, max_new_tokens=8, eval_size=0, eval_every=1000)


def train_command(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "grpo_vlm",
        "--output-dir",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "2",
    ]
    command += ["--group-size", "2", "--max-new-tokens", "8", "--eval-every", "1000", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False
    )


def write_jsonl(path: Path, samples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples), encoding="utf-8")
    return path


# --- reward fields, checked when the data loads -------------------------------------------------------------


def test_a_wrong_typed_label_on_line_5_stops_the_run_before_any_step_naming_file_line_and_field(tmp_path):
    samples = [{"id": f"s{i}", "prompt": "inspect", "label": "通过"} for i in range(8)]
    samples[4]["label"] = 3
    path = write_jsonl(tmp_path / "data.jsonl", samples)
    child = train_command(tmp_path, "--data", str(path), "--reward", "label", "format")
    assert child.returncode == 2, child.stderr
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}:5: label: reward 'label': needs a verdict"), last
    assert "got 3 (int)" in last and "Traceback" not in child.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("reward", "sample", "message"),
    [
        ("label", {"label": "maybe"}, "label: reward 'label': needs a verdict"),
        (
            "answer_match",
            {"prompt": "a"},
            "answer: reward 'answer_match': needs this field; the sample has none",
        ),
        (
            "exact_match",
            {"answer": None},
            "answer: reward 'exact_match': needs str or int or float, got None",
        ),
        ("numeric_match", {"answer": "four"}, "answer: reward 'numeric_match': needs a number, got 'four'"),
        ("iou", {"bbox": [1, 2]}, "bbox: reward 'iou': sample bbox [1, 2] is not a box"),
        ("box_f1", {}, 'reward \'box_f1\': needs "boxes" (or "bbox")'),
        ("box_iou_mean", {"boxes": 5}, "reward 'box_iou_mean': sample boxes must be a list"),
        ("point_in_region", {"region": [[1, 2]]}, "reward 'point_in_region': needs \"region\""),
        (
            "negative_points",
            {"region": [[[0, 0], [1, 0], [1, 1]]], "margin": -1},
            "reward 'negative_points': sample margin",
        ),
        ("count", {"count": "3"}, "count: reward 'count': sample count must be a non-negative int"),
    ],
)
def test_each_builtin_reward_checks_the_fields_it_reads(reward, sample, message):
    fns = scoring.rewards_from_flags([reward], builtins=BUILTINS)
    good = {
        "label": "通过",
        "answer": "4",
        "bbox": [0, 0, 2, 2],
        "region": [[[0, 0], [4, 0], [0, 4]]],
        "count": 1,
    }
    rewards.check_needs([good], fns, locate=lambda s: "here")
    with pytest.raises(ValueError, match="^here: " + re.escape(message)):
        rewards.check_needs([good, {**sample, "_where": "here"}], fns, locate=data.location)


def test_a_plug_in_declares_its_fields_with_needs_and_one_without_is_not_checked(tmp_path):
    plugin = tmp_path / "judge.py"
    plugin.write_text(
        "import rewards\n"
        "@rewards.needs(score=(int, float))\n"
        "def declared(completion, sample):\n    return float(sample['score'])\n"
        "def undeclared(completion, sample):\n    return 0.0\n"
    )
    declared, undeclared = (scoring.rewards_from_flags([f"{plugin}:{n}"]) for n in ("declared", "undeclared"))
    rewards.check_needs([{"score": "high"}], undeclared)
    with pytest.raises(
        ValueError, match=r"score: reward '.*:declared': needs int or float, got 'high' \(str\)"
    ):
        rewards.check_needs([{"score": 2}, {"score": "high"}], declared)


# --- --reward-timeout ---


def test_a_reward_slower_than_reward_timeout_stops_the_run_naming_the_reward_and_sample(tmp_path):
    plugin = tmp_path / "slow.py"
    plugin.write_text("import time\ndef judge(completion, sample):\n    time.sleep(60)\n    return 1.0\n")
    started = time.monotonic()
    child = train_command(
        tmp_path, "--task", "shapes", "--reward", f"{plugin}:judge", "--reward-timeout", "1"
    )
    assert child.returncode == 2, child.stderr
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: reward '{plugin}:judge' took longer than --reward-timeout 1.0 s on completion"
    )
    assert "sample id" in last and time.monotonic() - started < 50


def test_the_reward_timer_cannot_be_swallowed_and_restores_the_previous_alarm():
    def swallow(completion, sample):
        try:
            time.sleep(5)
        except Exception:  # noqa: BLE001 (a broad except in a plug-in does not hide the timeout)
            return 1.0
        return 0.0

    def previous(signum, frame):
        raise AssertionError("the earlier alarm fired too soon")

    old = signal.signal(signal.SIGALRM, previous)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        with pytest.raises(TimeoutError) as info:
            scoring.score(["x"], [{"id": "a1"}], [rewards.Reward("swallow", swallow)], timeout=0.2)
        assert info.value.user_message.endswith("--reward-timeout 0.2 s on completion 0 (sample id 'a1')")
        assert signal.getsignal(signal.SIGALRM) is previous
        assert 29 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
        quick = rewards.Reward("quick", lambda c, s: 1.0)
        assert scoring.score(["x"], [{}], [quick], timeout=5).total == [1.0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_reward_timeout_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match="--reward-timeout: must be a positive number"):
        scoring.RewardConfig(reward_timeout=value).check()


# --- plug-in files that exit while imported ---


def test_a_plug_in_file_calling_sys_exit_at_import_is_its_named_failure_exit_2(tmp_path):
    plugin = tmp_path / "p.py"
    plugin.write_text("import sys\nsys.exit(0)\n")
    child = train_command(tmp_path, "--task", "shapes", "--reward", f"{plugin}:judge")
    assert child.returncode == 2, child.stderr
    expected = f"error: --reward: {plugin}:judge: the plug-in file called sys.exit(0) while it was imported"
    assert child.stderr.strip().splitlines()[-1] == expected


@pytest.mark.parametrize(
    ("body", "did"),
    [
        ("raise SystemExit('bye')", "called sys.exit('bye')"),
        ("raise KeyboardInterrupt", "raised KeyboardInterrupt"),
    ],
)
def test_a_plug_in_file_raising_systemexit_or_keyboardinterrupt_at_import_is_its_failure(tmp_path, body, did):
    plugin = tmp_path / "p.py"
    plugin.write_text(body + "\n")
    with pytest.raises(ValueError, match=re.escape(f"the plug-in file {did} while it was imported")):
        scoring.rewards_from_flags([f"{plugin}:judge"])
    assert not any(name.startswith("_reward_plugin_p") for name in sys.modules)


def test_a_signal_during_a_plug_in_import_stays_a_stop(tmp_path):
    plugin = tmp_path / "p.py"
    plugin.write_text(
        "from grpo_vlm import cli\nraise cli.Stopped('stopped by SIGINT before training started')\n"
    )
    with pytest.raises(cli.Stopped):
        scoring.rewards_from_flags([f"{plugin}:judge"])


# --- huge images ---


@pytest.fixture(scope="module")
def processor():
    _, _, image_processor = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    return image_processor


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P"])
def test_an_image_above_the_pixel_budget_is_decoded_once_shrunk_with_exactly_the_same_pixel_values(
    tmp_path, processor, mode
):
    pixels = np.random.default_rng(0).integers(0, 256, (333, 517, 4), dtype=np.uint8)
    path = tmp_path / "big.png"
    Image.fromarray(pixels).convert(mode).save(path)
    full = processor(images=[data.load_image(Image.open(path), {})], return_tensors="pt")
    dataset._shrunk.cache_clear()
    shrunk = dataset.load_image(str(path), {}, processor)
    assert shrunk.size == (112, 84) and shrunk.info["original_size"] == (517, 333)  # 12,544-pixel budget
    assert torch.equal(processor(images=[shrunk], return_tensors="pt")["pixel_values"], full["pixel_values"])
    sample = {"images": [str(path)], "prompt": "a"}
    batch = dataset.prepare_prompts([sample], *_tokenizer_and(processor), device="cpu")
    assert batch.inputs["image_grid_thw"][0, 1:].flip(-1).mul(processor.patch_size).tolist() == [112, 84]
    (grounded,) = dataset.with_grounding([sample], processor, "absolute")  # grounding's frames
    assert grounded["grounding"]["original_size"] == [517, 333] and grounded["grounding"]["resized_size"] == [
        112,
        84,
    ]
    assert dataset._shrunk.cache_info().misses == 1  # decoded once, then kept


def _tokenizer_and(processor):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_io.DEFAULT_MODEL), processor


def test_a_jpeg_above_the_budget_is_decoded_at_a_reduced_scale_close_to_the_full_image(tmp_path, processor):
    y, x = np.mgrid[0:1000, 0:1500]
    smooth = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)  # a photo-like gradient
    path = tmp_path / "big.jpg"
    Image.fromarray(smooth).save(path, quality=95)
    full = processor(images=[data.load_image(Image.open(path), {})], return_tensors="pt")["pixel_values"]
    shrunk = dataset.load_image(str(path), {}, processor)
    ours = processor(images=[shrunk], return_tensors="pt")["pixel_values"]
    assert ours.shape == full.shape and (ours - full).abs().mean() < 0.05


def test_an_image_above_max_image_pixels_is_refused_at_load_naming_file_line_and_size(tmp_path):
    Image.new("1", (300, 200)).save(tmp_path / "big.png")
    path = write_jsonl(tmp_path / "d.jsonl", [{"images": ["big.png"], "prompt": "a", "answer": "x"}] * 2)
    args = train_args(output_dir=str(tmp_path / "run"), data=(str(path),), reward=("answer_match",), **TINY)
    args.samples.max_image_pixels = 50_000
    with pytest.raises(
        cli.UsageError, match=rf"{path}:1: image .*big\.png is 300x200 \(60,000 pixels\), more than"
    ):
        trainer.main(args)
    assert not (tmp_path / "run").exists()


def test_max_image_pixels_is_bounded_by_pillows_decompression_bomb_limit():
    with pytest.raises(ValueError, match="--max-image-pixels: at most 178,956,970"):
        dataset.DataConfig(max_image_pixels=10**9).check()


# --- malformed adapters ---


@pytest.fixture
def adapter(tmp_path, random_vlm) -> Path:
    lora.inject_lora(random_vlm, r=4, alpha=16.0, last_k=2)
    model_io.save_adapter(random_vlm, tmp_path / "adapter", base_model_name_or_path="tiny")
    return tmp_path / "adapter"


def _edit_config(folder: Path, **changes) -> dict:
    config = json.loads((folder / model_io.ADAPTER_CONFIG).read_text())
    return {k: v for k, v in {**config, **changes}.items() if v != "<drop>"}


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda c: json.dumps({**c, "r": None}), r"r: expected a positive int, got None"),
        (lambda c: json.dumps({**c, "r": "8"}), r"r: expected a positive int, got '8'"),
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "lora_alpha"}), r"lora_alpha: missing"),
        (lambda c: json.dumps([c]), r"must hold a JSON object, got list"),
        (lambda c: "{not json", r"not a JSON file"),
        (lambda c: b"\xff\xfe{}", r"not a JSON file"),
        (
            lambda c: json.dumps({**c, "target_modules": [1, 2]}),
            r"target_modules: expected a list of module names",
        ),
        (lambda c: json.dumps({**c, "target_modules": 5}), r"uses options lora.py does not implement"),
        (
            lambda c: json.dumps({**c, "layers_to_transform": "all"}),
            r"layers_to_transform: expected null, a layer",
        ),
        (lambda c: json.dumps({**c, "lora_dropout": None}), r"lora_dropout: expected a number in \[0, 1\)"),
    ],
    ids=["r null", "r a string", "no lora_alpha", "a list", "not JSON", "not UTF-8", "targets not names"]
    + ["targets a number", "layers a string", "dropout null"],
)
def test_a_malformed_adapter_config_is_one_error_naming_the_file_and_field(
    adapter, random_vlm, write, message
):
    content = write(_edit_config(adapter))
    path = adapter / model_io.ADAPTER_CONFIG
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    fresh = type(random_vlm)(random_vlm.config)
    with pytest.raises(ValueError, match=f"^{path}: {message}"):
        adapters.load_adapter(fresh, adapter)
    assert not lora.lora_modules(fresh)  # the model is untouched


def test_a_truncated_adapter_safetensors_is_named(adapter, random_vlm):
    weights = adapter / model_io.ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"^{weights}: unreadable .*; is it damaged or cut short"):
        adapters.load_adapter(type(random_vlm)(random_vlm.config), adapter)
