"""The two rooms take the same step: the full trainer's default path and the reference's `train.train_step`.

The full trainer (grpo_vlm) samples with each prompt prefilled once (shared prefill), records the frozen
trunk while sampling and reuses it in every log-prob pass (trunk reuse), and splits the N rows into
micro-batches whose gradients add up. The reference calls `generate` and runs one full forward per pass.
From the same LoRA weights, prompts and seed both must draw the same completion tokens and give the same
loss and LoRA gradients, to rounding (<= 1e-5 in fp32), for every variant below.

`PYTHONPATH=.:tests python tests/full/test_trainers_agree.py` prints the differences per variant.
"""

import dataclasses

import pytest
import torch

import data
import model_io
import rewards
import train
from full.helpers import lora_model_with_gradients, make_run, train_args
from grpo_vlm import dataset
from grpo_vlm import trainer as full

B, G, T, SEED, LR = 4, 4, 16, 3, 2e-3
GSPO = dict(loss_type="grpo", importance_sampling_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
VARIANTS = {  # name: the flags both trainers get
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo"),
    "dr_grpo": dict(loss_type="dr_grpo", adv_scale="none"),
    "gspo": GSPO,
    "dapo, mu = 2": dict(loss_type="dapo", num_iterations=2),
    "gspo, mu = 2": dict(GSPO, num_iterations=2),
}
TOLERANCE = 1e-5


def one_step_each(flags: dict) -> dict[str, float]:
    """One step of each trainer from the same LoRA weights, samples and RNG state; their differences."""
    model, tokenizer, image_processor = lora_model_with_gradients()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    samples = data.inspection_samples(32, split="train", seed=0)
    reward_fns = [rewards.Reward(r, rewards.load_reward(r)) for r in ("label", "format")]
    shape = dict(batch_size=B, group_size=G, max_new_tokens=T, lr=LR, seed=SEED)

    def optimizer_and_schedule():
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0
        )
        return optimizer, model_io.cosine_with_warmup(optimizer, warmup_steps=0, total_steps=10)

    # The full trainer: shared prefill and trunk reuse (its defaults), micro-batches of 4 of the 16 rows.
    args = train_args(**shape, **flags, micro_batch_size=4)
    optimizer, scheduler = optimizer_and_schedule()
    policy = dict(model=model, tokenizer=tokenizer, image_processor=image_processor)
    run = make_run(
        **policy,
        args=args,
        optimizer=optimizer,
        scheduler=scheduler,
        train_samples=samples,
        reward_fns=reward_fns,
        accuracy_name="label",
    )
    assert run.speed.record_block is not None and len(run.speed.parts or {}) > 0  # the fast path
    torch.manual_seed(SEED)
    record, _, rollout = full.train_step(1, run, args, args.loss.beta)
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    # The reference, from the same weights, the same B samples and the same RNG state.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start[n])
    optimizer, _ = optimizer_and_schedule()
    reference_args = train.Args(**shape, **flags)
    prompts = dataset.batch_for_step(samples, 0, B, SEED)
    torch.manual_seed(SEED)
    metrics, completion_ids = train.train_step(
        model, tokenizer, image_processor, prompts, reward_fns, optimizer, reference_args
    )
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {
        "tokens": int((completion_ids != rollout.completion_ids).sum()),
        "loss": abs(metrics["loss"] - record["loss"]),
        "gradient": max(float((grads[n] - fast_grads[n]).abs().max()) for n in grads),
        "gradient_scale": max(float(g.abs().max()) for g in grads.values()),
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_full_trainers_step_equals_the_reference_train_step(variant):
    diff = one_step_each(VARIANTS[variant])
    assert diff["tokens"] == 0, diff
    assert diff["loss"] <= TOLERANCE, diff
    assert diff["gradient"] <= TOLERANCE, diff
    assert diff["gradient_scale"] > 100 * TOLERANCE, diff  # the gradients compared are not all ~0


def test_the_comparison_fails_when_the_reference_step_differs(monkeypatch):
    """The test can fail: the reference with another clip range gives another loss or gradient."""
    real = train.loss_config
    monkeypatch.setattr(train, "loss_config", lambda args: dataclasses.replace(real(args), beta=0.5))
    diff = one_step_each(VARIANTS["dapo"])
    assert diff["tokens"] == 0 and (diff["loss"] > TOLERANCE or diff["gradient"] > TOLERANCE), diff


if __name__ == "__main__":
    print("| variant | tokens differing | loss | max LoRA gradient difference | largest gradient |")
    print("|---|---|---|---|---|")
    for name, flags in VARIANTS.items():
        d = one_step_each(flags)
        print(
            f"| {name} | {d['tokens']} | {d['loss']:.1e} | {d['gradient']:.1e} | {d['gradient_scale']:.1e} |"
        )
