"""The step's prompts off its critical path (grpo_vlm/train.py: `prompts_ahead`, `host_batch`, `to_device`)
and its timings on the device's clock (`clock`): the batch made one step ahead on a background thread equals
the one made on the spot; on CUDA (a stand-in here) it is pinned and copied without blocking, and phases are
timed with device events."""

import threading
from typing import ClassVar

import torch

from full.helpers import train_args
from grpo_vlm import trainer

CPU = torch.device("cpu")
FLAGS = dict(device="cpu", train_size=8, eval_size=0, batch_size=2, group_size=2, max_new_tokens=4)


def built(tmp_path, **flags):
    args = train_args(output_dir=str(tmp_path / "run"), **(FLAGS | flags))
    return trainer.build_run(args, CPU, torch.float32, 0, 1), args


def assert_same_batch(a, b):
    assert a.images_per_row == b.images_per_row and a.inputs.keys() == b.inputs.keys()
    for key in a.inputs:
        assert torch.equal(a.inputs[key], b.inputs[key]), key


def test_the_batch_made_a_step_ahead_on_another_thread_equals_the_one_made_on_the_spot(tmp_path, monkeypatch):
    run, args = built(tmp_path, task="shapes")
    threads, real = [], trainer.host_batch
    monkeypatch.setattr(
        trainer, "host_batch", lambda *a: threads.append(threading.current_thread()) or real(*a)
    )
    with trainer.prompts_ahead(run, args, range(2, 5)) as prepared:
        ahead = [prepared(step) for step in (2, 3, 4)]
    made_here = len(threads)
    for step, batch in zip((2, 3, 4), ahead):
        assert_same_batch(batch, trainer.prompt_batch(run, trainer.step_prompts(run, step, args), args))
    assert made_here == 3 and all(t is not threading.main_thread() for t in threads[:made_here])
    before = len(threads)
    with trainer.prompts_ahead(run, args, range(2, 3)) as prepared:  # a step outside the range: made here
        assert_same_batch(prepared(7), trainer.prompt_batch(run, trainer.step_prompts(run, 7, args), args))
    # Made here: step 7 and the comparison's batch, both on the main thread, whenever the thread ahead
    # (step 2, on its own thread) runs.
    assert sum(t is threading.main_thread() for t in threads[before:]) == 2


def test_every_training_step_takes_its_prompts_from_the_thread_ahead(tmp_path, monkeypatch):
    made_on, real = [], trainer.host_batch
    monkeypatch.setattr(
        trainer, "host_batch", lambda *a: made_on.append(threading.current_thread()) or real(*a)
    )
    trainer.main(train_args(output_dir=str(tmp_path / "run"), steps=3, **FLAGS))
    assert len(made_on) == 3 and threading.main_thread() not in made_on


def test_on_cuda_the_host_batch_is_pinned_and_copied_without_blocking(tmp_path, monkeypatch):
    run, args = built(tmp_path)
    pinned, copies = [], []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    run.device = torch.device("cuda")  # a stand-in: the CPU build cannot copy there, the copy is recorded
    batch = trainer.host_batch(run, trainer.step_prompts(run, 1, args), args)
    assert pinned == [v.shape for v in batch.inputs.values()] and "pixel_values" in batch.inputs
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking: copies.append(non_blocking))
    trainer.to_device(batch, run.device)
    assert copies == [True] * len(batch.inputs)
    copies.clear()
    trainer.to_device(batch, "meta")  # any other device: a plain copy
    assert copies == [False] * len(batch.inputs)


class Event:
    """torch.cuda.Event as the clock uses it: recorded on a stream, waited for, then read (ms)."""

    recorded: ClassVar[list] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.ms, self.waited = None, False

    def record(self, stream):
        self.ms = 100.0 * len(Event.recorded)  # the device reaches each mark 100 ms after the one before
        Event.recorded.append(stream)

    def synchronize(self):
        self.waited = True

    def elapsed_time(self, end):
        assert end.waited, "read before the device reached the mark"
        return end.ms - self.ms


def test_on_cuda_phases_are_timed_with_device_events_and_on_the_cpu_with_the_host_clock(monkeypatch):
    monkeypatch.setattr(Event, "recorded", [])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    marks = [trainer.clock("cuda:1") for _ in range(3)]
    assert all(isinstance(m, Event) for m in marks) and Event.recorded == ["stream of cuda:1"] * 3
    assert trainer.seconds_between(marks[0], marks[2]) == 0.2
    start = trainer.clock(CPU)
    assert isinstance(start, float) and 0 <= trainer.seconds_between(start, trainer.clock(CPU)) < 1


def test_a_steps_timings_are_read_from_the_clock_of_the_runs_device(tmp_path, monkeypatch):
    run, args = built(tmp_path)
    devices, ticks = [], iter([1.0, 3.0, 7.0])
    monkeypatch.setattr(trainer, "clock", lambda device: devices.append(device) or next(ticks))
    _, timings, _ = trainer.train_step(1, run, args, args.loss.beta)
    assert timings == {"step": 1, "rollout_s": 2.0, "update_s": 4.0} and devices == [CPU] * 3
