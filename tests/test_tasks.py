"""tasks.py: the built-in synthetic tasks are reproducible per seed, their splits are disjoint, and their
reference answers earn full reward."""

import pytest

import rewards
import tasks


def fingerprint(samples: list[dict]) -> list[tuple]:
    return [(s["id"], s["prompt"], s["answer"], tuple(im.tobytes() for im in s["images"])) for s in samples]


@pytest.mark.parametrize("task", tasks.TASKS)
def test_builtin_tasks_are_deterministic_per_seed_and_splits_differ(task):
    train = fingerprint(tasks.make_task(task, 30, seed=5))
    assert train == fingerprint(tasks.make_task(task, 30, seed=5))
    assert train != fingerprint(tasks.make_task(task, 30, seed=6))
    test = fingerprint(tasks.make_task(task, 30, split="test", seed=5))
    assert [t[2:] for t in train] != [t[2:] for t in test]  # ids repeat, contents must not


def test_inspection_labels_are_balanced_and_reference_answers_are_well_formed():
    samples = tasks.make_task("inspection", 400, seed=0)
    passed = sum(s["label"] == "通过" for s in samples) / len(samples)
    assert 0.35 <= passed <= 0.65
    assert {len(s["images"]) for s in samples} == {1, 2, 3, 4}
    for s in samples:
        assert rewards.format_reward(s["answer"], s) == 1.0, s["answer"]
        assert rewards.label_reward(s["answer"], s) == 1.0, s["answer"]
