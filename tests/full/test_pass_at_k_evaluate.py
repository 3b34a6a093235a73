"""scripts/evaluate.py --num-samples n: pass@1 .. pass@n from the same n samples per prompt, by the unbiased
estimator, in the summary (hand-computed lines, and a real sampled run checked against k-subset counts)."""

import itertools
import json

import pytest

from scripts import evaluate


def line(correct: list[bool]) -> dict:
    """An output line of evaluate.py with these completions' correctness (other fields as it writes them)."""
    n = len(correct)
    return {
        "completions": ["x"] * n,
        "correct": correct,
        "pass_at_k": any(correct),
        "total": [float(c) for c in correct],
        "rewards": {"label": [float(c) for c in correct]},
        "completion_tokens": [3] * n,
        "truncated": [False] * n,
    }


def test_the_summary_gives_pass_at_1_to_n_by_the_unbiased_estimator():
    # two samples of n = 4: one correct completion in the first, none in the second
    summary = evaluate.summarise([line([False, True, False, False]), line([False] * 4)])
    curve = [summary[f"pass@{k}"] for k in range(1, 5)]
    assert curve == pytest.approx([1 / 8, 1 / 4, 3 / 8, 1 / 2])  # (1/4, 1/2, 3/4, 1) for the first, 0 else
    assert summary["pass@1"] == summary["accuracy"]
    assert "pass@5" not in summary


def share_of_k_subsets(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_a_sampled_evaluation_reports_each_k_as_the_share_of_k_subsets_with_a_correct_completion(tmp_path):
    out = tmp_path / "pass4.jsonl"
    args = evaluate.Args(eval_size=6, batch_size=3, max_new_tokens=16, num_samples=4, temperature=1.0)
    args.output = str(out)
    summary = evaluate.main(args)["base"]
    lines = [json.loads(text) for text in out.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 6 and all(len(r["correct"]) == 4 for r in lines)
    for k in range(1, 5):
        by_subsets = sum(share_of_k_subsets(r["correct"], k) for r in lines) / len(lines)
        assert summary[f"pass@{k}"] == pytest.approx(by_subsets, abs=1e-12)
    assert summary["pass@4"] == pytest.approx(sum(r["pass_at_k"] for r in lines) / 6)  # any of the 4
    assert 0 < summary["pass@1"] < summary["pass@4"]  # the tiny model is right some of the time, not always
