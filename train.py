"""GRPO with LoRA on a Qwen-VL style model: the command-line trainer.

    python train.py                               # embedded tiny VLM, built-in task, CPU, a few minutes
    python train.py --help                        # every flag, with its documentation
    python train.py --dry-run                     # one rollout + rewards + loss, no update, then exit
    python train.py --resume runs/grpo            # continue a run from its latest checkpoint
    python train.py --model Qwen/Qwen2.5-VL-3B-Instruct --data my.jsonl --reward label format \\
        --reward-weight 1.0 0.5 --gate format --device cuda --max-new-tokens 128 --lr 1e-5
    torchrun --nproc-per-node 8 train.py --device cuda ...  # R ranks, each on B prompts (README: torchrun)

One training step (see `main`): sample G completions for each of B prompts with the current policy
(no grad) -> score them with the reward functions -> group z-score advantages -> recompute the
completion log-probs WITH gradient (same images, masks, temperature) -> PPO-clip + KL loss ->
optimizer step on the LoRA parameters only -> log. The reference policy is the same model with its
adapters switched off. The algorithm lives in grpo.py, the rewards in rewards.py, LoRA in lora.py,
inputs in data.py and loading/checkpoints in model_io.py; this file only wires them together.

Under torchrun (R ranks, "Several processes" below) each rank samples B whole groups of one global batch of
B*R prompts, normalises its loss by the global counts and the LoRA gradients are summed: the update equals
one process on B*R prompts. Rank 0 alone evaluates and writes files. R = 1 runs exactly as one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import time
import warnings
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


@dataclass
class Args:
    # --- model ---
    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, or a text-only causal LM.
    The default is the tiny Qwen2.5-VL shipped in assets/."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""

    # --- data ---
    data: tuple[str, ...] = ()
    """Training JSONL file(s). Empty: the built-in task `--task`."""
    eval_data: str | None = None
    """Held-out JSONL file. Default: the built-in task's held-out split (or none for --data)."""
    task: Literal["inspection", "shapes", "summaries"] = "inspection"
    """Built-in synthetic task used when --data is empty: inspection (1-4 photos -> 通过/不通过 + 理由),
    shapes (one photo -> 'red circle'), summaries (the inspection verdict from per-photo text summaries)."""
    prompt_template: str | None = None
    """Text file with placeholders {prompt}, {summaries}, {num_images}: renders samples that carry per-image
    `summaries` instead of images (numbered 图片_1: ...). Default: prompt, newline, the numbered lines."""
    train_size: int = 2000
    """Number of built-in training samples."""
    eval_size: int = 200
    """Number of held-out samples evaluated (built-in task, or the first ones of --eval-data)."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image tokens included. Longer prompts raise (never truncated)."""

    # --- lora ---
    lora_last_k: int = 4
    """LoRA goes into the last K decoder blocks of the language model (vision tower frozen)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is B @ A * alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch input during the gradient pass."""

    # --- rollout ---
    batch_size: int = 16
    """B: prompts per step (per rank under torchrun: the global batch is B*R prompts)."""
    group_size: int = 8
    """G: completions sampled per prompt (the group that advantages are normalised within)."""
    max_new_tokens: int = 24
    """Longest completion; a completion that reaches it without EOS counts as truncated."""
    temperature: float = 1.0
    """Sampling temperature; the recompute divides logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""

    # --- rewards ---
    reward: tuple[str, ...] = ()
    """Reward names (label, format, exact_match, answer_match, numeric_match, think_answer_format, iou)
    or plug-ins 'module:function'. Default: answer_match for shapes; label and format for inspection."""
    reward_weight: tuple[float, ...] = ()
    """One weight per --reward (default 1.0 each)."""
    gate: tuple[str, ...] = ()
    """Rewards (from --reward) that zero the total when they fail, e.g. format."""
    accuracy_reward: str | None = None
    """The reward whose value 1.0 means 'correct' (accuracy, length of correct completions). Default:
    the first --reward."""

    # --- loss ---
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Aggregation of per-token losses (see grpo.aggregate)."""
    beta: float = 0.04
    """KL penalty weight (k3 estimator against the adapter-free reference). 0 skips the reference pass."""
    clip_eps_low: float = 0.2
    """PPO clip: ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """PPO clip: ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher when > clip_eps_low)."""
    num_iterations: int = 1
    """mu: optimizer steps per rollout batch. > 1 stores old log-probs at rollout time."""
    adv_scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group's std, the batch's std, or nothing (Dr. GRPO)."""
    kl_target_low: float | None = None
    """Adaptive KL: after each step, divide beta by --kl-adapt-factor when the measured KL is below this.
    Off unless both --kl-target-low and --kl-target-high are given."""
    kl_target_high: float | None = None
    """Adaptive KL: multiply beta by --kl-adapt-factor when the measured KL is above this."""
    kl_adapt_factor: float = 1.5
    """Adaptive KL: the factor beta is multiplied or divided by."""
    adv_clip: float | None = None
    """Clip advantages to [-c, c] (e.g. 5.0). None: no clipping."""
    mask_truncated: bool = False
    """Drop completions that hit --max-new-tokens without EOS from the loss (DAPO's overlong filtering)."""

    # --- optimisation ---
    steps: int = 100
    """Number of training steps (rollout batches)."""
    lr: float = 2e-3
    """Peak learning rate of AdamW on the LoRA parameters (tiny model; use ~1e-5..5e-5 on real models)."""
    warmup_steps: int = 5
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient-norm clipping of the LoRA gradients."""
    max_bad_steps: int = 3
    """A step whose loss or gradient is not finite is skipped (and logged); more than this many in a row
    stop the run with a checkpoint."""

    # --- speed (each one leaves the results unchanged; tests/test_speed.py) ---
    shared_prefill: bool = True
    """Sample with our own decoding loop (grpo.sample_shared_prefill): each prompt's prefill runs once and its
    KV cache is copied to its G rows, and with --trunk-reuse the frozen trunk's output is recorded on the way
    (no trunk forward left to run). Same tokens as generate. --no-shared-prefill: transformers' generate,
    which prefills every prompt G times."""
    trunk_reuse: bool = True
    """Compute the frozen trunk (vision tower and the first L - K blocks) once per batch, without grad (with
    --shared-prefill: recorded while sampling, no extra forward), and run only the K adapted blocks for the
    policy, the reference and the old policy. --no-trunk-reuse: a full forward for each."""
    micro_batch_size: int | None = None
    """Rows per chunk of the log-prob recomputes and of the backward (gradient accumulation, same loss).
    None: all N = B*G rows at once."""
    gradient_checkpointing: bool = False
    """Recompute the adapted blocks' activations in the backward instead of keeping them (non-reentrant)."""

    # --- logging, evaluation, checkpoints ---
    output_dir: str = "runs/grpo"
    """Run folder: metrics.jsonl, checkpoint-*/, adapter/, curves.png."""
    eval_every: int = 25
    """Greedy held-out evaluation every this many steps (and before the first and after the last)."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end)."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints."""
    resume: str | None = None
    """Run folder or checkpoint folder to continue from."""
    overwrite: bool = False
    """Allow writing into an output dir that already holds a run (its files are replaced)."""
    dry_run: bool = False
    """Load model and data, run one rollout, one reward pass and one loss without updating, print, exit."""
    seed: int = 0
    """Seeds data order, sampling and LoRA initialisation."""


DEFAULT_REWARDS = {
    "shapes": ("answer_match",),
    "inspection": ("label", "format"),
    "summaries": ("label", "format"),
}


# --------------------------------------------------------------------------------------------------
# Setup


def resolve_rewards(args: Args, task: str | None) -> list[rewards.Reward]:
    names = args.reward or DEFAULT_REWARDS.get(task, ())
    if not names:
        raise ValueError("--reward is required with --data (e.g. --reward label format)")
    if args.reward_weight and len(args.reward_weight) != len(names):
        raise ValueError(f"--reward-weight has {len(args.reward_weight)} values for {len(names)} rewards")
    return rewards.parse_reward_specs(list(names), list(args.reward_weight) or None, list(args.gate) or None)


def load_samples(args: Args) -> tuple[list[dict], list[dict]]:
    """(train, held-out) samples from --data/--eval-data or the built-in task."""
    if args.data:
        train = []
        for path in args.data:
            loaded = data.read_jsonl(path)
            print(f"loaded {len(loaded)} samples from {path}")
            train += loaded
        held_out = data.read_jsonl(args.eval_data)[: args.eval_size] if args.eval_data else []
    else:
        train = data.make_task(args.task, args.train_size, seed=args.seed)
        held_out = data.make_task(args.task, args.eval_size, split="test", seed=args.seed)
    template = Path(args.prompt_template).read_text(encoding="utf-8") if args.prompt_template else None
    return data.apply_prompt_template(train, template), data.apply_prompt_template(held_out, template)


def batch_for_step(samples: list[dict], step: int, batch_size: int, seed: int) -> list[dict]:
    """The B samples of a step: epochs of seeded permutations, a pure function of the step (resumable)."""
    per_epoch = max(len(samples) // batch_size, 1)
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return [samples[i] for i in order[k * batch_size : (k + 1) * batch_size].tolist()]


def suppressed_tokens(tokenizer) -> list[int]:
    """Special tokens a completion must never contain: vision markers and chat control, except EOS."""
    # NOTE: a tokenizer without these tokens maps them to its unk id (or None); those are not suppressed.
    # (No `t in tokenizer.get_vocab()`: that builds a 151k-entry dict per call, and this runs every step.)
    vision = {
        tokenizer.convert_tokens_to_ids(t) for t in (data.IMAGE_PAD, data.VISION_START, data.VISION_END)
    }
    vision |= {tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    ids = set(tokenizer.all_special_ids) | (vision - {None, tokenizer.unk_token_id})
    ids.discard(tokenizer.eos_token_id)
    return sorted(ids)


@dataclass
class Completions:
    """What sampling returns for N rows."""

    ids: torch.Tensor  # (N, T) completion tokens, padding after EOS
    mask: torch.Tensor  # (N, T) bool, True up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within max_new_tokens
    texts: list[str]  # decoded up to the first EOS, special tokens dropped
    recording: torch.Tensor | None = None  # (N, P + T - 1, H) the trunk's output, if asked for


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    inputs: dict,
    *,
    num_return_sequences: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    shared_prefill: bool = True,
    record_block: torch.nn.Module | None = None,
) -> Completions:
    """Sample num_return_sequences completions of each prompt row (temperature 0: greedy), mask and decode.

    shared_prefill: grpo.sample_shared_prefill (prefill once per prompt; `record_block` records the trunk), else
    transformers' generate (grpo.sample_completions). Both draw the same tokens for the same seed.
    """
    options = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        suppress_token_ids=suppressed_tokens(tokenizer),
    )
    if shared_prefill:
        ids, recording = grpo.sample_shared_prefill(
            model, inputs, group_size=num_return_sequences, record_block=record_block, **options
        )
    elif record_block is not None:
        raise ValueError("recording the trunk needs shared_prefill")
    else:
        ids, _ = grpo.sample_completions(model, inputs, num_return_sequences=num_return_sequences, **options)
        recording = None
    mask, truncated = grpo.completion_mask(ids, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(ids.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
    return Completions(ids, mask, truncated, texts, recording)


def cosine_with_warmup(
    optimizer, *, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------------------------------
# Several processes (torchrun): one rank per device, each on B whole prompt groups, one global update


def resolve_device(name: str) -> torch.device:
    """'auto' is cuda if available, else cpu; under torchrun (R > 1) a bare 'cuda' becomes cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return torch.device(name)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, R) from torchrun's environment; NCCL on CUDA, else gloo. R = 1 creates no process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not distributed():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL communicates through the current device
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return torch.distributed.get_rank(), world


def finish_distributed() -> None:
    if distributed():
        torch.distributed.destroy_process_group()


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def collective_device() -> torch.device:
    """Where tensors must live to be communicated: the current CUDA device for NCCL, the CPU for gloo."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64); one process: the values themselves, untouched."""
    if not distributed():
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on one (all-reduce MAX): a decision all ranks take together."""
    if not distributed():
        return bool(flag)
    value = torch.tensor([int(bool(flag))], device=collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def barrier() -> None:
    if distributed():
        on_cuda = torch.distributed.get_backend() == "nccl"
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()] if on_cuda else None)


def rank_batch(
    samples: list[dict], step: int, batch_size: int, seed: int, rank: int, world: int
) -> list[dict]:
    """Rank `rank`'s B prompts: [rank*B, (rank+1)*B) of the step's global batch of B*R (R = 1: batch_for_step).

    Every rank draws the same seeded permutation, so the slices partition the global batch and each prompt's
    G completions (its whole group) stay on one rank: group advantages need no communication.
    NOTE: `--adv-scale batch` therefore divides by the std of this rank's batch, not the global one.
    """
    global_batch = batch_for_step(samples, step, batch_size * world, seed)
    return global_batch[rank * batch_size : (rank + 1) * batch_size]


def batch_counts(mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(num_rows, num_tokens) of the global batch: this rank's rows and unmasked tokens, summed over ranks.

    int64, so that dividing a bf16 loss by num_tokens does not promote it; num_tokens is clamped to >= 1.
    """
    if not distributed():
        return mask.shape[0], mask.sum().clamp(min=1)
    counts = torch.stack([torch.tensor(mask.shape[0]), mask.sum().cpu()]).to(torch.int64)
    counts = counts.to(collective_device())
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    return int(counts[0]), counts[1].to(mask.device).clamp(min=1)


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the LoRA gradients over ranks in place, through one flat buffer (one collective, not one per tensor).

    Each rank's loss is already normalised by the global counts, so the SUM is the gradient of the global
    loss: what DistributedDataParallel gives with each rank's loss multiplied by R (DDP averages). DDP itself
    is not used: its wrapper hides the model's `generate` and the adapters-off switch of the reference pass.
    """
    if not distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.float().reshape(-1) for g in grads]).to(collective_device())
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    for p, g, summed in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = g.copy_(summed.view_as(g))


def mean_across_ranks(record: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks that logged it, NaN ignored; a value equal on every rank stays exact.

    An object all-gather, not a tensor all-reduce: ranks can log different keys (completion_length/correct
    is missing on a rank where nothing was correct).
    """
    if not distributed():
        return record
    gathered: list[dict[str, float]] = [{} for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, record)
    merged = {}
    for key in dict.fromkeys(k for rank_record in gathered for k in rank_record):  # first-seen order
        values = [r[key] for r in gathered if key in r and not math.isnan(r[key])]
        if not values:
            merged[key] = float("nan")
        else:
            merged[key] = values[0] if len(set(values)) == 1 else sum(values) / len(values)
    return merged


def seed_rank_stream(seed: int, step: int, rank: int) -> None:
    """With R > 1: reseed this rank's sampling (and LoRA dropout) for `step` from (seed, step, rank).

    Ranks draw different completions, and a resumed run draws the same ones again from rank 0's checkpoint
    alone. One process never calls this: its single stream stays as it always was (bit-exact resume).
    """
    torch.manual_seed((seed * 1_000_003 + step) * 10_007 + rank)


# --------------------------------------------------------------------------------------------------
# Speed: micro-batches and the frozen trunk (the math is in grpo.py; these only wire it to the model)


def decoder_parts(model, lora_last_k: int) -> dict:
    """blocks, first_adapted, final norm and LM head: the keyword arguments of grpo's trunk functions."""
    path, blocks = lora.find_decoder_blocks(model)
    first_adapted = len(blocks) - lora_last_k  # 1 <= K <= L is checked by inject_lora and capture_trunk
    config = model.config.get_text_config()
    # NOTE: the trunk hands every adapted block the mask of blocks[first_adapted]; one attention type only.
    if len(set((getattr(config, "layer_types", None) or [])[first_adapted:])) > 1:
        raise ValueError("the adapted blocks mix attention types; use --no-trunk-reuse")
    # NOTE: Qwen3-VL adds visual features to the hidden states after its first blocks ("deepstack").
    vision_config = getattr(model.config, "vision_config", None)
    if first_adapted < len(getattr(vision_config, "deepstack_visual_indexes", None) or []):
        raise ValueError("LoRA reaches the blocks that receive deepstack features; use --no-trunk-reuse")
    norm = model.get_submodule(path.rpartition(".")[0]).norm  # applied to the last block's output
    lm_head = model.get_output_embeddings()
    return {"blocks": blocks, "first_adapted": first_adapted, "norm": norm, "lm_head": lm_head}


@dataclass
class RowChunk:
    """One micro-batch of rows: its prompt inputs, completions and (with --trunk-reuse) its frozen trunk."""

    rows: slice  # which of the N rows
    inputs: dict[str, torch.Tensor]  # input_ids (n, P), ..., and only these rows' images
    completion_ids: torch.Tensor  # (n, T)
    trunk: grpo.Trunk | None


def record_block(model, args: Args) -> torch.nn.Module | None:
    """blocks[first_adapted], whose input sampling records as the trunk (--shared-prefill --trunk-reuse), or None."""
    if not (args.shared_prefill and args.trunk_reuse):
        return None
    parts = decoder_parts(model, args.lora_last_k)
    # NOTE: grpo.trunk_from_recording takes the adapted blocks' mask from blocks[0]: same attention type needed.
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if len(set(types[:1] + types[parts["first_adapted"] :])) > 1:
        raise ValueError("blocks[0] and the adapted blocks differ in attention type; use --no-shared-prefill")
    return parts["blocks"][parts["first_adapted"]]


def make_chunks(
    model, inputs, completion_ids, args: Args, recording: torch.Tensor | None = None
) -> list[RowChunk]:
    """Split the N rows into micro-batches, each with its trunk (--trunk-reuse): recorded while sampling
    (`recording`, (N, P + T - 1, H)), or else run here, once."""
    parts = decoder_parts(model, args.lora_last_k)
    chunks = []
    for rows, chunk_inputs in grpo.split_rows(inputs, args.micro_batch_size or completion_ids.shape[0]):
        trunk = None
        if args.trunk_reuse and recording is not None:
            trunk = grpo.trunk_from_recording(
                model,
                chunk_inputs,
                completion_ids[rows],
                recording[rows],
                blocks=parts["blocks"],
                first_adapted=parts["first_adapted"],
            )
        elif args.trunk_reuse:  # adapters on or off does not matter: none sits in the trunk
            trunk = grpo.capture_trunk(
                model,
                chunk_inputs,
                completion_ids[rows],
                blocks=parts["blocks"],
                first_adapted=parts["first_adapted"],
            )
        chunks.append(RowChunk(rows, chunk_inputs, completion_ids[rows], trunk))
    return chunks


def chunk_logprobs(model, chunk: RowChunk, args: Args, *, return_entropy: bool = False):
    """(logp, entropy) of one chunk: the adapted blocks on its trunk, or the full model (plain path)."""
    if chunk.trunk is None:
        return grpo.completion_logprobs(
            model,
            chunk.inputs,
            chunk.completion_ids,
            temperature=args.temperature,
            return_entropy=return_entropy,
        )
    return grpo.trunk_logprobs(
        chunk.trunk,
        chunk.completion_ids,
        temperature=args.temperature,
        return_entropy=return_entropy,
        gradient_checkpointing=args.gradient_checkpointing,
        **decoder_parts(model, args.lora_last_k),
    )


def enable_plain_checkpointing(model) -> None:
    """transformers' non-reentrant checkpointing of every block, for the plain path (--no-trunk-reuse)."""
    # transformers >= 5.23 renamed gradient_checkpointing_enable (deprecated until v6) to this.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@torch.no_grad()
def no_grad_logprobs(model, chunks: list[RowChunk], args: Args) -> torch.Tensor:
    """old_logp or ref_logp (N, T), chunk by chunk (call inside adapters_disabled for the reference)."""
    return torch.cat([chunk_logprobs(model, chunk, args)[0] for chunk in chunks])


# --------------------------------------------------------------------------------------------------
# One step: rollout (no grad) and policy update (grad)


@dataclass
class Rollout:
    """Everything sampled and scored for one batch of N = B*G rows."""

    inputs: dict[str, torch.Tensor]  # N rows: input_ids (N, P), attention_mask, [pixel_values, ...]
    completion_ids: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T) bool, True up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within max_new_tokens
    texts: list[str]
    samples: list[dict]  # the sample of each row (repeated G times)
    reward: torch.Tensor  # (N,)
    components: dict[str, torch.Tensor]  # (N,) per reward, unweighted
    adv: torch.Tensor  # (N,)
    old_logp: torch.Tensor | None  # (N, T), only when num_iterations > 1
    ref_logp: torch.Tensor | None  # (N, T), only when beta > 0
    chunks: list[RowChunk] = dataclasses.field(default_factory=list)  # micro-batches, trunks captured


@torch.no_grad()
def rollout(
    model, tokenizer, image_processor, prompts: list[dict], reward_fns, args: Args, device
) -> Rollout:
    G = args.group_size
    batch = data.prepare_prompts(
        prompts, tokenizer, image_processor, device=device, max_prompt_length=args.max_prompt_length
    )
    inputs = data.repeat_rows(batch, G).inputs  # prompt b -> rows b*G .. b*G+G-1
    model.eval()
    sampled = generate_completions(
        model,
        tokenizer,
        batch.inputs,  # the B prompts: each image encoded once, then expanded to the N rows
        num_return_sequences=G,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        shared_prefill=args.shared_prefill,
        record_block=record_block(model, args),  # the trunk, recorded while sampling
    )
    completion_ids, mask, truncated, texts = sampled.ids, sampled.mask, sampled.truncated, sampled.texts
    samples = [s for s in prompts for _ in range(G)]
    scores = rewards.score(texts, samples, reward_fns, completion_lengths=mask.sum(1).tolist())
    if args.mask_truncated:  # NOTE: after scoring: they are still scored and logged, they carry no gradient
        mask = mask & ~truncated[:, None]
    reward = torch.tensor(scores.total, dtype=torch.float32, device=device)
    components = {
        k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in scores.components.items()
    }
    adv = grpo.group_advantages(reward, G, scale=args.adv_scale, clip=args.adv_clip)
    # Old log-probs are only needed when the same rollout is reused for mu > 1 optimizer steps;
    # with mu = 1 the ratio's denominator is the (detached) recompute itself.
    # With --trunk-reuse the frozen trunk runs once (or was recorded while sampling); old, ref, policy reuse it.
    chunks = make_chunks(model, inputs, completion_ids, args, sampled.recording)
    old_logp = None
    if args.num_iterations > 1:
        old_logp = no_grad_logprobs(model, chunks, args)
    ref_logp = None
    if args.beta > 0:
        with lora.adapters_disabled(model):  # the reference policy: same weights, no adapters
            ref_logp = no_grad_logprobs(model, chunks, args)
    return Rollout(
        inputs,
        completion_ids,
        mask,
        truncated,
        texts,
        samples,
        reward,
        components,
        adv,
        old_logp,
        ref_logp,
        chunks=chunks,
    )


def accumulate_policy_gradient(
    model, ro: Rollout, args: Args, beta: float
) -> tuple[float, dict[str, float], torch.Tensor]:
    """Recompute logp with grad and backward the GRPO loss, one micro-batch at a time (gradient accumulation).

    Every chunk's loss is normalised by the whole batch (num_rows = N, num_tokens = all unmasked tokens), so
    the accumulated gradient equals the unchunked one for every loss_type (grpo.aggregate). With R ranks the
    whole batch is the global one (batch_counts: all ranks' rows and tokens; NOTE: so bnpo is normalised by
    all ranks' tokens, like dapo), and all_reduce_gradients then sums the ranks' gradients. Returns the loss,
    its stats (token means, re-weighted by each chunk's share of the tokens), both summed over ranks so they
    are global on every rank, and this rank's entropy (N, T).
    """
    if not ro.chunks:  # NOTE: a Rollout built by hand without make_chunks would otherwise train on nothing
        raise ValueError("rollout has no chunks; build it with rollout() or make_chunks()")
    num_rows, num_tokens = batch_counts(ro.mask)  # global: one process, or all ranks
    loss_sum, stats_sum, entropies = 0.0, {}, []
    for chunk in ro.chunks:
        rows = chunk.rows
        logp, entropy = chunk_logprobs(model, chunk, args, return_entropy=True)  # (n, T) with grad
        loss, stats = grpo.grpo_loss(
            logp,
            ro.old_logp[rows] if ro.old_logp is not None else logp.detach(),
            ro.ref_logp[rows] if ro.ref_logp is not None else None,
            ro.adv[rows],
            ro.mask[rows],
            clip_eps_low=args.clip_eps_low,
            clip_eps_high=args.clip_eps_high,
            beta=beta,
            loss_type=args.loss_type,
            max_completion_length=args.max_new_tokens,
            num_rows=num_rows,
            num_tokens=num_tokens,
        )
        loss.backward()  # frees this chunk's activations before the next chunk's forward
        loss_sum += loss.item()
        share = ro.mask[rows].sum().item() / num_tokens.item()
        stats_sum = {key: stats_sum.get(key, 0.0) + share * value for key, value in stats.items()}
        entropies.append(entropy)
    totals = sum_across_ranks([loss_sum, *stats_sum.values()])  # each rank holds its share of the global mean
    return totals[0], dict(zip(stats_sum, totals[1:])), torch.cat(entropies)


def policy_update(model, ro: Rollout, optimizer, scheduler, args: Args, beta: float) -> dict[str, float]:
    """num_iterations optimizer steps on one rollout; returns the last iteration's loss statistics.

    NOTE: a non-finite loss or gradient norm skips the optimizer step (the LoRA weights stay as they were)
    and is reported in the stats as `skipped` with its cause; the caller counts and logs it.
    With R ranks the gradients are summed BEFORE the clip, so every rank clips the same global norm, takes
    the same AdamW step (the adapters stay identical without a broadcast) and, the loss and norm being
    global, decides the same skip. Every stat is global, the entropy too.
    """
    model.train()  # only LoRA dropout reacts to this; the base has no dropout
    params = lora.lora_parameters(model)
    skipped = ""
    for _ in range(args.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss, stats, entropy = accumulate_policy_gradient(model, ro, args, beta)  # recompute + backward
        all_reduce_gradients(params)  # R > 1: the global batch's gradient on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        if not math.isfinite(loss) or not torch.isfinite(grad_norm):
            skipped = "non-finite loss" if not math.isfinite(loss) else "non-finite gradient"
            optimizer.zero_grad(set_to_none=True)
            break
        optimizer.step()
    with warnings.catch_warnings():
        # NOTE: the schedule follows the step count, skipped or not. When the very first step is skipped, torch
        # warns that the scheduler stepped before the optimizer; that order is intended here.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()
    model.eval()
    stats.update(loss=loss, grad_norm=grad_norm.item(), lr=scheduler.get_last_lr()[0], skipped=skipped)
    entropy_sum, num_tokens = sum_across_ranks([(entropy * ro.mask).sum().item(), ro.mask.sum().item()])
    stats["entropy"] = entropy_sum / num_tokens
    return stats


# --------------------------------------------------------------------------------------------------
# Evaluation, logging, plots


@torch.no_grad()
def evaluate(
    model, tokenizer, image_processor, samples, reward_fns, accuracy_name, args: Args, device
) -> dict:
    """Greedy decoding on held-out samples: accuracy (accuracy reward == 1) and mean total reward."""
    model.eval()
    totals, correct = [], []
    for i in range(0, len(samples), 50):
        chunk = samples[i : i + 50]
        batch = data.prepare_prompts(
            chunk, tokenizer, image_processor, device=device, max_prompt_length=args.max_prompt_length
        )
        sampled = generate_completions(
            model,
            tokenizer,
            batch.inputs,
            num_return_sequences=1,
            max_new_tokens=args.max_new_tokens,
            temperature=0.0,
            shared_prefill=args.shared_prefill,
        )
        lengths = sampled.mask.sum(1).tolist()
        scores = rewards.score(sampled.texts, chunk, reward_fns, completion_lengths=lengths)
        totals += scores.total
        correct += [v >= 1.0 for v in scores.components[accuracy_name]]
    return {"eval/accuracy": sum(correct) / len(correct), "eval/reward": sum(totals) / len(totals)}


def print_if(condition: bool, *values) -> None:
    """print on the writing rank only (every rank would print the same line R times)."""
    if condition:
        print(*values)


def append_jsonl(path: Path, record: dict) -> None:
    """One line per record, flushed and fsynced, so `tail -f` works and a crash loses at most one line."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def progress(step: int, total: int, stats: dict, seconds: float) -> None:
    done = int(30 * step / total)
    line = (
        f"\r[{'#' * done}{'.' * (30 - done)}] {step}/{total}  reward {stats['reward/mean']:.3f}"
        f"  kl {stats.get('kl', float('nan')):.4f}  {seconds:.0f}s"
    )
    print(line, end="", flush=True)


def plot_curves(records: list[dict], path: Path) -> None:
    """Reward, held-out accuracy and KL against step, drawn with PIL (no plotting dependency)."""
    from PIL import Image, ImageDraw

    panels = [
        ("reward/mean", "train reward (mean)"),
        ("eval/accuracy", "held-out accuracy (greedy)"),
        ("kl", "KL to reference"),
    ]
    W, H, pad = 900, 260, 50
    image = Image.new("RGB", (W, H * len(panels)), "white")
    draw = ImageDraw.Draw(image)
    for p, (key, title) in enumerate(panels):
        pts = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
        top = p * H
        draw.rectangle((pad, top + 30, W - 20, top + H - 30), outline="black")
        if not pts:
            draw.text((pad, top + 8), f"{title}: no data", fill="black")
            continue
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        y0, y1 = min(ys), max(ys)
        if y1 - y0 < 1e-9:
            y0, y1 = y0 - 0.5, y1 + 0.5

        def to_pixel(x, y, x0=x0, x1=x1, y0=y0, y1=y1, top=top):
            return pad + (x - x0) / (x1 - x0) * (W - 20 - pad), top + H - 30 - (y - y0) / (y1 - y0) * (H - 60)

        draw.line([to_pixel(x, y) for x, y in pts], fill=(30, 90, 200), width=2)
        for x, y in pts[-1:] + pts[:1]:
            px, py = to_pixel(x, y)
            draw.text((px + 3, py - 12), f"{y:.3g}", fill="black")
        draw.text((pad, top + 8), f"{title}   [{y0:.3g}, {y1:.3g}]   steps {x0}..{x1}", fill="black")
    image.save(path)


# --------------------------------------------------------------------------------------------------
# Main


def main(args: Args) -> dict:
    device = resolve_device(args.device)
    rank, world = init_distributed(device)  # (0, 1) without torchrun
    dtype = model_io.resolve_dtype(args.dtype, device)
    out = Path(args.output_dir)
    metrics_path = out / "metrics.jsonl"
    if any_rank(metrics_path.exists() and not (args.resume or args.overwrite or args.dry_run)):
        raise SystemExit(f"{out} already holds a run; pass --resume {out} to continue it or --overwrite")

    run = build_run(args, device, dtype, world)  # every input is checked here, before the first rollout
    if args.dry_run:
        return dry_run(run, args, device)
    writer = rank == 0  # the only rank that writes files, prints progress and evaluates
    start_step, beta = start_run(args, out, writer, run.model, run.optimizer, run.scheduler)
    print_if(writer, describe(run, args, device, dtype, world))
    evaluate_ = functools.partial(
        evaluate,
        run.model,
        run.tokenizer,
        run.image_processor,
        run.held_out,
        run.reward_fns,
        run.accuracy_name,
        args,
        device,
    )
    if start_step == 0 and writer:
        append_jsonl(metrics_path, {"step": 0, **(evaluate_() if run.held_out else {})})

    t_start, bad_in_a_row = time.time(), 0
    with stop_requests() as stop:  # Ctrl-C / SIGTERM: finish this step, checkpoint, exit
        for step in range(start_step + 1, args.steps + 1):
            record, timings = train_step(step, run, args, beta, device, rank, world)  # sample, score, update
            beta = next_beta(beta, record, args)
            bad_in_a_row = bad_in_a_row + 1 if record["skipped"] else 0  # global: the same on every rank
            if writer:  # NOTE: no collectives inside evaluate; the other ranks wait at the next all-reduce
                if run.held_out and (step % args.eval_every == 0 or step == args.steps):
                    record.update(evaluate_())
                log_step(out, record, timings, args.steps, time.time() - t_start, bad_in_a_row)
            halt = halt_reason(stop, bad_in_a_row, args)
            if writer and (step % args.save_every == 0 or step == args.steps or halt):
                save(
                    out / f"checkpoint-{step:06d}", run.model, run.optimizer, run.scheduler, step, beta, args
                )
            if halt:
                barrier()  # every rank exits only once rank 0's checkpoint is written
                raise SystemExit(
                    f"\nstopped after step {step} ({halt}); checkpoint written. "
                    f"Continue with: python train.py --resume {out} <the same flags>"
                )
    return finish(run, args, out, time.time() - t_start) if writer else {}


def describe(run: Run, args: Args, device: torch.device, dtype: torch.dtype, world: int) -> str:
    ranks = f"; {world} ranks x {args.batch_size} prompts" if world > 1 else ""
    return (
        f"{args.model}: LoRA r={args.lora_r} on {len(run.wrapped)} modules of the last {args.lora_last_k} "
        f"blocks, {run.n_trainable:,} trainable parameters; {len(run.train_samples)} training samples; "
        f"{device}, {dtype}{ranks}"
    )


def log_step(
    out: Path, record: dict, timings: dict, total_steps: int, seconds: float, bad_in_a_row: int
) -> None:
    """Append the step's metrics and timings, print progress (and a skipped optimizer step)."""
    append_jsonl(out / "metrics.jsonl", record)
    append_jsonl(out / "timings.jsonl", timings)
    progress(record["step"], total_steps, record, seconds)
    if record["skipped"]:
        print(
            f"\nstep {record['step']}: optimizer step skipped ({record['skipped']}); {bad_in_a_row} in a row"
        )


def finish(run: Run, args: Args, out: Path, seconds: float) -> dict:
    """The final adapter, the curves and the summary (rank 0)."""
    print()
    lora.save_adapter(run.model, out / "adapter", base_model_name_or_path=args.model)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plot_curves(records, out / "curves.png")
    return summarise(records, out, seconds)


@dataclass
class Run:
    """What `main` builds before the first step; building it is where every bad input is reported."""

    model: torch.nn.Module
    tokenizer: object
    image_processor: object | None
    train_samples: list[dict]
    held_out: list[dict]
    reward_fns: list[rewards.Reward]
    accuracy_name: str
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    wrapped: list[str]  # names of the LoRA-wrapped modules
    n_trainable: int


def build_run(args: Args, device: torch.device, dtype: torch.dtype, world: int) -> Run:
    """Data, rewards, model, LoRA and optimizer. Everything a user can get wrong fails here, before any
    rollout: data, images, prompt lengths, rewards, model path, LoRA placement."""
    train_samples, held_out = load_samples(args)
    if world > 1 and len(train_samples) < args.batch_size * world:
        raise ValueError(
            f"{len(train_samples)} training samples for {world} ranks x {args.batch_size} prompts"
        )
    reward_fns = resolve_rewards(args, None if args.data else args.task)
    model, tokenizer, image_processor = model_io.load_model(args.model, device=device, dtype=dtype)
    data.check_samples(
        train_samples + held_out, tokenizer, image_processor, max_prompt_length=args.max_prompt_length
    )
    torch.manual_seed(args.seed)  # LoRA's A init (the same on every rank), then sampling
    wrapped = lora.inject_lora(
        model, last_k=args.lora_last_k, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout
    )
    if args.gradient_checkpointing and not args.trunk_reuse:  # the trunk path checkpoints by itself
        enable_plain_checkpointing(model)
    params = lora.lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=args.steps)
    accuracy_name = args.accuracy_reward or reward_fns[0].name
    n_trainable = sum(p.numel() for p in params)
    return Run(
        model,
        tokenizer,
        image_processor,
        train_samples,
        held_out,
        reward_fns,
        accuracy_name,
        optimizer,
        scheduler,
        wrapped,
        n_trainable,
    )


def start_run(args: Args, out: Path, writer: bool, model, optimizer, scheduler) -> tuple[int, float]:
    """(start step, beta): resume from a checkpoint (every rank loads it), or clear an old run (--overwrite)."""
    metrics_path = out / "metrics.jsonl"
    start_step, beta = 0, args.beta
    if args.resume:  # rank 0 alone truncates metrics.jsonl
        start_step, beta = resume_from(
            args.resume, model, optimizer, scheduler, metrics_path if writer else None
        )
    elif args.overwrite and out.exists() and writer:
        metrics_path.unlink(missing_ok=True)
        # NOTE: the old run's checkpoints too: a stale checkpoint-000100 would outrank this run's newer ones,
        # so keep_last pruning would delete those and --resume would load the old run.
        for old in model_io.list_checkpoints(out):
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    return start_step, beta


def train_step(
    step: int, run: Run, args: Args, beta: float, device: torch.device, rank: int, world: int
) -> tuple[dict, dict]:
    """One step on this rank's B prompts: sample and score, then update. Returns (metrics record, timings).

    The record is the same on every rank: the update's stats are global, the rollout metrics averaged over
    ranks.
    """
    t0 = time.time()
    if world > 1:  # one process keeps its single stream (bit-exact resume as before)
        seed_rank_stream(args.seed, step, rank)
    prompts = rank_batch(run.train_samples, step - 1, args.batch_size, args.seed, rank, world)
    ro = rollout(run.model, run.tokenizer, run.image_processor, prompts, run.reward_fns, args, device)
    t1 = time.time()
    stats = policy_update(run.model, ro, run.optimizer, run.scheduler, args, beta)  # recompute, loss, step
    metrics = mean_across_ranks(rollout_metrics(ro, run.accuracy_name, args))
    record = {"step": step, "beta": beta, **stats, **metrics}
    return record, {"step": step, "rollout_s": t1 - t0, "update_s": time.time() - t1}


def halt_reason(stop: list[str], bad_in_a_row: int, args: Args) -> str | None:
    """Why the run stops after this step (a signal on any rank, too many bad steps), or None to go on.

    NOTE: `stop` is read ONCE and the decision is taken from the all-reduced value alone: a signal arriving
    between the all-reduce and a second read would otherwise stop this rank and not the others (a hang).
    """
    requests = list(stop)
    if any_rank(bool(requests)):
        return requests[0] if requests else "a stop request on another rank"
    if bad_in_a_row > args.max_bad_steps:
        return f"{bad_in_a_row} bad steps in a row"
    return None


def rollout_metrics(ro: Rollout, accuracy_name: str, args: Args) -> dict[str, float]:
    """grpo.rollout_metrics plus the share of empty completions (EOS as the first token)."""
    correct = ro.components[accuracy_name] >= 1.0
    metrics = grpo.rollout_metrics(ro.reward, ro.components, ro.mask, ro.truncated, correct, args.group_size)
    empty = (ro.mask.sum(dim=1) == 1) & ~ro.truncated  # (N,) the EOS alone: the model chose to say nothing
    metrics["frac_empty"] = empty.float().mean().item()
    return metrics


@contextlib.contextmanager
def stop_requests():
    """Turn SIGINT / SIGTERM into a request (a non-empty list) that the loop honours after the current step.

    The previous handlers are restored on exit, so importing or calling `main` changes nothing global.
    Under torchrun the request is all-reduced after each step (halt_reason), so every rank stops together.
    A second Ctrl-C while a request is pending interrupts at once (KeyboardInterrupt), as usual.
    """
    requests: list[str] = []

    def handler(signum, frame):
        if requests and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requests.append(signal.Signals(signum).name)
        print(f"\n{requests[-1]} received: finishing the current step, then writing a checkpoint", flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requests
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def next_beta(beta: float, stats: dict[str, float], args: Args) -> float:
    """The KL weight for the next step: adaptive (grpo.adapt_beta) when a KL band is given, else fixed."""
    if args.kl_target_low is None or args.kl_target_high is None or "kl" not in stats:
        return beta
    return grpo.adapt_beta(
        beta,
        stats["kl"],
        kl_target_low=args.kl_target_low,
        kl_target_high=args.kl_target_high,
        factor=args.kl_adapt_factor,
    )


def save(directory: Path, model, optimizer, scheduler, step: int, beta: float, args: Args) -> None:
    state = {
        "step": step,
        "beta": beta,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "args": dataclasses.asdict(args),
    }
    model_io.save_checkpoint(
        directory,
        write_adapter=lambda d: lora.save_adapter(model, d, base_model_name_or_path=args.model),
        state=state,
        keep_last=args.keep_last,
    )


def resume_from(path: str, model, optimizer, scheduler, metrics_path: Path | None) -> tuple[int, float]:
    """Load adapter, optimizer, scheduler and RNG states; drop metric lines logged after the checkpoint.

    metrics_path None (ranks other than 0 under torchrun): load only, leave the files to rank 0.
    """
    checkpoint = Path(path)
    if not (checkpoint / model_io.STATE_FILE).exists():
        found = model_io.list_checkpoints(checkpoint)
        if not found:
            raise SystemExit(f"--resume {path}: no checkpoint-* folder found")
        checkpoint = found[-1]
    state = model_io.load_checkpoint(checkpoint)
    lora.load_adapter(model, checkpoint)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    model_io.set_rng_state(state["rng"])
    step = state["step"]
    if (
        metrics_path is not None and metrics_path.exists()
    ):  # lines after the checkpoint would be logged again: drop them first
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] <= step]
        tmp = metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(metrics_path)
    print_if(metrics_path is not None, f"resumed from {checkpoint} at step {step}")
    return step, state["beta"]


def dry_run(run: Run, args: Args, device: torch.device) -> dict:
    """One rollout, its rewards and one loss (with its backward, to exercise the gradient path), no update."""
    print(json.dumps(dataclasses.asdict(args), indent=2, ensure_ascii=False))
    print(f"trainable parameters: {run.n_trainable:,} in {len(run.wrapped)} LoRA modules")
    prompts = batch_for_step(run.train_samples, 0, args.batch_size, args.seed)
    ro = rollout(run.model, run.tokenizer, run.image_processor, prompts, run.reward_fns, args, device)
    loss, stats, _ = accumulate_policy_gradient(run.model, ro, args, args.beta)  # no optimizer step
    run.model.zero_grad(set_to_none=True)
    for i, (text, r, a) in enumerate(zip(ro.texts, ro.reward.tolist(), ro.adv.tolist())):
        print(f"row {i:3d}  reward {r:.2f}  adv {a:+.2f}  {text!r}")
    print(f"loss {loss:.4f}  {stats}")
    return {"loss": loss, **stats}


def summarise(records: list[dict], out: Path, seconds: float) -> dict:
    evals = [r for r in records if "eval/accuracy" in r]
    summary = {"steps": records[-1]["step"], "wall_time_s": round(seconds, 1)}
    if evals:
        summary.update(accuracy_start=evals[0]["eval/accuracy"], accuracy_end=evals[-1]["eval/accuracy"])
    print(f"done: {json.dumps(summary)}; adapter in {out / 'adapter'}, curves in {out / 'curves.png'}")
    return summary


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    finally:
        finish_distributed()  # torchrun: destroy the process group, also after a stop (SystemExit)
    sys.exit(0)
