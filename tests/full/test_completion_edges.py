"""What a completion may contain and where it ends (every end-of-turn id, grounding markers kept), the image
budget (--min-pixels / --max-pixels), and image ablation (does the policy look at the images?)."""

import copy
import json

import pytest
import torch
from conftest import EOS_ID, IMAGE_PAD_ID, PAD_ID, VISION_END_ID, VISION_START_ID, make_random_vlm
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, GenerationConfig

import data
import grpo
import model_io
import rewards
from full.helpers import train_args
from grpo_vlm import dataset, grounding, sampling_config, speedups, tasks, trainer
from scripts import evaluate

GROUNDING = list(data.GROUNDING_TOKENS)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_io.DEFAULT_MODEL)


@pytest.fixture
def grounding_tokenizer(tokenizer):
    """The embedded tokenizer with Qwen-VL's grounding markers added as special tokens (as Qwen-VL has)."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": GROUNDING})
    assert all(tok.convert_tokens_to_ids(t) in tok.all_special_ids for t in GROUNDING)
    return tok


# --- end of turn --------------------------------------------------------------------------------------------


def test_end_of_turn_ids_are_the_tokenizers_eos_and_every_id_the_generation_config_lists(tokenizer):
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert data.end_of_turn_ids(tokenizer) == [im_end]
    listed = GenerationConfig(eos_token_id=[im_end, endoftext])  # as Qwen2.5-VL-Instruct ships it
    assert data.end_of_turn_ids(tokenizer, listed) == sorted([im_end, endoftext])
    assert data.end_of_turn_ids(tokenizer, GenerationConfig(eos_token_id=endoftext)) == sorted(
        [im_end, endoftext]
    )


def test_sampling_options_end_on_every_end_of_turn_id_and_suppress_image_tokens_but_never_an_end(tokenizer):
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    listed = GenerationConfig(eos_token_id=[im_end, endoftext])
    options = sampling_config.sampler_options(tokenizer, listed, max_new_tokens=5, temperature=0.7, top_p=0.9)
    assert options["eos_token_id"] == sorted([im_end, endoftext])
    assert IMAGE_PAD_ID in options["suppress_token_ids"]
    assert not set(options["suppress_token_ids"]) & {im_end, endoftext}
    assert options["pad_token_id"] == tokenizer.pad_token_id
    assert (options["max_new_tokens"], options["temperature"], options["top_p"]) == (5, 0.7, 0.9)


def test_completion_mask_ends_each_row_at_the_first_of_several_end_ids():
    ids = torch.tensor([[5, 7, 9, 2], [5, 2, 7, 9], [5, 6, 8, 8]])  # rows end on 7, on 2, never
    mask, truncated = grpo.completion_mask(ids, [2, 7])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]
    assert grpo.completion_mask(ids, 2)[0].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]  # one id


def test_sampler_stops_on_every_listed_end_id_exactly_as_generate():
    model = make_random_vlm()
    inputs = {
        "input_ids": torch.tensor([[PAD_ID, 9, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 10, 11]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1]]),
        "mm_token_type_ids": torch.tensor([[0, 0, 0, 1, 0, 0, 0]]),
        "pixel_values": torch.randn(4, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0)),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }
    options = dict(max_new_tokens=8, temperature=1.0, pad_token_id=PAD_ID, suppress_token_ids=[IMAGE_PAD_ID])
    torch.manual_seed(3)
    free = grpo.sample_completions(model, inputs, num_return_sequences=4, eos_token_id=EOS_ID, **options)
    second_end = int(free[0, 1])  # a token the model does draw: make it an end of turn too
    assume = second_end not in (EOS_ID, PAD_ID)
    assert assume, "pick another seed: the drawn token is already EOS or PAD"
    ends = [EOS_ID, second_end]
    torch.manual_seed(3)
    ours, _ = speedups.sample_shared_prefill(model, inputs, group_size=4, eos_token_id=ends, **options)
    torch.manual_seed(3)
    ref = grpo.sample_completions(model, inputs, num_return_sequences=4, eos_token_id=ends, **options)
    assert torch.equal(ours, ref)
    mask, _ = grpo.completion_mask(ours, ends)
    assert mask[0].sum() == 2 and bool((ours[0, 2:] == PAD_ID).all())  # row 0 ended on the second id


def test_an_end_of_turn_id_can_never_be_suppressed():
    with pytest.raises(ValueError, match="could never stop"):
        grpo.check_sampling(1.0, 1.0, [1, 2], [2, 5])


# --- what a completion may contain --------------------------------------------------------------------------


def test_suppressed_tokens_spare_the_grounding_markers_and_the_end_of_turn_ids(grounding_tokenizer):
    tok = grounding_tokenizer
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    vision = tok.convert_tokens_to_ids([data.IMAGE_PAD, data.VISION_START, data.VISION_END])
    suppressed = set(data.suppressed_tokens(tok, [im_end]))
    assert set(vision) <= suppressed and endoftext in suppressed and im_end not in suppressed
    assert not suppressed & set(tok.convert_tokens_to_ids(GROUNDING))
    assert endoftext not in data.suppressed_tokens(tok, [im_end, endoftext])  # a listed end of turn


def test_decoding_keeps_the_grounding_markers_and_drops_the_end_of_turn(grounding_tokenizer):
    tok = grounding_tokenizer
    text = "<|object_ref_start|>meter<|object_ref_end|><|box_start|>(10,20),(300,400)<|box_end|>"
    body = tok(text, add_special_tokens=False)["input_ids"]
    ends = data.end_of_turn_ids(tok)
    ended = torch.tensor([body + ends[:1] + [tok.pad_token_id] * 2])  # EOS, then padding
    mask, truncated = grpo.completion_mask(ended, ends)
    assert not truncated[0] and data.decode_completions(tok, ended, mask, ends) == [text]
    cut = torch.tensor([body])  # no end of turn within max_new_tokens: every token is text
    assert data.decode_completions(tok, cut, grpo.completion_mask(cut, ends)[0], ends) == [text]


# --- the image budget ---------------------------------------------------------------------------------------
def seen_sizes(batch, processor) -> list[list[int]]:
    """(w, h) of each image as the model sees it: image_grid_thw (t, h, w) in patches, times patch_size."""
    return (batch.inputs["image_grid_thw"][:, 1:].flip(-1) * processor.patch_size).tolist()


def test_max_pixels_shrinks_the_resize_and_the_prompt_length_check_uses_it(tokenizer):
    processor = AutoImageProcessor.from_pretrained(model_io.DEFAULT_MODEL)
    sample = {"id": "big", "prompt": "look", "images": [Image.new("RGB", (333, 517), "white")]}
    before = data.prepare_prompts([sample], tokenizer, processor, device="cpu")
    assert seen_sizes(before, processor) == [[84, 112]]  # 12 x 16 patches of 7
    limit = before.inputs["input_ids"].shape[1] - 1
    with pytest.raises(ValueError):
        dataset.check_samples([sample], tokenizer, processor, max_prompt_length=limit)
    dataset.set_pixel_budget(processor, None, 4 * 28 * 28)
    after = data.prepare_prompts([sample], tokenizer, processor, device="cpu")
    assert seen_sizes(after, processor) == [[28, 56]] and after.inputs["input_ids"].shape[1] < limit
    dataset.check_samples([sample], tokenizer, processor, max_prompt_length=limit)  # fits now
    with pytest.raises(ValueError, match="--min-pixels/--max-pixels"):
        dataset.set_pixel_budget(processor, 10_000, 5_000)


# --- does the policy look at the images? --------------------------------------------------------------------


def test_image_ablation_blanks_each_image_at_its_size_or_moves_every_image_to_another_slot():
    samples = tasks.make_task("inspection", 6, split="test", seed=0)
    blank = dataset.ablate_images(samples, "blank")
    for real, ablated in zip(samples, blank):
        assert [im.size for im in ablated["images"]] == [im.size for im in real["images"]]
        assert all(im.getextrema() == ((128, 128),) * 3 for im in ablated["images"])
    shuffled = dataset.ablate_images(samples, "shuffle", seed=1)
    real_slots = [id(im) for s in samples for im in s["images"]]
    new_slots = [id(im) for s in shuffled for im in s["images"]]
    assert sorted(real_slots) == sorted(new_slots)  # the same images, each sample keeps its count
    assert all(a != b for a, b in zip(real_slots, new_slots))  # none stays where it was
    assert [len(s["images"]) for s in shuffled] == [len(s["images"]) for s in samples]


def test_evaluate_reports_blank_image_columns_beside_the_real_ones(tmp_path):
    args = evaluate.Args(eval_size=4, batch_size=4, max_new_tokens=8, output=str(tmp_path / "e.jsonl"))
    args.image_ablation = ("blank",)
    summaries = evaluate.main(args)
    assert set(summaries) == {"base", "base+blank"}
    lines = [json.loads(line) for line in (tmp_path / "e.blank.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and json.loads((tmp_path / "e.blank.settings.json").read_text())["image_ablation"]


def test_training_logs_the_blank_image_accuracy_at_each_evaluation(tmp_path):
    args = train_args(
        steps=1,
        batch_size=2,
        group_size=2,
        max_new_tokens=8,
        train_size=4,
        eval_size=4,
        output_dir=str(tmp_path / "run"),
        eval_image_ablation="blank",
    )
    trainer.main(args)
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    evals = [r for r in evals if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0 <= r["eval/accuracy_blank"] <= 1 and "eval/reward_blank" in r for r in evals)


# --- grounding frames reach the rewards ---------------------------------------------------------------------


def test_the_resized_frame_reaches_the_reward_so_a_box_in_resized_pixels_scores_against_original_pixels(
    tokenizer,
):
    processor = AutoImageProcessor.from_pretrained(model_io.DEFAULT_MODEL)
    sample = {
        "id": "m",
        "prompt": "box?",
        "images": [Image.new("RGB", (333, 517))],
        "bbox": [40, 90, 210, 400],
    }
    batch = data.prepare_prompts([sample], tokenizer, processor, device="cpu")
    (grounded,) = dataset.with_grounding([sample], processor, "absolute")
    assert seen_sizes(batch, processor) == [grounded["grounding"]["resized_size"]]  # the frame it saw
    assert grounded["grounding"] == {
        "frame": "absolute",
        "original_size": [333, 517],
        "resized_size": [84, 112],
    }
    # The same box the model would write in the 84 x 112 image it saw: x * 84 / 333, y * 112 / 517.
    written = [40 * 84 / 333, 90 * 112 / 517, 210 * 84 / 333, 400 * 112 / 517]
    completion = json.dumps({"bbox_2d": written})
    iou = rewards.Reward("iou", grounding.iou_reward)
    assert rewards.score([completion], [grounded], [iou]).total[0] == pytest.approx(1.0)
    assert dataset.with_grounding([sample], processor, None) == [sample]  # text-only models: unchanged


def test_box_frame_auto_reads_the_model_family_and_goes_only_to_rewards_that_read_coordinates():
    vision = object()  # an image processor: the model sees images
    assert grounding.resolve_frame("auto", "qwen2_5_vl", vision, ["iou"]) == "absolute"
    assert grounding.resolve_frame("auto", "qwen2_vl", vision, ["label", "box_f1"]) == "relative1000"
    assert grounding.resolve_frame("auto", "qwen2_5_vl", vision, ["my_rewards:fn"]) == "absolute"  # plug-ins
    # Nobody reads coordinates; then an unknown family that no reward requires.
    assert grounding.resolve_frame("auto", "qwen2_5_vl", vision, ["label", "format"]) is None
    assert grounding.resolve_frame("auto", "llava", vision, ["my_rewards:fn"]) is None
    assert grounding.resolve_frame("auto", "qwen2_vl", None, ["iou"]) is None  # text-only
    assert grounding.resolve_frame("relative1000", "qwen2_5_vl", vision, ["iou"]) == "relative1000"
    with pytest.raises(ValueError, match="--box-frame"):
        grounding.resolve_frame("auto", "llava", vision, ["iou"])


def test_a_step_whose_every_completion_is_truncated_and_masked_logs_zero_entropy_not_a_crash(tmp_path):
    """--mask-truncated with completions too short to end: no token carries gradient, and the step's
    token means (entropy) are 0 over 0 tokens, not a division by zero."""
    flags = dict(steps=1, batch_size=2, group_size=2, max_new_tokens=2, eval_size=0, train_size=8)
    args = train_args(output_dir=str(tmp_path / "run"), mask_truncated=True, **flags)
    trainer.main(args)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["frac_truncated"] == 1.0 and record["entropy"] == 0.0
