"""The full trainer's data (dataset.py) around data.py: several datasets, summaries, pixel budgets and large
images, image ablation, grounding fields, the other built-in tasks.
"""

import copy

import pytest
import test_data
import torch
from test_data import G, assert_same_inputs, solid

import data
import grpo
from grpo_vlm import dataset, tasks

INPUT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")

tiny = test_data.tiny  # the embedded asset, loaded once (the reference tests' fixture)


def multi_image_samples(n: int) -> list[dict]:
    """`n` inspection samples with 2+ images, of which at least two differ (so swapping them matters)."""
    found = []
    for s in tasks.make_task("inspection", 200, seed=0):
        distinct = {im.tobytes() for im in s["images"]}
        if len(s["images"]) >= 2 and len(distinct) >= 2:
            found.append(s)
        if len(found) == n:
            return found
    raise AssertionError("not enough multi-image inspection samples with distinct photos")


def fixed_completion(tokenizer, rows: int) -> torch.Tensor:
    ids = tokenizer("通过\n理由: 无缺陷", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor([ids] * rows)  # (N, T)


def logprobs(model, batch: data.PromptBatch, completion: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, batch.inputs, completion, temperature=1.0)
    return logp  # (N, T)


def test_swapping_images_of_one_sample_changes_exactly_its_group_rows(tiny):
    model, tok, ip = tiny
    samples = multi_image_samples(3)
    completion = fixed_completion(tok, len(samples) * G)
    before = logprobs(
        model, data.repeat_rows(data.prepare_prompts(samples, tok, ip, device="cpu"), G), completion
    )

    target = 1
    images = list(samples[target]["images"])
    i, j = next(
        (i, j)
        for i in range(len(images))
        for j in range(i + 1, len(images))
        if images[i].tobytes() != images[j].tobytes()
    )
    images[i], images[j] = images[j], images[i]
    swapped = [dict(s) for s in samples]
    swapped[target]["images"] = images
    after = logprobs(
        model, data.repeat_rows(data.prepare_prompts(swapped, tok, ip, device="cpu"), G), completion
    )

    for row in range(len(samples) * G):
        if row // G == target:
            assert (before[row] - after[row]).abs().max() > 1e-6, f"row {row} did not see its own images"
        else:
            assert torch.equal(before[row], after[row]), f"row {row} changed with another sample's images"


def test_repeat_rows_equals_preparing_each_sample_repeated(tiny):
    _, tok, ip = tiny
    samples = multi_image_samples(3)
    expanded = data.repeat_rows(data.prepare_prompts(samples, tok, ip, device="cpu"), G)
    reference = data.prepare_prompts([s for s in samples for _ in range(G)], tok, ip, device="cpu")
    assert set(expanded.inputs) == set(INPUT_KEYS)
    assert_same_inputs(expanded, reference)


def test_mixed_text_only_and_image_rows_run_through_the_model(tiny):
    model, tok, ip = tiny
    samples = [{"id": "t", "prompt": "what colour and shape is this?"}, tasks.make_task("shapes", 1)[0]]
    batch = data.repeat_rows(data.prepare_prompts(samples, tok, ip, device="cpu"), G)
    assert batch.images_per_row == [0] * G + [1] * G
    assert not batch.inputs["mm_token_type_ids"][:G].any()
    logp = logprobs(model, batch, fixed_completion(tok, 2 * G))
    assert torch.isfinite(logp).all()
    # The text-only row must not be affected by the image row sharing its batch.
    alone = logprobs(
        model, data.prepare_prompts(samples[:1], tok, ip, device="cpu"), fixed_completion(tok, 1)
    )
    torch.testing.assert_close(logp[0], alone[0], atol=1e-5, rtol=0)


def test_check_samples_counts_the_images_the_processor_shrinks_and_names_the_largest(tiny):
    _, tok, ip = tiny
    budget = dataset.image_pixel_budget(ip)
    assert budget == 112 * 112  # the tiny asset's budget, small enough for small test images
    sizes = [(56, 56), (112, 112), (113, 112), (300, 200), (150, 150)]
    samples = [
        {"id": f"s{i}", "images": [solid(w, h, (9, 9, 9))], "prompt": "p"} for i, (w, h) in enumerate(sizes)
    ]
    report = dataset.check_samples(samples, tok, ip, max_prompt_length=None)
    assert (report.count, report.largest) == (3, (300, 200))  # at the budget exactly is no resize
    # Independent reference: the processor's own output covers fewer pixels exactly for the counted ones.
    batch = data.prepare_prompts(samples, tok, ip, device="cpu")
    grid = batch.inputs["image_grid_thw"]  # (images, 3)
    assert (
        report.longest_prompt == batch.inputs["input_ids"].shape[1]
    )  # the batch is padded to its longest prompt
    kept = (grid[:, 1] * grid[:, 2] * ip.patch_size**2).tolist()
    assert [k < w * h for k, (w, h) in zip(kept, sizes)] == [False, False, True, True, True]
    # The prompt-length bound still counts the resized images' tokens exactly.
    P = data.prepare_prompts(samples[3:4], tok, ip, device="cpu").inputs["input_ids"].shape[1]
    dataset.check_samples(samples[3:4], tok, ip, max_prompt_length=P)
    with pytest.raises(ValueError, match=rf"sample s3: prompt is {P} tokens"):
        dataset.check_samples(samples[3:4], tok, ip, max_prompt_length=P - 1)


def test_the_budget_reported_is_the_one_the_processor_resizes_by(tiny):
    _, tok, ip = tiny
    small = copy.deepcopy(ip)
    small.size["longest_edge"] = 56 * 56
    assert dataset.image_pixel_budget(small) == 56 * 56
    sample = {"id": "a", "images": [solid(112, 112, (9, 9, 9))], "prompt": "p"}
    assert dataset.check_samples([sample], tok, ip, max_prompt_length=None).count == 0
    assert dataset.check_samples([sample], tok, small, max_prompt_length=None).count == 1
    (grid,) = data.prepare_prompts([sample], tok, small, device="cpu").inputs["image_grid_thw"].tolist()
    assert grid[1] * grid[2] * small.patch_size**2 <= 56 * 56  # what the processor really did


def test_describe_resizes_says_how_many_images_shrink_and_the_largest():
    budget = 12_845_056  # Qwen2.5-VL's default max_pixels
    assert dataset.describe_resizes(dataset.ResizeReport(count=0, largest=None), budget) is None
    assert dataset.describe_resizes(dataset.ResizeReport(count=3, largest=(6000, 6000)), budget) == (
        "3 images are larger than the image processor's budget (12,845,056 pixels) and are resized down "
        "to fit it; the largest is 6000x6000"
    )
    assert dataset.describe_resizes(dataset.ResizeReport(count=1, largest=(4000, 3500)), budget) == (
        "1 image is larger than the image processor's budget (12,845,056 pixels) and is resized down to fit "
        "it: 4000x3500"
    )
