"""scripts/train_offline.py: offline GRPO on pre-scored groups (RCE warm-up, frozen old log-probs, curriculum,
best checkpoint). Pure pieces against hand-computed numbers, file validation, and end-to-end runs of `main`
on the shipped tiny model with the demo's pre-scored inspection groups."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import data
import grpo
import lora
import model_io
import rewards
from grpo_vlm import checkpoints, cli, lora_config, objectives
from scripts import mock_rollouts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import train_offline as offline


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_io.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One end-to-end run: 8 demo groups, validated on the training groups themselves (the tiny model cannot
    generalise the defect detection in a few epochs, but it can learn the groups it trains on)."""
    root = tmp_path_factory.mktemp("offline")
    train_path, _ = mock_rollouts.write_scored_demo(root / "demo", 8, seed=0)
    out = root / "run"
    args = offline.Args(
        data=str(train_path),
        val_data=str(train_path),
        output_dir=str(out),
        device="cpu",
        rce_epochs=2,
        grpo_epochs=2,
        batch_size=4,
        lr=5e-3,
        curriculum_top_k=2,
        curriculum_epochs=1,
        best_by="reward",
        keep_last=2,
    )
    offline.main(args)
    return out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def best_epoch(metric: str, values: list[float]) -> int | None:
    """1-based epoch that `is_better` keeps when the values arrive one epoch at a time."""
    best, epoch = None, None
    for e, value in enumerate(values, start=1):
        if offline.is_better(metric, value, best):
            best, epoch = value, e
    return epoch


# --- pure functions ------------------------------------------------------------------------------------


def test_rce_loss_matches_hand_computed_softmax_weighting():
    nll = torch.tensor([[1.0, 2.0], [3.0, 5.0]], requires_grad=True)  # (B=2, G=2)
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    # tau = 1: w = [e, 1] / (e + 1) = [0.7310586, 0.2689414] -> 1.2689414; equal scores: w = 1/2 -> 4.0.
    loss = offline.rce_loss(nll, scores, 1.0)
    assert loss.item() == pytest.approx((1.2689414 + 4.0) / 2, abs=1e-6)
    loss.backward()  # the weights are constants: d loss / d nll = w / B
    assert torch.allclose(nll.grad, torch.tensor([[0.7310586, 0.2689414], [0.5, 0.5]]) / 2, atol=1e-6)
    # tau = 0.5: scores / tau = [2, 0] -> w = [0.8807971, 0.1192029] -> 1.1192029.
    assert offline.rce_loss(nll, scores, 0.5).item() == pytest.approx((1.1192029 + 4.0) / 2, abs=1e-6)


def test_tau_schedule_is_linear_from_start_to_end_over_the_rce_epochs():
    args = offline.Args(rce_epochs=4, tau_start=2.0, tau_end=0.5)
    taus = [offline.epoch_schedule(e, args)["tau"] for e in range(1, 5)]
    assert taus == pytest.approx([2.0, 1.5, 1.0, 0.5])
    single = offline.Args(rce_epochs=1, tau_start=2.0, tau_end=0.5)
    assert offline.epoch_schedule(1, single)["tau"] == 2.0  # a single RCE epoch uses tau_start


def test_curriculum_keeps_the_top_k_of_each_group_and_switches_off_after_its_epochs():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0])  # G = 4; ties go to the earlier row
    expected = [False, True, True, False, True, True, False, False]
    assert offline.curriculum_mask(scores, 4, 2).tolist() == expected
    assert offline.curriculum_mask(scores, 4, None).all()
    assert offline.curriculum_mask(scores, 4, 4).all()
    args = offline.Args(rce_epochs=1, curriculum_top_k=2, curriculum_epochs=2)  # GRPO epochs are 2..5
    assert [offline.epoch_schedule(e, args)["top_k"] for e in range(2, 6)] == [2, 2, None, None]
    assert offline.epoch_schedule(2, offline.Args(rce_epochs=1, curriculum_epochs=2))["top_k"] is None


def test_best_checkpoint_selection_picks_lowest_kl_and_highest_reward():
    assert best_epoch("kl", [0.30, 0.10, 0.20, 0.05, math.nan]) == 4
    assert best_epoch("reward", [0.1, 0.5, math.nan, 0.5, 0.4]) == 2  # a tie keeps the earlier epoch
    assert best_epoch("reward", [math.nan, math.nan]) is None


def test_validation_split_is_seeded_disjoint_and_complete():
    samples = [{"id": i} for i in range(20)]
    train, val = offline.split_validation(samples, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert sorted(s["id"] for s in train + val) == list(range(20))
    assert offline.split_validation(samples, 0.25, seed=3) == (train, val)
    with pytest.raises(ValueError, match="--val-data"):
        offline.split_validation(samples[:1], 0.5, seed=0)


# --- input files ---------------------------------------------------------------------------------------

VALID = {"prompt": "p", "completions": ["a", "b"], "scores": [1.0, 0.0]}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"prompt": "p", "completions": ["a", "b", "c"], "scores": [1.0, 0.0]}',
            "3 completions but 2 scores",
        ),
        ('{"prompt": "p", "completions": ["a"], "scores": [1.0]}', "G >= 2"),
        (
            '{"prompt": "p", "completions": ["a", "b"], "scores": [1.0, "high"]}',
            "scores\\[1\\] = 'high' is not",
        ),
        (
            '{"prompt": "p", "completions": ["a", "b"], "scores": [true, false]}',
            "scores\\[0\\] = True is not",
        ),
        ('{"prompt": "p", "completions": ["a", "b"], "scores": [1.0, NaN]}', "not finite"),
        ('{"prompt": "p", "completions": ["a", 2], "scores": [1.0, 0.0]}', "list of strings"),
        ('{"prompt": "p", "completions": ["a", "b"]}', "'scores' must be a list"),
    ],
)
def test_malformed_scored_line_raises_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "scored.jsonl"
    path.write_text(json.dumps(VALID) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        offline.read_scored(str(path))
    assert f"{path}:2:" in str(info.value)


def test_batches_group_equal_g_and_advantages_are_group_zscores_of_the_scores(tokenizer):
    samples = [
        {"id": "a", "prompt": "p", "completions": ["通过", "不通过", "x"], "scores": [1.0, 0.0, 0.5]},
        {"id": "b", "prompt": "p", "completions": ["通过\n理由: 无缺陷", ""], "scores": [0.2, 0.9]},
        {"id": "c", "prompt": "p", "completions": ["a", "b", "c"], "scores": [3.0, -1.0, 2.0]},
    ]
    batches = offline.make_batches(samples, tokenizer, offline.Args(batch_size=8, max_completion_length=64))
    assert [(b.group_size, [s["id"] for s in b.samples]) for b in batches] == [(2, ["b"]), (3, ["a", "c"])]
    for b in batches:
        assert torch.equal(b.adv, grpo.group_advantages(b.scores, b.group_size))
        texts = [t for s in b.samples for t in s["completions"]]
        for row, mask, text in zip(b.completion_ids, b.mask, texts):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert row[: len(ids)].tolist() == ids and int(mask.sum()) == len(ids)  # EOS is in the mask
            assert (row[len(ids) :] == tokenizer.pad_token_id).all()
    clip = offline.Args(batch_size=8, max_completion_length=64, adv=objectives.AdvantageConfig(adv_clip=0.5))
    clipped = offline.make_batches(samples, tokenizer, clip)
    assert torch.equal(clipped[1].adv, grpo.group_advantages(clipped[1].scores, 3).clamp(-0.5, 0.5))


def test_completion_with_eos_text_or_too_long_raises_naming_the_sample(tokenizer):
    bad_eos = {"_where": "f.jsonl:7", "completions": ["a<|im_end|>b", "c"], "scores": [1.0, 0.0]}
    with pytest.raises(ValueError, match="f.jsonl:7: a completion contains the EOS"):
        offline.make_batches([bad_eos], tokenizer, offline.Args(batch_size=1, max_completion_length=64))
    long = {"_where": "f.jsonl:8", "completions": ["通过\n理由: 无缺陷", "c"], "scores": [1.0, 0.0]}
    with pytest.raises(ValueError, match="f.jsonl:8: .*max_completion_length=3"):
        offline.make_batches([long], tokenizer, offline.Args(batch_size=1, max_completion_length=3))


def test_demo_scores_agree_with_the_label_and_format_rewards(tmp_path):
    train_path, val_path = mock_rollouts.write_scored_demo(tmp_path, 12, seed=0)
    for sample in offline.read_scored(str(train_path)) + offline.read_scored(str(val_path)):
        assert len(sample["completions"]) == 4
        for text, score in zip(sample["completions"], sample["scores"]):
            label, fmt = rewards.label_reward(text, sample), rewards.format_reward(text, sample)
            assert (label * fmt == 1.0) == (score == 1.0)  # only the right, well-formed answer scores 1
            assert score == 1.0 or score <= 0.2
        assert min(sample["scores"]) == 0.0 and max(sample["scores"]) == 1.0


# --- old log-probs ---------------------------------------------------------------------------------------


def test_old_logprobs_are_frozen_across_epochs_and_ratio_is_one_at_the_first_step(tmp_path):
    train_path, _ = mock_rollouts.write_scored_demo(tmp_path, 4, seed=1)
    args = offline.Args(
        data=str(train_path),
        val_data=str(train_path),
        device="cpu",
        dtype="float32",
        batch_size=2,
        max_completion_length=64,
        rce_epochs=0,  # every epoch is a GRPO epoch
        lr=1e-2,
        loss=objectives.LossConfig(beta=0.04),
        lora=lora_config.LoRAConfig(lora_last_k=2, lora_r=4, lora_alpha=8.0),
    )
    model, logprobs_of, batches, _ = offline.load_inputs(args)
    batches = offline.with_logprobs(model, batches, logprobs_of, "ref_logp", adapters=False)
    batches = offline.with_logprobs(model, batches, logprobs_of, "old_logp", adapters=True)
    # LoRA B = 0: at the start the policy is the reference, exactly.
    assert all(torch.equal(b.old_logp, b.ref_logp) for b in batches)
    frozen = [b.old_logp.clone() for b in batches]
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    first_steps = []
    for epoch in (1, 2):
        record = offline.train_epoch(model, batches, logprobs_of, optimizer, scheduler, args, epoch)
        first_steps.append(record["log_ratio_absmax/first_step"])
        assert all(torch.equal(b.old_logp, f) for b, f in zip(batches, frozen)), f"old_logp moved in {epoch=}"
    assert first_steps[0] < 1e-6  # ratio == 1 at the first GRPO step
    assert first_steps[1] > 1e-3  # the policy moved; old_logp did not


# --- end to end ------------------------------------------------------------------------------------------


def test_offline_training_lowers_rce_loss_then_raises_best_over_worst_logprob(run):
    _, records = run
    rce = [r["rce_loss"] for r in records if r.get("phase") == "rce"]
    assert len(rce) == 2 and rce[1] < rce[0]
    start, after_rce, end = records[0]["val/margin"], records[2]["val/margin"], records[-1]["val/margin"]
    assert end > after_rce and end > start, (start, after_rce, end)
    assert records[-1]["val/reward"] > records[0]["val/reward"]


def test_tau_and_curriculum_switch_happen_at_the_configured_epochs(run):
    _, records = run
    assert [r["epoch"] for r in records] == [0, 1, 2, 3, 4]
    assert [r.get("phase") for r in records[1:]] == ["rce", "rce", "grpo", "grpo"]
    assert [r["tau"] for r in records[1:3]] == pytest.approx([2.0, 0.5])
    assert [r["curriculum"] for r in records[3:]] == [True, False]
    assert [r["top_k"] for r in records[3:]] == [2, None]
    assert [r["frac_rows_in_loss"] for r in records[3:]] == pytest.approx([0.5, 1.0])  # top 2 of G = 4
    assert records[3]["log_ratio_absmax/first_step"] < 1e-6  # old_logp taken where GRPO starts


def test_run_keeps_best_checkpoint_by_reward_last_checkpoints_and_final_adapter(run):
    out, records = run
    expected = best_epoch("reward", [r["val/reward"] for r in records[1:]])
    assert checkpoints.load_checkpoint(out / "best")["epoch"] == expected
    assert [r["epoch"] for r in records if r.get("best")][-1] == expected
    assert (out / "best" / model_io.ADAPTER_WEIGHTS).is_file() and not (out / "best.tmp").exists()
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000003", "checkpoint-000004"]
    assert (out / "adapter" / model_io.ADAPTER_CONFIG).is_file()


def test_demo_flag_runs_and_keeps_best_by_kl(tmp_path):
    out = tmp_path / "demo-run"
    args = offline.Args(
        demo=True, demo_size=4, batch_size=4, rce_epochs=1, grpo_epochs=1, best_by="kl", output_dir=str(out)
    )
    offline.main(args)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = best_epoch("kl", [r["val/kl"] for r in records[1:]])
    assert checkpoints.load_checkpoint(out / "best")["epoch"] == expected
    assert data.read_jsonl(out / "demo" / "train.jsonl")[0]["images"]  # the demo wrote real files
    with pytest.raises(cli.UsageError, match="--overwrite"):
        offline.main(args)
