"""python -m grpo_vlm --eval-num-samples n: eval/pass@1 .. eval/pass@n at every held-out evaluation, from n
samples per prompt at the training temperature, without moving training's own random stream; off by
default."""

import itertools
import json
from pathlib import Path

import pytest
import torch

import data
import grpo
from full.helpers import train_args
from grpo_vlm import cli, scoring, speedups, trainer

FLAGS = dict(device="cpu", train_size=16, eval_size=5, batch_size=2, group_size=2, max_new_tokens=8)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def without_pass_at_k(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("eval/pass@")}


def test_pass_at_k_is_logged_at_every_evaluation_and_leaves_training_unchanged(tmp_path):
    trainer.main(train_args(output_dir=str(tmp_path / "off"), steps=2, eval_every=1, **FLAGS))
    trainer.main(
        train_args(output_dir=str(tmp_path / "on"), steps=2, eval_every=1, eval_num_samples=3, **FLAGS)
    )
    off, on = metrics(tmp_path / "off"), metrics(tmp_path / "on")
    assert [r["step"] for r in on] == [0, 1, 2]
    for record in on:
        curve = [record[f"eval/pass@{k}"] for k in (1, 2, 3)]
        assert all(0 <= p <= 1 for p in curve) and curve == sorted(curve)
        assert "eval/pass@4" not in record
    assert not any(key.startswith("eval/pass@") for record in off for key in record)  # off by default
    # the same training steps, greedy evaluations and checkpoints: the samples drew from a forked stream
    assert [without_pass_at_k(r) for r in on] == [without_pass_at_k(r) for r in off]
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "on" / adapter).read_bytes() == (tmp_path / "off" / adapter).read_bytes()


def test_step_zeros_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_completion(tmp_path, monkeypatch):
    """Step 0's eval/pass@k against each prompt's k-subsets of its 4 completions, drawn again from the random
    state the trainer's evaluation drew them with (its one batch), on the same base model."""
    args = train_args(output_dir=str(tmp_path / "run"), steps=1, eval_num_samples=4, **FLAGS)
    trainer.main(args)
    logged = metrics(tmp_path / "run")[0]
    run = trainer.build_run(args, torch.device("cpu"), torch.float32, rank=0, world=1)
    run.model.eval()
    states, real = [], speedups.sample

    def spy(*a, **k):  # the random state each of the evaluation's batches starts sampling from
        states.append(torch.get_rng_state())
        return real(*a, **k)

    monkeypatch.setattr(speedups, "sample", spy)
    trainer.pass_at_k_sums(run, run.held_out, args, step=0)
    assert len(states) == 1  # 5 prompts x 4 completions: one batch
    torch.set_rng_state(states[0])
    batch = trainer.prompt_batch(run, run.held_out, args)
    ids, _ = real(run.model, batch.inputs, run.speed, group_size=4, record=False, **run.sampling)
    ends = run.sampling["eos_token_id"]
    mask, _ = grpo.completion_mask(ids, ends)
    texts = data.decode_completions(run.tokenizer, ids, mask, ends)
    rows = [s for s in run.held_out for _ in range(4)]
    scores = scoring.score(texts, rows, run.reward_fns, completion_lengths=mask.sum(1).tolist())
    correct = [v >= 1.0 for v in scores.components[run.accuracy_name]]
    for k in range(1, 5):
        shares = []
        for b in range(5):
            subsets = list(itertools.combinations(correct[b * 4 : (b + 1) * 4], k))
            shares.append(sum(any(s) for s in subsets) / len(subsets))
        assert logged[f"eval/pass@{k}"] == pytest.approx(sum(shares) / 5, abs=1e-12)


def test_a_negative_eval_num_samples_is_a_usage_error_naming_the_flag(tmp_path):
    with pytest.raises(cli.UsageError, match="--eval-num-samples: must be >= 0"):
        trainer.main(train_args(output_dir=str(tmp_path / "run"), eval_num_samples=-1, **FLAGS))
