"""GRPO with LoRA on a Qwen-VL style model: the command-line trainer.

    python -m grpo_vlm                               # embedded tiny VLM, built-in task, CPU, about a minute
    python -m grpo_vlm --help                        # every flag, with its documentation
    python -m grpo_vlm --dry-run                     # one rollout + rewards + loss, no update, then exit
    python -m grpo_vlm --resume runs/grpo            # continue a run from its latest checkpoint
    python -m grpo_vlm --model Qwen/Qwen2.5-VL-3B-Instruct --data my.jsonl --reward label format \\
        --reward-weight 1.0 0.5 --gate format --device cuda --max-new-tokens 128 --lr 1e-5
    torchrun --nproc-per-node 8 -m grpo_vlm --device cuda ...  # R ranks, each on B prompts (distributed.py)

Reading order: the objective in grpo.py's docstring -> `grpo.grpo_loss` -> `grpo.group_advantages` -> the step
below (`train_step`: `rollout`, `frozen_logprobs`, `policy_update`) -> speedups.py. The plain path,
`--no-shared-prefill --no-trunk-reuse`, is the reference: transformers' generate, then one full forward per
log-prob pass; the defaults re-arrange it (speedups.py), with the same tokens and log-probs equal to rounding.

One step: sample G completions of each of B prompts (no grad) -> rewards -> group advantages -> old and
reference log-probs (no grad; the reference is the model with its adapters off) -> the completion log-probs
WITH gradient (same images, masks, temperature) -> PPO-clip + KL loss -> optimizer step on LoRA only -> log.
Under torchrun every rank runs the same text: the collectives of distributed.py return their argument in one
process. This file holds `Args`, the step, then set-up, saving and resuming (the run folder and its
checkpoints: checkpoints.py), evaluation and `main`, last.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import shlex
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

import data
import grpo
import lora
import model_io
import rewards
from grpo_vlm import (
    adapters,
    adaptive_kl,
    attention,
    checkpoints,
    cli,
    dataset,
    distributed,
    grounding,
    logs,
    lora_config,
    memory,
    metrics,
    model_files,
    multiturn,
    objectives,
    pass_at_k,
    plugins,
    report,
    sampling_config,
    scoring,
    speedups,
    tasks,
    thumbnails,
    tools,
    trackers,
)


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # flat flag names: `--beta`, not `--loss.beta`
@dataclass
class Args:
    """The command line: the trainer's own flags, then each module's settings group (defined beside the code
    it configures)."""

    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, or a text-only causal LM.
    The default is the tiny Qwen2.5-VL shipped in assets/."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    """Attention kernel: sdpa (PyTorch's fused attention, transformers' default), flash_attention_2 (the
    flash-attn package; CUDA, bf16) or eager (plain matmuls)."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8):
    on CUDA a resumed run then repeats an uninterrupted one bit for bit, slower; CPU runs always do."""
    dist_timeout: float = 30.0
    """torchrun: minutes a rank waits for the others at a collective (rank 0's checkpoint, a slower rank's
    step) before the run fails (NCCL's own default: 10)."""
    batch_size: int = 16
    """B: prompts per step (per rank under torchrun: the global batch is B*R prompts)."""
    group_size: int = 8
    """G: completions sampled per prompt (the group that advantages are normalised within)."""
    num_iterations: int = 1
    """mu: optimizer steps per rollout batch. > 1 stores old log-probs at rollout time."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts until B groups
    carry a learning signal (at most --max-sampling-rounds rounds). Logs dynamic/groups_sampled and _kept."""
    max_sampling_rounds: int = 3
    """With --dynamic-sampling: rollout rounds per step at most (each of B prompts), the first included."""
    mask_truncated: bool = False
    """Drop completions that hit --max-new-tokens without EOS from the loss (DAPO's overlong filtering)."""
    steps: int = 100
    """Number of training steps (rollout batches)."""
    lr: float = 2e-3
    """Peak learning rate of AdamW on the LoRA parameters (tiny model; use ~1e-5..5e-5 on real models). 0: the
    no-update control, LoRA stays as initialised (B = 0: the base model), every step sampled and scored."""
    warmup_steps: int = 5
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient-norm clipping of the LoRA gradients."""
    max_bad_steps: int = 3
    """A step with a non-finite loss or gradient is skipped; more than this many in a row stop the run."""
    output_dir: str | None = None
    """Run folder (default runs/grpo; with --resume, that run's): run.json, metrics.jsonl, rollouts.jsonl,
    eval_samples.jsonl, timings.jsonl, thumbs/, checkpoint-*/, report.html, adapter/, curves.png. A new or
    empty folder, or a run folder (its run.json names the run); one run and one process per folder."""
    log_every: int = 1
    """Print a progress line every this many steps (redrawn in place on a terminal, else one line each)."""
    log_completions_every: int = 1
    """Keep every completion (text, rewards, advantage, its images in thumbs/) in rollouts.jsonl every this
    many steps; 0: never."""
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"
    """Also send metrics and a few completions to this tracker (its package must be installed)."""
    eval_every: int = 25
    """Greedy held-out evaluation every this many steps (and before the first and after the last); each
    sample's completion and scores go to eval_samples.jsonl."""
    eval_image_ablation: Literal["none", "blank", "shuffle"] = "none"
    """Also evaluate with every image grey (blank) or the images permuted across samples (shuffle), logged as
    eval/accuracy_<mode>: does the policy look at the images?"""
    eval_num_samples: int = 0
    """Also sample n completions of each held-out prompt at the training temperature and log eval/pass@1 ..
    eval/pass@n, by the unbiased estimator from those same n (pass_at_k.py): did GRPO sharpen pass@1 or
    widen pass@n? 0: off. Its draws are seeded apart from training's, which they leave unchanged."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints."""
    resume: str | None = None
    """A run folder (or one of its checkpoint-* folders) to continue, in that folder, from its latest (or
    that) checkpoint, with the settings run.json records. Only RESUME_MAY_CHANGE's flags may be given
    differently (--steps to extend it, logging, evaluation, saving, device, speed-ups)."""
    overwrite: bool = False
    """Delete the run the output folder holds (only its own files, which are listed), then start anew."""
    dry_run: bool = False
    """Load model and data, run one rollout, one reward pass and one loss without updating, print, exit."""
    seed: int = 0
    """Seeds LoRA's initialisation, the batch order and sampling; not the built-in task's samples nor the
    shuffle ablation: every seed trains on the same pool and answers the same held-out questions."""
    samples: dataset.DataConfig = dataclasses.field(default_factory=dataset.DataConfig)
    """Samples and prompts (dataset.py, data.py, tasks.py)."""
    sampling: sampling_config.SamplingConfig = dataclasses.field(
        default_factory=sampling_config.SamplingConfig
    )
    """Sampling (sampling_config.py, grpo.py)."""
    rewards: scoring.RewardConfig = dataclasses.field(default_factory=scoring.RewardConfig)
    """Rewards (rewards.py, grounding.py, scoring.py)."""
    adv: objectives.AdvantageConfig = dataclasses.field(default_factory=objectives.AdvantageConfig)
    """Advantages (objectives.py, grpo.py)."""
    loss: objectives.LossConfig = dataclasses.field(default_factory=objectives.LossConfig)
    """The loss and its variants (objectives.py, grpo.py)."""
    kl_band: adaptive_kl.AdaptiveKLConfig = dataclasses.field(default_factory=adaptive_kl.AdaptiveKLConfig)
    """Adaptive KL (adaptive_kl.py): the band beta keeps the KL in."""
    lora: lora_config.LoRAConfig = dataclasses.field(default_factory=lora_config.LoRAConfig)
    """LoRA (lora.py, lora_config.py): where, its rank and scale."""
    speed: speedups.SpeedConfig = dataclasses.field(default_factory=speedups.SpeedConfig)
    """Speed-ups (speedups.py); each leaves the results unchanged (equal to rounding)."""
    tools: tools.ToolConfig = dataclasses.field(default_factory=tools.ToolConfig)
    """Tool calls in multi-turn rollouts (tools.py, multiturn.py)."""


# --- One training step: rollout (sample -> score -> advantages), frozen log-probs, policy update ------------


@dataclass
class Run:
    """What `main` builds before the first step (`build_run`); the step functions read the model from here."""

    model: torch.nn.Module
    tokenizer: object = None
    image_processor: object | None = None
    device: torch.device | str = "cpu"
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    train_samples: list[dict] = dataclasses.field(default_factory=list)
    held_out: list[dict] = dataclasses.field(default_factory=list)
    held_out_ablated: list[dict] = dataclasses.field(default_factory=list)  # --eval-image-ablation's samples
    reward_fns: list[rewards.Reward] = dataclasses.field(default_factory=list)
    accuracy_name: str = ""
    box_frame: str | None = None  # the frame the model writes coordinates in (None: text-only model)
    sampling: dict = dataclasses.field(default_factory=dict)  # the sampler's options (`sampling_options`)
    speed: speedups.Plan = dataclasses.field(default_factory=speedups.Plan)  # the plain path unless chosen
    tools: multiturn.ToolUse | None = None  # --max-tool-calls > 0: multi-turn rollouts
    rank: int = 0  # torchrun: this process's rank among `world`; one process: 0 of 1
    world: int = 1
    kept: thumbnails.Kept = dataclasses.field(default_factory=thumbnails.Kept)  # thumbnails handed to rank 0


@dataclass
class Rollout:
    """Everything sampled and scored for one batch of N = B*G rows."""

    prompts: data.PromptBatch  # the B prompts once: input_ids (B, P), attention_mask, [pixel_values, ...]
    # (with tools: the N rows and their images' grids; their pixel_values only if a pass reads them)
    completion_ids: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T) bool, True up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within max_new_tokens
    texts: list[str]
    samples: list[dict]  # the sample of each row (repeated G times)
    reward: torch.Tensor  # (N,)
    components: dict[str, torch.Tensor]  # (N,) per reward, unweighted
    adv: torch.Tensor  # (N,)
    chunks: list[speedups.RowChunk]  # the rows as the log-prob passes take them (one chunk on the plain path)
    recording: torch.Tensor | None = None  # (N, P + T - 1, H) the trunk sampling recorded; chunks view it
    old_logp: torch.Tensor | None = None  # (N, T), only when num_iterations > 1
    ref_logp: torch.Tensor | None = None  # (N, T), only when beta > 0
    token_mask: torch.Tensor | None = None  # (N, T) the high-entropy tokens, when top_entropy_quantile < 1
    tool_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # tools/calls, tools/errors/..
    turns: list[list[dict]] | None = None  # each row's turns (multiturn.py), for rollouts.jsonl
    thumbs: concurrent.futures.Future | None = None  # the logged rows' thumbnails.keep, made aside

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The N rows' model inputs, each prompt's images with its G rows: made when asked, never held (the
        chunks keep pixels only for a pass that reads them: the plain path's full forward). With tools: the
        rows as sampled, without pixel_values under trunk reuse."""
        G = self.completion_ids.shape[0] // self.prompts.inputs["input_ids"].shape[0]
        return dict(self.prompts.inputs) if G == 1 else data.repeat_rows(self.prompts, G).inputs


def train_step(
    step: int, run: Run, args: Args, beta: float, *, prepared: data.PromptBatch | None = None
) -> tuple[dict, dict, Rollout]:
    """One GRPO step on this rank's B prompts: (metrics record, the same on every rank; timings; rollout).
    `prepared`: the step's prompts as `host_batch` makes them, made ahead (`prompts_ahead`); None: here."""
    t0 = clock(run.device)
    distributed.seed_rank_stream(args.seed, step, run.rank)  # torchrun: each rank its own sampling stream
    prompts = step_prompts(run, step, args)
    batch = to_device(host_batch(run, prompts, args) if prepared is None else prepared, run.device)
    roll = tool_rollout if run.tools else rollout
    ro = roll(run, prompts, args, batch=batch)  # sample, mask, rewards, advantages
    # DAPO's dynamic sampling: only groups with a learning signal, topped up from more prompts.
    ro, counts = groups_with_signal(run, ro, step, args) if args.dynamic_sampling else (ro, {})
    thumbnails_aside(step, ro, run, args)  # the logged rows' thumbnails, made while the step goes on
    frozen_logprobs(run, ro, args)  # old_logp (mu > 1) and ref_logp (beta > 0), no grad
    t1 = clock(run.device)
    stats = policy_update(run, ro, args, beta)  # logp with grad -> loss -> optimizer step(s)
    correct = ro.components[run.accuracy_name] >= 1.0
    measured = metrics.rollout_metrics(
        ro.reward, ro.components, ro.mask, ro.truncated, correct, args.group_size
    )
    measured.update(ro.tool_metrics)  # with tools: calls and errors per completion
    record = {"step": step, "beta": beta, **stats, **distributed.mean_across_ranks(measured), **counts}
    t2 = clock(run.device)
    timings = {"step": step, "rollout_s": seconds_between(t0, t1), "update_s": seconds_between(t1, t2)}
    return record, timings, ro


def clock(device: torch.device | str) -> float | torch.cuda.Event:
    """A point in a step's time. On CUDA an event recorded on the device's stream: it completes when the
    kernels queued before it have run, so a phase is charged with its own kernels, not with those the host
    queued earlier and the device runs late; elsewhere the host's clock (the CPU runs each op as called)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()  # NOTE: waits for the device: once a step, after its last .item() anyway
    return start.elapsed_time(end) / 1000  # milliseconds


def logs_completions(step: int, args: Args) -> bool:
    return bool(args.log_completions_every) and step % args.log_completions_every == 0


def thumbnails_aside(step: int, ro: Rollout, run: Run, args: Args) -> None:
    """On a step that logs its rows: their images' thumbnails (thumbnails.keep_aside), made on another thread
    while the step's log-prob passes and update run; `completion_rows` takes them (ro.thumbs)."""
    if logs_completions(step, args):
        ro.thumbs = thumbnails.keep_aside(ro.samples, run.image_processor, run.kept, ro.turns)


def completion_rows(step: int, ro: Rollout, run: Run, args: Args) -> tuple[list[dict], dict[str, bytes]]:
    """rollouts.jsonl's lines for this step (every --log-completions-every steps), every rank's rows, and the
    thumbnails they name that no rank handed to the writer before (file name -> JPEG): on the writing rank;
    the others return nothing."""
    if not logs_completions(step, args):
        return [], {}
    components = {name: values.tolist() for name, values in ro.components.items()}
    numbers = (ro.reward.tolist(), ro.adv.tolist(), ro.mask.sum(dim=1).tolist(), ro.truncated.tolist())
    extras, turns, made = logged_fields(run, ro.samples, ro.texts, ro.turns, thumbs=ro.thumbs)
    rows = logs.rollout_records(
        step, ro.samples, ro.texts, components, *numbers, args.group_size, turns, extras=extras
    )
    # every rank's rows and files, to the writing rank only, in one collective (one process: its own)
    gathered = distributed.gather_to_writer([(rows, made)])
    return [row for rows, _ in gathered for row in rows], merged([made for _, made in gathered])


def logged_fields(
    run: Run,
    samples: list[dict],
    texts: list[str],
    turns: list[list[dict]] | None = None,
    thumbs: concurrent.futures.Future | None = None,
) -> tuple[list[dict], list[list[dict]] | None, dict[str, bytes]]:
    """What a logged row shows besides its scores: each row's prompt, target, "thumbs" (its images kept:
    thumbnails.keep, on its thread: `thumbs` if started already) and, for a sample with boxes, the
    completion's boxes in original pixels; the rows' turns with their returned crops' thumbnails; the new
    thumbnail files."""
    aside = thumbs or thumbnails.keep_aside(samples, run.image_processor, run.kept, turns)
    thumbs, turns, made = aside.result()
    extras = []
    for sample, text, row_thumbs in zip(samples, texts, thumbs):
        fields = {"prompt": dataset.prompt_text(sample), "target": dataset.target_fields(sample)}
        fields["thumbs"] = row_thumbs
        if "bbox" in sample or "boxes" in sample:
            if "grounding" not in sample:  # NOTE: dynamic sampling's kept groups: the frame added again
                sample = dataset.with_grounding([sample], run.image_processor, run.box_frame)[0]
            fields["boxes_parsed"] = [list(box) for box in grounding.predicted_boxes(text, sample)]
        extras.append(fields)
    return extras, turns, made


def merged(parts: list[dict]) -> dict:
    return {key: value for part in parts for key, value in part.items()}


def step_prompts(run: Run, step: int, args: Args) -> list[dict]:
    """This rank's B samples of `step` (1-based): a pure function of the step (dataset.batch_for_step)."""
    return dataset.batch_for_step(
        run.train_samples, step - 1, args.batch_size, args.seed, run.rank, run.world
    )


def host_batch(run: Run, samples: list[dict], args: Args) -> data.PromptBatch:
    """The samples' chat text, tokens and image tensors, left-padded into one batch in host memory,
    page-locked when the run is on CUDA, so that `to_device`'s copy runs without the host waiting for it."""
    # Large files decoded once, shrunk to the budget; every prompt's length was checked when the data loaded.
    batch = dataset.prepare_prompts(samples, run.tokenizer, run.image_processor, device="cpu")
    return pinned(batch) if torch.device(run.device).type == "cuda" else batch


def pinned(batch: data.PromptBatch) -> data.PromptBatch:
    """`batch` in page-locked host memory, allocated (cudaHostAlloc) on `prompts_ahead`'s thread while the
    step before it samples, perhaps capturing its decoding step (`speedups.capture_cuda_graph`)."""
    return data.PromptBatch({k: v.pin_memory() for k, v in batch.inputs.items()}, batch.images_per_row)


def to_device(batch: data.PromptBatch, device: torch.device | str) -> data.PromptBatch:
    """`batch` on `device`: from pinned memory on CUDA without blocking the host (the kernels that read it
    queue behind the copy on the same stream); elsewhere a plain (on the CPU: no) copy."""
    non_blocking = torch.device(device).type == "cuda"
    inputs = {k: v.to(device, non_blocking=non_blocking) for k, v in batch.inputs.items()}
    return data.PromptBatch(inputs, batch.images_per_row)


def prompt_batch(run: Run, samples: list[dict], args: Args) -> data.PromptBatch:
    """The samples' prompts on the run's device, made on the spot."""
    return to_device(host_batch(run, samples, args), run.device)


@contextlib.contextmanager
def prompts_ahead(run: Run, args: Args, steps: range) -> Iterator[Callable[[int], data.PromptBatch]]:
    """`prepared(step)`: the step's `host_batch`, made on a background thread while the step before it ran
    (image decoding and processing off the step's critical path). Each is a pure function of its step, so
    the tokens, metrics and resume are those of a batch made on the spot.
    NOTE: the thread shares the tokenizer with the main thread, which only decodes (no settings change)."""
    futures: dict[int, concurrent.futures.Future] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts-ahead") as pool:

        def submit(step: int) -> None:
            if step in steps:
                futures[step] = pool.submit(lambda: host_batch(run, step_prompts(run, step, args), args))

        def prepared(step: int) -> data.PromptBatch:
            future = futures.pop(step, None)
            submit(step + 1)  # queued behind this step's batch, made while this step runs
            return host_batch(run, step_prompts(run, step, args), args) if future is None else future.result()

        submit(steps.start)
        yield prepared


@torch.no_grad()
def rollout(run: Run, prompts: list[dict], args: Args, batch: data.PromptBatch | None = None) -> Rollout:
    """Sample G completions of each prompt with the current policy, score them, and compute advantages.
    `batch`: the prompts' model inputs if made already (`prompt_batch`)."""
    G, model, ends = args.group_size, run.model, run.sampling["eos_token_id"]
    batch = prompt_batch(run, prompts, args) if batch is None else batch
    model.eval()
    # B prompts in, rows b*G .. b*G+G-1 out (prompt b's group); `recording`: the frozen trunk, or None.
    completion_ids, recording = speedups.sample(model, batch.inputs, run.speed, group_size=G, **run.sampling)
    mask, truncated = grpo.completion_mask(completion_ids, ends)  # (N, T), (N,)
    texts = data.decode_completions(run.tokenizer, completion_ids, mask, ends)
    if run.box_frame:  # the image's frame, for rewards that read coordinates (grounding.py)
        prompts = dataset.with_grounding(prompts, run.image_processor, run.box_frame)
    samples = [s for s in prompts for _ in range(G)]
    lengths, timeout = mask.sum(1).tolist(), args.rewards.reward_timeout
    scores = scoring.score(texts, samples, run.reward_fns, completion_lengths=lengths, timeout=timeout)
    mask = mask & ~truncated[:, None] if args.mask_truncated else mask  # NOTE: still scored and logged
    as_floats = functools.partial(torch.tensor, dtype=torch.float32, device=run.device)
    reward = as_floats(scores.total)  # (N,)
    components = {name: as_floats(values) for name, values in scores.components.items()}
    adv = advantages(reward, components, run, args)  # (N,)
    rows = chunk_rows(batch, G, recording)  # the N rows the completions belong to
    chunks = speedups.row_chunks(model, rows, completion_ids, recording, run.speed)  # rows' pixels: if read
    return Rollout(
        batch, completion_ids, mask, truncated, texts, samples, reward, components, adv, chunks, recording
    )


def chunk_rows(batch: data.PromptBatch, G: int, recording: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The N = B*G rows for `speedups.row_chunks`: each prompt's inputs and images G times (data.repeat_rows).
    With a recorded trunk the chunks read ids, masks and grids only, so the rows' pixels are not copied (1.3
    GiB of fp32 at 3B, B = 8, G = 8): `pixel_values` is then a stand-in of their shape that holds no memory.
    NOTE: NaN throughout, so a pass that read it would show it; none does (trunk_from_recording drops it)."""
    if recording is None or "pixel_values" not in batch.inputs:
        return data.repeat_rows(batch, G).inputs
    images = ("pixel_values", "image_grid_thw")
    text = data.PromptBatch({k: v for k, v in batch.inputs.items() if k not in images}, batch.images_per_row)
    rows = data.repeat_rows(text, G).inputs
    grids = batch.inputs["image_grid_thw"].split(batch.images_per_row)  # (images of prompt b, 3) each
    rows["image_grid_thw"] = torch.cat([grid for grid in grids for _ in range(G)])
    pixels = batch.inputs["pixel_values"]  # (patches, D) of the B prompts
    rows["pixel_values"] = pixels.new_full((), float("nan")).expand(G * pixels.shape[0], pixels.shape[1])
    return rows


@torch.no_grad()
def tool_rollout(run: Run, prompts: list[dict], args: Args, batch: data.PromptBatch | None = None) -> Rollout:
    """`rollout` with tool calls (--max-tool-calls > 0): multi-turn completions (multiturn.py), scored on
    their final answers (the samples carry the trajectory and the calls), the mask on the model's own tokens,
    each row with its tools' images."""
    batch = prompt_batch(run, prompts, args) if batch is None else batch
    run.model.eval()
    prompts = dataset.with_grounding(prompts, run.image_processor, run.box_frame)
    options = dict(group_size=args.group_size, sampling=run.sampling)
    turns = multiturn.sample(run.model, batch, prompts, run.tools, **options)
    lengths = turns.mask.sum(1).tolist()  # the model's tokens
    timeout = args.rewards.reward_timeout
    scores = scoring.score(
        turns.texts, turns.samples, run.reward_fns, completion_lengths=lengths, timeout=timeout
    )
    mask = turns.mask & ~turns.truncated[:, None] if args.mask_truncated else turns.mask
    as_floats = functools.partial(torch.tensor, dtype=torch.float32, device=run.device)
    reward = as_floats(scores.total)  # (N,)
    components = {name: as_floats(values) for name, values in scores.components.items()}
    chunks = speedups.row_chunks(run.model, turns.inputs, turns.completion_ids, None, run.speed)
    # NOTE: the N rows' fp32 pixels (1.3 GiB for 64 rows of one 952x952 photo, before the tools' images) are
    # kept only if a pass reads them (the plain path's chunks: views of one storage); a trunk encoded them.
    read = any("pixel_values" in chunk.inputs for chunk in chunks)
    inputs = {k: v for k, v in turns.inputs.items() if read or k != "pixel_values"}
    return Rollout(
        prompts=data.PromptBatch(inputs, turns.images_per_row),  # the N rows, each with its own images
        completion_ids=turns.completion_ids,
        mask=mask,
        truncated=turns.truncated,
        texts=turns.texts,
        samples=turns.samples,
        reward=reward,
        components=components,
        adv=advantages(reward, components, run, args),
        chunks=chunks,
        tool_metrics=multiturn.tool_metrics(turns.counts),
        turns=turns.turns,
    )


def advantages(
    reward: torch.Tensor, components: dict[str, torch.Tensor], run: Run, args: Args
) -> torch.Tensor:
    """Advantages (N,) of the weighted total reward, or GDPO's of the group-normalised rewards' sum."""
    weights = torch.tensor([r.weight for r in run.reward_fns], device=reward.device)  # (K,)
    stacked = torch.stack(list(components.values()), 1)  # (N, K)
    return objectives.advantages(reward, stacked, weights, args.group_size, args.adv)


@torch.no_grad()
def frozen_logprobs(run: Run, ro: Rollout, args: Args) -> None:
    """Fill ro.old_logp (mu > 1; at mu = 1 it is logp.detach()), ro.ref_logp (beta > 0) and ro.token_mask
    (top_entropy_quantile < 1: chosen once, from the policy that sampled), chunk by chunk, without grad."""
    options = dict(temperature=args.sampling.temperature)

    def every_chunk(model_options: dict) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [speedups.chunk_logprobs(run.model, c, run.speed, **model_options) for c in ro.chunks]

    quantile = args.loss.top_entropy_quantile
    if args.num_iterations > 1 or quantile < 1:
        pairs = every_chunk(dict(options, return_entropy=quantile < 1))  # the policy that sampled
        ro.old_logp = torch.cat([logp for logp, _ in pairs]) if args.num_iterations > 1 else None  # (N, T)
        if quantile < 1:
            entropy = torch.cat([h for _, h in pairs])  # (N, T)
            pool = distributed.gather_tensor(entropy[ro.mask])  # the quantile is over the global batch
            ro.token_mask = objectives.high_entropy_mask(entropy, ro.mask, quantile, pool=pool)
    if args.loss.beta > 0:
        with lora.adapters_disabled(run.model):  # the reference policy: the same weights, no adapters
            ro.ref_logp = torch.cat([logp for logp, _ in every_chunk(options)])  # (N, T)


def accumulate_policy_gradient(
    run: Run, ro: Rollout, args: Args, beta: float
) -> tuple[float, dict[str, float], torch.Tensor]:
    """Recompute logp with grad and backward the GRPO loss, chunk by chunk; returns the loss, its stats and
    this rank's entropy (N, T). Each chunk's loss is normalised by the whole (under torchrun: global) batch's
    rows and tokens, so the summed gradient equals the unchunked one for every loss_type (objectives.py)."""
    num_rows, num_tokens = distributed.batch_counts(ro.mask)  # all ranks'
    totals = objectives.BatchTotals(num_rows=num_rows, num_tokens=num_tokens)
    config = dataclasses.replace(args.loss, beta=beta)  # this step's beta (adaptive KL may move it)
    options = dict(temperature=args.sampling.temperature, return_entropy=True)
    loss_sum, stats_sum, entropies = 0.0, {}, []
    for chunk in ro.chunks:
        logp, entropy = speedups.chunk_logprobs(run.model, chunk, run.speed, **options)  # (n, T) with grad
        rows, adv, mask = chunk.rows, ro.adv[chunk.rows], ro.mask[chunk.rows]
        old_logp = ro.old_logp[rows] if ro.old_logp is not None else logp.detach()  # mu = 1: ratio 1
        ref_logp = ro.ref_logp[rows] if ro.ref_logp is not None else None
        chosen = ro.token_mask[rows] if ro.token_mask is not None else None  # high-entropy tokens, or all
        loss, stats = objectives.grpo_loss(
            logp,
            old_logp,
            ref_logp,
            adv,
            mask,
            config,
            token_mask=chosen,
            totals=totals,
            max_completion_length=args.sampling.max_new_tokens,  # dr_grpo's constant
        )
        loss.backward()  # frees this chunk's activations before the next chunk's forward
        loss_sum += loss.item()
        share = mask.sum().item() / totals.num_tokens.item()  # this chunk's part of the token means
        stats_sum = {key: stats_sum.get(key, 0.0) + share * value for key, value in stats.items()}
        entropies.append(entropy)
    loss_sum, *values = distributed.sum_across_ranks([loss_sum, *stats_sum.values()])  # each rank: its share
    stats_sum = dict(zip(stats_sum, values))
    return loss_sum, stats_sum, torch.cat(entropies)


def policy_update(run: Run, ro: Rollout, args: Args, beta: float) -> dict[str, float]:
    """mu optimizer steps on one rollout (the last one's stats); a non-finite loss or gradient skips it."""
    model, optimizer, params = run.model, run.optimizer, lora.lora_parameters(run.model)
    model.train()  # only LoRA dropout reacts to this; the base has no dropout
    skipped = ""
    for _ in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss, stats, entropy = accumulate_policy_gradient(run, ro, args, beta)  # recompute + backward
        distributed.all_reduce_gradients(params)  # torchrun: the global batch's gradient on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        if not math.isfinite(loss) or not torch.isfinite(grad_norm):
            skipped = "non-finite loss" if not math.isfinite(loss) else "non-finite gradient"
            optimizer.zero_grad(set_to_none=True)
            break
        optimizer.step()
    run.scheduler.step()  # every step counts, skipped or not
    model.eval()
    stats.update(loss=loss, grad_norm=grad_norm.item(), lr=run.scheduler.get_last_lr()[0], skipped=skipped)
    entropy_sum, num_tokens = (entropy * ro.mask).sum().item(), ro.mask.sum().item()
    entropy_sum, num_tokens = distributed.sum_across_ranks([entropy_sum, num_tokens])
    stats["entropy"] = entropy_sum / max(num_tokens, 1)  # NOTE: --mask-truncated may leave no token
    return stats


# --- DAPO's dynamic sampling: a step's rollout from the groups that carry a learning signal -----------------


def groups_with_signal(run: Run, ro: Rollout, step: int, args: Args) -> tuple[Rollout, dict]:
    """DAPO's dynamic sampling (Yu et al. 2025): drop the groups whose G rewards are all equal (advantage 0,
    no learning signal) and sample more prompts, round by round, until B groups have a signal or
    --max-sampling-rounds rounds were drawn; then train on what there is, topped up to B with dropped groups
    (they add only their KL term). Round k's prompts are a pure function of (step, k)
    (dataset.batch_for_step): --resume stays exact with no stream to save.
    Under torchrun the choice is made over the global batch, as one process on B*R prompts makes it: every
    rank shares its groups' completions and scores (small data), the first B*R groups with a signal in
    (round, rank, group) order are kept, and rank r trains on [r*B, (r+1)*B) of them.
    The trunk each round recorded (if sampling records one) is kept until the choice: a kept group's rows of
    it are re-padded into the new batch (`speedups.recording_of_groups`), never run again, except for groups
    another rank sampled (recordings are large: never sent), whose trunk this rank captures."""
    B, G, R = args.batch_size, args.group_size, run.world
    groups = []  # every rank's groups as plain lists (`group_lists`), in (round, rank, group) order
    recordings = []  # this rank's (trunk recording, prompt length) of each round, or None
    for k in range(args.max_sampling_rounds):
        if k > 0:
            rounds = dict(sampling_round=k, rounds=args.max_sampling_rounds)
            prompts = dataset.batch_for_step(run.train_samples, step - 1, B, args.seed, run.rank, R, **rounds)
            ro = rollout(run, prompts, args)
        mine = [group_lists(ro, slice(g * G, (g + 1) * G)) for g in range(B)]
        groups += distributed.gather_lists(mine)
        recordings.append(
            None if ro.recording is None else (ro.recording, ro.prompts.inputs["input_ids"].shape[1])
        )
        signal = [any(r != group["reward"][0] for r in group["reward"]) for group in groups]
        if sum(signal) >= B * R:
            break
    order = [i for i, s in enumerate(signal) if s] + [i for i, s in enumerate(signal) if not s]
    chosen = order[: B * R][run.rank * B : (run.rank + 1) * B]

    def sample(i: int) -> dict:  # global group i: round i // (B*R), rank i // B % R, index i % B
        rounds = dict(sampling_round=i // (B * R), rounds=args.max_sampling_rounds)  # re-derived, never sent
        return dataset.batch_for_step(run.train_samples, step - 1, B, args.seed, i // B % R, R, **rounds)[
            i % B
        ]

    def recorded(i: int) -> tuple[torch.Tensor, int] | None:  # global group i's trunk rows, if this rank's
        if i // B % R != run.rank or recordings[i // (B * R)] is None:
            return None
        recording, prompt_length = recordings[i // (B * R)]
        return recording[i % B * G : (i % B + 1) * G], prompt_length

    kept = min(sum(signal), B * R)
    counts = {"dynamic/groups_sampled": len(groups), "dynamic/groups_kept": kept, "dynamic/rounds": k + 1}
    chosen_groups = ([sample(i) for i in chosen], [groups[i] for i in chosen], [recorded(i) for i in chosen])
    return rollout_of_groups(run, *chosen_groups, args), counts


def group_lists(ro: Rollout, rows: slice) -> dict:
    """One group's completions and scores as plain lists, to send between ranks."""
    columns = {f: getattr(ro, f) for f in ("completion_ids", "mask", "truncated", "reward")}
    columns.update({f"reward/{name}": values for name, values in ro.components.items()})
    return {"texts": ro.texts[rows], **{key: values[rows].tolist() for key, values in columns.items()}}


def rollout_of_groups(
    run: Run, samples: list[dict], groups: list[dict], recorded: list[tuple | None], args: Args
) -> Rollout:
    """One Rollout from the chosen groups (`group_lists`) of B prompts: prompts re-padded together,
    completions padded to the longest (masks carried over, never recomputed from padding), advantages; the
    trunk from the groups' `recorded` rows where a group has them (`speedups.recording_of_groups`)."""
    T = max(len(group["completion_ids"][0]) for group in groups)

    def column(key: str, pad=None, dtype=None) -> torch.Tensor:  # the groups' rows: (N,), or (N, T) padded
        values = [x if pad is None else x + [pad] * (T - len(x)) for group in groups for x in group[key]]
        return torch.tensor(values, dtype=dtype, device=run.device)

    reward = column("reward", dtype=torch.float32)  # (N,)
    names = [key.removeprefix("reward/") for key in groups[0] if key.startswith("reward/")]
    components = {name: column(f"reward/{name}", dtype=torch.float32) for name in names}
    ids = column("completion_ids", pad=run.tokenizer.pad_token_id)  # (N, T)
    batch = prompt_batch(run, samples, args)
    inputs = data.repeat_rows(batch, args.group_size).inputs  # the rows' pixels: only while chunks are made
    recording = None
    if any(r is not None for r in recorded):
        recording = speedups.recording_of_groups(run.model, inputs, ids, recorded, run.speed, args.group_size)
    return Rollout(
        prompts=batch,
        completion_ids=ids,
        mask=column("mask", pad=False),
        truncated=column("truncated"),
        texts=[text for group in groups for text in group["texts"]],
        samples=[s for s in samples for _ in range(args.group_size)],
        reward=reward,
        components=components,
        adv=advantages(reward, components, run, args),
        chunks=speedups.row_chunks(run.model, inputs, ids, recording, run.speed),
        recording=recording,
    )


# --- Set-up: data, rewards, model, LoRA, optimizer ----------------------------------------------------------


FP16_REFUSED = (
    "float16 is not supported for training (activations overflow, gradients underflow); use bfloat16 "
    "(Ampere or newer) or float32"
)


MAX_SEED = 10**9
# Memory of one built-in sample as tasks.make_task draws it, its PIL images included (measured, rounded up):
# all of them are made before the first step, so --train-size is checked against the machine's memory.
TASK_SAMPLE_BYTES = {
    "shapes": 16 << 10,
    "inspection": 40 << 10,
    "summaries": 2 << 10,
    "inspection-zoom": 256 << 10,
}


def check_args(args: Args) -> None:
    """Every flag's range and every file it names, before anything is loaded or written (cli.UsageError):
    each settings group checks its own, then the trainer's flags and the rules that span groups."""
    cli.check_utf8(args)
    cli.check_finite(args)
    with cli.user_errors():
        args.samples.check()
        with cli.fields_as_flags(args.sampling, args.adv, args.loss):  # grpo.py's settings name fields
            for group in (args.sampling, args.adv, args.loss):
                group.check()
        for group in (args.rewards, args.kl_band, args.lora, args.speed, args.tools):
            group.check()
    a = args
    ranges = [
        ("--steps", a.steps >= 1, "must be >= 1"),
        ("--batch-size", a.batch_size >= 1, "must be >= 1 prompt per step"),
        ("--group-size", a.group_size >= 2, "must be >= 2: each completion is compared with its group"),
        ("--num-iterations", a.num_iterations >= 1, "must be >= 1"),
        ("--max-sampling-rounds", a.max_sampling_rounds >= 1, "must be >= 1"),
        # NOTE: AdamW moves each weight by about lr a step: from 1 on the adapters' outputs overflow at once
        ("--lr", 0 <= a.lr < 1, "must be in [0, 1) (0: the no-update control; e.g. 2e-5 on real models)"),
        ("--warmup-steps", a.warmup_steps >= 0, "must be >= 0"),
        # AdamW scales each weight by 1 - lr * weight_decay a step: past 1 it flips its sign, past 2 grows it
        ("--weight-decay", 0 <= a.weight_decay * a.lr <= 1, "must be >= 0 with --lr x --weight-decay <= 1"),
        ("--max-grad-norm", a.max_grad_norm > 0, "must be > 0"),
        ("--max-bad-steps", a.max_bad_steps >= 0, "must be >= 0"),
        ("--log-every", a.log_every >= 1, "must be >= 1"),
        ("--log-completions-every", a.log_completions_every >= 0, "must be >= 0 (0: never)"),
        ("--eval-every", a.eval_every >= 1, "must be >= 1"),
        ("--eval-num-samples", a.eval_num_samples >= 0, "must be >= 0 (0: off)"),
        ("--save-every", a.save_every >= 1, "must be >= 1"),
        ("--keep-last", a.keep_last >= 1, "must be >= 1"),
        # NOTE: Qwen2/2.5-VL were trained in bf16; in fp16 their activations overflow (transformers#33294,
        # QwenLM/Qwen3#868) and, without loss scaling, GRPO's per-token gradients underflow to zero.
        ("--dtype", a.dtype != "float16", FP16_REFUSED),
    ]
    for flag, ok, message in ranges:
        cli.check(ok, flag, f"{message}, got {getattr(a, flag[2:].replace('-', '_'))}")
    bounds = [
        ("--clip-eps-high", a.loss.clip_eps_high),
        ("--delta", a.loss.delta),
        ("--adv-clip", a.adv.adv_clip),
    ]
    for flag, value in [*bounds, *(("--reward-weight", w) for w in a.rewards.reward_weight)]:
        limit = cli.FLOAT32_FLAG_MAX  # NOTE: the step clips and weighs in float32; beyond, it raises mid-step
        cli.check(
            value is None or abs(value) <= limit, flag, f"must be at most {limit:g} in size, got {value}"
        )
    if not a.samples.data:  # the built-in task's samples, every one made in memory before the first step
        count = a.samples.train_size + a.samples.eval_size
        need, budget = count * TASK_SAMPLE_BYTES[a.samples.task], memory.device_budget(torch.device("cpu"))
        flag = "--train-size" if a.samples.train_size >= a.samples.eval_size else "--eval-size"
        made = f"{a.samples.train_size:,} training and {a.samples.eval_size:,} held-out samples"
        too_many = f"{made} of --task {a.samples.task} would hold {need / memory.GIB:,.1f} GiB in memory"
        cli.check(
            need <= budget,
            flag,
            f"{too_many}, more than 80% of this machine's ({budget / memory.GIB:,.1f} GiB)",
        )
    cli.check(not (a.resume and a.overwrite), "--overwrite", "cannot be combined with --resume")
    temperature = a.sampling.temperature
    cli.check(math.isfinite(temperature), "--temperature", f"must be a finite number, got {temperature}")
    # NOTE: the per-step and per-rank seeds multiply the seed by about 1e10 and must fit torch's 64 bits
    cli.check(0 <= a.seed < MAX_SEED, "--seed", f"must be in [0, {MAX_SEED:,}), got {a.seed}")
    gated_sum = a.adv.multi_objective_aggregation == "normalize_then_sum" and a.rewards.gate
    cli.check(not gated_sum, "--gate", "has no meaning with normalize_then_sum (no total)")
    required = "is required with --data (e.g. --reward label format)"
    cli.check(bool(a.rewards.reward or not a.samples.data), "--reward", required)
    cli.check(a.dist_timeout > 0, "--dist-timeout", f"must be > 0 minutes, got {a.dist_timeout}")
    multi_turn = "cannot be combined with --max-tool-calls > 0 yet (multi-turn rollouts)"
    cli.check(not (a.dynamic_sampling and a.tools.max_tool_calls), "--dynamic-sampling", multi_turn)
    flash = a.attn_implementation != "flash_attention_2" or importlib.util.find_spec("flash_attn") is not None
    needs = "flash_attention_2 needs the flash-attn package (pip install flash-attn; CUDA only); or use sdpa"
    cli.check(flash, "--attn-implementation", needs)


def sampling_options(args: Args, tokenizer, generation_config=None) -> dict:
    """The sampler's keyword arguments from the flags and the checkpoint's end-of-turn ids."""
    config = args.sampling
    return sampling_config.sampler_options(
        tokenizer,
        generation_config,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
    )


def resolve_rewards(args: Args, task: str | None) -> list[rewards.Reward]:
    """--reward (or the built-in task's defaults), --reward-weight and --gate -> the reward functions."""
    config = args.rewards
    return scoring.rewards_from_flags(
        config.reward or tasks.TASK_REWARDS[task], config.reward_weight, config.gate
    )


def fit_memory(
    args: Args,
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    longest_prompt: int,
    budget: int | None = None,
    tool_image_tokens: int = 0,
) -> tuple[speedups.SpeedConfig, list[str]]:
    """The speed settings with --micro-batch-size auto (the default on CUDA) resolved by `memory.fit`, and the
    lines that print the estimate and the choice (on CUDA or with auto). An explicit size is kept as given.
    `tool_image_tokens`: with tools, the visual tokens a row's tool turns may add (in the completion)."""
    speed = args.speed
    auto = speed.micro_batch_size == "auto" or (speed.micro_batch_size is None and device.type == "cuda")
    if not auto and device.type != "cuda":
        return speed, []
    shapes = dict(
        rows=args.batch_size * args.group_size,
        prompt_len=longest_prompt,
        completion_len=args.sampling.max_new_tokens + tool_image_tokens,
        last_k=args.lora.lora_last_k,
        lora_r=args.lora.lora_r,
        dtype_bytes=dtype.itemsize,
        trunk_reuse=speed.trunk_reuse,
        shared_prefill=speed.shared_prefill,
        group_size=args.group_size,
        num_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),  # adapters aside
        tool_image_tokens=tool_image_tokens,
        cuda_graph=speed.cuda_graph and device.type == "cuda",  # the decoding step kept between calls
        device_type=device.type,
    )
    budget = memory.device_budget(device) if budget is None else budget
    size = None if auto else speed.micro_batch_size  # None: memory.fit chooses
    size, checkpointing, lines = memory.fit(
        model.config, budget, size, speed.gradient_checkpointing, **shapes
    )
    return dataclasses.replace(speed, micro_batch_size=size, gradient_checkpointing=checkpointing), lines


def build_run(args: Args, device: torch.device, dtype: torch.dtype, rank: int, world: int) -> Run:
    """Data, rewards, model, LoRA and optimizer. Everything a user can get wrong fails here, before any
    rollout: data, images, prompt lengths, rewards, model path, LoRA placement."""
    train_samples, held_out = dataset.load_samples(args.samples)
    too_few = f"{len(train_samples)} training samples for {world} ranks x {args.batch_size} prompts"
    cli.check(world == 1 or len(train_samples) >= args.batch_size * world, "--batch-size", too_few)
    reward_fns = resolve_rewards(args, None if args.samples.data else args.samples.task)
    # The fields each reward reads, on every sample now, not at the step that first draws a bad one.
    rewards.check_needs(train_samples + held_out, reward_fns, locate=data.location)
    accuracy_name, names = args.rewards.accuracy_reward or reward_fns[0].name, [r.name for r in reward_fns]
    cli.check(accuracy_name in names, "--accuracy-reward", f"{accuracy_name!r} is not a --reward")
    options = dict(device=device, dtype=dtype, attn_implementation=args.attn_implementation)
    model, tokenizer, image_processor = model_files.load_model(args.model, **options)
    # the vision tower on FlashAttention-2's variable-length kernel where it can run (attention.py)
    print_if(rank == 0, attention.set_per_part(model, args.attn_implementation, device, dtype))
    config = args.samples
    dataset.set_pixel_budget(image_processor, config.min_pixels, config.max_pixels)  # before the length check
    with cli.user_errors("--box-frame: "):
        frame = args.rewards.box_frame
        box_frame = grounding.resolve_frame(frame, model.config.model_type, image_processor, names)
    length = dict(max_prompt_length=config.max_prompt_length, max_image_pixels=config.max_image_pixels)
    resized = dataset.check_samples(train_samples + held_out, tokenizer, image_processor, **length)
    message = dataset.describe_resizes(resized, dataset.image_pixel_budget(image_processor))
    print_if(rank == 0 and message is not None, message)
    torch.manual_seed(args.seed)  # LoRA's A init (the same on every rank), then sampling
    lora_config.check_fits(model, args.lora, memory.device_budget(device))  # a huge --lora-r: before it fills
    lora_config.inject(model, args.lora)
    tool_tokens = multiturn.tool_image_tokens(args.tools.max_tool_calls, image_processor)
    speed, lines = fit_memory(
        args, model, device, dtype, resized.longest_prompt, tool_image_tokens=tool_tokens
    )
    print_if(rank == 0 and bool(lines), "\n".join(lines))
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
    mode = args.eval_image_ablation
    ablated = dataset.ablate_images(held_out, mode) if mode != "none" and held_out else []  # for every --seed
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=args.steps)
    # NOTE: the schedule counts skipped steps too; torch warns when the first one is skipped: intended.
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
    return Run(
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        device=device,
        optimizer=optimizer,
        scheduler=scheduler,
        train_samples=train_samples,
        held_out=held_out,
        held_out_ablated=ablated,
        reward_fns=reward_fns,
        accuracy_name=accuracy_name,
        box_frame=box_frame,
        sampling=sampling_options(args, tokenizer, model.generation_config),
        speed=speedups.choose(model, speed, last_k=args.lora.lora_last_k),
        tools=tool_use(args, model, tokenizer, image_processor, rank) if args.tools.max_tool_calls else None,
        rank=rank,
        world=world,
    )


def tool_use(args: Args, model: torch.nn.Module, tokenizer, image_processor, rank: int) -> multiturn.ToolUse:
    """--tools and --max-tool-calls (multiturn.tool_use); the speed-up that cannot carry them says so."""
    suppressed = sampling_options(args, tokenizer, model.generation_config)["suppress_token_ids"]
    options = dict(
        box_frame=args.rewards.box_frame, model_type=model.config.model_type, suppressed=suppressed
    )
    max_length = args.samples.max_prompt_length + args.sampling.max_new_tokens
    options.update(max_length=max_length, max_image_pixels=args.samples.max_image_pixels)
    with cli.user_errors():
        use = multiturn.tool_use(args.tools, tokenizer, image_processor, **options)
    print_if(
        rank == 0 and args.speed.shared_prefill,
        "--max-tool-calls: multi-turn rollouts sample with generate, turn by turn (shared prefill is off for "
        "them); trunk reuse and micro-batches carry them",
    )
    return use


def describe(run: Run, args: Args, dtype: torch.dtype) -> str:
    params = lora.lora_parameters(run.model)
    ranks = f"; {run.world} ranks x {args.batch_size} prompts" if run.world > 1 else ""
    return (
        f"{args.model}: LoRA r={args.lora.lora_r} on {len(params) // 2} modules of the last "
        f"{args.lora.lora_last_k} blocks, {sum(p.numel() for p in params):,} trainable parameters; "
        f"{len(run.train_samples)} training samples; {run.device}, {dtype}{ranks}"
    )


# --- Resume and checkpoints (checkpoints.py) ---------------------------------------------------------------


def save(directory: Path, run: Run, step: int, beta: float, run_id: str, args: Args) -> None:
    """A checkpoint folder (checkpoints.save_checkpoint): the adapter, and the state --resume reads back."""
    optimizer, scheduler = run.optimizer.state_dict(), run.scheduler.state_dict()
    settings = dataclasses.asdict(args)
    state = dict(step=step, beta=beta, run_id=run_id, optimizer=optimizer, scheduler=scheduler, args=settings)
    adapter = functools.partial(adapters.save_adapter, run.model, base_model_name_or_path=args.model)
    with checkpoints.writing(directory.parent, directory):
        checkpoints.save_checkpoint(
            directory, write_adapter=adapter, state=state, keep_last=args.keep_last, run_id=run_id
        )


def write_report(out: Path) -> None:
    """report.html in the run folder (report.py), written whole. It only shows the run's files: a failure to
    build it is printed as one warning and the run goes on."""
    try:
        with checkpoints.writing(out, out / "report.html"):
            report.write_report(out, out / "report.html")
    except Exception as e:  # noqa: BLE001 (any bug of the report's; the run's own files are intact)
        print(f"\nwarning: report.html not written: {type(e).__name__}: {e}", flush=True)


def resume_from(path: str, out: Path, run: Run) -> tuple[int, float, str]:
    """Load adapter, optimizer, scheduler and RNG states of the latest intact checkpoint (or the one named):
    (step, beta, run id). Damaged checkpoints passed over are reported; a checkpoint of another run than the
    folder's run.json is refused."""
    with cli.user_errors("--resume: "):
        checkpoint, state, run_id, report = checkpoints.checkpoint_to_resume(path, out)
    print_if(run.rank == 0 and report is not None, f"warning: {report}")
    with cli.user_errors(f"--resume {checkpoint}: "):
        adapters.load_adapter(run.model, checkpoint)
    problem = checkpoints.trainer_state_problem(state, required=checkpoints.RESUME_FIELDS)
    problem = problem or checkpoints.optimizer_state_problem(state["optimizer"], run.optimizer)
    problem = problem or checkpoints.scheduler_state_problem(state["scheduler"], run.scheduler)
    cli.check(problem is None, "--resume", f"{checkpoint / checkpoints.STATE_FILE}: {problem}")
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    checkpoints.set_rng_state(state["rng"])
    return state["step"], state["beta"], run_id


# The flags a resumed run may change: how long it trains, what it logs, evaluates and saves, where and how
# fast it runs (speed-ups and devices of one kind give equal results to rounding), never a step's computation.
RESUME_MAY_CHANGE = {
    *("steps", "device", "log_every", "log_completions_every", "report_to", "eval_every"),
    *("eval_image_ablation", "eval_num_samples", "save_every", "keep_last", "max_bad_steps"),
    *("output_dir", "resume", "overwrite", "dry_run"),
    *(field.name for field in dataclasses.fields(speedups.SpeedConfig)),
}


def command_line(argv: list[str]) -> Args:
    """The flags. With --resume DIR the run's recorded settings are the defaults, so that only what is typed
    can differ from them (and `main` refuses what may not)."""
    given = [a.partition("=")[2] or next(iter(argv[i + 1 :]), "") for i, a in enumerate(argv)]
    resume = next((g for a, g in zip(argv, given) if a.partition("=")[0] == "--resume"), None)
    if not resume:
        return tyro.cli(Args, args=argv)
    with cli.user_errors():
        out = checkpoints.run_folder(None, resume)
        record = checkpoints.read_run_record(out) or {}
    with cli.user_errors(f"{out / 'run.json'}: "):
        recorded = checkpoints.settings_from_record(record.get("args") or {}, Args)
    return tyro.cli(Args, args=argv, default=dataclasses.replace(recorded, output_dir=None, overwrite=False))


def typed_flags(argv: list[str]) -> set[str]:
    """The flags typed in `argv` (`--reward a b`, `--tools=x`: {"--reward", "--tools"}), for `main`'s
    `typed`: with --resume, the plug-ins of a flag typed again are accepted as their files are now."""
    return {a.partition("=")[0] for a in argv if a.startswith("--")}


def run_settings(args: Args, out: Path, mode: str, writer: bool) -> dict | None:
    """run.json's "args" for this start (a resumed run: the record, checked, with the changes allowed), or
    None when --resume finds the run finished: then it says so, and how to extend it."""
    if mode != "resume":
        print_if(
            writer and args.resume and mode == "replace", f"{out}: no checkpoint yet, starting at step 0"
        )
        return dataclasses.asdict(args)
    with cli.user_errors():  # a flag that may not change; --steps below the checkpoint's step
        settings, note = checkpoints.resumed_settings(out, dataclasses.asdict(args), RESUME_MAY_CHANGE)
        print_if(note is not None, note)
        finished = checkpoints.finished_run(args.resume, out, args.steps)
    print_if(writer and finished is not None, finished)
    return settings if finished is None else None


def plugin_flags(args: Args) -> dict[str, tuple[str, ...]]:
    """The flags that may name plug-ins (code run.json names, which a resume imports), with their values."""
    return {"--reward": args.rewards.reward, "--tools": args.tools.tools}


def check_plugins(args: Args, out: Path, mode: str, typed: Collection[str], writer: bool) -> list[dict]:
    """run.json's "plugins" for this start (plugins.plugin_records), before any plug-in is imported. A
    resumed run prints each one it imports, and refuses one whose file changed since the run started (or
    whose hash run.json lacks) unless its flag is among `typed` (given again on the command line)."""
    with cli.user_errors():
        current = plugins.plugin_records(plugin_flags(args))
        if mode == "resume":
            record = checkpoints.read_run_record(out) or {}
            recorded = record.get("plugins")
            where = out / "run.json"
            lines = plugins.check_resumed(recorded, current, plugin_flags(args), typed, where)
            print_if(writer and bool(lines), "\n".join(lines))
    return current


def halt_reason(stop: cli.Signals, bad_in_a_row: int, args: Args) -> str | None:
    """Why the run stops after this step (a signal on any rank, too many bad steps), or None to go on.
    NOTE: the requests are read once and only the all-reduced value decides (a second read could differ)."""
    requests = list(stop.requests)
    if distributed.any_rank(bool(requests)):
        return requests[0] if requests else "a stop request on another rank"
    if bad_in_a_row > args.max_bad_steps:
        return f"{bad_in_a_row} bad steps in a row"
    return None


# --- Evaluation, logging, plots -----------------------------------------------------------------------------


# Held-out prompts per greedy batch. Under torchrun a rank decodes whole batches of those one process makes:
# a sample's greedy completion (its batch's padding) is then the same for any number of ranks.
EVAL_BATCH_SIZE = 50


@torch.no_grad()
def evaluate(run: Run, args: Args, step: int = 0) -> tuple[dict, list[dict], dict[str, bytes]]:
    """Greedy held-out accuracy (accuracy reward == 1) and mean reward; also with --eval-image-ablation's;
    with --eval-num-samples n, eval/pass@1 .. pass@n (`pass_at_k_sums`, its draws seeded by `step`).
    Also each held-out sample's record for eval_samples.jsonl (the main set's, in held-out order) and the
    thumbnails they name that no rank handed to the writer before (file name -> JPEG).
    Under torchrun rank r decodes batches r, r + R, ... and the ranks' sums and records are gathered: every
    rank returns one process's numbers. A failure on one rank (a reward plug-in) is raised on all: none waits
    alone."""
    run.model.eval()
    sets = (("", run.held_out), (f"_{args.eval_image_ablation}", run.held_out_ablated))
    try:
        # the main set's per-sample records only: the ablated copy's are not logged
        per_set = [held_out_sums(run, samples, args, records=not i) for i, (_, samples) in enumerate(sets)]
        mine = {"sums": [sums for sums, _, _ in per_set], "samples": per_set[0][1], "files": per_set[0][2]}
        mine["pass"] = pass_at_k_sums(run, run.held_out, args, step) if args.eval_num_samples else []
    except (Exception, cli.Stopped) as error:
        distributed.gather_lists([{"failed": getattr(error, "user_message", None) or str(error)}])
        raise
    ranks = distributed.gather_lists([mine])  # in rank order; one process: its own
    failed = [(rank, r["failed"]) for rank, r in enumerate(ranks) if "failed" in r]
    if failed:
        raise cli.UsageError(f"evaluation on rank {failed[0][0]}: {failed[0][1]}")
    scores = {}
    for i, (suffix, samples) in enumerate(sets):
        if samples:
            scores[f"eval/accuracy{suffix}"] = sum(r["sums"][i][0] for r in ranks) / len(samples)
            scores[f"eval/reward{suffix}"] = sum(r["sums"][i][1] for r in ranks) / len(samples)
        if samples and run.tools is not None:  # calls per completion
            scores[f"eval/tools/calls{suffix}"] = sum(r["sums"][i][2] for r in ranks) / len(samples)
    for k in range(1, args.eval_num_samples + 1):
        scores[f"eval/pass@{k}"] = sum(r["pass"][k - 1] for r in ranks) / len(run.held_out)
    records = sorted((record for r in ranks for record in r["samples"]), key=lambda record: record["index"])
    return scores, records, merged([r["files"] for r in ranks])


def held_out_sums(
    run: Run, samples: list[dict], args: Args, *, records: bool = False
) -> tuple[tuple[int, float, int], list[dict], dict[str, bytes]]:
    """(correct, summed reward, tool calls) of this rank's greedy batches of `samples` (batches rank,
    rank + R, ...); with `records`, each of those samples' record for eval_samples.jsonl ("index": its place
    in `samples`; no "step") and the new thumbnail files they name."""
    totals, correct, calls, ends = [], [], 0, run.sampling["eos_token_id"]
    logged, made = [], {}
    greedy = dict(run.sampling, temperature=0.0, group_size=1, record=False)
    for i in range(run.rank * EVAL_BATCH_SIZE, len(samples), run.world * EVAL_BATCH_SIZE):
        chunk = samples[i : i + EVAL_BATCH_SIZE]
        thumbs = None  # the records' thumbnails, made aside while the batch decodes (with tools: after it)
        if records and run.tools is None:
            thumbs = thumbnails.keep_aside(chunk, run.image_processor, run.kept)
        batch = prompt_batch(run, chunk, args)
        chunk = dataset.with_grounding(chunk, run.image_processor, run.box_frame)
        turns = None
        if run.tools is None:
            ids, _ = speedups.sample(run.model, batch.inputs, run.speed, **greedy)  # (n, T)
            mask, truncated = grpo.completion_mask(ids, ends)
            texts = data.decode_completions(run.tokenizer, ids, mask, ends)
        else:  # multi-turn: the final answers scored, the trajectories and calls in the samples
            options = dict(group_size=1, sampling=dict(run.sampling, temperature=0.0))
            rollouts = multiturn.sample(run.model, batch, chunk, run.tools, **options)
            texts, chunk, mask = rollouts.texts, rollouts.samples, rollouts.mask
            truncated, turns = rollouts.truncated, rollouts.turns
            calls += int(rollouts.counts["calls"].sum())
        lengths, timeout = mask.sum(1).tolist(), args.rewards.reward_timeout
        scores = scoring.score(texts, chunk, run.reward_fns, completion_lengths=lengths, timeout=timeout)
        totals += scores.total
        correct += [v >= 1.0 for v in scores.components[run.accuracy_name]]
        if records:
            new, files = eval_records(
                run, i, chunk, texts, scores, lengths, truncated.tolist(), turns, thumbs=thumbs
            )
            logged, made = logged + new, made | files
    return (sum(correct), sum(totals), calls), logged, made


@torch.no_grad()
def pass_at_k_sums(run: Run, samples: list[dict], args: Args, step: int) -> list[float]:
    """Over this rank's prompts of `samples`, the sums of pass@1 .. pass@n (pass_at_k.py), n = --eval-num-
    samples completions each sampled as training samples them (temperature, top-p, speed-ups), the accuracy
    reward >= 1 counted correct. Batches of about EVAL_BATCH_SIZE rows, rank r's are r, r + R, ...; each batch
    draws from its own seed, (--seed, step, batch), inside torch.random.fork_rng: training's random stream
    is left as it was, and every number of ranks draws the same completions."""
    n, ends = args.eval_num_samples, run.sampling["eos_token_id"]
    size = max(1, EVAL_BATCH_SIZE // n)  # prompts a batch
    sums, devices = [0.0] * n, [] if run.device.type == "cpu" else [run.device]
    for i in range(run.rank * size, len(samples), run.world * size):
        chunk = samples[i : i + size]
        batch = prompt_batch(run, chunk, args)
        chunk = dataset.with_grounding(chunk, run.image_processor, run.box_frame)
        key = hashlib.sha256(f"eval pass@k/{args.seed}/{step}/{i // size}".encode()).digest()
        with torch.random.fork_rng(devices, device_type=None if not devices else run.device.type):
            torch.manual_seed(int.from_bytes(key[:8], "little"))  # 64 bits, apart from every training seed
            if run.tools is None:  # rows b*n .. b*n + n - 1 are prompt b's
                options = dict(run.sampling, group_size=n, record=False)
                ids, _ = speedups.sample(run.model, batch.inputs, run.speed, **options)  # (B*n, T)
                mask, _ = grpo.completion_mask(ids, ends)
                texts = data.decode_completions(run.tokenizer, ids, mask, ends)
                rows = [sample for sample in chunk for _ in range(n)]
            else:
                rollouts = multiturn.sample(
                    run.model, batch, chunk, run.tools, group_size=n, sampling=run.sampling
                )
                texts, rows, mask = rollouts.texts, rollouts.samples, rollouts.mask
        lengths, timeout = mask.sum(1).tolist(), args.rewards.reward_timeout
        scores = scoring.score(texts, rows, run.reward_fns, completion_lengths=lengths, timeout=timeout)
        correct = [v >= 1.0 for v in scores.components[run.accuracy_name]]
        for b in range(len(chunk)):
            c = sum(correct[b * n : (b + 1) * n])
            sums = [total + pass_at_k.pass_at_k(n, c, k) for k, total in enumerate(sums, start=1)]
    return sums


def eval_records(
    run: Run,
    first: int,
    samples: list[dict],
    texts: list[str],
    scores: rewards.Scores,
    lengths: list[int],
    truncated: list[bool],
    turns: list[list[dict]] | None,
    thumbs: concurrent.futures.Future | None = None,
) -> tuple[list[dict], dict[str, bytes]]:
    """eval_samples.jsonl's records (without "step") of held-out samples first, first + 1, ... and their
    greedy completions (`turns`: None without tools), and the new thumbnail files they name (`thumbs`: their
    thumbnails.keep if started already). "correct" is
    the accuracy reward >= 1, as eval/accuracy counts it."""
    extras, turns, made = logged_fields(run, samples, texts, turns, thumbs)
    records = []
    for k, (sample, text, fields) in enumerate(zip(samples, texts, extras)):
        images = [logs.image_reference(image) for image in sample.get("images") or []]
        record = {
            "index": first + k,
            "sample_id": sample.get("id"),
            "images": images,
            "thumbs": fields["thumbs"],
        }
        record |= {"prompt": fields["prompt"], "target": fields["target"], "completion": text}
        record["rewards"] = {name: float(values[k]) for name, values in scores.components.items()}
        correct = scores.components[run.accuracy_name][k] >= 1.0
        record |= {"reward": float(scores.total[k]), "correct": bool(correct)}
        record |= {"length": int(lengths[k]), "truncated": bool(truncated[k])}
        if "boxes_parsed" in fields:
            record["boxes_parsed"] = fields["boxes_parsed"]
        if turns is not None:
            record["turns"] = turns[k]
        records.append(record)
    return records, made


def print_if(condition: bool, *values) -> None:  # on the writing rank only, not R times
    if condition:
        print(*values)


def finish(run: Run, args: Args, out: Path, seconds: float) -> dict:
    print()  # the final adapter, the curves and the summary (rank 0)
    with checkpoints.writing(out, out / "adapter"):
        adapters.save_adapter(run.model, out / "adapter", base_model_name_or_path=args.model)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with checkpoints.writing(out, out / "curves.png"):
        logs.plot_curves(records, out / "curves.png")
    summary = logs.run_summary(records, seconds)
    with checkpoints.writing(out, out / "run.json"):
        checkpoints.mark_finished(out, summary)
    write_report(out)  # after run.json: it shows the run finished
    print(f"done: {json.dumps(summary)}; adapter in {out / 'adapter'}, curves in {out / 'curves.png'}")
    return summary


def dry_run(run: Run, args: Args) -> dict:
    """One rollout, its rewards and one loss (with its backward, to exercise the gradient path), no update."""
    print(json.dumps(dataclasses.asdict(args), indent=2, ensure_ascii=False))
    params = lora.lora_parameters(run.model)
    print(f"trainable parameters: {sum(p.numel() for p in params):,} in {len(params) // 2} LoRA modules")
    prompts = dataset.batch_for_step(run.train_samples, 0, args.batch_size, args.seed)
    ro = (tool_rollout if run.tools else rollout)(run, prompts, args)
    frozen_logprobs(run, ro, args)
    loss, stats, _ = accumulate_policy_gradient(run, ro, args, args.loss.beta)  # no optimizer step
    run.model.zero_grad(set_to_none=True)
    for i, (text, r, a) in enumerate(zip(ro.texts, ro.reward.tolist(), ro.adv.tolist())):
        print(f"row {i:3d}  reward {r:.2f}  adv {a:+.2f}  {text!r}")
    print(f"loss {loss:.4f}  {stats}")
    return {"loss": loss, **stats}


# --- Main: check, set up, then the loop: step -> log -> evaluate -> checkpoint ------------------------------


def failed_step(error: BaseException, step: int, run: Run, out: Path, beta: float, run_id: str, args: Args):
    """After the user's code failed (a reward plug-in, a bad sample) or a signal stopped it: the checkpoint
    of the last finished `step` (unless written already; none before step 1), so that `--resume` continues
    once it is fixed, then the error again, its message saying so. A bug returns: its traceback as it is."""
    message = getattr(error, "user_message", None)
    if message is None and not isinstance(error, cli.UsageError | cli.Stopped):
        return
    if step > 0 and not (out / f"checkpoint-{step:06d}").exists():
        save(out / f"checkpoint-{step:06d}", run, step, beta, run_id, args)
    again = f"python -m grpo_vlm --resume {out}" if step > 0 else "the same command (it starts the run again)"
    done = f"checkpoint of step {step} written" if step > 0 else "no step finished"
    if isinstance(error, cli.Stopped):  # "stopped by SIGTERM while a tool ran" (cli.call_plugin)
        raise cli.Stopped(f"{error}; {done}. Continue with: {again}")
    if message is None:
        raise cli.UsageError(f"{error}; {done}. Once that is fixed, continue with: {again}")
    error.user_message = f"{message}; {done}. Once that is fixed, continue with: {again}"
    raise error


def write_step(
    log: logs.StepLog,
    out: Path,
    made: dict[str, bytes],
    record: dict,
    timings: dict,
    completions: list[dict],
    bad_in_a_row: int,
    evaluated: Collection[dict] = (),
) -> None:
    """The writing rank's files of a step: the thumbnails first, then the lines that name them (metrics,
    timings, rollouts, eval samples); an OSError names the file."""
    with checkpoints.writing(out):
        thumbnails.write(out, made)
        log.step(record, timings, completions, bad_in_a_row, evaluated)


def train_loop(
    run: Run,
    args: Args,
    stop: cli.Signals,
    log: logs.StepLog | None,
    out: Path,
    start_step: int,
    beta: float,
    run_id: str,
) -> dict:
    """Steps start_step + 1 .. args.steps; every rank evaluates its share, the writing rank (log is not None)
    logs and saves."""
    bad_in_a_row = 0
    steps = range(start_step + 1, args.steps + 1)
    with prompts_ahead(run, args, steps) as prepared:  # the next step's prompts, made while this one runs
        for step in steps:
            # step - 1's checkpoint takes it, should this step fail in user code
            rng = checkpoints.rng_state()
            try:
                record, timings, ro = train_step(step, run, args, beta, prepared=prepared(step))
            except (Exception, cli.Stopped) as error:
                # NOTE: the rewards come before the update: the model holds step - 1's state
                if log is not None:
                    checkpoints.set_rng_state(rng)
                    failed_step(error, step - 1, run, out, beta, run_id, args)  # a user's failure: raised
                raise
            # rollouts.jsonl's rows and their thumbnails' files (all ranks take part)
            completions, made = completion_rows(step, ro, run, args)
            del ro  # NOTE: its chunks and trunk recordings are freed before the next step samples, not after
            if args.kl_band.kl_target_low is not None and "kl" in record:  # adaptive KL: the next step's beta
                beta = adaptive_kl.adapt_beta(beta, record["kl"], args.kl_band)
            bad_in_a_row = bad_in_a_row + 1 if record["skipped"] else 0  # global: the same on every rank
            evaluated = []  # eval_samples.jsonl's records of this step's evaluation
            try:  # every rank evaluates its share; a failure on one is raised on all (`evaluate`)
                if run.held_out and (step % args.eval_every == 0 or step == args.steps):
                    scores, evaluated, eval_made = evaluate(run, args, step)
                    record.update(scores)
                    made |= eval_made
            except (Exception, cli.Stopped) as error:  # the step's update is done: logged and saved without
                try:
                    if log is not None:
                        write_step(log, out, made, record, timings, completions, bad_in_a_row)
                        failed_step(error, step, run, out, beta, run_id, args)
                finally:
                    distributed.barrier()  # NOTE: torchrun ends every rank once one exits: not before saving
                raise
            if log is not None:
                write_step(log, out, made, record, timings, completions, bad_in_a_row, evaluated)
            halt = halt_reason(stop, bad_in_a_row, args)
            if log is not None and (step % args.save_every == 0 or step == args.steps or halt):
                save(out / f"checkpoint-{step:06d}", run, step, beta, run_id, args)
                if step < args.steps or halt:  # the last step's report: `finish` writes it, after the adapter
                    write_report(out)
            if halt:
                distributed.barrier()  # every rank exits only once rank 0's checkpoint is written
                message = f"stopped after step {step} ({halt}); checkpoint written. Continue with: "
                message += f"python -m grpo_vlm --resume {out}"
                if stop.requests:
                    raise cli.Stopped(message)
                raise SystemExit(message)
    return finish(run, args, out, time.time() - log.t_start) if log is not None else {}


def main(args: Args, typed: Collection[str] = (), argv: Sequence[str] | None = None) -> dict:
    """Train; returns the summary. Bad flags, files or data raise cli.UsageError before anything is written;
    a signal stops cleanly (cli.Stopped): before the first write with nothing left behind, later after the
    current step (at once while a reward function runs) and a checkpoint. `typed`: the flags given on the
    command line (`typed_flags`); with --resume, the plug-ins of --reward or --tools typed again are
    accepted as their files are now. `argv`: the command line's arguments, which run.json records."""
    with cli.signals() as stop, contextlib.ExitStack() as held:  # a plug-in's call is abortable: cli.Signals
        check_args(args)
        if args.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
            distributed.use_deterministic_algorithms()
        with cli.user_errors():
            device = distributed.resolve_device(args.device)
            out = checkpoints.run_folder(args.output_dir, args.resume)
        # NOTE: torch has no deterministic cumsum on CUDA, which top-p sampling needs (ours and generate's)
        no_cumsum = args.deterministic and args.sampling.top_p < 1 and device.type == "cuda"
        message = "cannot sample with --top-p < 1 on CUDA: torch has no deterministic cumsum there"
        cli.check(not no_cumsum, "--deterministic", message)
        timeout = dict(timeout_minutes=args.dist_timeout)
        rank, world = distributed.init_distributed(device, **timeout)  # (0, 1) without torchrun
        writer = rank == 0  # the only rank that writes files and prints progress
        # --dry-run writes nothing: it takes no lock
        held.enter_context(checkpoints.run_folder_lock(out, hold=writer and not args.dry_run))
        with cli.user_errors():
            options = dict(resume=args.resume, overwrite=args.overwrite)
            mode = "new" if args.dry_run else checkpoints.check_run_folder(out, **options)
        if (settings := run_settings(args, out, mode, writer)) is None:
            return {}  # --resume of a finished run
        plugin_files = check_plugins(args, out, mode, typed, writer)
        with cli.user_errors():
            dtype = model_files.resolve_dtype(args.dtype, device)
            run = build_run(args, device, dtype, rank, world)  # data, rewards, model: every input checked
        held.callback(run.kept.close)  # the thumbnails' thread ends with the run, however it ends
        if args.dry_run:
            return dry_run(run, args)
        start_step, beta, run_id = 0, args.loss.beta, uuid.uuid4().hex
        if mode == "resume":
            start_step, beta, run_id = resume_from(args.resume, out, run)
            print_if(writer, f"resumed {out} from step {start_step}")
        print_if(writer, describe(run, args, dtype))
        first, evaluated, made = None, [], {}
        if start_step == 0:  # the step-0 evaluation, logged once the run folder is set up
            scores, evaluated, made = evaluate(run, args) if run.held_out else ({}, [], {})
            first = {"step": 0, **scores}
        stop.defer()  # from here on files are written: a signal lets the step finish and checkpoints
        log = None
        if writer:
            with cli.user_errors():  # a run file that is a FIFO or folder; a tracker that cannot start
                command = None if argv is None else shlex.join(["python", "-m", "grpo_vlm", *argv])
                replaced = checkpoints.open_run_folder(
                    out, mode, run_id, start_step, settings, plugin_files, command=command
                )
                if mode == "resume":  # the -seen images' budget counts what the earlier starts kept
                    run.kept.seen_bytes = thumbnails.seen_bytes_in(out)
                tracker = trackers.open_tracker(args.report_to, out, settings, run_name=out.name)
            print_if(replaced is not None, replaced)
            accuracy = (first or {}).get("eval/accuracy")
            progress = (start_step, args.steps, args.log_every, args.group_size, args.sampling.temperature)
            log = logs.StepLog(out, tracker, time.time(), *progress, accuracy=accuracy)
            if first is not None:
                with checkpoints.writing(out):
                    thumbnails.write(out, made)
                    log.first(first, evaluated)
        distributed.barrier()
        try:
            return train_loop(run, args, stop, log, out, start_step, beta, run_id)
        finally:
            if log is not None:
                log.close()
