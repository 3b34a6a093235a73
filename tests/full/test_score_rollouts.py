"""Tests of scripts/score_rollouts.py and scripts/mock_rollouts.py: every report figure against hand-computed
numbers on a hand-written rollouts file, advantages against grpo.group_advantages, the on-disk reward cache,
and the mock generator's determinism. No model is involved; these run in about a second.
"""

import json
from pathlib import Path

import pytest
import torch

import grpo
from scripts import mock_rollouts, score_rollouts

PROMPTS = [
    {"prompt_id": "p1", "label": "通过"},
    {"prompt_id": "p2", "label": "不通过"},
    {"prompt_id": "p3", "label": "通过"},
    {"prompt_id": "p4", "answer": "x"},  # no label: the label reward cannot score it
]


def line(step, prompt_id, text) -> str:
    return json.dumps({"step": step, "prompt_id": prompt_id, "group_id": f"{step}/{prompt_id}", "text": text})


# Rewards: label, format, with format as a gate. Per line: (label, format) -> total.
ROLLOUTS = [
    line(0, "p1", "通过\n理由: 无缺陷"),  # 1: (1, 1) -> 2
    line(0, "p1", "不通过\n理由: 有缺陷"),  # 2: (0, 1) -> 1
    line(0, "p1", "通过"),  # 3: (1, 0) -> 0, the format gate fails
    '{"step": 0, "prompt_id": "p2", "text": "不通',  # 4: bad, invalid JSON
    line(0, "p2", "不通过\n理由: 图片1有缺陷"),  # 5: (1, 1) -> 2
    line(0, "p2", "不通过\n理由: 图片2有缺陷"),  # 6: (1, 1) -> 2
    json.dumps({"step": 0, "text": "通过\n理由: 无缺陷"}),  # 7: bad, no prompt_id
    line(0, "p2", "fail\n理由: red mark"),  # 8: (1, 1) -> 2; p2 is a zero-std group
    line(0, "p3", "通过\n理由: 无缺陷"),  # 9: (1, 1) -> 2
    line(0, "p3", "不通过\n理由: 图片1有缺陷"),  # 10: (0, 1) -> 1; group (0, p3) has size 2
    line(0, "p9", "通过\n理由: 无缺陷"),  # 11: bad, unknown prompt
    line(1, "p3", "通过\n理由: 无缺陷"),  # 12: (1, 1) -> 2; step 1: a group of one
    line(0, "p4", "x"),  # 13: bad, the label reward raises KeyError (p4 has no label)
]
TOTALS = [2, 1, 0, 2, 2, 2, 2, 1, 2]  # the 9 scored lines, in order
GROUPS = {(0, "p1"): [2.0, 1.0, 0.0], (0, "p2"): [2.0, 2.0, 2.0], (0, "p3"): [2.0, 1.0]}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return path


def run(tmp_path: Path, reward=("label", "format"), **overrides) -> tuple[dict, list[dict]]:
    args = score_rollouts.Args(
        rollouts=str(write_jsonl(tmp_path / "rollouts.jsonl", ROLLOUTS)),
        prompts=str(write_jsonl(tmp_path / "prompts.jsonl", [json.dumps(p) for p in PROMPTS])),
        reward=reward,
        gate=("format",),
        **overrides,
    )
    report = score_rollouts.main(args)
    scored = (tmp_path / "rollouts.scored.jsonl").read_text(encoding="utf-8").splitlines()
    return report, [json.loads(x) for x in scored]


def test_report_figures_match_hand_computed_numbers(tmp_path):
    report, scored = run(tmp_path)
    assert report["counts"] == {"lines": 13, "scored": 9, "bad": 4, "groups": 4}
    assert [b["line"] for b in report["bad_lines"]] == [4, 7, 11, 13]
    reasons = [b["reason"] for b in report["bad_lines"]]
    assert reasons[0].startswith("invalid JSON") and reasons[1] == "missing prompt_id"
    assert reasons[2] == "unknown prompt_id 'p9'" and "KeyError" in reasons[3]
    assert report["group_size"] == 3  # sizes 3, 3, 2, 1: the most common is 3
    assert report["reward_mean"] == pytest.approx(14 / 9)  # 2+1+0 + 2+2+2 + 2+1 + 2
    assert report["component_means"] == pytest.approx({"label": 7 / 9, "format": 8 / 9})
    assert report["gate_failures"] == {"format": 1}
    assert report["frac_zero_std_groups"] == 0.5  # (0, p2) all 2, and the lone (1, p3): 2 of 4
    assert report["singleton_groups"] == 1
    assert report["wrong_size_groups"] == [
        {"step": 0, "prompt_id": "p3", "size": 2},
        {"step": 1, "prompt_id": "p3", "size": 1},
    ]
    assert [r["reward"]["total"] for r in scored] == TOTALS
    assert scored[2]["reward"]["gate_failed"] == {"format": True}
    assert scored[2]["reward"]["components"] == {"label": 1.0, "format": 0.0}


def test_advantages_equal_group_advantages_on_each_group(tmp_path):
    _, scored = run(tmp_path)
    for (step, pid), totals in GROUPS.items():
        adv = [r["advantage"] for r in scored if (r["step"], r["prompt_id"]) == (step, pid)]
        assert adv == grpo.group_advantages(torch.tensor(totals), len(totals)).tolist()
    by_group = {(r["step"], r["prompt_id"]): [] for r in scored}
    for r in scored:
        by_group[(r["step"], r["prompt_id"])].append(r["advantage"])
    # By hand (unbiased std, eps = 1e-4): [2, 1, 0] is centred to [1, 0, -1] with std 1; [2, 1] is centred
    # to [0.5, -0.5] with std sqrt(0.5) = 0.7071, giving +-0.7071.
    assert by_group[(0, "p1")] == pytest.approx([1, 0, -1], abs=1e-3)
    assert by_group[(0, "p2")] == [0.0, 0.0, 0.0]
    assert by_group[(0, "p3")] == pytest.approx([0.7071, -0.7071], abs=1e-3)
    assert by_group[(1, "p3")] == [0.0]  # a group of one: no baseline


COUNTING_REWARD = """
from pathlib import Path

CALLS = Path(__file__).with_name("calls.txt")


def text_length(completion, sample):
    with CALLS.open("a") as f:
        f.write("call\\n")
    return float(len(completion))
"""


def test_rerun_calls_the_expensive_reward_zero_times(tmp_path):
    (tmp_path / "counting.py").write_text(COUNTING_REWARD, encoding="utf-8")
    reward = ("label", "format", f"{tmp_path / 'counting.py'}:text_length")
    calls = tmp_path / "calls.txt"
    first, _ = run(tmp_path, reward=reward)
    # 9 scored lines (p4's line fails in label, before this reward); lines 9 and 12 share (p3, text),
    # so the second of them is already a cache hit: 8 calls.
    assert len(calls.read_text().splitlines()) == 8
    output = (tmp_path / "rollouts.scored.jsonl").read_bytes()

    second, _ = run(tmp_path, reward=reward)
    assert len(calls.read_text().splitlines()) == 8  # no new call
    assert (tmp_path / "rollouts.scored.jsonl").read_bytes() == output
    # The only miss: label on p4's line, which raises every time and so is never stored.
    assert second["cache"]["misses"] == 1
    assert {k: v for k, v in second.items() if k != "cache"} == {
        k: v for k, v in first.items() if k != "cache"
    }


def mock(tmp_path: Path, name: str, seed: int) -> Path:
    args = mock_rollouts.Args(
        prompts=str(tmp_path / f"prompts_{name}"),
        output=str(tmp_path / name),
        write_prompts=5,
        group_size=4,
        steps=2,
        seed=seed,
    )
    mock_rollouts.main(args)
    return tmp_path / name


def test_mock_rollouts_are_deterministic_per_seed_and_score_without_bad_lines(tmp_path):
    a, b, c = mock(tmp_path, "a.jsonl", 0), mock(tmp_path, "b.jsonl", 0), mock(tmp_path, "c.jsonl", 1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()

    report = score_rollouts.main(
        score_rollouts.Args(rollouts=str(a), prompts=str(tmp_path / "prompts_a.jsonl"))
    )
    assert report["counts"] == {"lines": 40, "scored": 40, "bad": 0, "groups": 10}  # 2 steps x 5 prompts x 4
    assert report["group_size"] == 4 and report["wrong_size_groups"] == []
    for r in map(json.loads, (tmp_path / "a.scored.jsonl").read_text(encoding="utf-8").splitlines()):
        components = r["reward"]["components"]
        kind = r["meta"]["kind"]
        if kind == "correct":
            assert components == {"label": 1.0, "format": 1.0}
        elif kind == "wrong":
            assert components == {"label": 0.0, "format": 1.0}
        else:
            assert components["format"] == 0.0
