"""Nothing held for nothing: a rollout's rows keep their images only where a log-prob pass reads them, and
dynamic sampling trains on the trunk each kept group's round recorded instead of running it again.

On the embedded tiny Qwen2.5-VL (LoRA with B != 0, so that the adapters matter), fp32, CPU. The reference for
re-used recordings is the full forward (`grpo.completion_logprobs`) and the trunk captured afresh.
"""

import json

import pytest
import torch

import grpo
from full.helpers import make_run
from full.test_train import load_tiny_with_lora, make_rollout, small_args
from grpo_vlm import speedups, tasks, trainer

PATHS = {  # (shared_prefill, trunk_reuse): whether a log-prob pass reads the rows' pixels
    "recorded trunk (default)": ((True, True), False),
    "captured trunk": ((False, True), False),
    "plain": ((False, False), True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_a_rollout_holds_its_prompts_pixels_once_and_the_rows_pixels_only_where_a_pass_reads_them(
    tmp_path, path, micro_batch_size
):
    (shared_prefill, trunk_reuse), read = PATHS[path]
    options = dict(shared_prefill=shared_prefill, trunk_reuse=trunk_reuse, micro_batch_size=micro_batch_size)
    args = small_args(tmp_path, batch_size=3, group_size=2, **options)
    _, ro = make_rollout(*load_tiny_with_lora(), args)
    once = ro.prompts.inputs["pixel_values"]  # (patches of the B prompts' images, D)
    G = args.group_size
    assert (
        ro.inputs["pixel_values"].shape[0] == G * once.shape[0]
    )  # the N rows' view of them, made when asked
    held = [c.inputs["pixel_values"] for c in ro.chunks if "pixel_values" in c.inputs]
    if read:  # the full forward of every pass reads each row's images: the chunks hold G copies
        assert sum(p.shape[0] for p in held) == G * once.shape[0]
    else:  # the trunk holds what the images gave
        assert held == [] and all(c.trunk is not None for c in ro.chunks)
    assert all("image_grid_thw" in c.inputs for c in ro.chunks)  # the grids still give mRoPE's positions


def vlm_with_adapters():
    model, tokenizer, image_processor = load_tiny_with_lora()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model, tokenizer, image_processor


def logprobs_of_chunks(run: trainer.Run, chunks: list[speedups.RowChunk]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(
            [speedups.chunk_logprobs(run.model, c, run.speed, temperature=1.0)[0] for c in chunks]
        )


def test_kept_groups_recordings_repadded_into_a_new_batch_give_the_recomputed_trunks_logprobs(
    tmp_path, monkeypatch
):
    # Two rounds whose prompts (1 and 4 images; 1 and 2) and completions differ in length: a kept group's
    # recording is cropped or left-padded to the new batch's prompts, right-padded to its completions.
    model, tokenizer, image_processor = vlm_with_adapters()
    args = small_args(tmp_path, group_size=2, max_new_tokens=12, temperature=1.0)
    run = make_run(model, args, tokenizer=tokenizer, image_processor=image_processor)
    run.reward_fns = trainer.resolve_rewards(args, "inspection")
    pool = tasks.make_task("inspection", 64, seed=0)
    by_images = {k: [s for s in pool if len(s["images"]) == k] for k in (1, 2, 4)}
    rounds = [[by_images[1][0], by_images[4][0]], [by_images[1][1], by_images[2][0]]]
    torch.manual_seed(1)
    sampled = [trainer.rollout(run, prompts, args) for prompts in rounds]
    assert (
        sampled[0].recording is not None
        and sampled[0].prompts.inputs["input_ids"].shape[1] > sampled[1].prompts.inputs["input_ids"].shape[1]
    )
    G = args.group_size

    def kept(
        k: int, g: int, recorded: bool = True
    ) -> tuple:  # round k's group g, as groups_with_signal keeps it
        ro, rows = sampled[k], slice(g * G, (g + 1) * G)
        recording = (ro.recording[rows], ro.prompts.inputs["input_ids"].shape[1]) if recorded else None
        return rounds[k][g], trainer.group_lists(ro, rows), recording

    captured = []
    real_capture = speedups.capture_trunk

    def capture(*a, **kw):
        captured.append(kw)
        return real_capture(*a, **kw)

    monkeypatch.setattr(speedups, "capture_trunk", capture)
    choices = {  # kept groups (round, group[, recorded here]) -> trunk captures
        "a 1-image group left-padded to a 4-image prompt": ([(1, 0), (0, 1)], 0),
        "a 1-image group recorded with a 4-image prompt, cropped to a 2-image one": ([(0, 0), (1, 1)], 0),
        "a group another rank sampled (no recording here): captured": ([(0, 1), (1, 1, False)], 1),
    }
    shapes = []  # the new batches' (P, T)
    for name, (choice, captures) in choices.items():
        captured.clear()
        samples, groups, recorded = map(list, zip(*[kept(*c) for c in choice]))
        ro = trainer.rollout_of_groups(run, samples, groups, recorded, args)
        assert len(captured) == captures, name
        shapes.append((ro.prompts.inputs["input_ids"].shape[1], ro.completion_ids.shape[1]))
        ours = logprobs_of_chunks(run, ro.chunks)
        with torch.no_grad():
            full, _ = grpo.completion_logprobs(model, ro.inputs, ro.completion_ids, temperature=1.0)
        chunks = speedups.row_chunks(model, ro.inputs, ro.completion_ids, None, run.speed)  # captured afresh
        again = logprobs_of_chunks(run, chunks)
        # Equal to rounding: the trunk recorded while sampling adds up attention in another order.
        torch.testing.assert_close(ours[ro.mask], again[ro.mask], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(ours[ro.mask], full[ro.mask], atol=1e-5, rtol=0, msg=name)
    (P0, T0), (P1, T1) = (
        (ro.prompts.inputs["input_ids"].shape[1], ro.completion_ids.shape[1]) for ro in sampled
    )
    assert shapes[0][0] == P0 > P1 and shapes[1][0] < P0  # a recording left-padded, then one cropped
    assert T0 != T1  # and one right-padded


def test_dynamic_sampling_in_one_process_trains_on_the_recorded_trunks_and_runs_none_again(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(speedups, "capture_trunk", lambda *a, **kw: pytest.fail("the trunk was run again"))
    args = small_args(
        tmp_path / "run", dynamic_sampling=True, max_sampling_rounds=3, eval_size=0, group_size=2
    )
    trainer.main(args)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and max(r["dynamic/rounds"] for r in records[1:]) > 1
