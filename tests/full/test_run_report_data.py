"""The run folder's data for the offline report: rollouts.jsonl's prompt, target, thumbnails and parsed boxes,
eval_samples.jsonl (one record per held-out sample per evaluation), thumbs/ (bounded, deduplicated, at the
size the model saw), on the embedded tiny model (CPU) and the tools asset."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_CHECKPOINT
from PIL import Image
from transformers import AutoImageProcessor

from full.helpers import train_args
from grpo_vlm import dataset, tasks, thumbnails, trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(train_size=16, batch_size=2, group_size=2, max_new_tokens=8, save_every=100)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def image_processor():
    return AutoImageProcessor.from_pretrained(TINY_CHECKPOINT)


def photo(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """An image whose pixels differ from place to place (a flat one would hide a wrong resize)."""
    image = Image.radial_gradient("L").resize(size).convert("RGB")
    return image.rotate(seed * 30)


# --- records of a run --------------------------------------------------------------------------------------


def test_records_carry_the_samples_prompt_target_and_thumbnails_and_eval_samples_match_the_metrics(tmp_path):
    out = tmp_path / "run"
    trainer.main(train_args(output_dir=str(out), steps=2, eval_size=4, eval_every=1, **SMALL))
    train_samples = {s["id"]: s for s in tasks.make_task("inspection", 16, seed=0)}
    held_out = tasks.make_task("inspection", 4, split="test", seed=0)

    rows = lines(out / "rollouts.jsonl")
    assert len(rows) == 2 * 4  # B * G rows a step
    for row in rows:
        sample = train_samples[row["sample_id"]]
        assert row["prompt"] == sample["prompt"]
        assert row["target"] == {"label": sample["label"], "answer": sample["answer"]}
        assert len(row["thumbs"]) == len(row["images"]) == len(sample["images"])
        assert "boxes_parsed" not in row  # no box to compare with
        for entry, image in zip(row["thumbs"], sample["images"]):
            assert entry["size"] == entry["seen_size"] == list(image.size)  # 56 x 56: seen as it is
            assert entry["thumb"] == f"thumbs/{thumbnails.image_key(image)}.jpg"
            assert (out / entry["thumb"]).is_file() and (out / entry["seen"]).is_file()

    metrics = {r["step"]: r for r in lines(out / "metrics.jsonl")}
    evaluated = lines(out / "eval_samples.jsonl")
    assert [(r["step"], r["index"]) for r in evaluated] == [(s, i) for s in (0, 1, 2) for i in range(4)]
    for record in evaluated:
        sample = held_out[record["index"]]
        assert record["sample_id"] == sample["id"] and record["prompt"] == sample["prompt"]
        assert record["target"] == {"label": sample["label"], "answer": sample["answer"]}
        assert record["correct"] == (record["rewards"]["label"] >= 1.0)
    for step in (0, 1, 2):
        mine = [r for r in evaluated if r["step"] == step]
        assert sum(r["correct"] for r in mine) == round(metrics[step]["eval/accuracy"] * 4)
        assert sum(r["reward"] for r in mine) / 4 == pytest.approx(metrics[step]["eval/reward"], abs=1e-12)

    named = {e[k] for r in rows + evaluated for e in r["thumbs"] for k in ("thumb", "seen")}
    assert {f"thumbs/{p.name}" for p in (out / "thumbs").iterdir()} == named  # each picture once, none else


def test_resume_trims_eval_samples_to_the_checkpoint_and_redoes_the_later_evaluations(tmp_path):
    flags = dict(SMALL, steps=2, eval_size=2, eval_every=1, save_every=1, keep_last=5)
    whole, out = tmp_path / "whole", tmp_path / "cut"
    trainer.main(train_args(output_dir=str(whole), **flags))
    trainer.main(train_args(output_dir=str(out), **flags))
    shutil.rmtree(out / "checkpoint-000002")  # the newest checkpoint lost: the run resumes from step 1
    trainer.main(train_args(output_dir=str(out), resume=str(out), **flags))
    assert [r["step"] for r in lines(out / "eval_samples.jsonl")] == [0, 0, 1, 1, 2, 2]
    assert (out / "eval_samples.jsonl").read_bytes() == (whole / "eval_samples.jsonl").read_bytes()
    assert (out / "rollouts.jsonl").read_bytes() == (whole / "rollouts.jsonl").read_bytes()


def test_a_moved_image_file_gives_an_error_entry_and_the_step_is_still_logged(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    photo((56, 56)).save(folder / "kept.png")
    photo((56, 56), seed=1).save(folder / "moved.png")
    sample = {"images": ["kept.png", "moved.png"], "prompt": "inspect", "label": "通过", "answer": "通过"}
    (folder / "trainer.jsonl").write_text(
        "".join(json.dumps({**sample, "id": f"s{i}"}) + "\n" for i in range(4))
    )
    real = thumbnails.keep

    def moved_after_the_rollout(*args, **kwargs):  # gone after the step read it: the logger finds no file
        (folder / "moved.png").unlink(missing_ok=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(thumbnails, "keep", moved_after_the_rollout)
    out = tmp_path / "run"
    flags = dict(SMALL, train_size=4, eval_size=0)
    trainer.main(
        train_args(
            output_dir=str(out), steps=1, data=(str(folder / "trainer.jsonl"),), reward=("label",), **flags
        )
    )
    assert [r["step"] for r in lines(out / "metrics.jsonl")] == [0, 1]
    for row in lines(out / "rollouts.jsonl"):
        kept, moved = row["thumbs"]
        assert (out / kept["thumb"]).is_file()
        assert set(moved) == {"error"} and "moved.png not found" in moved["error"]


# --- thumbs/ ------------------------------------------------------------------------------------------------


def test_thumbnails_are_bounded_and_seen_at_the_processors_resized_size(tmp_path, image_processor):
    photo((333, 517)).save(tmp_path / "tall.png")
    samples = [{"images": [str(tmp_path / "tall.png"), photo((600, 300)), photo((40, 30))]}]
    (entries,), _, made = thumbnails.keep(samples, image_processor, thumbnails.Kept())
    thumbnails.write(tmp_path, made)
    grid = image_processor(images=[photo((333, 517))], return_tensors="pt")["image_grid_thw"][0]  # (t, h, w)
    patch = image_processor.patch_size
    assert entries[0]["seen_size"] == [int(grid[2]) * patch, int(grid[1]) * patch]  # w', h': what it saw
    assert entries[0]["seen_size"] == list(dataset.resized_size(image_processor, (333, 517)))
    assert entries[0]["seen_size"] != [333, 517]  # resized: multiples of 28
    for entry, size, thumb in zip(
        entries, [(333, 517), (600, 300), (40, 30)], [(165, 256), (256, 128), (40, 30)]
    ):
        assert entry["size"] == list(size)
        with Image.open(tmp_path / entry["thumb"]) as t, Image.open(tmp_path / entry["seen"]) as s:
            assert t.size == thumb and t.format == "JPEG"  # longest side <= 256, never upscaled
            assert list(s.size) == entry["seen_size"]


def test_the_same_picture_twice_or_at_two_paths_is_kept_once_and_handed_on_once(tmp_path, image_processor):
    picture = photo((90, 60))
    picture.save(tmp_path / "a.png")
    picture.save(tmp_path / "b.png")  # PNG: the same pixels at another path
    samples = [{"images": [picture, picture]}, {"images": [str(tmp_path / "a.png"), str(tmp_path / "b.png")]}]
    kept = thumbnails.Kept()
    thumbs, _, made = thumbnails.keep(samples, image_processor, kept)
    assert len({e["thumb"] for entries in thumbs for e in entries}) == 1
    assert sorted(made) == sorted(
        [f"{thumbnails.image_key(picture)}.jpg", f"{thumbnails.image_key(picture)}-seen.jpg"]
    )
    thumbnails.write(tmp_path, made)
    assert len(list((tmp_path / "thumbs").iterdir())) == 2
    again, _, made = thumbnails.keep(samples, image_processor, kept)  # a later step: nothing encoded again
    assert again == thumbs and made == {}


def test_past_the_seen_budget_a_picture_keeps_its_thumbnail_and_no_seen_copy(
    tmp_path, image_processor, monkeypatch
):
    pictures = [photo((300, 200), seed) for seed in range(3)]
    first = thumbnails.keep([{"images": pictures[:1]}], image_processor, thumbnails.Kept())[2]
    one_seen = len(first[f"{thumbnails.image_key(pictures[0])}-seen.jpg"])
    monkeypatch.setattr(thumbnails, "SEEN_BYTES", one_seen)  # room for the first picture's -seen file only
    kept = thumbnails.Kept()
    (entries,), _, made = thumbnails.keep([{"images": pictures}], image_processor, kept)
    keys = [thumbnails.image_key(p) for p in pictures]
    assert [e["seen"] for e in entries] == [f"thumbs/{keys[0]}-seen.jpg", None, None]
    assert [e["thumb"] for e in entries] == [f"thumbs/{k}.jpg" for k in keys]  # every thumbnail kept
    assert sorted(made) == sorted([f"{k}.jpg" for k in keys] + [f"{keys[0]}-seen.jpg"])
    assert kept.seen_bytes == one_seen
    again, _, made = thumbnails.keep([{"images": pictures}], image_processor, kept)  # a later step
    assert again == [entries] and made == {}
    thumbnails.write(tmp_path, first)
    assert thumbnails.seen_bytes_in(tmp_path) == one_seen  # what a resumed run's budget starts from


def test_a_resumed_run_counts_the_seen_files_already_in_its_folder(tmp_path, monkeypatch):
    flags = dict(SMALL, steps=2, eval_size=0, save_every=1, log_completions_every=1)
    out = tmp_path / "run"
    trainer.main(train_args(output_dir=str(out), **dict(flags, steps=1)))
    monkeypatch.setattr(thumbnails, "SEEN_BYTES", thumbnails.seen_bytes_in(out))  # spent by step 1
    trainer.main(train_args(output_dir=str(out), resume=str(out), **flags))
    step_2 = [r for r in lines(out / "rollouts.jsonl") if r["step"] == 2]
    new = [
        e for r in step_2 for e in r["thumbs"] if not (out / e["thumb"].replace(".jpg", "-seen.jpg")).exists()
    ]
    assert new and all(e["seen"] is None for e in new)  # step 2's new pictures: thumbnails only
    assert all((out / e["thumb"]).is_file() for r in step_2 for e in r["thumbs"])


# --- grounding and tools -----------------------------------------------------------------------------------


def test_grounding_records_carry_the_completions_boxes_in_original_pixels(tmp_path, image_processor):
    photo((333, 517)).save(tmp_path / "tall.png")
    sample = {"images": [str(tmp_path / "tall.png")], "prompt": "find it", "bbox": [10, 20, 110, 220]}
    run = trainer.Run(model=None, image_processor=image_processor, box_frame="absolute")
    w, h = dataset.resized_size(
        image_processor, (333, 517)
    )  # the absolute frame: pixels of the resized image
    completion = f"<answer>[{w / 2}, {h / 4}, {w}, {h / 2}]</answer>"
    for given in (sample, dataset.with_grounding([sample], image_processor, "absolute")[0]):
        extras, _, _ = trainer.logged_fields(run, [given], [completion])
        assert extras[0]["target"] == {"bbox": [10, 20, 110, 220]}
        assert extras[0]["boxes_parsed"] == [pytest.approx([333 / 2, 517 / 4, 333, 517 / 2], abs=1e-9)]
    extras, _, _ = trainer.logged_fields(run, [sample], ["no box"])
    assert extras[0]["boxes_parsed"] == []


def test_a_tool_runs_returned_crops_carry_thumbnails_in_rollouts_and_eval_samples(tmp_path):
    out = tmp_path / "run"
    model = str(ROOT / "assets" / "tiny-qwen2.5-vl-tools")
    flags = dict(SMALL, train_size=4, eval_size=2, max_new_tokens=48, eval_every=1)
    flags |= dict(model=model, task="inspection-zoom", tools=("zoom",), max_tool_calls=1)
    trainer.main(train_args(output_dir=str(out), steps=1, **flags))
    records = lines(out / "rollouts.jsonl") + lines(out / "eval_samples.jsonl")
    assert all("turns" in r for r in records)
    returned = [i for r in records for t in r["turns"] if (c := t.get("call")) for i in c["images"]]
    assert returned, "the tools asset's policy calls zoom in most completions"
    for image in returned:
        with Image.open(out / image["thumb"]) as thumb:  # a crop of a 448 x 448 photo: under 256 px
            assert list(thumb.size) == image["size"]
