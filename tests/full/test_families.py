"""Every model family the README names, through the whole step: Qwen2.5-VL, Qwen2-VL, Qwen3-VL (deepstack),
Qwen2, Qwen3 and Llama, each a tiny random model from conftest.make_random_model (4 blocks, LoRA in the last
K = 2, so Qwen3-VL's first adapted block is the first one past its 2 deepstack blocks).

For each family, the checks tests/test_speed.py and tests/test_grpo.py make on Qwen2.5-VL and Qwen2:
1. the shared-prefill sampler draws generate's tokens (sampled and greedy; VLMs: image prompts with left
   padding, and a text-only batch in between whose positions must not leak);
2. the recomputed log-probs equal the ones generate reports;
3. the frozen trunk, captured or recorded while sampling, gives the full forward's log-probs, entropies and
   LoRA gradients;
4. one step of `trainer.main` on a saved checkpoint with the embedded tokenizer: the default speed-ups and the
   plain path sample the same completions and report the same loss, gradient norm, KL and entropy.
Then the placements the trunk cannot take (LoRA on Qwen3-VL's deepstack blocks; adapted blocks of mixed
attention types, or of another type than block 0 for the recorded trunk): refused by `trainer.main` before
anything runs or is written, with a flag that then trains, to the same numbers as the plain path.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    DEEPSTACK_BLOCKS,
    EOS_ID,
    FAMILIES,
    IMAGE_PAD_ID,
    PAD_ID,
    TINY_CHECKPOINT,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    VLM_FAMILIES,
    make_random_model,
)
from test_grpo import hand_completions, sample, text_inputs, vlm_inputs
from transformers import AutoImageProcessor, AutoTokenizer

import grpo
import lora
from full.helpers import save_random_checkpoint, train_args
from full.test_speed import SAMPLING, K, assert_same, logprobs_and_grads
from grpo_vlm import cli, speedups, trainer

G = 3  # completions per prompt: B = 2 prompts, N = 6 rows
NUM_LAYERS = 4  # make_random_model's default
# Blocks 2 and 3 slide over 4 tokens, blocks 0 and 1 attend to everything (Qwen2 / Qwen3 layer_types).
SLIDING = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
per_family = pytest.mark.parametrize("family", FAMILIES)


def inputs_of(family: str, group_size: int) -> dict[str, torch.Tensor]:
    """test_grpo's two left-padded prompts, each repeated group_size times: with images for a VLM."""
    return vlm_inputs(group_size) if family in VLM_FAMILIES else text_inputs(group_size)


def adapted(family: str, last_k: int = K, **config) -> torch.nn.Module:
    """A random model of `family`, LoRA in its last `last_k` blocks, random B (as test_speed.lora_model)."""
    model = make_random_model(family, **config)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=last_k)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


# --- 1-3: sampler, recompute and trunk, on every family -----------------------------------------------------


@per_family
def test_shared_prefill_draws_the_same_tokens_as_generate_in_every_family(family):
    model = make_random_model(family)
    # A VLM samples an image batch, a text batch, then images again: no positions may leak into the next.
    kinds = ("vlm", "text", "vlm") if family in VLM_FAMILIES else ("text",)
    lengths = set()
    for temperature, top_p in ((0.7, 0.9), (0.0, 1.0)):
        options = dict(max_new_tokens=8, temperature=temperature, top_p=top_p, **SAMPLING)
        for kind in kinds:
            inputs = vlm_inputs if kind == "vlm" else text_inputs
            torch.manual_seed(0)
            ours, _ = speedups.sample_shared_prefill(model, inputs(1), group_size=G, **options)
            torch.manual_seed(0)
            reference = grpo.sample_completions(model, inputs(G), **options)
            assert torch.equal(ours, reference), (temperature, kind)
            lengths |= set(grpo.completion_mask(ours, eos_token_id=EOS_ID)[0].sum(1).tolist())
    assert len(lengths) > 1  # some rows stopped early: the padding after EOS was exercised


@per_family
@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (0.0, 1.0)])
def test_recomputed_logprobs_equal_generation_logprobs_in_every_family(family, temperature, top_p):
    model, inputs = make_random_model(family), inputs_of(family, G)
    torch.manual_seed(0)
    ids, gen_logp = sample(model, inputs, temperature=temperature, top_p=top_p)
    mask, _ = grpo.completion_mask(ids, EOS_ID)
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, inputs, ids, temperature=temperature)
    torch.testing.assert_close(logp[mask], gen_logp[mask], atol=1e-5, rtol=0)


@per_family
def test_frozen_trunk_captured_or_recorded_equals_the_full_forward_in_every_family(family):
    model, inputs = adapted(family), inputs_of(family, G)
    parts = speedups.decoder_parts(model, K)
    blocks, first_adapted = parts["blocks"], parts["first_adapted"]
    torch.manual_seed(0)
    ids, recording = speedups.sample_shared_prefill(
        model,
        inputs_of(family, 1),
        group_size=G,
        max_new_tokens=6,
        temperature=1.0,
        record_block=speedups.record_block(model, parts),
        **SAMPLING,
    )
    full = logprobs_and_grads(
        model, lambda: grpo.completion_logprobs(model, inputs, ids, temperature=0.7, return_entropy=True)
    )
    captured = speedups.capture_trunk(model, inputs, ids, blocks=blocks, first_adapted=first_adapted)
    recorded = speedups.trunk_from_recording(
        model, inputs, ids, recording, blocks=blocks, first_adapted=first_adapted
    )
    options = dict(temperature=0.7, return_entropy=True, **parts)
    for trunk in (captured, recorded):
        ours = logprobs_and_grads(model, lambda t=trunk: speedups.trunk_logprobs(t, ids, **options))
        assert_same(ours, full)
    assert all(grad.abs().sum() > 0 for grad in full[2].values())  # every LoRA weight is exercised


# --- 4: one step of trainer.main on a saved checkpoint of every family ------------------------------------


@pytest.fixture
def reward_plugin(tmp_path: Path) -> str:
    """A reward that varies within a group even for a random model, so advantages and the loss are not 0."""
    path = tmp_path / "length_reward.py"
    path.write_text("def reward(completion, sample):\n    return float(len(completion) % 4)\n")
    return f"{path}:reward"


def train_one_step(model_dir: Path, out: Path, reward: str, **flags) -> dict:
    """trainer.main for one step of B = 2 prompts x G = 3 (image task for a VLM, text task otherwise); the
    metrics of that step and its completions. Two optimizer steps on the rollout (num_iterations): the
    second one's loss and KL depend on the recomputed log-probs, not on the advantages alone."""
    is_vlm = (model_dir / "preprocessor_config.json").exists()
    options = dict(
        model=str(model_dir),
        output_dir=str(out),
        device="cpu",
        task="shapes" if is_vlm else "summaries",
        reward=(reward,),
        train_size=4,
        eval_size=0,
        batch_size=2,
        group_size=G,
        max_new_tokens=6,
        steps=1,
        lora_last_k=K,
        num_iterations=2,
    )
    trainer.main(train_args(**(options | flags)))
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return record | {"completions": [row["completion"] for row in rows]}


def assert_same_step(a: dict, b: dict) -> None:
    assert a["completions"] == b["completions"]  # the same tokens sampled
    assert a["reward/std"] > 0  # some advantage is not 0: the loss has something to compare
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_the_embedded_tokenizer_and_image_processor_fit_every_family():
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHECKPOINT)
    image_processor = AutoImageProcessor.from_pretrained(TINY_CHECKPOINT)
    markers = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    expected = [PAD_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID]
    assert tokenizer.convert_tokens_to_ids(markers) == expected and tokenizer.pad_token_id == PAD_ID
    for family in FAMILIES:  # as save_random_checkpoint builds them for trainer.main
        model = make_random_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
        text = model.config.get_text_config()
        assert (text.vocab_size, text.eos_token_id) == (len(tokenizer), tokenizer.eos_token_id)
        if family in VLM_FAMILIES:
            vision = model.config.vision_config
            assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (
                image_processor.patch_size,
                image_processor.temporal_patch_size,
                image_processor.merge_size,
            )
            assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")


@per_family
def test_one_training_step_is_the_same_with_the_default_speedups_and_on_the_plain_path(
    family, tmp_path, reward_plugin
):
    model_dir = save_random_checkpoint(family, tmp_path / "model")
    default = train_one_step(model_dir, tmp_path / "default", reward_plugin)
    plain = train_one_step(
        model_dir, tmp_path / "plain", reward_plugin, shared_prefill=False, trunk_reuse=False
    )
    assert_same_step(default, plain)


# --- placements the trunk cannot take: refused up front, and a flag that works ------------------------------

# family, its config, K, what the refusal says, the flag it names (which then trains).
REFUSED = {
    "qwen3-vl, LoRA on every block (deepstack)": (
        "qwen3-vl",
        {},
        NUM_LAYERS,
        "deepstack features; use --no-trunk-reuse",
        dict(trunk_reuse=False),
    ),
    "qwen2 sliding window, adapted blocks mix attention types": (
        "qwen2",
        SLIDING,
        3,
        "mix attention types; use --no-trunk-reuse",
        dict(trunk_reuse=False),
    ),
    "qwen3 sliding window, adapted blocks mix attention types": (
        "qwen3",
        SLIDING,
        3,
        "mix attention types; use --no-trunk-reuse",
        dict(trunk_reuse=False),
    ),
    "qwen3 sliding window, adapted blocks differ from block 0": (
        "qwen3",
        SLIDING,
        2,
        "differ in attention type; use --no-shared-prefill",
        dict(shared_prefill=False),
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_placement_the_trunk_cannot_take_is_refused_before_anything_runs_and_the_named_flag_trains(
    case, tmp_path, reward_plugin, monkeypatch
):
    family, config, last_k, message, fallback = REFUSED[case]
    model_dir = save_random_checkpoint(family, tmp_path / "model", **config)
    with monkeypatch.context() as patched:
        for name in ("evaluate", "train_step"):  # the refusal must come before either
            patched.setattr(trainer, name, lambda *a, **k: pytest.fail("ran before refusing"))
        refused = [{}]
        if "trunk_reuse" in fallback:  # the trunk is refused whichever sampler would feed it
            refused.append(dict(shared_prefill=False))
        for flags in refused:
            with pytest.raises(cli.UsageError, match=message):
                train_one_step(
                    model_dir, tmp_path / "refused", reward_plugin, lora_last_k=last_k, eval_size=2, **flags
                )
            assert not (tmp_path / "refused").exists()  # nothing written
    # The named flag trains, with the other speed-up still on, to the numbers of the plain path.
    ours = train_one_step(model_dir, tmp_path / "fallback", reward_plugin, lora_last_k=last_k, **fallback)
    # The plain path, in micro-batches of 4 + 2 rows (exact; their chunks never look for a trunk).
    plain = train_one_step(
        model_dir,
        tmp_path / "plain",
        reward_plugin,
        lora_last_k=last_k,
        shared_prefill=False,
        trunk_reuse=False,
        micro_batch_size=4,
    )
    assert_same_step(ours, plain)


def trunk_logprobs_from(model, inputs, ids, parts, first_adapted: int, recording=None) -> torch.Tensor:
    """logp through a trunk that starts at `first_adapted`, past decoder_parts' checks (to show why)."""
    parts = parts | {"first_adapted": first_adapted}
    blocks = parts["blocks"]
    with torch.no_grad():
        if recording is None:
            trunk = speedups.capture_trunk(model, inputs, ids, blocks=blocks, first_adapted=first_adapted)
        else:
            trunk = speedups.trunk_from_recording(
                model, inputs, ids, recording, blocks=blocks, first_adapted=first_adapted
            )
        return speedups.trunk_logprobs(trunk, ids, temperature=1.0, **parts)[0]


def test_decoder_parts_refuses_a_trunk_that_ends_inside_qwen3_vls_deepstack_blocks_which_would_be_wrong():
    model, inputs, ids = adapted("qwen3-vl"), vlm_inputs(G), hand_completions()
    parts = speedups.decoder_parts(model, NUM_LAYERS - DEEPSTACK_BLOCKS)  # the first block past them: fine
    for last_k in range(NUM_LAYERS - DEEPSTACK_BLOCKS + 1, NUM_LAYERS + 1):
        with pytest.raises(ValueError, match="deepstack"):
            speedups.decoder_parts(model, last_k)
    with torch.no_grad():
        full, _ = grpo.completion_logprobs(model, inputs, ids, temperature=1.0)
    ok = trunk_logprobs_from(model, inputs, ids, parts, NUM_LAYERS - DEEPSTACK_BLOCKS)
    torch.testing.assert_close(ok, full, atol=1e-5, rtol=0)
    # One block earlier, the trunk misses the deepstack features added after that block.
    inside = trunk_logprobs_from(model, inputs, ids, parts, NUM_LAYERS - DEEPSTACK_BLOCKS - 1)
    assert (inside - full).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sliding_window_blocks_get_their_own_mask_in_the_captured_trunk_and_mixed_ones_are_refused(family):
    model, inputs = adapted(family, **SLIDING), text_inputs(G)  # LoRA in blocks 2, 3: both sliding
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    parts = speedups.decoder_parts(model, K)
    torch.manual_seed(0)
    ids, recording = speedups.sample_shared_prefill(
        model,
        text_inputs(1),
        group_size=G,
        max_new_tokens=6,
        temperature=1.0,
        record_block=parts["blocks"][parts["first_adapted"]],
        **SAMPLING,
    )
    with torch.no_grad():
        full, _ = grpo.completion_logprobs(model, inputs, ids, temperature=1.0)
    # Captured at block 2, the trunk hands blocks 2 and 3 the sliding mask they get in the full forward.
    captured = trunk_logprobs_from(model, inputs, ids, parts, K)
    torch.testing.assert_close(captured, full, atol=1e-5, rtol=0)
    # The recorded trunk takes its mask from block 0 (full attention): refused, and rightly so.
    with pytest.raises(ValueError, match="differ in attention type"):
        speedups.record_block(model, parts)
    recorded = trunk_logprobs_from(model, inputs, ids, parts, K, recording=recording)
    assert (recorded - full).abs().max() > 1e-2
    # Blocks 1-3 mix full and sliding attention: one mask for all of them cannot be right.
    for last_k in (3, 4):
        with pytest.raises(ValueError, match="mix attention types"):
            speedups.decoder_parts(model, last_k)
    mixed = trunk_logprobs_from(model, inputs, ids, parts, 1)  # block 1's full mask for blocks 1-3
    assert (mixed - full).abs().max() > 1e-2
