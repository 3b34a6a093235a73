"""The two controls a GRPO result is measured against, with each trainer's own flags: the random reward
(examples/random_reward.py:coin, a plug-in file the reference loads as any other) is a fair coin, the same
for the same completion and sample; the no-update control leaves LoRA as it was initialised (--lr 0 in either
trainer; in the reference, rewards weighted 0 with --beta 0 also give zero gradients, and its step with lr 0
changes nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import lora
import model_io
import rewards
import train
from full.helpers import train_args
from grpo_vlm import cli, scoring, trainer

ROOT = Path(__file__).resolve().parents[2]
COIN = f"{ROOT / 'examples' / 'random_reward.py'}:coin"
SMALL = dict(train_size=8, eval_size=4, batch_size=2, group_size=4, max_new_tokens=8, device="cpu")


def coin():
    return rewards.load_reward(COIN)


def test_the_coin_is_the_same_for_the_same_completion_and_sample_in_every_process():
    pairs = [(f"通过\n理由: {i}", {"id": f"inspection-{i % 7}"}) for i in range(50)]
    first = [coin()(text, sample) for text, sample in pairs]
    assert first == [coin()(text, sample) for text, sample in pairs]  # a second import of the file
    script = f"import json, rewards; fn = rewards.load_reward({COIN!r}); pairs = {pairs!r}\n"
    script += "print(json.dumps([fn(t, s) for t, s in pairs]))"
    for hash_seed in ("1", "2"):  # Python's str hash is salted per process; the coin must not be
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
        )
        assert json.loads(done.stdout) == first, done.stderr


def test_the_coin_is_fair_across_completions_and_across_samples():
    fn = coin()
    over_completions = [fn(f"completion {i}", {"id": "inspection-0"}) for i in range(4000)]
    over_samples = [fn("通过\n理由: 无缺陷", {"id": f"inspection-{i}"}) for i in range(4000)]
    for values in (over_completions, over_samples):
        assert set(values) == {0.0, 1.0}
        assert 0.47 < sum(values) / len(values) < 0.53  # 4000 fair tosses: 3.8 standard deviations each side
    # a sample without an id: its place in the data, or its prompt, keys it
    assert fn("x", {"_where": "a.jsonl:3"}) in (0.0, 1.0) and fn("x", {"prompt": "p"}) in (0.0, 1.0)


def test_the_random_reward_control_trains_the_reference_on_the_coin_and_reports_the_labels_accuracy(tmp_path):
    flags = {k: v for k, v in SMALL.items() if k != "device"}
    args = train.Args(reward=("label", COIN), reward_weight=(0.0, 1.0), steps=1, eval_every=1, **flags)
    args.output_dir = str(tmp_path / "run")
    last = train.main(args)
    assert last["reward/mean"] == last[f"reward/{COIN}/mean"]  # the coin is the whole training signal
    assert "eval/accuracy" in last  # the label's (the first reward), weighted 0 in training


def test_the_full_trainer_loads_the_coin_as_a_checked_plug_in_and_trains_on_it(tmp_path):
    reward_fns = scoring.rewards_from_flags(("label", COIN), (0.0, 1.0), ())
    assert [r.weight for r in reward_fns] == [0.0, 1.0]
    args = train_args(
        output_dir=str(tmp_path / "run"), reward=("label", COIN), reward_weight=(0.0, 1.0), **SMALL
    )
    args.steps = 1
    trainer.main(args)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["reward/mean"] == records[-1][f"reward/{COIN}/mean"]
    assert "eval/accuracy" in records[-1]


def initial_adapter(seed: int = 0) -> dict[str, bytes]:
    """The adapter files of the tiny model right after LoRA's injection with `seed`, as both trainers inject
    it (r 8, alpha 16, the last 4 blocks; B = 0)."""
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    torch.manual_seed(seed)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    return model_io.adapter_files(model, base_model_name_or_path=model_io.DEFAULT_MODEL)


def written_adapter(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((out / "adapter").iterdir())}


def test_lr_0_leaves_the_full_trainers_lora_as_initialised_and_every_evaluation_at_step_0s(tmp_path):
    trainer.main(train_args(output_dir=str(tmp_path / "run"), lr=0.0, steps=3, eval_every=1, seed=2, **SMALL))
    assert written_adapter(tmp_path / "run") == initial_adapter(seed=2)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [(r["eval/accuracy"], r["eval/reward"]) for r in records]
    assert len(evaluations) == 4 and len(set(evaluations)) == 1
    assert all(r["grad_norm"] > 0 for r in records[1:])  # it did compute gradients; the step moved nothing


def test_zero_reward_weights_and_beta_0_leave_the_references_lora_as_initialised(tmp_path):
    flags = {k: v for k, v in SMALL.items() if k != "device"}
    args = train.Args(
        reward_weight=(0.0, 0.0), beta=0.0, steps=2, seed=1, output_dir=str(tmp_path / "run"), **flags
    )
    last = train.main(args)
    assert last["grad_norm"] == 0.0
    assert written_adapter(tmp_path / "run") == initial_adapter(seed=1)


def test_the_references_step_with_lr_0_leaves_lora_unchanged():
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    torch.manual_seed(0)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    with torch.no_grad():  # B != 0, so that the step has a gradient for every LoRA parameter
        for p in lora.lora_parameters(model)[1::2]:
            p.normal_(std=0.05)
    before = [p.detach().clone() for p in lora.lora_parameters(model)]
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=0.0, weight_decay=0.0)
    samples = data.inspection_samples(2)
    args = train.Args(batch_size=2, group_size=4, max_new_tokens=8)
    metrics, _ = train.train_step(
        model, tokenizer, image_processor, samples, rewards.load_rewards(args.reward), optimizer, args
    )
    assert metrics["grad_norm"] > 0
    assert all(torch.equal(p, q) for p, q in zip(lora.lora_parameters(model), before))


BAD_LR = [(-1e-3, r"must be in \[0, 1\)"), (float("nan"), "must be a finite number")]


@pytest.mark.parametrize("lr, why", BAD_LR)
def test_the_full_trainer_still_refuses_a_negative_or_non_finite_lr(tmp_path, lr, why):
    with pytest.raises(cli.UsageError, match=f"--lr: {why}"):
        trainer.main(train_args(output_dir=str(tmp_path / "run"), lr=lr, **SMALL))
