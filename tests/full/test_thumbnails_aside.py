"""The report's thumbnails off the step's critical path (thumbnails.keep_aside): made on their own thread
while the step's log-prob passes and update run, one step's at most, and the run folder holds exactly the
files and lines that making them on the main thread writes."""

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from full.helpers import train_args
from grpo_vlm import thumbnails, trainer

FLAGS = dict(device="cpu", train_size=8, eval_size=4, batch_size=2, group_size=2, max_new_tokens=4)


def test_a_steps_thumbnails_are_made_on_their_own_thread_while_its_update_runs(tmp_path, monkeypatch):
    events, futures, threads = [], [], []
    keep, update, aside = thumbnails.keep, trainer.policy_update, thumbnails.keep_aside

    def kept(*args):
        threads.append(threading.current_thread())
        return keep(*args)

    def updating(*args, **kwargs):
        events.append("update")
        return update(*args, **kwargs)

    def started(*args, **kwargs):
        assert all(f.done() for f in futures)  # the earlier steps' results were taken: one step's waits
        events.append("keep")
        futures.append(aside(*args, **kwargs))
        return futures[-1]

    monkeypatch.setattr(thumbnails, "keep", kept)
    monkeypatch.setattr(thumbnails, "keep_aside", started)
    monkeypatch.setattr(trainer, "policy_update", updating)
    trainer.main(train_args(output_dir=str(tmp_path / "run"), steps=3, eval_every=2, **FLAGS))
    assert len(threads) == 6 and threading.main_thread() not in threads
    # evaluation (step 0), then per step: the rows' thumbnails started before its update (step 2 evaluates)
    assert events == ["keep", "keep", "update", "keep", "update", "keep", "keep", "update", "keep"]


def inline(samples, image_processor, kept, turns=None) -> Future:
    """keep_aside as the main thread would: done before it returns."""
    done = Future()
    done.set_result(thumbnails.keep(samples, image_processor, kept, turns))
    return done


def run_files(out: Path) -> dict[str, bytes]:
    names = ["rollouts.jsonl", "eval_samples.jsonl", "metrics.jsonl"]
    files = {name: (out / name).read_bytes() for name in names}
    return files | {f"thumbs/{p.name}": p.read_bytes() for p in sorted((out / "thumbs").iterdir())}


@pytest.mark.parametrize("task", ["inspection", "shapes"])
def test_the_run_folder_holds_the_files_and_lines_made_on_the_main_thread(tmp_path, monkeypatch, task):
    flags = dict(FLAGS, task=task, steps=2, eval_every=1)
    trainer.main(train_args(output_dir=str(tmp_path / "aside"), **flags))
    with monkeypatch.context() as patch:
        patch.setattr(thumbnails, "keep_aside", inline)
        trainer.main(train_args(output_dir=str(tmp_path / "inline"), **flags))
    aside, made_inline = run_files(tmp_path / "aside"), run_files(tmp_path / "inline")
    assert aside.keys() == made_inline.keys() and any(name.startswith("thumbs/") for name in aside)
    for name in aside:
        assert aside[name] == made_inline[name], name


def test_the_thumbnails_thread_ends_with_the_run(tmp_path):
    """No thread is left for the process's exit to wait for (cli.exit_process would name it on stdout)."""
    trainer.main(train_args(output_dir=str(tmp_path / "run"), steps=2, eval_every=1, **FLAGS))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("thumbnails")]
