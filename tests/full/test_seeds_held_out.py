"""One held-out set for every seed: --seed moves LoRA's initialisation, the batch order and sampling, never
the built-in task's samples, in the full trainer, in the reference and in scripts/evaluate.py alike."""

import json
from pathlib import Path

import data
from full.helpers import train_args
from grpo_vlm import dataset, tasks, trainer
from scripts import evaluate


def fingerprint(samples: list[dict]) -> list[tuple]:
    """What a sample asks and expects, its pixels included (ids are indices: the same for any draw)."""
    return [(s["prompt"], s["label"], tuple(im.tobytes() for im in s["images"])) for s in samples]


def step_zero_questions(out: Path) -> list[tuple]:
    """The held-out samples of a run's step-0 evaluation: prompt, target and the thumbnails' content keys."""
    lines = (out / "eval_samples.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if json.loads(line)["step"] == 0]
    return [(r["prompt"], json.dumps(r["target"]), json.dumps(r["thumbs"])) for r in records]


def test_two_seeds_of_the_full_trainer_evaluate_the_same_held_out_samples(tmp_path):
    flags = dict(device="cpu", train_size=16, eval_size=6, batch_size=2, group_size=2, max_new_tokens=8)
    for seed in (0, 3):
        trainer.main(train_args(output_dir=str(tmp_path / f"s{seed}"), seed=seed, steps=1, **flags))
    questions = step_zero_questions(tmp_path / "s0")
    assert len(questions) == 6
    assert step_zero_questions(tmp_path / "s3") == questions
    # the seed did act: LoRA's initialisation (A) differs, so the adapters differ
    adapters = [(tmp_path / f"s{s}" / "adapter" / "adapter_model.safetensors").read_bytes() for s in (0, 3)]
    assert adapters[0] != adapters[1]


def test_the_full_trainer_loads_the_references_training_pool_and_held_out_set():
    ours = dataset.load_samples(dataset.DataConfig(train_size=12, eval_size=7))
    reference = data.load_samples(None, None, train_size=12, eval_size=7)
    assert [fingerprint(split) for split in ours] == [fingerprint(split) for split in reference]


def test_evaluate_scores_the_trainers_held_out_samples_whatever_its_seed():
    samples, _ = evaluate.load_eval_samples(evaluate.Args(seed=7, eval_size=5))
    assert fingerprint(samples) == fingerprint(tasks.make_task("inspection", 5, split="test", seed=0))
