"""Offline GRPO on pre-scored groups (G given completions per prompt, with scores): no sampling.

    python scripts/train_offline.py --demo           # built-in pre-scored inspection groups, CPU, < 1 min
    python scripts/train_offline.py --demo --curriculum-top-k 2 --curriculum-epochs 1 --best-by kl
    python scripts/train_offline.py --help           # every flag, with its documentation
    python scripts/train_offline.py --data scored.jsonl --val-data scored_val.jsonl --adv-clip 5 \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --device cuda --lr 1e-5 --batch-size 4

Input: JSONL lines as data.py reads them, plus `completions: [text, ...]` and `scores: [float, ...]` of equal
length G >= 2 (G may differ between lines). B prompts per batch, N = B*G rows, T completion length.

The algorithm (`main`), epochs over the same fixed groups:
1. ref_logp: one no-grad pass with the adapters off, once (over the training rows only when beta > 0).
2. rce_epochs of reward-weighted cross-entropy: per group L = sum_i softmax(scores / tau)_i * CE_i, CE_i the
   MEAN token NLL of completion i, EOS included (a long completion must not outweigh a better-scored short
   one); tau linear from tau_start to tau_end; learning rate lr * rce_lr_scale, constant.
3. old_logp: one no-grad pass with the policy GRPO starts from, frozen for all GRPO epochs, so the ratio
   pi / pi_old measures the phase's total drift and the PPO clip bounds it. (--old-logp-from init: the
   initial policy's, the reference; after RCE the first ratio is then != 1 and the clip may already bind.)
4. grpo_epochs of grpo.grpo_loss on grpo.group_advantages of the scores; a fresh AdamW at lr, warm-up +
   cosine. NOTE: a group of equal scores has adv 0 (no GRPO signal); RCE still imitates it, uniformly.
   Curriculum: in the first curriculum_epochs only each group's top-k completions enter the loss, with the
   FULL group's advantages (the baseline does not change).
5. After each epoch: validation, checkpoint-<epoch>/ (newest keep_last kept), best/ (swapped in whole) when
   the --best-by metric beats every trained epoch before, one line of metrics.jsonl.

Choices:
- A batch holds prompts of one G and is fixed for the run (only the batch order is shuffled), so the first
  GRPO step sees the padding old_logp saw: its ratio is 1 to rounding. Prompts are prepared anew in every
  pass: a dataset's pixel values need not fit in memory.
- The completions are given text: logp at temperature 1, EOS appended to each (an action, as in grpo.py).
  One that holds the EOS text or exceeds max_completion_length raises naming its line (never truncated).
- Validation (--val-data, or a seeded --val-fraction of the training prompts): val/kl, the token mean of
  grpo.kl_k3 against the reference (NOTE: on fixed text, not the policy's samples, so a divergence, not a KL
  estimate; by it the least-moved epoch wins); val/reward, the mean over groups of (1/G) sum_i adv_i *
  mean_logp_i, how much the policy prefers the higher-scored completions; val/margin, the mean over groups
  of mean_logp(best-scored) - mean_logp(worst-scored), reported only.
- Adaptive KL (a per-step beta) and normalize_then_sum (several rewards) have no meaning here: refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli
import data
import distributed
import grpo
import logs
import lora
import model_io
import tasks


@dataclass
class Args:
    """Offline GRPO: this script's flags, then the settings groups it shares with train.py. Every flag keeps a
    flat name, `--beta` not `--loss.beta` (tyro.conf.OmitArgPrefixes)."""

    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of a Qwen-VL checkpoint (or a text-only causal LM). Default: the tiny one."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""
    data: str | None = None
    """Training JSONL with prompt/images plus `completions` and `scores` (equal length, G >= 2)."""
    val_data: str | None = None
    """Validation JSONL in the same format. Default: hold out --val-fraction of --data."""
    val_fraction: float = 0.1
    """Share of the training prompts held out for validation when --val-data is not given (at least 1)."""
    demo: bool = False
    """Write pre-scored groups of the built-in inspection task to <output-dir>/demo/ and train on them."""
    demo_size: int = 24
    """Training prompts of the demo (a quarter as many held-out ones)."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image tokens included. Longer prompts raise (never truncated)."""
    max_completion_length: int = 512
    """Longest completion in tokens, EOS included. Longer completions raise naming their line."""
    rce_epochs: int = 2
    """Epochs of reward-weighted cross-entropy before the GRPO epochs (0: none)."""
    tau_start: float = 2.0
    """Softmax temperature of the RCE weights w = softmax(scores / tau) in the first RCE epoch."""
    tau_end: float = 0.5
    """... and in the last RCE epoch (linear in between)."""
    rce_lr_scale: float = 0.1
    """RCE learning rate = lr * rce_lr_scale (constant)."""
    grpo_epochs: int = 3
    """Epochs of the GRPO loss after the warm-up."""
    batch_size: int = 8
    """B: prompts per optimizer step (all of one batch share G)."""
    old_logp_from: Literal["grpo_start", "init"] = "grpo_start"
    """Policy whose frozen log-probs are old_logp: the one after the RCE warm-up, or the initial one."""
    curriculum_top_k: int | None = None
    """Curriculum: only the top-k completions (by score) of each group enter the loss early on. None: off."""
    curriculum_epochs: int = 0
    """Number of first GRPO epochs that use the top-k curriculum; all completions afterwards."""
    lr: float = 2e-3
    """Peak AdamW learning rate of the GRPO epochs (tiny model; use ~1e-5..5e-5 on real models)."""
    warmup_steps: int = 2
    """Linear warm-up steps before the cosine decay of the GRPO epochs."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient-norm clipping of the LoRA gradients."""
    output_dir: str = "runs/offline"
    """Run folder: run.json, metrics.jsonl, checkpoint-<epoch>/, best/, adapter/ (and demo/ with --demo)."""
    best_by: Literal["kl", "reward"] = "reward"
    """Validation metric that picks best/: val/kl (lower is better) or val/reward (higher is better)."""
    keep_last: int = 2
    """Keep only the newest this many epoch checkpoints (best/ is kept separately)."""
    overwrite: bool = False
    """Replace the run the output dir holds (its logs, checkpoints, best/ and adapter/)."""
    seed: int = 0
    """Seeds the validation split, the demo data, batch order and LoRA initialisation."""
    adv: grpo.AdvantageConfig = dataclasses.field(default_factory=grpo.AdvantageConfig)
    """Advantages of the scores (grpo.py)."""
    loss: grpo.LossConfig = dataclasses.field(default_factory=grpo.LossConfig)
    """The GRPO loss and its variants (grpo.py)."""
    lora: lora.LoRAConfig = dataclasses.field(default_factory=lora.LoRAConfig)
    """LoRA (lora.py): where, its rank and scale."""


# --------------------------------------------------------------------------------------------------
# Pure pieces of the algorithm


def tau_schedule(epoch: int, rce_epochs: int, tau_start: float, tau_end: float) -> float:
    """tau of RCE epoch `epoch` (0-based): linear from tau_start (first) to tau_end (last RCE epoch)."""
    return tau_start + (tau_end - tau_start) * epoch / max(rce_epochs - 1, 1)


def rce_loss(nll: torch.Tensor, scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over groups of sum_i softmax(scores / tau)_i * nll_i, from nll and scores (B, G). The weights are
    constants and sum to 1 per group: every group weighs the same whatever its G. NOTE: softmax never gives
    0, so low-scored completions are imitated a little; a small tau approaches imitating the best alone."""
    w = torch.softmax(scores.to(nll.dtype) / tau, dim=-1)  # (B, G)
    return (w * nll).sum(dim=-1).mean()


def curriculum_mask(scores: torch.Tensor, group_size: int, top_k: int | None) -> torch.Tensor:
    """(N,) bool: True for the top_k highest-scored rows of each group of group_size rows (None: all).
    NOTE: ties go to the earlier row (stable sort), so the mask is deterministic."""
    if top_k is None or top_k >= group_size:
        return torch.ones_like(scores, dtype=torch.bool)
    grouped = scores.view(-1, group_size)  # (B, G)
    order = torch.sort(grouped, dim=1, descending=True, stable=True).indices  # (B, G)
    return torch.zeros_like(grouped, dtype=torch.bool).scatter_(1, order[:, :top_k], True).view(-1)


def curriculum_top_k(grpo_epoch: int, *, top_k: int | None, curriculum_epochs: int) -> int | None:
    """The top-k of GRPO epoch `grpo_epoch` (0-based): top_k during the first curriculum_epochs, then None."""
    return top_k if grpo_epoch < curriculum_epochs else None


def is_better(metric: str, value: float, best: float | None) -> bool:
    """Whether `value` of val/<metric> beats `best`: kl lower, reward higher; NaN never; ties keep the old."""
    if not math.isfinite(value):
        return False
    return best is None or (value < best if metric == "kl" else value > best)


def sequence_mean_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) mean log-prob per completion token under mask (N, T)."""
    return torch.where(mask, logp, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


# --------------------------------------------------------------------------------------------------
# Data: scored lines, demo groups, fixed batches


def read_scored(path: str) -> list[dict]:
    """data.read_jsonl's samples, each with valid `completions` and `scores`; errors name file:line."""
    samples = data.read_jsonl(path)
    for sample in samples:
        where, completions, scores = data.location(sample), sample.get("completions"), sample.get("scores")
        if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
            raise ValueError(f"{where}: field 'completions' must be a list of strings")
        if not isinstance(scores, list):
            raise ValueError(f"{where}: field 'scores' must be a list of numbers")  # noqa: TRY004 (data error)
        for i, x in enumerate(scores):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"{where}: scores[{i}] = {x!r} is not a number")  # noqa: TRY004 (data error)
            if not math.isfinite(x):  # json reads NaN and Infinity
                raise ValueError(f"{where}: scores[{i}] = {x!r} is not finite")
        if len(completions) != len(scores):
            raise ValueError(
                f"{where}: {len(completions)} completions but {len(scores)} scores (must be equal)"
            )
        if len(completions) < 2:
            raise ValueError(
                f"{where}: a group needs G >= 2 completions for a baseline, got {len(completions)}"
            )
    return samples


def split_validation(samples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): a seeded random `fraction` of the prompts (at least one) is held out."""
    n_val = max(1, round(fraction * len(samples)))
    if n_val >= len(samples):
        raise ValueError(f"cannot hold out {n_val} of {len(samples)} prompts; pass --val-data instead")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_val])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


def demo_group(sample: dict, rng: random.Random) -> tuple[list[str], list[float]]:
    """G = 4 scored candidates for an inspection sample, shuffled: right 1.0, wrong verdict 0.0, broken format
    with the right verdict 0.1-0.2, neither 0.0-0.1."""
    label, reason = sample["label"], sample["answer"].split("\n", 1)[1]
    other = "通过" if label == "不通过" else "不通过"
    wrong_reason = (
        "理由: 无缺陷" if other == "通过" else f"理由: 图片{rng.randint(1, len(sample['images']))}有缺陷"
    )
    candidates = [
        (sample["answer"], 1.0),
        (f"{other}\n{wrong_reason}", 0.0),
        (rng.choice([label, f"{label} {reason}", f"{reason}\n{label}"]), round(rng.uniform(0.1, 0.2), 3)),
        (rng.choice([other, reason, "理由:"]), round(rng.uniform(0.0, 0.1), 3)),
    ]
    rng.shuffle(candidates)
    return [c for c, _ in candidates], [s for _, s in candidates]


def write_demo(directory: Path, n: int, seed: int) -> tuple[Path, Path]:
    """Write train.jsonl (n prompts) and val.jsonl (n // 4, held-out split) with PNG images; return both."""
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n), ("val", max(n // 4, 1))):
        lines = []
        for sample in tasks.make_task(
            "inspection", count, split="test" if split == "val" else "train", seed=seed
        ):
            images = [f"images/{split}-{sample['id']}-{k}.png" for k in range(len(sample["images"]))]
            for image, name in zip(sample["images"], images):
                image.save(directory / name)
            completions, scores = demo_group(sample, rng)
            row = {"id": sample["id"], "images": images, "prompt": sample["prompt"], "label": sample["label"]}
            lines.append(
                json.dumps({**row, "completions": completions, "scores": scores}, ensure_ascii=False)
            )
        (directory / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return directory / "train.jsonl", directory / "val.jsonl"


@dataclass
class ScoredBatch:
    """B prompts with G completions each, as N = B*G rows grouped contiguously; tensors live on the CPU."""

    samples: list[dict]  # B
    group_size: int  # G
    completion_ids: torch.Tensor  # (N, T) right-padded with pad_token_id, EOS appended
    mask: torch.Tensor  # (N, T) bool, True up to and including EOS (from the lengths: pad may equal EOS)
    scores: torch.Tensor  # (N,)
    adv: torch.Tensor  # (N,)
    ref_logp: torch.Tensor | None = None  # (N, T) adapter-free reference, frozen
    old_logp: torch.Tensor | None = None  # (N, T) policy at the start of the GRPO phase, frozen


def tokenize_completion(text: str, tokenizer, sample: dict, max_completion_length: int) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if tokenizer.eos_token_id in ids[:-1]:  # the mask would end there and drop the rest silently
        raise ValueError(
            f"{data.location(sample)}: a completion contains the EOS token {tokenizer.eos_token!r}"
        )
    if len(ids) > max_completion_length:
        raise ValueError(
            f"{data.location(sample)}: a completion is {len(ids)} tokens (EOS included), more than "
            f"max_completion_length={max_completion_length}; raise the limit (it is never truncated)"
        )
    return ids


def make_batches(
    samples: list[dict],
    tokenizer,
    *,
    batch_size: int,
    max_completion_length: int,
    adv_clip: float | None,
    adv_scale: grpo.AdvantageScale = "group",
    adv_baseline: grpo.AdvantageBaseline = "group",
) -> list[ScoredBatch]:
    """Fixed batches of up to batch_size prompts with equal G (prompts bucketed by G, file order kept)."""
    by_g: dict[int, list[dict]] = {}
    for s in samples:
        by_g.setdefault(len(s["completions"]), []).append(s)
    batches = []
    for G, bucket in sorted(by_g.items()):
        for chunk in (bucket[i : i + batch_size] for i in range(0, len(bucket), batch_size)):
            rows = [
                tokenize_completion(t, tokenizer, s, max_completion_length)
                for s in chunk
                for t in s["completions"]
            ]
            T = max(len(r) for r in rows)
            ids = torch.tensor([r + [tokenizer.pad_token_id] * (T - len(r)) for r in rows])  # (N, T)
            mask = torch.arange(T)[None, :] < torch.tensor([len(r) for r in rows])[:, None]  # (N, T)
            scores = torch.tensor([x for s in chunk for x in s["scores"]], dtype=torch.float32)  # (N,)
            adv = grpo.group_advantages(scores, G, scale=adv_scale, clip=adv_clip, baseline=adv_baseline)
            batches.append(ScoredBatch(chunk, G, ids, mask, scores, adv))
    return batches


def batch_inputs(batch: ScoredBatch, *, tokenizer, image_processor, device, max_prompt_length: int) -> dict:
    """Model inputs of the N rows: prompt b repeated G times (rows b*G .. b*G+G-1), images included."""
    prompts = data.prepare_prompts(
        batch.samples, tokenizer, image_processor, device=device, max_prompt_length=max_prompt_length
    )
    return data.repeat_rows(prompts, batch.group_size).inputs


# --------------------------------------------------------------------------------------------------
# Passes over the batches


def logprobs(model, b: ScoredBatch, inputs_of, return_entropy: bool = False):
    """logp [and entropy] (N, T) of the batch's completions under `model`, temperature 1."""
    ids = b.completion_ids.to(next(model.parameters()).device)
    return grpo.completion_logprobs(model, inputs_of(b), ids, temperature=1.0, return_entropy=return_entropy)


@torch.no_grad()
def frozen_logprobs(model, batches: list[ScoredBatch], inputs_of, *, adapters: bool) -> list[torch.Tensor]:
    """(N, T) log-probs of every batch, fp32 on the CPU; adapters=False: the reference policy's."""
    model.eval()
    with contextlib.nullcontext() if adapters else lora.adapters_disabled(model):
        return [logprobs(model, b, inputs_of)[0].float().cpu() for b in batches]


def with_logprobs(model, batches: list[ScoredBatch], inputs_of, field: str, *, adapters: bool) -> list:
    """The batches with `field` (ref_logp or old_logp) set to frozen log-probs of the current model."""
    logps = frozen_logprobs(model, batches, inputs_of, adapters=adapters)
    return [dataclasses.replace(b, **{field: lp}) for b, lp in zip(batches, logps)]


def optimizer_step(loss: torch.Tensor, optimizer, params, max_grad_norm: float) -> float:
    if not torch.isfinite(loss):  # NOTE: stepping on a NaN loss would poison the adapter for good
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return grad_norm.item()


def rce_epoch(model, batches, order, inputs_of, optimizer, *, tau: float, max_grad_norm: float) -> dict:
    """One epoch of reward-weighted cross-entropy; returns the mean loss (at this tau) and grad norm."""
    model.train()  # LoRA dropout, if any
    params, losses, norms = lora.lora_parameters(model), [], []
    for b in (batches[i] for i in order):
        logp, _ = logprobs(model, b, inputs_of)
        nll = -sequence_mean_logp(logp, b.mask.to(logp.device))  # (N,) CE_i: mean token NLL, EOS included
        loss = rce_loss(nll.view(-1, b.group_size), b.scores.to(logp.device).view(-1, b.group_size), tau)
        norms.append(optimizer_step(loss, optimizer, params, max_grad_norm))
        losses.append(loss.item())
    model.eval()
    return {"rce_loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms)}


def grpo_epoch(model, batches, order, inputs_of, optimizer, scheduler, *, top_k, args: Args, max_len) -> dict:
    """One epoch of GRPO steps against the frozen old_logp / ref_logp; the mean statistics and the first
    step's max |log ratio| (0 to rounding when old_logp was taken just before)."""
    model.train()
    params, records, quantile = lora.lora_parameters(model), [], args.loss.top_entropy_quantile
    for b in (batches[i] for i in order):
        logp, entropy = logprobs(model, b, inputs_of, return_entropy=quantile < 1)
        rows = curriculum_mask(b.scores, b.group_size, top_k)  # (N,) adv stays the full group's
        mask = (b.mask & rows[:, None]).to(logp.device)  # (N, T)
        token_mask = grpo.high_entropy_mask(entropy, mask, quantile) if quantile < 1 else None
        old_logp = b.old_logp.to(logp.device)
        ref_logp = None if b.ref_logp is None else b.ref_logp.to(logp.device)
        # num_rows: "grpo" averages over the rows in the loss; dr_grpo divides by the longest completion.
        totals = grpo.BatchTotals(int(rows.sum()), mask.sum().clamp(min=1), max_completion_length=max_len)
        adv = b.adv.to(logp.device)
        loss, stats = grpo.grpo_loss(
            logp, old_logp, ref_logp, adv, mask, args.loss, token_mask=token_mask, totals=totals
        )
        stats["log_ratio_absmax"] = torch.where(mask, logp.detach() - old_logp, 0.0).abs().max().item()
        stats["frac_rows_in_loss"] = rows.float().mean().item()  # < 1 while the curriculum is on
        stats.update(loss=loss.item(), grad_norm=optimizer_step(loss, optimizer, params, args.max_grad_norm))
        scheduler.step()
        records.append(stats)
    model.eval()
    means = {k: sum(r[k] for r in records) / len(records) for k in records[0]}
    return {**means, "log_ratio_absmax/first_step": records[0]["log_ratio_absmax"]}


@torch.no_grad()
def validate(model, batches: list[ScoredBatch], inputs_of) -> dict:
    """val/kl, val/reward and val/margin of the current policy (definitions in the module docstring)."""
    kl_sum, tokens, reward, margin, groups = 0.0, 0, 0.0, 0.0, 0
    for b, logp in zip(batches, frozen_logprobs(model, batches, inputs_of, adapters=True)):
        G = b.group_size
        kl = grpo.kl_k3(torch.where(b.mask, logp, 0.0), torch.where(b.mask, b.ref_logp, 0.0))  # (N, T)
        kl_sum, tokens = kl_sum + kl[b.mask].sum().item(), tokens + int(b.mask.sum())
        mean_logp, scores = sequence_mean_logp(logp, b.mask).view(-1, G), b.scores.view(-1, G)  # (B, G)
        reward += (b.adv.view(-1, G) * mean_logp).mean(dim=1).sum().item()
        best, worst = scores.argmax(dim=1, keepdim=True), scores.argmin(dim=1, keepdim=True)  # (B, 1)
        margin += (mean_logp.gather(1, best) - mean_logp.gather(1, worst)).sum().item()
        groups += len(b.samples)
    return {"val/kl": kl_sum / tokens, "val/reward": reward / groups, "val/margin": margin / groups}


# --------------------------------------------------------------------------------------------------
# Set-up, epochs' end, main


def check_args(args: Args) -> None:
    """Every flag's range and every file it names, before anything is loaded or written (cli.UsageError):
    each settings group checks its own, then this script's flags."""
    with cli.user_errors():
        for group in (args.adv, args.loss, args.lora):
            group.check()
    a = args
    either = a.demo != (a.data is not None) and not (a.demo and a.val_data)
    cli.check(either, "--data", "pass either --data FILE [--val-data FILE] or --demo")
    for flag, path in (("--data", a.data), ("--val-data", a.val_data)):
        cli.check(path is None or Path(path).is_file(), flag, f"{path} does not exist (or is not a file)")
    split = a.data is None or a.val_data is not None or 0 < a.val_fraction < 1
    cli.check(split, "--val-fraction", f"must be in (0, 1), got {a.val_fraction}")
    top_k = a.curriculum_top_k
    cli.check(top_k is None or top_k >= 1, "--curriculum-top-k", f"must be >= 1, got {top_k}")

    for minimum, flags in [
        (1, ("--demo-size", "--max-prompt-length", "--max-completion-length", "--batch-size", "--keep-last")),
        (0, ("--rce-epochs", "--grpo-epochs", "--curriculum-epochs", "--warmup-steps", "--weight-decay")),
    ]:
        for flag in flags:
            value = getattr(a, flag[2:].replace("-", "_"))
            cli.check(value >= minimum, flag, f"must be >= {minimum}, got {value}")
    for flag in ("--tau-start", "--tau-end", "--rce-lr-scale", "--lr", "--max-grad-norm"):
        value = getattr(a, flag[2:].replace("-", "_"))
        cli.check(0 < value < math.inf, flag, f"must be a positive number, got {value}")
    cli.check(a.rce_epochs + a.grpo_epochs >= 1, "--rce-epochs/--grpo-epochs", "together must be >= 1, got 0")
    cli.check(a.loss.kl_target_low is None, "--kl-target-low", "adaptive KL is not available offline")
    one = a.adv.multi_objective_aggregation == "sum_then_normalize"
    cli.check(one, "--multi-objective-aggregation", "needs several rewards; a line has one score")
    out = Path(a.output_dir)
    cli.check(not out.exists() or out.is_dir(), "--output-dir", f"{out} is a file, not a folder")
    held = f"{out} already holds a run; pass --overwrite to replace it, or another --output-dir"
    cli.check(a.overwrite or not (out / "metrics.jsonl").exists(), "--output-dir", held)


def load_inputs(args: Args, out: Path, device: torch.device):
    """The model with LoRA, inputs_of (a batch's prompt inputs) and the (train, validation) batches. Every
    input is read and checked here: a bad model, line, image or length is a UsageError before any write."""
    with cli.user_errors():  # data.py's and read_scored's messages name file:line
        if args.demo:
            train, val = (read_scored(p) for p in write_demo(out / "demo", args.demo_size, args.seed))
        elif args.val_data is not None:
            train, val = read_scored(args.data), read_scored(args.val_data)
        else:
            train, val = split_validation(read_scored(args.data), args.val_fraction, args.seed)
    with cli.user_errors("--dtype: "):
        dtype = model_io.resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)  # LoRA's A matrices are drawn from it
    with cli.user_errors("--model: "):
        model, tokenizer, image_processor = model_io.load_model(args.model, device=device, dtype=dtype)
    with cli.user_errors("--lora-last-k: "):
        lora.inject_lora(model, args.lora)
    make = functools.partial(
        make_batches,
        tokenizer=tokenizer,
        batch_size=args.batch_size,
        max_completion_length=args.max_completion_length,
        adv_clip=args.adv.adv_clip,
        adv_scale=args.adv.adv_scale,
        adv_baseline=args.adv.adv_baseline,
    )
    with cli.user_errors():  # every image decodes and every prompt and completion fits, before any forward
        data.check_samples(train + val, tokenizer, image_processor, max_prompt_length=args.max_prompt_length)
        batches, val_batches = make(train), make(val)
    print(f"{len(train)} training and {len(val)} validation groups; {len(batches)} batches")
    inputs_of = functools.partial(
        batch_inputs,
        tokenizer=tokenizer,
        image_processor=image_processor,
        device=device,
        max_prompt_length=args.max_prompt_length,
    )
    return model, inputs_of, batches, val_batches


def end_epoch(
    model, records: list[dict], optimizer, record: dict, out: Path, args: Args, val_batches, inputs_of
):
    """Validate; checkpoint; replace best/ if the --best-by metric beats the best epoch's so far; log."""
    record.update(validate(model, val_batches, inputs_of))
    key = f"val/{args.best_by}"
    best = next((r[key] for r in reversed(records) if r.get("best")), None)
    record["best"] = is_better(args.best_by, record[key], best)
    state = {"epoch": record["epoch"], "metrics": record, "optimizer": optimizer.state_dict()}
    state["args"] = dataclasses.asdict(args)
    adapter = functools.partial(model_io.save_adapter, model, base_model_name_or_path=args.model)
    save = functools.partial(model_io.save_checkpoint, write_adapter=adapter, state=state)
    save(out / f"checkpoint-{record['epoch']:06d}", keep_last=args.keep_last)
    if record["best"]:  # written as best.tmp, then swapped in: best/ is never half-written
        save(out / "best", keep_last=None)
    records.append(record)
    logs.append_jsonl(out / "metrics.jsonl", record)
    if record["phase"] == "rce":
        head = f"tau {record['tau']:.2f}  rce_loss {record['rce_loss']:.4f}"
    else:
        head = f"top_k {record['top_k'] or 'all'}  loss {record['loss']:+.4f}  kl {record.get('kl', 0):.4f}"
    vals = "  ".join(f"{k} {record[k]:+.4f}" for k in ("val/kl", "val/reward", "val/margin"))
    print(f"epoch {record['epoch']:2d} {record['phase']:4s}  {head}  {vals}{'  best' * record['best']}")


def epoch_order(n_batches: int, epoch: int, seed: int) -> list[int]:
    return torch.randperm(n_batches, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def summarise(records: list[dict], seconds: float, out: Path) -> dict:
    summary = {"epochs": records[-1]["epoch"], "wall_time_s": round(seconds, 1)}
    best = [r["epoch"] for r in records if r.get("best")]
    summary.update({"best_epoch": best[-1]} if best else {})
    summary.update({f"start_{k[4:]}": records[0][k] for k in ("val/reward", "val/margin")})
    summary.update({f"end_{k[4:]}": records[-1][k] for k in ("val/reward", "val/margin")})
    print(f"done: {json.dumps(summary)}; best in {out / 'best'}, final adapter in {out / 'adapter'}")
    return summary


def main(args: Args) -> dict:
    """Train; returns the summary. A bad flag, file or line is a cli.UsageError before anything is written."""
    check_args(args)
    t_start, out = time.time(), Path(args.output_dir)
    with cli.user_errors():
        device = distributed.resolve_device(args.device)
    model, inputs_of, batches, val_batches = load_inputs(args, out, device)
    mode = "replace" if (out / "metrics.jsonl").exists() else "new"  # replace: check_args saw --overwrite
    if mode == "replace":
        shutil.rmtree(out / "best", ignore_errors=True)  # not among model_io's run files
    model_io.open_run_folder(out, mode, uuid.uuid4().hex, 0, dataclasses.asdict(args))

    # Reference log-probs (adapters off), once and frozen; with LoRA B = 0 they equal the initial policy's.
    val_batches = with_logprobs(model, val_batches, inputs_of, "ref_logp", adapters=False)
    if args.loss.beta > 0:
        batches = with_logprobs(model, batches, inputs_of, "ref_logp", adapters=False)
    if args.old_logp_from == "init":
        batches = with_logprobs(model, batches, inputs_of, "old_logp", adapters=True)
    records = [{"epoch": 0, **validate(model, val_batches, inputs_of)}]
    logs.append_jsonl(out / "metrics.jsonl", records[0])

    # RCE warm-up, epochs 1..E: constant lr * rce_lr_scale, tau annealed.
    params, lr = lora.lora_parameters(model), args.lr * args.rce_lr_scale
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    for e in range(args.rce_epochs):
        t0, tau = time.time(), tau_schedule(e, args.rce_epochs, args.tau_start, args.tau_end)
        order = epoch_order(len(batches), e, args.seed)
        stats = rce_epoch(
            model, batches, order, inputs_of, optimizer, tau=tau, max_grad_norm=args.max_grad_norm
        )
        record = {"epoch": e + 1, "phase": "rce", "tau": tau, "lr": lr, **stats, "time": time.time() - t0}
        end_epoch(model, records, optimizer, record, out, args, val_batches, inputs_of)

    # GRPO epochs E+1..E+M against the frozen old_logp; a fresh AdamW (the RCE moments fit another loss).
    if args.old_logp_from == "grpo_start":
        batches = with_logprobs(model, batches, inputs_of, "old_logp", adapters=True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    total = args.grpo_epochs * len(batches)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=total)
    max_len = max(b.completion_ids.shape[1] for b in batches)  # dr_grpo's constant normaliser
    for g in range(args.grpo_epochs):
        t0, epoch, lr = time.time(), args.rce_epochs + g + 1, scheduler.get_last_lr()[0]
        top_k = curriculum_top_k(g, top_k=args.curriculum_top_k, curriculum_epochs=args.curriculum_epochs)
        order = epoch_order(len(batches), epoch - 1, args.seed)
        stats = grpo_epoch(
            model, batches, order, inputs_of, optimizer, scheduler, top_k=top_k, args=args, max_len=max_len
        )
        record = {"epoch": epoch, "phase": "grpo", "curriculum": top_k is not None, "top_k": top_k, "lr": lr}
        record.update(stats, time=time.time() - t0)
        end_epoch(model, records, optimizer, record, out, args, val_batches, inputs_of)
    model_io.save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    return summarise(records, time.time() - t_start, out)


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,)))
