"""The N rows a rollout hands to the log-prob chunks (trainer.chunk_rows): with a recorded trunk, nothing
reads the rows' pixels, so the G copies of each prompt's images are never made; the plain path keeps them."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from full.helpers import lora_model_with_gradients, make_run, train_args
from grpo_vlm import dataset, tasks, trainer


class LargeTensors(TorchDispatchMode):
    """The element counts of the fp32 tensors made with at least `numel` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op
            return out
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.made.append(t.numel())
        return out


def rollout(speed: dict) -> tuple[trainer.Rollout, int, list[int]]:
    """A rollout of 2 photo prompts x G = 4 with the speed-ups `speed`: the rollout, its rows' pixel count
    (G times the prompts'), the sizes of the large fp32 tensors it made."""
    model, tokenizer, image_processor = lora_model_with_gradients()
    args = train_args(batch_size=2, group_size=4, max_new_tokens=6, lora_last_k=4, **speed)
    run = make_run(model, args, tokenizer=tokenizer, image_processor=image_processor)
    run.reward_fns = trainer.resolve_rewards(args, "inspection")
    run.accuracy_name = run.reward_fns[0].name
    prompts = dataset.batch_for_step(tasks.make_task("inspection", 8, seed=0), 0, 2, seed=0)
    batch = trainer.prompt_batch(run, prompts, args)
    rows_pixels = 4 * batch.inputs["pixel_values"].numel()
    torch.manual_seed(0)
    with LargeTensors(rows_pixels) as seen:
        ro = trainer.rollout(run, prompts, args, batch=batch)
    return ro, rows_pixels, seen.made


def test_a_recorded_trunks_rollout_copies_no_rows_pixels_and_its_chunks_hold_none():
    ro, rows_pixels, made = rollout({})  # the default: shared prefill, trunk recorded while sampling
    assert ro.recording is not None and rows_pixels not in made
    (chunk,) = ro.chunks  # the CPU's default: all N rows at once
    rows = ro.inputs  # data.repeat_rows: every row with its prompt's images
    assert chunk.inputs.keys() == rows.keys() - {"pixel_values"}  # ids, masks, grids: those of the rows
    assert all(torch.equal(chunk.inputs[key], rows[key]) for key in chunk.inputs)


def test_the_plain_paths_rollout_keeps_every_rows_pixels_for_its_full_forwards():
    ro, rows_pixels, made = rollout(dict(shared_prefill=False, trunk_reuse=False))
    assert ro.recording is None and rows_pixels in made
    (chunk,) = ro.chunks
    assert torch.equal(chunk.inputs["pixel_values"], ro.inputs["pixel_values"])
