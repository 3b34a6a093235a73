"""End-to-end and wiring tests of train.py on the embedded tiny Qwen2.5-VL (assets/), all on CPU.

What is checked: gradients reach the LoRA parameters, and only them, only through the recompute; the
recompute sees the images (pixel_values, image_grid_thw, mm_token_type_ids) and reproduces the
generation-time log-probs; `main` writes metrics, checkpoints, a PEFT adapter and curves, resumes
exactly, refuses to clobber a run, and a short seeded run learns. Runs use small Args (B=2..4, G=4,
2..4 steps) so that each `main` call takes a second or two.
"""

import gc
import json
import math
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

import data
import grpo
import lora
import model_io
from full.helpers import make_run, sample_with_logprobs, train_args
from grpo_vlm import checkpoints, cli, dataset, objectives, speedups, tasks, trainer

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def small_args(output_dir: Path, **overrides) -> trainer.Args:
    """A run that takes a second or two on the tiny model."""
    kwargs = dict(
        output_dir=str(output_dir),
        device="cpu",
        train_size=32,
        eval_size=8,
        batch_size=2,
        group_size=4,
        max_new_tokens=16,
        steps=2,
        seed=0,
    )
    kwargs.update(overrides)
    return train_args(**kwargs)


def load_tiny_with_lora(seed: int = 0):
    """The shipped tiny VLM with LoRA (B = 0) in its last 4 blocks, as `main` builds it."""
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device=CPU, dtype=torch.float32
    )
    torch.manual_seed(seed)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    return model, tokenizer, image_processor


def lora_modules(model) -> dict[str, lora.LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, lora.LoRALinear)}


def make_rollout(
    model, tokenizer, image_processor, args: trainer.Args, *, step: int = 0
) -> tuple[trainer.Run, trainer.Rollout]:
    """A Run around the model and the rollout of `step`, with its old and reference log-probs."""
    samples = tasks.make_task(args.samples.task, args.samples.train_size, seed=args.seed)
    prompts = dataset.batch_for_step(samples, step, args.batch_size, args.seed)
    reward_fns = trainer.resolve_rewards(args, args.samples.task)
    run = make_run(model, args, tokenizer=tokenizer, image_processor=image_processor, reward_fns=reward_fns)
    torch.manual_seed(1000 + step)  # the sampling draws
    ro = trainer.rollout(run, prompts, args)
    trainer.frozen_logprobs(run, ro, args)
    # Otherwise the policy-gradient term is zero and nothing below would be tested.
    assert ro.adv.abs().sum() > 0, "pick another seed: every group of this rollout has zero reward variance"
    return run, ro


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------------
# Gradient flow


# The recompute paths of policy_update: the frozen trunk recorded while sampling (default) or captured once
# per rollout, then only the adapted blocks re-run (in micro-batches of 3 rows, gradient accumulation), or the
# full model forward.
RECOMPUTE_PATHS = {
    "trunk_recorded_microbatched": dict(trunk_reuse=True, micro_batch_size=3),
    "trunk_captured": dict(trunk_reuse=True, shared_prefill=False),
    "full_forward": dict(trunk_reuse=False),
}


def test_every_sampling_and_recompute_path_gives_the_same_rollout_and_gradient(tmp_path):
    results = {}
    for shared_prefill in (True, False):
        for trunk_reuse in (True, False):
            args = small_args(tmp_path, batch_size=3, shared_prefill=shared_prefill, trunk_reuse=trunk_reuse)
            model, tokenizer, image_processor = load_tiny_with_lora()
            with torch.no_grad():  # non-zero adapters, so that the A's get gradient too
                for m in lora_modules(model).values():
                    m.lora_B.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(5))
            run, ro = make_rollout(model, tokenizer, image_processor, args)
            model.zero_grad(set_to_none=True)
            loss, _, _ = trainer.accumulate_policy_gradient(run, ro, args, args.loss.beta)
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            results[shared_prefill, trunk_reuse] = (ro, loss, grads)
    ro, loss, grads = results[False, False]  # generate + full forwards: the plain path
    for key, (ro2, loss2, grads2) in results.items():
        assert torch.equal(ro2.completion_ids, ro.completion_ids) and torch.equal(ro2.reward, ro.reward), key
        torch.testing.assert_close(ro2.ref_logp[ro.mask], ro.ref_logp[ro.mask], atol=1e-5, rtol=0)
        assert loss2 == pytest.approx(loss, abs=1e-6), key
        for name in grads:
            torch.testing.assert_close(grads2[name], grads[name], atol=1e-6, rtol=1e-4, msg=f"{key} {name}")


@pytest.mark.parametrize("path", RECOMPUTE_PATHS)
def test_training_steps_change_every_lora_tensor_and_no_base_or_vision_tensor(tmp_path, path):
    args = small_args(tmp_path, batch_size=4, warmup_steps=1, **RECOMPUTE_PATHS[path])
    model, tokenizer, image_processor = load_tiny_with_lora()
    params = lora.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=args.steps)
    before = snapshot(model)
    frozen_keys = [k for k in before if "lora_" not in k]
    assert any(".visual." in k or k.startswith("model.visual") for k in frozen_keys)  # the tower is compared
    assert any("base_layer" in k for k in frozen_keys)  # so are the wrapped linears' own weights

    run, ro = make_rollout(model, tokenizer, image_processor, args, step=0)
    run.optimizer, run.scheduler = optimizer, scheduler
    trainer.policy_update(run, ro, args, args.loss.beta)
    after_one = snapshot(model)
    # Step 1: B = 0, so dL/dA = B^T (dL/dy) x^T is exactly 0. AdamW with a zero gradient and weight_decay 0
    # leaves a parameter bit-for-bit unchanged (exp_avg = 0, the update is 0 / (0 + eps)), so every A is
    # still its initialisation and only the B's moved.
    for name in lora_modules(model):
        assert torch.equal(after_one[f"{name}.lora_A.weight"], before[f"{name}.lora_A.weight"]), name
        assert not torch.equal(after_one[f"{name}.lora_B.weight"], before[f"{name}.lora_B.weight"]), name

    run, ro = make_rollout(model, tokenizer, image_processor, args, step=1)
    run.optimizer, run.scheduler = optimizer, scheduler
    trainer.policy_update(run, ro, args, args.loss.beta)
    after_two = snapshot(model)
    # Step 2: B != 0 now, so A gets a gradient too: every LoRA tensor has changed.
    for name in lora_modules(model):
        for ab in ("lora_A", "lora_B"):
            key = f"{name}.{ab}.weight"
            assert not torch.equal(after_two[key], before[key]), key
    for key in frozen_keys:  # base language model, embeddings, vision tower, merger: bit-for-bit unchanged
        assert torch.equal(after_two[key], before[key]), key


def test_at_step_zero_every_A_gets_exactly_zero_gradient_and_every_B_a_nonzero_one(tmp_path):
    args = small_args(tmp_path, batch_size=4)
    model, tokenizer, image_processor = load_tiny_with_lora()
    _, ro = make_rollout(model, tokenizer, image_processor, args)
    logp, _ = grpo.completion_logprobs(
        model, ro.inputs, ro.completion_ids, temperature=args.sampling.temperature
    )
    config = objectives.LossConfig(
        loss_type=args.loss.loss_type,
        beta=args.loss.beta,
        clip_eps_low=args.loss.clip_eps_low,
        clip_eps_high=args.loss.clip_eps_high,
    )
    length = args.sampling.max_new_tokens
    loss, _ = objectives.grpo_loss(
        logp, logp.detach(), ro.ref_logp, ro.adv, ro.mask, config, max_completion_length=length
    )
    loss.backward()
    modules = lora_modules(model)
    assert len(modules) == 4 * 7  # 7 target linears in each of the last 4 blocks
    for name, m in modules.items():
        # y = W x + s * B A x: dL/dA = s * B^T (dL/dy) x^T is exactly zero while B = 0.
        assert m.lora_A.weight.grad is not None, name
        assert torch.count_nonzero(m.lora_A.weight.grad) == 0, name
        assert torch.count_nonzero(m.lora_B.weight.grad) > 0, name
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert p.grad is None, name  # frozen: no gradient is even allocated


def test_loss_reaches_lora_parameters_only_through_the_recompute(tmp_path):
    args = small_args(tmp_path, batch_size=4, num_iterations=2)  # mu = 2: old_logp is stored too
    model, tokenizer, image_processor = load_tiny_with_lora()
    _, ro = make_rollout(model, tokenizer, image_processor, args)
    _, gen_logp = sample_with_logprobs(
        model,
        ro.inputs,
        max_new_tokens=4,
        temperature=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generated = {
        "completion_ids": ro.completion_ids,
        "old_logp": ro.old_logp,
        "ref_logp": ro.ref_logp,
        "adv": ro.adv,
        "reward": ro.reward,
        "generation logp": gen_logp,
    }
    for name, tensor in generated.items():
        assert tensor is not None, name
        assert not tensor.requires_grad, name
    logp, _ = grpo.completion_logprobs(
        model, ro.inputs, ro.completion_ids, temperature=args.sampling.temperature
    )
    assert logp.requires_grad

    def loss_of(logp_in):
        config = objectives.LossConfig(
            loss_type=args.loss.loss_type,
            beta=args.loss.beta,
            clip_eps_low=args.loss.clip_eps_low,
            clip_eps_high=args.loss.clip_eps_high,
        )
        return objectives.grpo_loss(logp_in, ro.old_logp, ro.ref_logp, ro.adv, ro.mask, config)[0]

    # With the recompute detached, nothing in the loss is connected to the LoRA parameters.
    detached = loss_of(logp.detach())
    assert not detached.requires_grad and detached.grad_fn is None
    assert all(p.grad is None for p in lora.lora_parameters(model))
    # With it attached, the gradient arrives (on the B's; the A's are zero while B = 0, see above).
    loss_of(logp).backward()
    assert all(torch.count_nonzero(m.lora_B.weight.grad) > 0 for m in lora_modules(model).values())


# --------------------------------------------------------------------------------------------------
# Vision-language inputs reach the recompute


def assert_vision_inputs_reached_the_model(forward_kwargs: dict, inputs: dict, completion_ids) -> None:
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert key in forward_kwargs, key
    assert torch.equal(forward_kwargs["pixel_values"], inputs["pixel_values"])
    assert torch.equal(forward_kwargs["image_grid_thw"], inputs["image_grid_thw"])
    # The prompt's token types (1 = image token, for the 3D mRoPE positions), then text (0) for the
    # completion.
    N, T = completion_ids.shape
    types = forward_kwargs["mm_token_type_ids"]
    assert types.shape == (N, inputs["input_ids"].shape[1] + T)
    assert torch.equal(types[:, :-T], inputs["mm_token_type_ids"]) and not types[:, -T:].any()
    assert inputs["mm_token_type_ids"].any()


def test_policy_update_passes_pixels_grids_and_mm_token_types_to_the_full_forward(tmp_path, monkeypatch):
    args = small_args(tmp_path, batch_size=3, trunk_reuse=False)
    model, tokenizer, image_processor = load_tiny_with_lora()
    run, ro = make_rollout(model, tokenizer, image_processor, args)
    seen_inputs, seen_forward = [], []
    real_logprobs = grpo.completion_logprobs

    def spy(model_, inputs, completion_ids, **kwargs):
        seen_inputs.append(inputs)
        return real_logprobs(model_, inputs, completion_ids, **kwargs)

    monkeypatch.setattr(grpo, "completion_logprobs", spy)
    body = model.base_model  # the recompute runs the model's body, then the LM head in fp32
    hook = body.register_forward_pre_hook(lambda _m, _a, kw: seen_forward.append(dict(kw)), with_kwargs=True)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=1, total_steps=1)
    run.optimizer, run.scheduler = optimizer, scheduler
    trainer.policy_update(run, ro, args, args.loss.beta)
    hook.remove()

    assert len(seen_inputs) == 1 and len(seen_forward) == 1  # one recompute, with grad, of all N rows
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert torch.equal(seen_inputs[0][key], ro.inputs[key]), key  # the rollout's tensors (one chunk)
    assert_vision_inputs_reached_the_model(seen_forward[0], ro.inputs, ro.completion_ids)


def test_rollout_captures_the_trunk_from_every_image_grid_and_mm_token_type(tmp_path, monkeypatch):
    # With --trunk-reuse the images enter once, in the rollout's trunk forward (vision tower + frozen blocks);
    # old_logp, ref_logp and the policy recompute all start from that trunk. Whether the tower sees each
    # prompt's images once or G times (and the forward pixel_values or their embeddings) is grpo's business:
    # checked here is that every image of the rollout went through the tower, with grids and token types.
    # (--no-shared-prefill: the trunk is captured after sampling; the next test records it while sampling.)
    args = small_args(tmp_path, batch_size=3, trunk_reuse=True, shared_prefill=False)
    model, tokenizer, image_processor = load_tiny_with_lora()
    seen_forward, seen_pixels = [], []
    real_capture = speedups.capture_trunk

    def spy(model_, inputs, completion_ids, **kwargs):
        hooks = [
            model_.register_forward_pre_hook(
                lambda _m, _a, kw: seen_forward.append(dict(kw)), with_kwargs=True
            ),
            model_.model.visual.register_forward_pre_hook(
                lambda _m, a, kw: seen_pixels.append(a[0]), with_kwargs=True
            ),
        ]
        try:
            return real_capture(model_, inputs, completion_ids, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    monkeypatch.setattr(speedups, "capture_trunk", spy)
    _, ro = make_rollout(model, tokenizer, image_processor, args)
    assert len(seen_forward) == 1 and len(ro.chunks) == 1 and ro.chunks[0].trunk is not None
    forward_kwargs = seen_forward[0]
    assert "pixel_values" in forward_kwargs or "mm_encoder_outputs" in forward_kwargs
    assert torch.equal(forward_kwargs["image_grid_thw"], ro.inputs["image_grid_thw"])
    P = ro.inputs["input_ids"].shape[1]  # then the completion tokens but the last (it predicts nothing)
    assert forward_kwargs["input_ids"].shape[1] == P + ro.completion_ids.shape[1] - 1
    assert torch.equal(forward_kwargs["mm_token_type_ids"][:, :P], ro.inputs["mm_token_type_ids"])
    assert not forward_kwargs["mm_token_type_ids"][:, P:].any()
    # Every patch of every row's images (and nothing else) went through the vision tower.
    seen = torch.unique(torch.cat(seen_pixels), dim=0)
    assert torch.equal(seen, torch.unique(ro.inputs["pixel_values"], dim=0))


def test_rollout_records_the_trunk_while_sampling_with_every_image_encoded_once(tmp_path, monkeypatch):
    # With --shared-prefill --trunk-reuse the images enter once, in the sampling prefill of the B prompts; the
    # trunk is what blocks[first_adapted] received while sampling, and no trunk forward runs afterwards.
    args = small_args(tmp_path, batch_size=3, trunk_reuse=True, shared_prefill=True)
    model, tokenizer, image_processor = load_tiny_with_lora()
    encoded, seen_pixels, mask_forwards = [], [], []

    def count(module, args_, kwargs, out) -> None:
        encoded.append(kwargs["grid_thw"].shape[0])
        seen_pixels.append(args_[0])

    model.model.visual.register_forward_hook(count, with_kwargs=True)
    monkeypatch.setattr(speedups, "capture_trunk", lambda *a, **kw: pytest.fail("the trunk was run again"))
    real_from_recording = speedups.trunk_from_recording

    def spy(model_, inputs, completion_ids, hidden_states, **kwargs):
        hook = model_.register_forward_pre_hook(lambda _m, _a, kw: mask_forwards.append(kw), with_kwargs=True)
        try:
            return real_from_recording(model_, inputs, completion_ids, hidden_states, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(speedups, "trunk_from_recording", spy)
    run, ro = make_rollout(model, tokenizer, image_processor, args)
    assert len(ro.chunks) == 1 and ro.chunks[0].trunk is not None
    B, G = args.batch_size, args.group_size
    assert encoded == [int(ro.inputs["image_grid_thw"].shape[0]) // G]  # the B prompts' images, once
    assert torch.equal(
        torch.unique(torch.cat(seen_pixels), dim=0), torch.unique(ro.inputs["pixel_values"], dim=0)
    )
    # The mask/position forward saw every row's grids and token types (and no pixels: nothing to encode).
    (forward_kwargs,) = mask_forwards
    assert "pixel_values" not in forward_kwargs and forward_kwargs["input_ids"].shape[0] == B * G
    assert torch.equal(forward_kwargs["image_grid_thw"], ro.inputs["image_grid_thw"])
    P = ro.inputs["input_ids"].shape[1]
    assert torch.equal(forward_kwargs["mm_token_type_ids"][:, :P], ro.inputs["mm_token_type_ids"])
    # The recorded trunk gives the log-probs of a full forward with the images.
    with torch.no_grad():
        full, _ = grpo.completion_logprobs(
            model, ro.inputs, ro.completion_ids, temperature=args.sampling.temperature
        )
        recorded, _ = speedups.chunk_logprobs(
            model, ro.chunks[0], run.speed, temperature=args.sampling.temperature
        )
    torch.testing.assert_close(recorded[ro.mask], full[ro.mask], atol=1e-5, rtol=0)


def test_recomputed_logprobs_equal_generation_logprobs_on_left_padded_multi_image_groups(tmp_path):
    model, tokenizer, image_processor = load_tiny_with_lora()
    with torch.no_grad():  # a non-zero adapter, so that the LoRA branch is part of what must agree
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0.0, 0.05)
    # B = 3 prompts with 1, 2 and 4 images: prompt lengths differ, so the shorter rows are left-padded.
    pool = tasks.make_task("inspection", 64, seed=0)
    prompts = [next(s for s in pool if len(s["images"]) == k) for k in (1, 2, 4)]
    G, temperature = 2, 0.7
    batch = data.prepare_prompts(prompts, tokenizer, image_processor, device=CPU)
    inputs = data.repeat_rows(batch, G).inputs  # N = 6 rows
    assert not bool(inputs["attention_mask"].all())  # some rows really are left-padded
    assert inputs["image_grid_thw"].shape[0] == G * (1 + 2 + 4)
    sampling = dict(
        max_new_tokens=12,
        temperature=temperature,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        suppress_token_ids=data.suppressed_tokens(tokenizer),
    )
    torch.manual_seed(0)
    ids, gen_logp = sample_with_logprobs(model, inputs, **sampling)  # the N expanded rows
    torch.manual_seed(0)
    ids_b, gen_logp_b = sample_with_logprobs(model, batch.inputs, num_return_sequences=G, **sampling)
    # The rollout's way: the B prompts with num_return_sequences, then train's chunked trunk recompute.
    args = small_args(tmp_path, group_size=G, temperature=temperature, trunk_reuse=True, micro_batch_size=4)
    run = make_run(model, args)
    chunks = speedups.row_chunks(model, inputs, ids_b, None, run.speed)
    with torch.no_grad():
        logp = grpo.completion_logprobs(model, inputs, ids, temperature=temperature)[0]
        logp_b = torch.cat(
            [speedups.chunk_logprobs(model, c, run.speed, temperature=temperature)[0] for c in chunks]
        )
        blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
        logp_blank = grpo.completion_logprobs(model, blank, ids, temperature=temperature)[0]
    for ids_, gen, recomputed in ((ids, gen_logp, logp), (ids_b, gen_logp_b, logp_b)):
        mask, _ = grpo.completion_mask(ids_, tokenizer.eos_token_id)
        assert ids_.shape[1] > 1 and recomputed.shape == ids_.shape
        err = (recomputed - gen)[mask].abs().max()
        assert err < 1e-4, err
    # ...and the pixels matter: the same completions scored without the images get other log-probs.
    mask, _ = grpo.completion_mask(ids, tokenizer.eos_token_id)
    assert (logp_blank - logp)[mask].abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# End to end


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("e2e") / "run"
    summary = trainer.main(small_args(out, steps=3, save_every=2, eval_every=2))
    return out, summary


def test_main_logs_step_zero_and_one_parsable_line_per_step(finished_run):
    out, summary = finished_run
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert summary["steps"] == 3
    assert "eval/accuracy" in records[0]  # the start point of the held-out curve
    for r in records[1:]:
        for key in ("reward/mean", "kl", "loss", "clip_frac_low", "entropy", "frac_truncated", "lr"):
            assert key in r and math.isfinite(r[key]), (r["step"], key)
    assert "eval/accuracy" in records[2] and "eval/accuracy" in records[3]  # eval_every=2, and at the end


def test_main_writes_checkpoints_a_peft_adapter_and_png_curves(finished_run):
    out, _ = finished_run
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000002", "checkpoint-000003"]
    state = checkpoints.load_checkpoint(out / "checkpoint-000003")
    assert state["step"] == 3
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    from safetensors.torch import load_file

    weights = load_file(adapter / "adapter_model.safetensors")
    assert len(weights) == 2 * 4 * 7 and all(k.startswith("base_model.model.") for k in weights)
    with Image.open(out / "curves.png") as image:
        assert image.format == "PNG"
        image.verify()


def test_second_run_into_the_same_output_dir_refuses_and_leaves_metrics_untouched(finished_run):
    out, _ = finished_run
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(cli.UsageError, match="already holds a run"):
        trainer.main(small_args(out, steps=1))
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_continues_at_the_next_step_and_reproduces_an_uninterrupted_run(tmp_path):
    # warmup_steps (5) > steps, so the learning rate does not depend on `steps` and the runs are comparable.
    common = dict(save_every=1, eval_every=1, warmup_steps=5)
    interrupted, straight = tmp_path / "interrupted", tmp_path / "straight"
    trainer.main(small_args(interrupted, steps=2, **common))
    trainer.main(small_args(interrupted, steps=4, resume=str(interrupted), **common))
    trainer.main(small_args(straight, steps=4, **common))

    resumed = read_metrics(interrupted)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    # Adapter, AdamW moments, scheduler and RNG state all come back: steps 3 and 4 are the same numbers.
    for got, want in zip(resumed, read_metrics(straight)):
        for key in want:
            if not key.startswith("time_"):
                assert got[key] == want[key], (want["step"], key)


def test_overwrite_replaces_the_previous_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    trainer.main(small_args(out, steps=3, save_every=1, keep_last=2))
    trainer.main(small_args(out, steps=1, save_every=1, keep_last=2, overwrite=True))
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    # Stale checkpoints of the old run would outrank the new one: pruning would delete it, resume load them.
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-000001"]


def test_dry_run_changes_no_weight_and_writes_nothing(tmp_path, monkeypatch):
    captured = {}
    real_inject = lora.inject_lora

    def inject_and_snapshot(model, **kwargs):
        names = real_inject(model, **kwargs)
        captured["model"], captured["state"] = model, snapshot(model)
        return names

    monkeypatch.setattr(lora, "inject_lora", inject_and_snapshot)
    out = tmp_path / "run"
    result = trainer.main(small_args(out, dry_run=True))
    assert math.isfinite(result["loss"])
    after = captured["model"].state_dict()
    assert after.keys() == captured["state"].keys()
    assert all(torch.equal(after[k], v) for k, v in captured["state"].items())
    assert not out.exists() or not any(out.iterdir())


def test_shapes_task_trains_one_step(tmp_path):
    out = tmp_path / "run"
    summary = trainer.main(small_args(out, task="shapes", steps=1))
    records = read_metrics(out)
    assert summary["steps"] == 1 and [r["step"] for r in records] == [0, 1]
    assert math.isfinite(records[1]["loss"]) and "reward/answer_match/mean" in records[1]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_each_loss_type_runs_and_mu_2_starts_from_a_ratio_of_one(tmp_path, monkeypatch, loss_type):
    calls = []
    real_loss = objectives.grpo_loss

    def spy(logp, old_logp, *rest, **kwargs):
        loss, stats = real_loss(logp, old_logp, *rest, **kwargs)
        calls.append({"stats": stats, "logp": logp.detach().clone(), "old_logp": old_logp})
        return loss, stats

    monkeypatch.setattr(objectives, "grpo_loss", spy)
    out = tmp_path / "run"
    trainer.main(small_args(out, steps=1, loss_type=loss_type, num_iterations=2, eval_size=4))
    record = read_metrics(out)[1]
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
    assert len(calls) == 2  # mu = 2 optimizer steps on the one rollout
    first, second = calls
    # The stored old log-probs come from the same numerical path as the recompute: ratio 1 before any step.
    assert abs(first["stats"]["ratio_mean"] - 1) < 1e-5
    # The second iteration compares against the STORED rollout log-probs, not its own detached recompute.
    assert torch.equal(second["old_logp"], first["old_logp"]) and not second["old_logp"].requires_grad
    assert not torch.equal(second["logp"], second["old_logp"])


# --------------------------------------------------------------------------------------------------
# Learning and the command line


def test_seeded_short_run_raises_held_out_greedy_accuracy(tmp_path):
    # NOTE: the sampled (temperature 1) training reward is too noisy to show progress within 50 steps: the
    # label probabilities move from ~0.5 only a little, but enough to flip the greedy verdicts on held-out
    # samples. Measured: 0.42 -> 0.70 with this seed, ~25 s on an idle 2-core CPU.
    out = tmp_path / "run"
    t0 = time.time()
    summary = trainer.main(
        small_args(
            out,
            steps=50,
            batch_size=8,
            group_size=8,
            lr=3e-3,
            max_new_tokens=24,  # the default: a verdict plus a 理由 line fits
            train_size=400,
            eval_size=50,
            save_every=1000,
            eval_every=1000,
        )
    )
    print(
        f"learning run: {time.time() - t0:.0f}s, held-out accuracy {summary['accuracy_start']:.2f} -> "
        f"{summary['accuracy_end']:.2f}"
    )
    assert summary["accuracy_end"] >= summary["accuracy_start"] + 0.15


def test_help_lists_the_documented_flags():
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_vlm", "--help"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--lora-last-k",
        "--group-size",
        "--beta",
        "--loss-type",
        "--num-iterations",
        "--resume",
        "--dry-run",
    ):
        assert flag in result.stdout, flag
    assert "KL penalty weight" in result.stdout  # a field docstring became help text


def test_suppressed_tokens_are_the_vision_markers_and_specials_but_never_eos():
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_io.DEFAULT_MODEL)
    ids = data.suppressed_tokens(tokenizer)
    vision = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
    assert {tokenizer.convert_tokens_to_ids(t) for t in vision} <= set(ids)
    assert tokenizer.eos_token_id not in ids and tokenizer.pad_token_id in ids


def test_a_steps_rollout_is_freed_before_the_next_step_samples(tmp_path, monkeypatch):
    """Peak memory holds one rollout (its chunks, trunk recordings, images), never two: the loop lets go of a
    step's Rollout before the next train_step starts."""
    alive_at_start, previous = [], []
    real_step = trainer.train_step

    def step_watched(step, run, args, beta, **options):
        gc.collect()
        alive_at_start.append([ref() is not None for ref in previous])
        record, timings, ro = real_step(step, run, args, beta, **options)
        previous.append(weakref.ref(ro))
        return record, timings, ro

    monkeypatch.setattr(trainer, "train_step", step_watched)
    flags = dict(steps=3, batch_size=2, group_size=2, max_new_tokens=4, eval_size=0, train_size=8)
    trainer.main(train_args(output_dir=str(tmp_path / "run"), **flags))
    assert alive_at_start == [[], [False], [False, False]]
