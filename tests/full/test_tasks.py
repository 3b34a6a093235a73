"""tasks.py: the built-in synthetic tasks are reproducible per seed, their splits are disjoint, and their
reference answers earn full reward."""

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoImageProcessor

import data
import rewards
from grpo_vlm import dataset, tasks, tools

TINY_CHECKPOINT = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2.5-vl")


def fingerprint(samples: list[dict]) -> list[tuple]:
    return [(s["id"], s["prompt"], s["answer"], tuple(im.tobytes() for im in s["images"])) for s in samples]


@pytest.mark.parametrize("task", tasks.TASKS + tasks.TOOL_TASKS)
def test_builtin_tasks_are_deterministic_per_seed_and_splits_differ(task):
    train = fingerprint(tasks.make_task(task, 30, seed=5))
    assert train == fingerprint(tasks.make_task(task, 30, seed=5))
    assert train != fingerprint(tasks.make_task(task, 30, seed=6))
    test = fingerprint(tasks.make_task(task, 30, split="test", seed=5))
    assert [t[2:] for t in train] != [t[2:] for t in test]  # ids repeat, contents must not


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_package_draws_the_same_inspection_samples_as_the_reference(split):
    ours = fingerprint(tasks.make_task("inspection", 40, split=split, seed=3))
    assert ours == fingerprint(data.inspection_samples(40, split=split, seed=3))


def test_inspection_labels_are_balanced_and_reference_answers_are_well_formed():
    samples = tasks.make_task("inspection", 400, seed=0)
    passed = sum(s["label"] == "通过" for s in samples) / len(samples)
    assert 0.35 <= passed <= 0.65
    assert {len(s["images"]) for s in samples} == {1, 2, 3, 4}
    for s in samples:
        assert rewards.format_reward(s["answer"], s) == 1.0, s["answer"]
        assert rewards.label_reward(s["answer"], s) == 1.0, s["answer"]


def redness(image) -> np.ndarray:
    """R - (G + B) / 2 of every pixel: about 180 on the red mark, about 0 on grey."""
    a = np.asarray(image.convert("RGB"), dtype=float)
    return a[..., 0] - (a[..., 1] + a[..., 2]) / 2


def test_inspection_zoom_mark_vanishes_in_the_resized_photo_but_is_clear_in_a_crop():
    processor = AutoImageProcessor.from_pretrained(TINY_CHECKPOINT)
    samples = tasks.make_task("inspection-zoom", 200, seed=0)
    resized, cropped = {True: [], False: []}, {True: []}
    for s in samples:
        photo = s["images"][0]
        seen = photo.convert("RGB").resize(dataset.resized_size(processor, photo.size), processor.resample)
        resized[s["mark_box"] is not None].append(redness(seen).max())
        crop = tools.zoom({"image": 0, "bbox_2d": s["zoom_box"]}, s)  # original pixels: the panel
        seen_crop = crop.resize(dataset.resized_size(processor, crop.size), processor.resample)
        if s["mark_box"]:
            cropped[True].append(redness(seen_crop).max())
    figures = {k: round(float(np.mean(v))) for k, v in {**resized, "crop": cropped[True]}.items()}
    print("mean of the max redness: without a mark, with one, in a crop with one:", figures)
    assert 0.35 <= len(resized[True]) / len(samples) <= 0.65
    assert figures[True] < 1.6 * figures[False]  # the blurred mark is about as red as the noise
    assert figures["crop"] > 5 * figures[False]


def test_inspection_zoom_samples_name_the_panel_and_the_mark_in_original_pixels():
    for s in tasks.make_task("inspection-zoom", 100, seed=1):
        x1, y1, x2, y2 = s["zoom_box"]
        assert s["images"][0].size == (448, 448) and x2 - x1 == y2 - y1 == 8
        assert (s["mark_box"] is None) == (s["label"] == "通过")
        if s["mark_box"]:
            mx1, my1, mx2, my2 = s["mark_box"]
            assert x1 <= mx1 < mx2 <= x2 and y1 <= my1 < my2 <= y2
        assert rewards.format_reward(s["answer"], s) == rewards.label_reward(s["answer"], s) == 1.0
