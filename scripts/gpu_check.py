"""The first hour on a GPU: every part of a GRPO step at a real model's shapes, each against its reference.

    python scripts/gpu_check.py                             # CUDA: random Qwen2.5-VL-3B, bf16, B = 8 x G = 8
    python scripts/gpu_check.py --shapes 7b --micro-batch-size 8 --gradient-checkpointing
    python scripts/gpu_check.py --device cpu --shapes tiny  # a few-MB model in fp32, seconds (the test suite)
    python scripts/gpu_check.py --checks 8,9                # only these checks

Random weights in the public config.json's shapes (nothing downloaded) and no tokenizer: a prompt is token ids
written directly (random text around an image's <|vision_start|>, placeholders and <|vision_end|>) with random
pixels; rewards are seeded random numbers. Each check prints one line, PASS / FAIL / SKIP and its figure; an
exception fails its own check only (traceback on stderr) and the next one runs; exit status 1 if any failed.

1. sampler: `speedups.sample_shared_prefill` draws the same tokens as generate (`grpo.sample_completions`)
   for the same seed: every row, in fp32 (the parameters are cast to fp32 and back, exact from bf16). The
   line also counts the equal rows in the run's dtype, where rounding (another batch shape in the prefill,
   another cache layout) may make a row drift after some token: not a failure.
2. left padding: `grpo.completion_logprobs` of prompts of different lengths, left-padded, is finite.
3. recorded trunk: log-probs from what sampling recorded (`speedups.trunk_logprobs`) against a full forward
   (`grpo.completion_logprobs`). The bound: two bf16 computations of one value differ by at most the sum of
   their errors, each taken as the full forward's measured error against fp32, doubled as a margin: 4x that
   error. In fp32, 1e-4 (10x what the tests measure at tiny shapes).
4. one step of each loss variant (docs/variants.md's flag sets; dynamic sampling is a rollout rule, no loss)
   and of the plain, micro-batched and mu = 2 paths: a finite loss, finite non-zero gradients, LoRA's only.
5. phases: time (device events on CUDA) and peak allocated and reserved memory (reset per phase) of one
   default step, beside `memory.estimate`; on CUDA it passes if the step's peak is within 25% of the estimate.
   Timed with cuBLAS's default workspace: this process never sets --deterministic's.
6. determinism: the same step twice from the same state (seed, LoRA weights, AdamW's moments) under
   --deterministic's settings (`distributed.use_deterministic_algorithms`): bit-identical loss and weights.
   On CUDA it runs in a child process (`--checks 6`) whose cuBLAS starts with CUBLAS_WORKSPACE_CONFIG set.
7. CUDA graph: the sampler's decoding step replayed as a CUDA graph draws the tokens it draws eagerly,
   captured while another thread allocates page-locked memory as the training loop's prompts ahead do (a
   capture in CUDA's "global" mode fails there); the memory the kept graph holds between calls within 25%
   of `memory.decode_graph_bytes`.
8. decode time per token, eager and CUDA-graph-replayed, each within one sampling call of T tokens: the
   clock read at each decoding step (device events on CUDA, the host clock elsewhere), first to last; and
   the time of one capture (warm-up step, capture, instantiation), which each new prompt length pays.
9. kernels launched per decoded token (torch.profiler; on the CPU, aten ops), eager.
10. the fp32 LM head as the log-prob passes run it (bf16 on CUDA: multiplied into fp32 without a copy, the
    backward through two bf16 halves of dz) against plain fp32: log-probs (bound 1e-3) and the gradient by
    the hidden states (2^-7 of its largest; it is stored in bf16).
11. FlashAttention-2 (flash-attn installed, CUDA, bf16): the sampler's tokens against sdpa's, and its
    recorded trunk against a full forward (check 3's rule), which a wrong decode mask breaks.
12. the trunk recorded under the CUDA graph against the eager one: the same tokens, and within check 3's
    bound of a full forward.

Checks 1-3 run on the base model, before LoRA is injected (its adapters start as the identity anyway); 8-12
after the steps, with LoRA in place as training samples. The figures close in one Markdown table (a row per
measure; SKIP where this device cannot measure it) that docs can quote as it is.
No GPU has run this script yet: its first run on one is its first test.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import torch
import tyro
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data
import grpo
import lora
from grpo_vlm import (
    attention,
    cli,
    distributed,
    lora_config,
    memory,
    model_files,
    objectives,
    speedups,
    trainer,
)

# Qwen2.5-VL's public config.json numbers (memory.QWEN25_VL, shared with the estimate) with what a random
# build needs beside them, and a tiny model of the kind: name -> (text config, vision config, first special
# id).
# mrope_section: head_dim / 2 split over (t, h, w).
QWEN_ROPE = dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])
QWEN_VISION = dict(num_heads=16, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
SHAPES = {
    name: (
        numbers["text_config"] | dict(rope_parameters=QWEN_ROPE),
        numbers["vision_config"] | QWEN_VISION,
        151643,
    )
    for name, numbers in memory.QWEN25_VL.items()
} | {
    "tiny": (
        dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
        | dict(intermediate_size=128, vocab_size=512, tie_word_embeddings=True)
        | dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])),
        dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, window_size=56)
        | dict(out_hidden_size=64, fullatt_block_indexes=[1]),
        480,
    ),
}
# Special ids as Qwen's tokenizer numbers them, from the first, <|endoftext|> (padding, and an end of turn):
# <|im_end|> (the other end of turn), <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>. Of the
# 22, a completion may hold only the two ends of turn.
IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 2, 9, 10, 12, 13
NUM_SPECIALS = 22
# B, G, T, an image of side x side patches and the longest prompt's text tokens (the others have fewer, so
# they are left-padded). 3b/7b: the README's 3B command as docs/speed.md prices it, B = 8, G = 8, T = 256, a
# 952-px image (68 x 68 patches: 1,156 placeholders) and 100 text tokens: P = 1,258.
WORKLOADS = {
    "3b": dict(batch_size=8, group_size=8, max_new_tokens=256, image_side=68, text_tokens=100),
    "7b": dict(batch_size=8, group_size=8, max_new_tokens=256, image_side=68, text_tokens=100),
    "tiny": dict(batch_size=2, group_size=3, max_new_tokens=8, image_side=4, text_tokens=8),
}
PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch

# docs/variants.md's flag sets: (LossConfig settings, AdvantageConfig settings).
VARIANTS = {
    "dapo": ({}, {}),
    "grpo": (dict(loss_type="grpo"), {}),
    "dr_grpo": (dict(loss_type="dr_grpo"), dict(adv_scale="none")),
    "gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4),
        {},
    ),
    "cispo": (dict(loss_type="cispo", clip_eps_high=4.0), {}),
    "sapo": (dict(loss_type="sapo"), {}),
    "rloo": ({}, dict(adv_baseline="rloo", adv_scale="none")),
}
# The step's other paths, with the default loss: (SpeedConfig settings over the run's, num_iterations).
# NOTE: the plain path never checkpoints here: transformers' checkpointing, once on, stays on for the model.
PATHS = {
    "plain path": (dict(shared_prefill=False, trunk_reuse=False, gradient_checkpointing=False), 1),
    "micro-batches of 2 rows, checkpointing": (dict(micro_batch_size=2, gradient_checkpointing=True), 1),
    "num_iterations 2": ({}, 2),
}
# Each phase of a step, and the memory.estimate entry printed beside it.
ESTIMATE_KEYS = {
    "sampling": "sampling",
    "trunk": "trunk",
    "reference/old": "logprob_pass",
    "policy fwd+bwd": "update",
    "optimizer": "lora+adam",
}


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # flat flag names: `--lora-r`, not `--lora.lora-r`
@dataclass
class Args:
    """Every part of a GRPO step at a real model's shapes, random weights, each against its reference."""

    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    shapes: Literal["auto", "3b", "7b", "tiny"] = "auto"
    """Qwen2.5-VL-3B's or -7B's shapes, or a tiny model; 'auto': 3b on CUDA, tiny on the CPU."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32' or 'bfloat16'."""
    batch_size: int | None = None
    """B prompts, one image each. Default: 8 (3b, 7b), 2 (tiny)."""
    group_size: int | None = None
    """G completions per prompt. Default: 8 (3b, 7b), 3 (tiny)."""
    max_new_tokens: int | None = None
    """T, the completion length (random weights rarely end a row early). Default: 256 (3b, 7b), 8 (tiny)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off), as trainer.py's --top-p."""
    micro_batch_size: int | None = None
    """Rows per chunk of the log-prob passes and the backward in the default step (None: all N)."""
    gradient_checkpointing: bool = False
    """Checkpoint the adapted blocks in the default step."""
    seed: int = 0
    """Seeds the weights, the prompts, LoRA, sampling and the rewards."""
    checks: str = "all"
    """The checks to run, by number ('6', '1,3,8'); 'all': every one."""
    lora: lora_config.LoRAConfig = field(default_factory=lora_config.LoRAConfig)
    """LoRA (lora.py, grpo_vlm/lora_config.py): the last K blocks, rank r."""


@dataclass
class Setup:
    """What the checks share: the prompts, the sampler's options, the default step's settings."""

    prompts: data.PromptBatch  # B prompts, left-padded
    rows: dict[str, torch.Tensor]  # the N = B*G rows' inputs, each prompt's images with it
    sampling: dict  # the samplers' keyword arguments
    group_size: int
    dtype: torch.dtype
    seed: int
    lora: lora_config.LoRAConfig
    speed: speedups.SpeedConfig  # the default step's
    report: list[tuple[str, str]] = field(default_factory=list)  # the closing table's rows: (measure, value)

    @property
    def device(self) -> torch.device:
        return self.rows["input_ids"].device


# --- the model, its prompts, the step -----------------------------------------------------------------------


def random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A Qwen2.5-VL of `name`'s shapes with random weights, made on `device` in `dtype`, frozen."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text, vision, first = SHAPES[name]
    ids = dict(bos_token_id=first, eos_token_id=first + IM_END, pad_token_id=first)
    config = Qwen2_5_VLConfig(
        text_config=dict(text, rms_norm_eps=1e-6, max_position_embeddings=128000, **ids),
        vision_config=dict(vision, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        vision_start_token_id=first + VISION_START,
        vision_end_token_id=first + VISION_END,
        image_token_id=first + IMAGE_PAD,
        video_token_id=first + VIDEO_PAD,
        tie_word_embeddings=text["tie_word_embeddings"],
        **ids,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 3B random init on the CPU is slow
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def random_prompts(config, workload: dict, device: torch.device, seed: int) -> data.PromptBatch:
    """B prompts of token ids, left-padded: text, <|vision_start|>, an image's placeholders, <|vision_end|>,
    text; prompt b has fewer text tokens than prompt b - 1, so every prompt but the first is padded."""
    B, side, longest = workload["batch_size"], workload["image_side"], workload["text_tokens"]
    gen = torch.Generator().manual_seed(seed)
    placeholders = [config.image_token_id] * (side // 2) ** 2  # one per 2 x 2 patches (the merger)
    image = [config.vision_start_token_id, *placeholders, config.vision_end_token_id]
    prompts = []
    for b in range(B):
        n = max(longest - b * longest // (2 * B), 2)  # from `longest` down to about half of it
        text = torch.randint(0, config.pad_token_id, (n,), generator=gen).tolist()  # below the special ids
        prompts.append(text[: n // 4] + image + text[n // 4 :])
    P = max(map(len, prompts))
    input_ids = torch.full((B, P), config.pad_token_id)  # (B, P)
    attention_mask = torch.zeros(B, P, dtype=torch.long)  # (B, P)
    for b, ids in enumerate(prompts):  # LEFT padding
        input_ids[b, P - len(ids) :], attention_mask[b, P - len(ids) :] = torch.tensor(ids), 1
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=(input_ids == config.image_token_id).long(),  # (B, P) 1 on the placeholders
        pixel_values=torch.randn(B * side * side, PATCH_DIM, generator=gen),  # (patches, C*2*14*14)
        image_grid_thw=torch.tensor([[1, side, side]] * B),  # (images, 3): t, h, w in patches
    )
    return data.PromptBatch({k: v.to(device) for k, v in inputs.items()}, images_per_row=[1] * B)


def sampling_options(config, max_new_tokens: int, top_p: float) -> dict:
    """trainer.py's sampler options at temperature 1: the two ends of turn, no other special token."""
    first = config.pad_token_id
    ends = [first, first + IM_END]
    suppress = [t for t in range(first, first + NUM_SPECIALS) if t not in ends]
    options = dict(max_new_tokens=max_new_tokens, temperature=1.0, top_p=top_p, eos_token_id=ends)
    return options | dict(pad_token_id=first, suppress_token_ids=suppress)


def untimed(name: str):
    return nullcontext()


def gpu_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    s: Setup,
    plan: speedups.Plan,
    loss_config: objectives.LossConfig,
    adv_config: objectives.AdvantageConfig,
    *,
    num_iterations: int = 1,
    phase: Callable = untimed,
) -> tuple[float, float]:
    """One GRPO step as trainer.py's `train_step` takes it, with random rewards: sample -> mask -> advantages
    -> old and reference log-probs -> logp with grad, loss, backward -> clip, AdamW. (loss, grad norm)."""
    G, T, options = s.group_size, s.sampling["max_new_tokens"], dict(temperature=s.sampling["temperature"])
    model.eval()
    with phase("sampling"):
        ids, recording = speedups.sample(model, s.prompts.inputs, plan, group_size=G, **s.sampling)  # (N, T)
    mask, _ = grpo.completion_mask(ids, s.sampling["eos_token_id"])  # (N, T)
    reward = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(s.seed)).to(s.device)  # (N,)
    adv = objectives.advantages(reward, None, None, G, adv_config)  # (N,)
    with phase("trunk"):
        chunks = speedups.row_chunks(model, s.rows, ids, recording, plan)
    with phase("reference/old"), torch.no_grad():
        old_logp = ref_logp = None
        if num_iterations > 1:
            old_logp = torch.cat([speedups.chunk_logprobs(model, c, plan, **options)[0] for c in chunks])
        if loss_config.beta > 0:
            with lora.adapters_disabled(model):
                ref_logp = torch.cat([speedups.chunk_logprobs(model, c, plan, **options)[0] for c in chunks])
    totals = objectives.BatchTotals(num_rows=ids.shape[0], num_tokens=mask.sum().clamp(min=1))
    model.train()
    for _ in range(num_iterations):
        with phase("policy fwd+bwd"):
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for c in chunks:
                logp, _ = speedups.chunk_logprobs(model, c, plan, **options)  # (n, T) with grad
                old = old_logp[c.rows] if old_logp is not None else logp.detach()  # mu = 1: ratio 1
                ref = ref_logp[c.rows] if ref_logp is not None else None
                loss, _ = objectives.grpo_loss(
                    logp,
                    old,
                    ref,
                    adv[c.rows],
                    mask[c.rows],
                    loss_config,
                    totals=totals,
                    max_completion_length=T,
                )
                loss.backward()
                loss_sum += loss.item()
        with phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(lora.lora_parameters(model), 1.0)
            optimizer.step()
    model.eval()
    return loss_sum, float(grad_norm)


# --- the checks: each returns (True / False / None for skipped, its figure) ---------------------------------


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The parameters only: the rotary frequencies, buffers, stay in fp32 as they were made."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


@contextmanager
def in_fp32(model: torch.nn.Module, dtype: torch.dtype):
    cast_parameters(model, torch.float32)
    try:
        yield
    finally:
        cast_parameters(model, dtype)


def ours(model: torch.nn.Module, s: Setup, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """speedups.sample_shared_prefill's completions (N, T) [and recording] of the seed."""
    torch.manual_seed(s.seed)
    return speedups.sample_shared_prefill(
        model, s.prompts.inputs, group_size=s.group_size, **s.sampling, **options
    )


@torch.no_grad()
def full_logprobs(model: torch.nn.Module, s: Setup, ids: torch.Tensor) -> torch.Tensor:
    """grpo.completion_logprobs (N, T), 8 rows at a time: it holds (rows, T, V) fp32 logits (10 GB for 64)."""
    chunks = speedups.split_rows(s.rows, 8)
    options = dict(temperature=s.sampling["temperature"])
    return torch.cat([grpo.completion_logprobs(model, c, ids[rows], **options)[0] for rows, c in chunks])


def check_sampler(model: torch.nn.Module, s: Setup) -> tuple[bool, str]:
    def equal_rows() -> tuple[int, int]:
        torch.manual_seed(s.seed)
        theirs = grpo.sample_completions(
            model, s.prompts.inputs, num_return_sequences=s.group_size, **s.sampling
        )
        mine, _ = ours(model, s)
        T = max(theirs.shape[1], mine.shape[1])  # both stop when every row has ended: pad the shorter
        theirs, mine = (
            F.pad(x, (0, T - x.shape[1]), value=s.sampling["pad_token_id"]) for x in (theirs, mine)
        )
        return int((theirs == mine).all(dim=1).sum()), theirs.shape[0]

    in_dtype = ""
    if s.dtype != torch.float32:
        same, n = equal_rows()
        in_dtype = f"; in {str(s.dtype).removeprefix('torch.')}: {same} of {n} (rounding may drift a row)"
    with in_fp32(model, s.dtype):
        same, n = equal_rows()
    return same == n, f"equal tokens for {same} of {n} rows in fp32{in_dtype}"


def check_left_padding(model: torch.nn.Module, s: Setup) -> tuple[bool, str]:
    ids, _ = ours(model, s)
    logp = full_logprobs(model, s, ids)  # (N, T)
    bad = int((~torch.isfinite(logp)).sum())
    pads = (s.prompts.inputs["attention_mask"] == 0).sum(dim=1)  # (B,)
    rows = f"{logp.shape[0]} rows x {logp.shape[1]} tokens, {int(pads.min())}-{int(pads.max())} pad tokens"
    return bad == 0, f"{bad} log-probs not finite of {logp.numel()} ({rows}); mean {logp.nanmean():.3f}"


def check_trunk(model: torch.nn.Module, s: Setup) -> tuple[bool, str]:
    parts = speedups.decoder_parts(model, s.lora.lora_last_k)
    frozen = dict(blocks=parts["blocks"], first_adapted=parts["first_adapted"])
    ids, recording = ours(model, s, record_block=speedups.record_block(model, parts))
    trunk = speedups.trunk_from_recording(model, s.rows, ids, recording, **frozen)
    with torch.no_grad():
        from_trunk, _ = speedups.trunk_logprobs(trunk, ids, **parts, temperature=s.sampling["temperature"])
    full = full_logprobs(model, s, ids)  # (N, T)
    bound, why = 1e-4, "fp32"
    if s.dtype != torch.float32:
        with in_fp32(model, s.dtype):
            error = float((full - full_logprobs(model, s, ids)).abs().max())  # this dtype's own rounding
        bound, why = max(4 * error, bound), f"4 x the full forward's own error against fp32, {error:.1e}"
    diff = float((from_trunk - full).abs().max())
    within = diff <= bound
    figure = f"max |logp difference| {diff:.1e} {'<=' if within else '>'} {bound:.1e} ({why})"
    return within, f"{figure}, K = {s.lora.lora_last_k}"


def check_step(
    model: torch.nn.Module, optimizer, s: Setup, loss: dict, adv: dict, speed: dict, num_iterations: int
) -> tuple[bool, str]:
    plan = speedups.choose(model, dataclasses.replace(s.speed, **speed), last_k=s.lora.lora_last_k)
    configs = objectives.LossConfig(**loss), objectives.AdvantageConfig(**adv)
    torch.manual_seed(s.seed)
    value, grad_norm = gpu_step(model, optimizer, s, plan, *configs, num_iterations=num_iterations)
    trained = {id(p) for p in lora.lora_parameters(model)}
    outside = [name for name, p in model.named_parameters() if p.grad is not None and id(p) not in trained]
    ok = math.isfinite(value) and math.isfinite(grad_norm) and grad_norm > 0 and not outside
    where = f"gradients outside LoRA: {outside[:3]}" if outside else "gradients on LoRA only"
    return ok, f"loss {value:.4g}, grad norm {grad_norm:.3g}, {where}"


def phase_clock(device: torch.device) -> tuple[Callable, dict[str, float], dict[str, tuple[int, int]]]:
    """(phase context manager, ms per phase, (peak allocated, peak reserved) bytes per phase: CUDA only,
    reset per phase). On CUDA a phase is timed with device events (`grpo_vlm.trainer.clock`)."""
    ms, peak, cuda = {}, {}, device.type == "cuda"

    @contextmanager
    def phase(name: str):
        if cuda:  # the host only queues kernels: charge each phase with its own
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = trainer.clock(device)
        yield
        ms[name] = ms.get(name, 0.0) + 1000 * trainer.seconds_between(start, trainer.clock(device))
        if cuda:
            high = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
            peak[name] = tuple(max(a, b) for a, b in zip(peak.get(name, (0, 0)), high))

    return phase, ms, peak


def check_phases(model: torch.nn.Module, optimizer, s: Setup) -> tuple[bool, str]:
    phase, ms, peak = phase_clock(s.device)
    plan = speedups.choose(model, s.speed, last_k=s.lora.lora_last_k)
    torch.manual_seed(s.seed)
    gpu_step(model, optimizer, s, plan, objectives.LossConfig(), objectives.AdvantageConfig(), phase=phase)
    speed = s.speed
    estimate = memory.estimate(
        model.config,
        rows=s.rows["input_ids"].shape[0],
        prompt_len=s.rows["input_ids"].shape[1],
        completion_len=s.sampling["max_new_tokens"],
        last_k=s.lora.lora_last_k,
        lora_r=s.lora.lora_r,
        dtype_bytes=s.dtype.itemsize,
        micro_batch_size=speed.micro_batch_size,
        gradient_checkpointing=speed.gradient_checkpointing,
        trunk_reuse=speed.trunk_reuse,
        shared_prefill=speed.shared_prefill,
        device_type=s.device.type,
    )
    print_table(ms, peak, estimate)
    clock = "device events, cuBLAS's default workspace" if s.device.type == "cuda" else "host clock"
    s.report.append(("phases of one default step timed with", clock))
    for name, key in (*ESTIMATE_KEYS.items(), ("step", "peak")):
        took = sum(ms.values()) if name == "step" else ms.get(name, 0.0)
        high = max(peak.values(), default=None) if name == "step" else peak.get(name)
        held = "n/a (CPU)" if high is None else f"{gib(high[0])} / {gib(high[1])}"
        beside = gib(estimate[key]) if key in estimate else "-"
        s.report.append(
            (
                f"phase {name}: ms; peak allocated / reserved GiB; estimate GiB",
                f"{took:.1f}; {held}; {beside}",
            )
        )
    step_ms = sum(ms.values())
    if s.device.type != "cuda":
        return True, f"step {step_ms:.0f} ms; memory n/a (CPU)"
    measured, predicted = max(a for a, _ in peak.values()), estimate["peak"]
    ok = abs(measured / predicted - 1) <= 0.25
    return ok, f"step {step_ms:.0f} ms, peak {gib(measured)} GiB, estimate {gib(predicted)} GiB"


def gib(n: float) -> str:
    return f"{n / 2**30:.3g}"


def print_table(ms: dict[str, float], peak: dict[str, tuple[int, int]], estimate: dict[str, int]) -> None:
    """Phase, ms, measured peaks (allocated and reserved: weights included), the estimate's entry for it."""
    print(f"  {'phase':<16}{'ms':>10}{'peak GiB':>11}{'reserved':>11}   estimate GiB (memory.estimate key)")
    for name, key in (*ESTIMATE_KEYS.items(), ("step", "peak")):
        step = name == "step"
        took = sum(ms.values()) if step else ms.get(name, 0.0)
        high = max(peak.values(), default=None) if step else peak.get(name)
        beside = f"{gib(estimate[key])} ({key})" if key in estimate else f"- (no {key!r})"
        held = ("n/a (CPU)", "n/a") if high is None else (gib(high[0]), gib(high[1]))
        print(f"  {name:<16}{took:>10.1f}{held[0]:>11}{held[1]:>11}   {beside}")


def determinism_in_child(argv: list[str]) -> tuple[bool, str]:
    """Check 6 in a child process (this script, `argv`'s flags, --checks 6) whose cuBLAS starts with
    --deterministic's workspace setting: CUBLAS_WORKSPACE_CONFIG is read once, when cuBLAS starts, and this
    process times the default setting."""
    flags, skip = [], False
    for arg in argv:  # this run's flags but its --checks
        if not skip and not arg.startswith("--checks"):
            flags.append(arg)
        skip = arg == "--checks"
    env = os.environ | {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    command = [sys.executable, __file__, *flags, "--checks", "6"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x[6:].startswith("6 determinism")), None)
    if line is None:
        return False, f"the child process exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return line.startswith("PASS"), line.partition(": ")[2] + " (child process, deterministic cuBLAS)"


def check_determinism(model: torch.nn.Module, optimizer, s: Setup) -> tuple[bool, str]:
    params = lora.lora_parameters(model)
    start, moments = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    plan = speedups.choose(model, s.speed, last_k=s.lora.lora_last_k)
    results = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            with torch.no_grad():
                for p, value in zip(params, start):
                    p.copy_(value)
            optimizer.load_state_dict(
                copy.deepcopy(moments)
            )  # NOTE: a copy: AdamW updates its state in place
            torch.manual_seed(s.seed)
            loss, _ = gpu_step(
                model, optimizer, s, plan, objectives.LossConfig(), objectives.AdvantageConfig()
            )
            results.append((loss, [p.detach().clone() for p in params]))
    finally:
        torch.use_deterministic_algorithms(False)
    (loss_a, weights_a), (loss_b, weights_b) = results
    same = all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    moved = not all(torch.equal(a, b) for a, b in zip(weights_a, start))  # the step did update them
    words = "bit-identical" if same else "different"
    return loss_a == loss_b and same and moved, f"losses {loss_a!r}, {loss_b!r}; LoRA weights after: {words}"


@contextmanager
def pinning_alongside(s: Setup) -> Iterator[list[int]]:
    """A thread that pins the prompts' batch, then keeps allocating page-locked copies of its ids (held, so
    each is a new cudaHostAlloc), as `trainer.prompts_ahead` pins the next step's batch on CUDA while this
    step samples, and may capture its decoding step. Yields [pins made]; re-raises the thread's error."""
    host = data.PromptBatch({k: v.cpu() for k, v in s.prompts.inputs.items()}, s.prompts.images_per_row)
    done, made, errors, held = threading.Event(), [0], [], []

    def pin() -> None:
        try:
            held.append(trainer.pinned(host))
            while not done.is_set() and len(held) < 10_000:
                held.append(trainer.pinned(data.PromptBatch({"ids": host.inputs["input_ids"]}, [])))
                made[0] += 1
        except Exception as error:  # noqa: BLE001 (handed to the main thread)
            errors.append(error)

    thread = threading.Thread(target=pin, name="pinning-alongside", daemon=True)
    thread.start()
    try:
        yield made
    finally:
        done.set()
        thread.join()
    if errors:
        raise errors[0]


def check_cuda_graph(model: torch.nn.Module, s: Setup) -> tuple[bool | None, str]:
    """The graph's tokens against eager decoding, captured while another thread pins host memory (the
    training loop's prompts ahead); the memory the kept graph holds against `memory.decode_graph_bytes`."""
    if s.device.type != "cuda":
        s.report.append(
            ("kept decode graph: allocated GiB held between calls; estimate GiB", "SKIP (CUDA only)")
        )
        return None, "captured on CUDA only"
    tokens, options = [], dict(group_size=s.group_size, record=False, **s.sampling)
    for graph in (False, True):
        plan = speedups.choose(model, speedups.SpeedConfig(cuda_graph=graph), last_k=s.lora.lora_last_k)
        torch.manual_seed(s.seed)
        torch.cuda.synchronize(s.device)
        before = torch.cuda.memory_allocated(s.device)
        with pinning_alongside(s) as pins:
            tokens.append(speedups.sample(model, s.prompts.inputs, plan, **options)[0])
        torch.cuda.synchronize(s.device)
        held = torch.cuda.memory_allocated(s.device) - before - tokens[-1].untyped_storage().nbytes()
    N, P = s.rows["input_ids"].shape
    counted = memory.decode_graph_bytes(model.config, N, P, s.sampling["max_new_tokens"], s.dtype.itemsize)
    s.report.append(
        ("kept decode graph: allocated GiB held between calls; estimate GiB", f"{gib(held)}; {gib(counted)}")
    )
    same = int((tokens[0] == tokens[1]).all(dim=1).sum()) if tokens[0].shape == tokens[1].shape else 0
    figure = f"equal tokens for {same} of {tokens[0].shape[0]} rows, {pins[0]} pins alongside; "
    figure += f"the kept graph holds {gib(held)} GiB, estimate {gib(counted)} GiB"
    return same == tokens[0].shape[0] and abs(held / counted - 1) <= 0.25, figure


# --- decoding, the head, the kernels: what the first GPU hour measures --------------------------------------


def sample_seconds(model: torch.nn.Module, s: Setup, max_new_tokens: int, **options) -> float:
    """Seconds of one shared-prefill sampling call of `max_new_tokens` tokens: device events on CUDA."""
    torch.manual_seed(s.seed)
    start = trainer.clock(s.device)
    speedups.sample_shared_prefill(
        model,
        s.prompts.inputs,
        group_size=s.group_size,
        **(s.sampling | dict(max_new_tokens=max_new_tokens)),
        **options,
    )
    return trainer.seconds_between(start, trainer.clock(s.device))


def decode_figures(model: torch.nn.Module, s: Setup, graphs: speedups.DecodeGraphs | None = None) -> tuple:
    """(ms per decoded token, steps timed, ms of the capture or None) of ONE sampling call of T tokens: the
    clock read as each decoding step after the first starts (eager: the model's forward; under a graph: its
    replay), first to last, over the steps between. Each step is its forward, the draw and the host's work
    between. One call and one monotonic clock: a difference of two separately timed calls, which load on a
    shared host can make negative at small shapes, is not used."""
    marks, capture_ms = [], []

    def eager_step(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] == 1:  # a decoding step, not the prefill
            marks.append(trainer.clock(s.device))

    def timed(capture: speedups.Capture) -> speedups.Capture:
        def run(step: Callable[[], tuple]) -> tuple:
            start = trainer.clock(s.device)
            first, static, replay = capture(step)
            capture_ms.append(1000 * trainer.seconds_between(start, trainer.clock(s.device)))
            return first, static, lambda: (marks.append(trainer.clock(s.device)), replay())

        return run

    sample_seconds(model, s, 2, capture=graphs)  # a warm-up: lazy allocations, cuBLAS handles
    if graphs is not None:
        graphs.capture = timed(graphs.capture)
        sample_seconds(model, s, s.sampling["max_new_tokens"], capture=graphs)
    else:
        with model.base_model.register_forward_pre_hook(eager_step, with_kwargs=True):
            sample_seconds(model, s, s.sampling["max_new_tokens"])
        marks = marks[1:]  # from the second step on, as a graph's replays
    if len(marks) < 2:
        return None, 0, None
    seconds = trainer.seconds_between(marks[0], marks[-1])
    return 1000 * seconds / (len(marks) - 1), len(marks) - 1, capture_ms[-1] if capture_ms else None


def check_decode_time(model: torch.nn.Module, s: Setup) -> tuple[bool | None, str]:
    if s.sampling["max_new_tokens"] < 4:
        return None, "needs --max-new-tokens >= 4"
    eager, steps, _ = decode_figures(model, s)
    if eager is None:
        return None, "every row ended before a third decoding step"
    clock = "device events" if s.device.type == "cuda" else "host clock"
    s.report.append((f"decode ms/token, eager ({clock}, {steps} steps)", f"{eager:.2f}"))
    figure = f"eager {eager:.2f} ms/token over {steps} steps ({clock})"
    if s.device.type != "cuda":
        s.report.append(("decode ms/token, CUDA graph replayed", "SKIP (CUDA only)"))
        s.report.append(
            ("decode graph: ms of one capture (warm-up step, capture, instantiation)", "SKIP (CUDA only)")
        )
        return eager > 0, f"{figure}; graph: CUDA only"
    kept = speedups.decode_capture(model, speedups.SpeedConfig(cuda_graph=True))
    graph, steps, capture_ms = decode_figures(model, s, kept)  # captured once, then replayed
    s.report.append((f"decode ms/token, CUDA graph replayed ({clock}, {steps} steps)", f"{graph:.2f}"))
    s.report.append(
        ("decode graph: ms of one capture (warm-up step, capture, instantiation)", f"{capture_ms:.1f}")
    )
    return (
        eager > graph > 0,
        f"{figure}; graph replayed {graph:.2f} ms/token ({eager / graph:.1f}x), capture {capture_ms:.0f} ms",
    )


def launches(model: torch.nn.Module, s: Setup, max_new_tokens: int, device_kernels: bool) -> int:
    """Kernels (CUDA) or aten ops (CPU) one sampling call of `max_new_tokens` tokens launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_kernels else [])
    with profile(activities=activities) as prof:
        sample_seconds(model, s, max_new_tokens)
        if device_kernels:
            torch.cuda.synchronize(s.device)
    if device_kernels:
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    return sum(e.name.startswith("aten::") for e in prof.events())


def check_kernel_count(model: torch.nn.Module, s: Setup) -> tuple[bool | None, str]:
    if s.sampling["max_new_tokens"] < 3:
        return None, "needs --max-new-tokens >= 3"
    T, cuda = min(s.sampling["max_new_tokens"], 10), s.device.type == "cuda"  # the profiler's trace: short
    per_token = (launches(model, s, T, cuda) - launches(model, s, 2, cuda)) / (T - 2)
    what = "CUDA kernels" if cuda else "aten ops (CPU; no kernels)"
    s.report.append((f"{what} per decoded token, eager (torch.profiler)", f"{per_token:.0f}"))
    return per_token > 0, f"{per_token:.0f} {what} per decoded token, eager"


def check_fp32_head(model: torch.nn.Module, s: Setup) -> tuple[bool, str]:
    """The fp32 LM head as the log-prob passes run it (`speedups.logprobs_row_by_row`: on CUDA a bf16 head
    multiplied into fp32 as it is, its backward through two bf16 halves of dz) against plain fp32 (the
    hidden states and the weight cast to fp32): log-probs and their gradient by the hidden states."""
    ids, _ = ours(model, s)
    T, weight, rows = ids.shape[1], model.get_output_embeddings().weight, min(8, ids.shape[0])
    with torch.no_grad():
        inputs = grpo.recompute_inputs(speedups.split_rows(s.rows, rows)[0][1], ids[:rows])
        hidden = model.base_model(**inputs, use_cache=False).last_hidden_state[:, -T - 1 : -1]  # (rows, T, H)
    ids, results = ids[:rows], []
    for h, w in ((hidden, weight), (hidden.float(), weight.float())):  # as run; plain fp32
        h = h.detach().requires_grad_()
        logp, _ = speedups.logprobs_row_by_row(
            h, w, ids, temperature=s.sampling["temperature"], return_entropy=False
        )
        logp.sum().backward()
        results.append((logp.detach(), h.grad.float()))
    (logp, grad), (logp32, grad32) = results
    diff, grad_diff = (
        float((logp - logp32).abs().max()),
        float(((grad - grad32).abs() / grad32.abs().max()).max()),
    )
    s.report.append(
        (
            "the fp32 head as run vs plain fp32: max abs difference of logp; of the gradient / its largest",
            f"{diff:.1e}; {grad_diff:.1e}",
        )
    )
    figure = f"max |logp difference| {diff:.1e}, gradient {grad_diff:.1e} of its largest"
    if s.dtype == torch.float32:
        return diff == 0 and grad_diff == 0, f"{figure} (an fp32 model: the same matmuls)"
    # Products of bf16 values are exact in fp32 and summed in fp32: what is left is summation order (and
    # the gradient's rounding to the hidden states' bf16, 2^-8). The bounds are a first guess for the first
    # GPU run to confirm.
    ok = diff <= 1e-3 and grad_diff <= 2**-7
    return ok, f"{figure} ({'within' if ok else 'beyond'} 1e-3 and 2^-7: bf16 operands)"


def trunk_against_full(
    model: torch.nn.Module, s: Setup, **options
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(tokens, max |logp difference| of the recorded trunk against a full forward, the recording) of a
    sampling call with `options` (a capture)."""
    parts = speedups.decoder_parts(model, s.lora.lora_last_k)
    frozen = dict(blocks=parts["blocks"], first_adapted=parts["first_adapted"])
    ids, recording = ours(model, s, record_block=speedups.record_block(model, parts), **options)
    trunk = speedups.trunk_from_recording(model, s.rows, ids, recording, **frozen)
    with torch.no_grad():
        from_trunk, _ = speedups.trunk_logprobs(trunk, ids, **parts, temperature=s.sampling["temperature"])
    return ids, float((from_trunk - full_logprobs(model, s, ids)).abs().max()), recording


def check_flash_attention(model: torch.nn.Module, s: Setup) -> tuple[bool | None, str]:
    kernel, why = attention.vision_kernel(s.device, s.dtype)
    if kernel != "flash_attention_2":
        s.report.append(("FlashAttention-2 sampler vs sdpa", f"SKIP ({why})"))
        return None, why
    sdpa_ids, sdpa_diff, _ = trunk_against_full(model, s)
    model.set_attn_implementation("flash_attention_2")
    try:  # the sampler under FlashAttention-2; the full forward it is held to: sdpa's
        flash_ids, flash_diff, _ = trunk_against_full(model, s)
    finally:
        model.set_attn_implementation("sdpa")
    same = int((flash_ids == sdpa_ids).all(dim=1).sum()) if flash_ids.shape == sdpa_ids.shape else 0
    n = sdpa_ids.shape[0]
    bound = max(4 * sdpa_diff, 1e-4)
    s.report.append(("FlashAttention-2 sampler: rows equal to sdpa's", f"{same} of {n}"))
    s.report.append(
        (
            "FlashAttention-2 sampler: recorded trunk vs sdpa full forward, max |logp diff|",
            f"{flash_diff:.1e}",
        )
    )
    figure = f"equal tokens for {same} of {n} rows; its trunk vs the full forward {flash_diff:.1e}"
    return flash_diff <= bound, f"{figure} (bound {bound:.1e}: 4 x sdpa's own, {sdpa_diff:.1e})"


def check_graph_trunk(model: torch.nn.Module, s: Setup) -> tuple[bool | None, str]:
    if s.device.type != "cuda":
        s.report.append(("recorded trunk under the CUDA graph vs eager", "SKIP (CUDA only)"))
        return None, "captured on CUDA only"
    eager_ids, eager_diff, eager = trunk_against_full(model, s)
    kept = speedups.decode_capture(model, speedups.SpeedConfig(cuda_graph=True))
    trunk_against_full(model, s, capture=kept)  # the first call captures; the second replays the kept graph
    graph_ids, graph_diff, graph = trunk_against_full(model, s, capture=kept)
    same = eager_ids.shape == graph_ids.shape and torch.equal(eager_ids, graph_ids)
    gap = float((graph - eager).abs().max()) if graph.shape == eager.shape else float("inf")
    s.report.append(("recorded trunk under the CUDA graph vs eager, max abs difference", f"{gap:.1e}"))
    bound = max(4 * eager_diff, 1e-4)  # check 3's rule: the eager recording's own error against the forward
    figure = f"tokens {'equal' if same else 'differ'}; recordings differ by {gap:.1e}; "
    figure += f"the graph's trunk vs the full forward {graph_diff:.1e} (bound {bound:.1e})"
    return same and graph_diff <= bound, figure


# --- main ---------------------------------------------------------------------------------------------------


def run_check(label: str, check: Callable[[], tuple[bool | None, str]]) -> bool:
    """Print `PASS|FAIL|SKIP label: figure`; an exception fails this check only. False if it failed."""
    try:
        ok, figure = check()
    except Exception as error:  # noqa: BLE001 (what fails at these shapes is what this script looks for)
        traceback.print_exc()
        ok, figure = False, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # an out-of-memory error leaves the allocator's cache full
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {label}: {figure}", flush=True)
    return ok is not False


def wanted(label: str, chosen: set[str] | None) -> bool:
    return chosen is None or label.split()[0] in chosen


def print_report(rows: list[tuple[str, str]], header: str) -> None:
    """The measures as one Markdown table, to quote as it is (docs/full-trainer.md's GPU section)."""
    if not rows:
        return
    print(f"\n| measured: {header} | value |\n|---|---|")
    for measure, value in rows:
        print(f"| {measure} | {value} |")
    print()


def check_args(args: Args) -> None:
    """Every flag's range before any model is built (cli.UsageError)."""
    with cli.user_errors():
        args.lora.check()
    for flag, value, low in (
        ("--batch-size", args.batch_size, 1),
        ("--group-size", args.group_size, 2),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--micro-batch-size", args.micro_batch_size, 1),
    ):
        cli.check(value is None or value >= low, flag, f"must be >= {low}, got {value}")
    cli.check(0 < args.top_p <= 1, "--top-p", f"must be in (0, 1], got {args.top_p}")
    cli.check(args.dtype != "float16", "--dtype", "float16 is not supported for training; use bfloat16")


def main(args: Args) -> None:
    check_args(args)
    with cli.user_errors():
        device = distributed.resolve_device(args.device)
        dtype = model_files.resolve_dtype(args.dtype, device)
    name = args.shapes if args.shapes != "auto" else "3b" if device.type == "cuda" else "tiny"
    flags = dict(batch_size=args.batch_size, group_size=args.group_size, max_new_tokens=args.max_new_tokens)
    workload = WORKLOADS[name] | {key: value for key, value in flags.items() if value is not None}
    layers = SHAPES[name][0]["num_hidden_layers"]
    too_many = f"must be <= the {layers} blocks of {name}, got {args.lora.lora_last_k}"
    cli.check(args.lora.lora_last_k <= layers, "--lora-last-k", too_many)
    # NOTE: no deterministic cuBLAS here: this process times the default; check 6 on CUDA runs in a child.
    model = random_model(name, device, dtype, args.seed)
    prompts = random_prompts(model.config, workload, device, args.seed)
    G = workload["group_size"]
    sampling = sampling_options(model.config, workload["max_new_tokens"], args.top_p)
    speed = speedups.SpeedConfig(
        micro_batch_size=args.micro_batch_size, gradient_checkpointing=args.gradient_checkpointing
    )
    s = Setup(prompts, data.repeat_rows(prompts, G).inputs, sampling, G, dtype, args.seed, args.lora, speed)
    B, P = prompts.inputs["input_ids"].shape
    size, precision = sum(p.numel() for p in model.parameters()), str(dtype).removeprefix("torch.")
    header = (
        f"random Qwen2.5-VL, {name} shapes ({size:,} parameters), {device}, {precision}; "
        f"B = {B} x G = {G} rows, P = {P}, T = {sampling['max_new_tokens']}, "
        f"LoRA K = {args.lora.lora_last_k}, r = {args.lora.lora_r}"
    )
    print(f"gpu_check: {header}", flush=True)
    on_cuda_child = device.type == "cuda" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    base = {
        "1 sampler = generate": lambda: check_sampler(model, s),
        "2 left-padded rows": lambda: check_left_padding(model, s),
        "3 recorded trunk = full forward": lambda: check_trunk(model, s),
    }
    chosen = None if args.checks == "all" else set(args.checks.split(","))
    results = [run_check(label, check) for label, check in base.items() if wanted(label, chosen)]
    torch.manual_seed(args.seed)  # LoRA's A
    lora_config.inject(model, args.lora)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-5)
    steps = {label: (loss, adv, {}, 1) for label, (loss, adv) in VARIANTS.items()}
    steps |= {label: ({}, {}, overrides, mu) for label, (overrides, mu) in PATHS.items()}
    trained = {
        f"4 step, {label}": functools.partial(check_step, model, optimizer, s, *settings)
        for label, settings in steps.items()
    }
    trained |= {
        "5 phases": lambda: check_phases(model, optimizer, s),
        "6 determinism": (
            (lambda: determinism_in_child(sys.argv[1:]))
            if on_cuda_child
            else (lambda: check_determinism(model, optimizer, s))
        ),
        "7 CUDA graph = eager": lambda: check_cuda_graph(model, s),
        # with LoRA in place, as training samples
        "8 decode time per token": lambda: check_decode_time(model, s),
        "9 kernels per decoded token": lambda: check_kernel_count(model, s),
        "10 fp32 head as run = fp32": lambda: check_fp32_head(model, s),
        "11 FlashAttention-2 sampler = sdpa": lambda: check_flash_attention(model, s),
        "12 trunk recorded under the graph = eager": lambda: check_graph_trunk(model, s),
    }
    results += [run_check(label, check) for label, check in trained.items() if wanted(label, chosen)]
    print_report(s.report, header)
    failed = results.count(False)
    print(f"{failed} of {len(results)} checks failed" if failed else f"all {len(results)} checks passed")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
