"""End-to-end tests of scripts/evaluate.py on the embedded tiny Qwen2.5-VL (CPU, fp32, built-in task).

Resuming is tested twice: with a torn line written by hand (exactly what a kill mid-write leaves), and with
a real SIGKILL of a running subprocess followed by the same command.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tyro

import lora
import model_io
import rewards
from grpo_vlm import cli
from scripts import evaluate

ROOT = Path(__file__).resolve().parents[2]


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in read_lines(path)]


def small_args(output: Path, **overrides) -> evaluate.Args:
    settings = dict(eval_size=8, batch_size=4, max_new_tokens=16, output=str(output)) | overrides
    return evaluate.Args(**settings)


def test_rerun_after_a_torn_line_writes_each_sample_exactly_once(tmp_path):
    out = tmp_path / "eval.jsonl"
    first = evaluate.main(small_args(out))["base"]
    complete = read_lines(out)
    assert len(complete) == 8
    # A kill after 3 lines, in the middle of writing the 4th: 3 complete lines and half of the next.
    half = complete[3].encode()[: len(complete[3].encode()) // 2]
    out.write_bytes("".join(line + "\n" for line in complete[:3]).encode() + half)
    (tmp_path / "eval.summary.json").unlink()

    again = evaluate.main(small_args(out))["base"]
    ids = [r["id"] for r in records(out)]
    assert sorted(ids) == sorted(f"inspection-{i}" for i in range(8))  # all, none twice
    assert read_lines(out) == complete  # greedy: the torn line is gone and the redone lines are identical
    summary = json.loads((tmp_path / "eval.summary.json").read_text(encoding="utf-8"))
    assert summary == again == first
    correct = [c for r in records(out) for c in r["correct"]]
    assert summary["samples"] == 8 and summary["accuracy"] == pytest.approx(sum(correct) / 8)


def test_killed_process_resumes_without_duplicates_or_losses(tmp_path):
    out = tmp_path / "eval.jsonl"
    argv = ["--eval-size", "6", "--batch-size", "1", "--max-new-tokens", "16", "--output", str(out)]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (out.exists() and b"\n" in out.read_bytes()):  # poll for the first complete line
            assert proc.poll() is None, "evaluate.py exited before writing a line"
            assert time.time() < deadline, "no output line within 120 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    written = len(read_lines(out))
    assert 1 <= written < 6, "the process was not stopped part-way"

    evaluate.main(tyro.cli(evaluate.Args, args=argv))  # the same command again
    ids = [r["id"] for r in records(out)]
    assert len(ids) == 6 and set(ids) == {f"inspection-{i}" for i in range(6)}
    assert json.loads((tmp_path / "eval.summary.json").read_text(encoding="utf-8"))["samples"] == 6


def test_pass_at_k_is_any_of_k_sampled_completions_correct(tmp_path):
    out = tmp_path / "pass2.jsonl"
    summary = evaluate.main(small_args(out, eval_size=4, num_samples=2, temperature=1.0))["base"]
    lines = records(out)
    assert len(lines) == 4
    for r in lines:
        assert len(r["completions"]) == len(r["total"]) == len(r["correct"]) == 2
        sample = r["ground_truth"]
        assert r["rewards"]["label"] == [rewards.label_reward(t, sample) for t in r["completions"]]
        assert r["correct"] == [v == 1.0 for v in r["rewards"]["label"]]
        assert r["pass_at_k"] == any(r["correct"])
    assert summary["pass@2"] == pytest.approx(sum(r["pass_at_k"] for r in lines) / 4)
    assert summary["accuracy"] == pytest.approx(sum(c for r in lines for c in r["correct"]) / 8)
    assert summary["format_valid"] == pytest.approx(sum(v for r in lines for v in r["format_valid"]) / 8)
    with pytest.raises(cli.UsageError, match="other settings"):  # greedy into the sampled run's file
        evaluate.main(small_args(out, eval_size=4))


def test_a_resumed_sampled_run_draws_what_an_uninterrupted_run_draws(tmp_path):
    out = tmp_path / "pass2.jsonl"
    sampled = dict(eval_size=8, batch_size=4, num_samples=2, temperature=1.0)
    evaluate.main(small_args(out, **sampled))
    complete = read_lines(out)
    # Killed after 5 lines: batch 1 (samples 4-7) was partly written; its missing lines must match exactly.
    out.write_text("".join(line + "\n" for line in complete[:5]), encoding="utf-8")
    evaluate.main(small_args(out, **sampled))
    assert read_lines(out) == complete
    assert len({tuple(r["completions"]) for r in records(out)}) > 1  # really sampled, not all alike


@pytest.fixture
def random_adapter(tmp_path) -> Path:
    """An adapter whose B matrices are random (B = 0 would leave the model unchanged)."""
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in lora.lora_parameters(model)[1::2]:  # (A, B) pairs: every second one is B
            p.normal_(std=0.5)
    model_io.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=model_io.DEFAULT_MODEL)
    return tmp_path / "adapter"


def test_compare_writes_one_report_with_base_and_adapter_columns(tmp_path, random_adapter):
    base_only = tmp_path / "base_only.jsonl"
    evaluate.main(small_args(base_only, eval_size=4))
    out = tmp_path / "cmp.jsonl"
    summaries = evaluate.main(small_args(out, eval_size=4, adapter=str(random_adapter), compare=True))

    report = json.loads((tmp_path / "cmp.compare.json").read_text(encoding="utf-8"))
    assert set(report) >= {"base", "adapter"} and report["base"] == summaries["base"]
    assert report["adapter"] == summaries["adapter"] and report["base"].keys() == report["adapter"].keys()
    # The base column (adapters switched off) is exactly the base model evaluated alone.
    assert read_lines(tmp_path / "cmp.base.jsonl") == read_lines(base_only)
    adapter_texts = [r["completions"] for r in records(tmp_path / "cmp.adapter.jsonl")]
    assert adapter_texts != [r["completions"] for r in records(base_only)]  # the adapter was applied
    assert len(adapter_texts) == 4
