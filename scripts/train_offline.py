"""Offline GRPO: train on pre-scored groups (G given completions per prompt with scores), no sampling.

    python scripts/train_offline.py --demo           # built-in pre-scored inspection groups, CPU, < 1 min
    python scripts/train_offline.py --demo --curriculum-top-k 2 --curriculum-epochs 1 --best-by kl
    python scripts/train_offline.py --help           # every flag, with its documentation
    python scripts/train_offline.py --data scored.jsonl --val-data scored_val.jsonl --adv-clip 5 \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --device cuda --lr 1e-5 --batch-size 4

Input: JSONL lines with the usual `prompt`/`messages` and `images` fields (see data.py) plus
`completions: [text, ...]` and `scores: [float, ...]` of equal length G >= 2 (G may differ between lines).
Every malformed line raises a ValueError naming `file:line`.

The algorithm (see `main`), for rce_epochs + grpo_epochs epochs over the same fixed groups:
1. Reference log-probs ref_logp: one no-grad pass with the adapters disabled, over train and validation, once.
2. RCE warm-up (reward-weighted cross-entropy) for the first rce_epochs epochs: per group
   L = sum_i w_i * CE_i, w = softmax(scores / tau), CE_i the MEAN token NLL of completion i (EOS included;
   the mean, so that a long completion does not outweigh a better-scored short one), tau annealed linearly
   tau_start -> tau_end, learning rate lr * rce_lr_scale, constant. Groups are averaged over the batch.
3. Old log-probs old_logp: one no-grad pass with the policy at the start of the GRPO phase, stored per row on
   the CPU and reused unchanged (frozen) in every GRPO epoch, so ratio = pi / pi_old measures the total drift
   of the offline phase and the PPO clip bounds it (a trust region around the policy GRPO started from).
4. GRPO epochs: adv = grpo.group_advantages(scores) (group z-scores, optionally clipped), grpo.grpo_loss with
   the frozen old_logp and ref_logp (ref is only computed for the training rows when beta > 0), a fresh
   AdamW at lr with warm-up + cosine over the GRPO steps. NOTE: a group whose scores are all equal has
   advantage 0 (no GRPO signal); RCE still imitates it with uniform weights.
   Curriculum: in the first curriculum_epochs GRPO epochs only the top-k completions (by score) of each group
   enter the loss; their advantages stay the z-scores of the FULL group (the baseline does not change).
5. After every epoch: validation metrics, a checkpoint (checkpoint-<epoch>/, newest keep_last kept), and
   best/ (replaced atomically) when the --best-by metric improved; metrics.jsonl gets one line per epoch.

Letters: B prompts per batch, G completions per prompt, N = B*G rows, P prompt length, T completion length.

Choices, where the issue text was silent:
- Batches hold prompts with the SAME G (bucketed by G, then cut into batch_size prompts); the batches are
  fixed for the whole run and only their order is shuffled per epoch, so the first GRPO step sees exactly the
  padding old_logp was computed with and its ratio is 1 (up to float rounding of the grad-mode forward).
  Prompts are prepared (chat template, image processing) once per batch per pass and expanded with
  data.repeat_rows; they are not cached, since the pixel values of a whole dataset need not fit in memory.
- --old-logp-from grpo_start (default) takes old_logp after the RCE warm-up. "init" takes it from the initial
  policy (= the reference, LoRA B = 0); after RCE the first GRPO ratio is then != 1 and the clip may
  already bind, which stalls the GRPO phase; with --rce-epochs 0 the two options coincide.
- Completions are scored text, not our samples: logp uses temperature 1 and every completion gets EOS appended
  (EOS is an action, as in grpo.py). A completion containing the EOS text, or longer than
  max_completion_length tokens, raises naming its line (never truncated).
- Validation metrics (on the --val-data file or a seeded --val-fraction of the training prompts):
    val/kl     token mean of grpo.kl_k3(logp, ref_logp) on the validation completions (lower is better).
               NOTE: these completions were not sampled from the policy, so this is the k3 divergence on
               fixed text, not an unbiased KL estimate.
    val/reward mean over groups of (1/G) sum_i adv_i * mean_logp_i: the covariance of the z-scored scores
               with the policy's mean token log-prob, i.e. how much it prefers higher-scored completions;
               a shift of all log-probs of a group leaves it unchanged (sum_i adv_i = 0). Higher is better.
    val/margin mean over groups of mean_logp(best-scored) - mean_logp(worst-scored) (reported only).
  The best checkpoint is chosen among the trained epochs (RCE epochs included); epoch 0 is only logged.
  NOTE: with --best-by kl the least-moved epoch wins, usually the first one.
- Errors: a bad flag, a missing file or a malformed line (scored groups, images, completions too long) print
  one line `error: ...` naming the flag or file:line and exit with status 2 (cli.py), before the model is
  trained and before an old run in --output-dir is replaced; a bug keeps its traceback (exit status 1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import shutil
import sys
import time
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
    # --- model ---
    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of a Qwen-VL checkpoint (or a text-only causal LM). Default: the tiny one."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""

    # --- data ---
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

    # --- lora ---
    lora_last_k: int = 4
    """LoRA goes into the last K decoder blocks of the language model (vision tower frozen)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is B @ A * alpha / r."""

    # --- rce warm-up ---
    rce_epochs: int = 2
    """E: epochs of reward-weighted cross-entropy before the GRPO epochs (0: none)."""
    tau_start: float = 2.0
    """Softmax temperature of the RCE weights w = softmax(scores / tau) in the first RCE epoch."""
    tau_end: float = 0.5
    """... and in the last RCE epoch (linear in between)."""
    rce_lr_scale: float = 0.1
    """RCE learning rate = lr * rce_lr_scale (constant)."""

    # --- grpo ---
    grpo_epochs: int = 3
    """Epochs of the clipped GRPO loss after the warm-up."""
    batch_size: int = 8
    """B: prompts per optimizer step (all of one batch share G)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Aggregation of per-token losses (see grpo.aggregate)."""
    beta: float = 0.04
    """KL penalty weight (k3 against the adapter-free reference). 0 skips the training reference pass."""
    clip_eps_low: float = 0.2
    """PPO clip: ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """PPO clip: ratio is clipped above at 1 + clip_eps_high."""
    adv_clip: float | None = None
    """Clip advantages (group z-scores of the scores) to [-c, c], e.g. 5.0. None: no clipping."""
    old_logp_from: Literal["grpo_start", "init"] = "grpo_start"
    """Policy whose frozen log-probs are old_logp: the one after the RCE warm-up, or the initial one."""
    curriculum_top_k: int | None = None
    """Curriculum: only the top-k completions (by score) of each group enter the loss early on. None: off."""
    curriculum_epochs: int = 0
    """Number of first GRPO epochs that use the top-k curriculum; all completions afterwards."""

    # --- optimisation ---
    lr: float = 2e-3
    """Peak AdamW learning rate of the GRPO epochs (tiny model; use ~1e-5..5e-5 on real models)."""
    warmup_steps: int = 2
    """Linear warm-up steps before the cosine decay of the GRPO epochs."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient-norm clipping of the LoRA gradients."""

    # --- logging, checkpoints ---
    output_dir: str = "runs/offline"
    """Run folder: metrics.jsonl, checkpoint-<epoch>/, best/, adapter/ (and demo/ with --demo)."""
    best_by: Literal["kl", "reward"] = "reward"
    """Validation metric that picks best/: val/kl (lower is better) or val/reward (higher is better)."""
    keep_last: int = 2
    """Keep only the newest this many epoch checkpoints (best/ is kept separately)."""
    overwrite: bool = False
    """Allow writing into an output dir that already holds a run (its metrics.jsonl is replaced)."""
    seed: int = 0
    """Seeds the validation split, the demo data, batch order and LoRA initialisation."""


# --------------------------------------------------------------------------------------------------
# Pure pieces of the algorithm


def tau_schedule(epoch: int, rce_epochs: int, tau_start: float, tau_end: float) -> float:
    """tau of RCE epoch `epoch` (0-based): linear from tau_start (first) to tau_end (last RCE epoch)."""
    return tau_start + (tau_end - tau_start) * epoch / max(rce_epochs - 1, 1)


def rce_loss(nll: torch.Tensor, scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Reward-weighted cross-entropy: mean over groups of sum_i softmax(scores / tau)_i * nll_i.

    nll, scores: (B, G), one row per group. The weights are constants (scores carry no gradient) and sum to 1
    per group, so every group weighs the same whatever its G. NOTE: softmax never gives 0, so low-scored
    completions are still imitated a little; a small tau approaches supervised learning on the best one.
    """
    w = torch.softmax(scores.to(nll.dtype) / tau, dim=-1)  # (B, G)
    return (w * nll).sum(dim=-1).mean()


def curriculum_mask(scores: torch.Tensor, group_size: int, top_k: int | None) -> torch.Tensor:
    """(N,) bool: True for the top_k highest-scored rows of each group of group_size rows (None: all).

    NOTE: ties are broken by position (stable sort), so the mask is deterministic.
    """
    if top_k is None or top_k >= group_size:
        return torch.ones_like(scores, dtype=torch.bool)
    grouped = scores.view(-1, group_size)  # (B, G)
    order = torch.sort(grouped, dim=1, descending=True, stable=True).indices  # (B, G)
    keep = torch.zeros_like(grouped, dtype=torch.bool)  # (B, G)
    keep.scatter_(1, order[:, :top_k], True)
    return keep.view(-1)


def curriculum_top_k(grpo_epoch: int, *, top_k: int | None, curriculum_epochs: int) -> int | None:
    """The top-k of GRPO epoch `grpo_epoch` (0-based): top_k during the first curriculum_epochs, then None."""
    return top_k if grpo_epoch < curriculum_epochs else None


def is_better(metric: str, value: float, best: float | None) -> bool:
    """Whether `value` of val/<metric> beats `best`: kl lower, reward higher; NaN never; ties keep the old."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best if metric == "kl" else value > best


def sequence_mean_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) mean log-prob per completion token under mask (N, T)."""
    return torch.where(mask, logp, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


# --------------------------------------------------------------------------------------------------
# Data: validation, demo groups, fixed batches


def check_scored(sample: dict) -> dict:
    """Validate `completions`/`scores` of a sample read by data.read_jsonl; errors name its file:line."""
    where = data.location(sample)
    completions, scores = sample.get("completions"), sample.get("scores")
    if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
        raise ValueError(f"{where}: field 'completions' must be a list of strings")
    if not isinstance(scores, list):
        raise ValueError(f"{where}: field 'scores' must be a list of numbers")  # noqa: TRY004 (a data error)
    for i, x in enumerate(scores):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"{where}: scores[{i}] = {x!r} is not a number")  # noqa: TRY004 (a data error)
        if not math.isfinite(x):  # json accepts NaN and Infinity
            raise ValueError(f"{where}: scores[{i}] = {x!r} is not finite")
    if len(completions) != len(scores):
        raise ValueError(f"{where}: {len(completions)} completions but {len(scores)} scores (must be equal)")
    if len(completions) < 2:
        raise ValueError(
            f"{where}: a group needs G >= 2 completions to have a baseline, got {len(completions)}"
        )
    return sample


def read_scored(path: str) -> list[dict]:
    return [check_scored(s) for s in data.read_jsonl(path)]


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
    label = sample["label"]
    other = "通过" if label == "不通过" else "不通过"
    reason = sample["answer"].split("\n", 1)[1]
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
    paths = []
    for split, count in (("train", n), ("val", max(n // 4, 1))):
        lines = []
        for sample in tasks.make_task(
            "inspection", count, split="test" if split == "val" else "train", seed=seed
        ):
            images = []
            for k, image in enumerate(sample["images"]):
                images.append(f"images/{split}-{sample['id']}-{k}.png")
                image.save(directory / images[-1])
            completions, scores = demo_group(sample, rng)
            row = {"id": sample["id"], "images": images, "prompt": sample["prompt"], "label": sample["label"]}
            lines.append(
                json.dumps({**row, "completions": completions, "scores": scores}, ensure_ascii=False)
            )
        paths.append(directory / f"{split}.jsonl")
        paths[-1].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return paths[0], paths[1]


@dataclass
class ScoredBatch:
    """B prompts with G completions each, as N = B*G rows grouped contiguously; tensors live on the CPU."""

    samples: list[dict]  # B
    group_size: int  # G
    completion_ids: torch.Tensor  # (N, T) right-padded with pad_token_id, EOS appended
    mask: torch.Tensor  # (N, T) bool, True up to and including EOS (from the lengths)
    scores: torch.Tensor  # (N,)
    adv: torch.Tensor  # (N,) group z-scores of the scores
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


def collate(
    samples: list[dict], tokenizer, *, adv_clip: float | None, max_completion_length: int
) -> ScoredBatch:
    G = len(samples[0]["completions"])
    rows = [
        tokenize_completion(text, tokenizer, s, max_completion_length)
        for s in samples
        for text in s["completions"]
    ]
    lengths = torch.tensor([len(r) for r in rows])  # (N,)
    completion_ids = torch.full((len(rows), int(lengths.max())), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        completion_ids[i, : len(row)] = torch.tensor(row)
    mask = torch.arange(completion_ids.shape[1])[None, :] < lengths[:, None]  # (N, T) pad may equal EOS
    scores = torch.tensor([x for s in samples for x in s["scores"]], dtype=torch.float32)  # (N,)
    adv = grpo.group_advantages(scores, G, clip=adv_clip)  # (N,) NOTE: an all-equal group gets adv 0
    return ScoredBatch(samples, G, completion_ids, mask, scores, adv)


def make_batches(samples: list[dict], tokenizer, *, batch_size: int, **kw) -> list[ScoredBatch]:
    """Fixed batches of up to batch_size prompts with equal G (prompts bucketed by G, file order kept)."""
    by_g: dict[int, list[dict]] = {}
    for s in samples:
        by_g.setdefault(len(s["completions"]), []).append(s)
    return [
        collate(bucket[i : i + batch_size], tokenizer, **kw)
        for _, bucket in sorted(by_g.items())
        for i in range(0, len(bucket), batch_size)
    ]


def batch_inputs(batch: ScoredBatch, *, tokenizer, image_processor, device, max_prompt_length: int) -> dict:
    """Model inputs of the N rows: prompt b repeated G times (rows b*G .. b*G+G-1), images included."""
    prompts = data.prepare_prompts(
        batch.samples, tokenizer, image_processor, device=device, max_prompt_length=max_prompt_length
    )
    return data.repeat_rows(prompts, batch.group_size).inputs


# --------------------------------------------------------------------------------------------------
# Passes over the batches


@torch.no_grad()
def frozen_logprobs(model, batches: list[ScoredBatch], inputs_of, *, adapters: bool) -> list[torch.Tensor]:
    """(N, T) log-probs of every batch on the CPU, without grad; adapters=False is the reference policy."""
    model.eval()
    device, out = next(model.parameters()).device, []
    for b in batches:
        if adapters:
            logp, _ = grpo.completion_logprobs(
                model, inputs_of(b), b.completion_ids.to(device), temperature=1.0
            )
        else:
            with lora.adapters_disabled(model):
                logp, _ = grpo.completion_logprobs(
                    model, inputs_of(b), b.completion_ids.to(device), temperature=1.0
                )
        out.append(logp.float().cpu())
    return out


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
    model.train()
    device, params = next(model.parameters()).device, lora.lora_parameters(model)
    losses, norms = [], []
    for i in order:
        b = batches[i]
        logp, _ = grpo.completion_logprobs(model, inputs_of(b), b.completion_ids.to(device), temperature=1.0)
        nll = -sequence_mean_logp(logp, b.mask.to(device))  # (N,) CE_i: mean token NLL, EOS included
        G = b.group_size
        loss = rce_loss(nll.view(-1, G), b.scores.to(device).view(-1, G), tau)  # (B, G) -> scalar
        norms.append(optimizer_step(loss, optimizer, params, max_grad_norm))
        losses.append(loss.item())
    model.eval()
    return {"rce_loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms)}


def grpo_step(model, b: ScoredBatch, inputs_of, *, top_k: int | None, args: Args, max_len: int):
    """The clipped GRPO loss of one batch against its frozen old_logp / ref_logp, and its statistics."""
    device = next(model.parameters()).device
    logp, _ = grpo.completion_logprobs(model, inputs_of(b), b.completion_ids.to(device), temperature=1.0)
    rows = curriculum_mask(b.scores, b.group_size, top_k)  # (N,) adv stays the full group's z-score
    mask = (b.mask & rows[:, None]).to(device)  # (N, T)
    old_logp = b.old_logp.to(device)
    config = grpo.LossConfig(
        loss_type=args.loss_type,
        beta=args.beta,
        clip_eps_low=args.clip_eps_low,
        clip_eps_high=args.clip_eps_high,
    )
    # num_rows: "grpo" averages over the rows that are in the loss; num_tokens: this batch's.
    totals = grpo.BatchTotals(int(rows.sum()), mask.sum().clamp(min=1), max_completion_length=max_len)
    loss, stats = grpo.grpo_loss(
        logp,
        old_logp,
        b.ref_logp.to(device) if b.ref_logp is not None else None,
        b.adv.to(device),
        mask,
        config,
        totals=totals,
    )
    stats["log_ratio_absmax"] = torch.where(mask, logp.detach() - old_logp, 0.0).abs().max().item()
    stats["frac_rows_in_loss"] = rows.float().mean().item()  # < 1 while the curriculum is on
    return loss, stats


def grpo_epoch(model, batches, order, inputs_of, optimizer, scheduler, *, top_k, args: Args, max_len) -> dict:
    """One epoch of offline GRPO steps; returns mean statistics and the first step's |log ratio| max."""
    model.train()
    params = lora.lora_parameters(model)
    records = []
    for i in order:
        loss, stats = grpo_step(model, batches[i], inputs_of, top_k=top_k, args=args, max_len=max_len)
        stats.update(loss=loss.item(), grad_norm=optimizer_step(loss, optimizer, params, args.max_grad_norm))
        scheduler.step()
        records.append(stats)
    model.eval()
    means = {k: sum(r[k] for r in records) / len(records) for k in records[0]}
    means["log_ratio_absmax/first_step"] = records[0]["log_ratio_absmax"]
    return means


@torch.no_grad()
def validate(model, batches: list[ScoredBatch], inputs_of) -> dict:
    """val/kl, val/reward and val/margin of the current policy (definitions in the module docstring)."""
    logps = frozen_logprobs(model, batches, inputs_of, adapters=True)
    kl_sum, tokens, reward, margin, groups = 0.0, 0, 0.0, 0.0, 0
    for b, logp in zip(batches, logps):
        kl = grpo.kl_k3(torch.where(b.mask, logp, 0.0), torch.where(b.mask, b.ref_logp, 0.0))  # (N, T)
        kl_sum, tokens = kl_sum + kl[b.mask].sum().item(), tokens + int(b.mask.sum())
        mean_logp = sequence_mean_logp(logp, b.mask).view(-1, b.group_size)  # (B, G)
        scores = b.scores.view(-1, b.group_size)  # (B, G)
        reward += (b.adv.view(-1, b.group_size) * mean_logp).mean(dim=1).sum().item()
        best, worst = scores.argmax(dim=1, keepdim=True), scores.argmin(dim=1, keepdim=True)  # (B, 1)
        margin += (mean_logp.gather(1, best) - mean_logp.gather(1, worst)).sum().item()
        groups += len(b.samples)
    return {"val/kl": kl_sum / tokens, "val/reward": reward / groups, "val/margin": margin / groups}


# --------------------------------------------------------------------------------------------------
# Checkpoints and epochs


def save(directory: Path, model, optimizer, record: dict, args: Args, keep_last: int | None) -> None:
    state = {"epoch": record["epoch"], "metrics": record, "optimizer": optimizer.state_dict()}
    model_io.save_checkpoint(
        directory,
        write_adapter=lambda d: model_io.save_adapter(model, d, base_model_name_or_path=args.model),
        state={**state, "args": dataclasses.asdict(args)},
        keep_last=keep_last,
    )


def end_epoch(
    model, optimizer, record: dict, best: float | None, out: Path, args: Args, val_batches, inputs_of
):
    """Validate, checkpoint, replace best/ if the --best-by metric improved, log; return the best value."""
    record.update(validate(model, val_batches, inputs_of))
    value = record[f"val/{args.best_by}"]
    record["best"] = is_better(args.best_by, value, best)
    save(out / f"checkpoint-{record['epoch']:06d}", model, optimizer, record, args, args.keep_last)
    if record["best"]:  # save_checkpoint writes best.tmp and swaps it in: best/ is never half-written
        save(out / "best", model, optimizer, record, args, None)
        best = value
    logs.append_jsonl(out / "metrics.jsonl", record)
    print(describe(record))
    return best


def describe(record: dict) -> str:
    """One console line per epoch (metrics.jsonl has everything)."""
    if record["phase"] == "rce":
        head = f"tau {record['tau']:.2f}  rce_loss {record['rce_loss']:.4f}"
    else:
        head = f"top_k {record['top_k'] or 'all'}  loss {record['loss']:+.4f}  kl {record.get('kl', 0):.4f}"
    vals = "  ".join(f"{k} {record[k]:+.4f}" for k in ("val/kl", "val/reward", "val/margin"))
    return f"epoch {record['epoch']:2d} {record['phase']:4s}  {head}  {vals}{'  best' * record['best']}"


def epoch_order(n_batches: int, epoch: int, seed: int) -> list[int]:
    return torch.randperm(n_batches, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


# --------------------------------------------------------------------------------------------------
# Main


def check_args(args: Args) -> None:
    """Every flag's range and every file it names, before anything is loaded or written (cli.UsageError)."""
    either = args.demo != (args.data is not None) and not (args.demo and args.val_data)
    cli.check(either, "--data", "pass either --data FILE [--val-data FILE] or --demo")
    for flag, path in (("--data", args.data), ("--val-data", args.val_data)):
        cli.check(path is None or Path(path).is_file(), flag, f"{path} does not exist (or is not a file)")
    top_k, adv_clip = args.curriculum_top_k, args.adv_clip
    ranges = [
        (
            "--val-fraction",
            args.data is None or args.val_data is not None or 0 < args.val_fraction < 1,
            "must be in (0, 1)",
        ),
        ("--demo-size", args.demo_size >= 1, "must be >= 1"),
        ("--max-prompt-length", args.max_prompt_length >= 1, "must be >= 1"),
        ("--max-completion-length", args.max_completion_length >= 1, "must be >= 1 (EOS included)"),
        ("--lora-last-k", args.lora_last_k >= 1, "must be >= 1"),
        ("--lora-r", args.lora_r >= 1, "must be >= 1"),
        ("--lora-alpha", args.lora_alpha > 0, "must be > 0"),
        ("--rce-epochs", args.rce_epochs >= 0, "must be >= 0"),
        ("--grpo-epochs", args.grpo_epochs >= 0, "must be >= 0"),
        ("--tau-start", args.tau_start > 0, "must be > 0"),
        ("--tau-end", args.tau_end > 0, "must be > 0"),
        ("--rce-lr-scale", args.rce_lr_scale > 0, "must be > 0"),
        ("--batch-size", args.batch_size >= 1, "must be >= 1 prompt per step"),
        ("--beta", args.beta >= 0, "must be >= 0 (0 drops the KL term)"),
        ("--clip-eps-low", 0 <= args.clip_eps_low < 1, "must be in [0, 1)"),
        ("--clip-eps-high", args.clip_eps_high >= 0, "must be >= 0"),
        ("--adv-clip", adv_clip is None or adv_clip > 0, "must be > 0"),
        ("--curriculum-top-k", top_k is None or top_k >= 1, "must be >= 1"),
        ("--curriculum-epochs", args.curriculum_epochs >= 0, "must be >= 0"),
        ("--lr", args.lr > 0 and math.isfinite(args.lr), "must be a positive number"),
        ("--warmup-steps", args.warmup_steps >= 0, "must be >= 0"),
        ("--weight-decay", args.weight_decay >= 0, "must be >= 0"),
        ("--max-grad-norm", args.max_grad_norm > 0, "must be > 0"),
        ("--keep-last", args.keep_last >= 1, "must be >= 1"),
    ]
    for flag, ok, message in ranges:
        cli.check(ok, flag, f"{message}, got {getattr(args, flag[2:].replace('-', '_'))}")
    epochs = args.rce_epochs + args.grpo_epochs
    cli.check(epochs >= 1, "--rce-epochs/--grpo-epochs", "together must be >= 1 epoch, got 0")
    out = Path(args.output_dir)
    cli.check(not out.exists() or out.is_dir(), "--output-dir", f"{out} is a file, not a folder")


def load_groups(args: Args, out: Path) -> tuple[list[dict], list[dict]]:
    """(train, validation) pre-scored samples from --data/--val-data, a held-out split, or the demo."""
    if args.demo:
        train_path, val_path = write_demo(out / "demo", args.demo_size, args.seed)
        return read_scored(train_path), read_scored(val_path)
    samples = read_scored(args.data)
    if args.val_data is not None:
        return samples, read_scored(args.val_data)
    return split_validation(samples, args.val_fraction, args.seed)


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an output dir that holds a run unless --overwrite."""
    if (out / "metrics.jsonl").exists() and not overwrite:
        raise cli.UsageError(
            f"{out} already holds a run; pass --overwrite to replace it, or another --output-dir"
        )


def prepare_output(out: Path) -> None:
    """Clear an old run (check_output allowed it); called once every input has been read and checked."""
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()
        for stale in [*model_io.list_checkpoints(out), out / "best"]:  # or they would mix with the new run
            shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def load_inputs(args: Args, out: Path, device: torch.device):
    """Model, tokenizer, image processor and the (train, validation) batches; every input is read and checked
    here (a bad model path, scored line, image or too long prompt or completion is a UsageError)."""
    with cli.user_errors():  # data.py's and check_scored's messages name file:line
        train_samples, val_samples = load_groups(args, out)
    with cli.user_errors("--dtype: "):
        dtype = model_io.resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    with cli.user_errors("--model: "):
        model, tokenizer, image_processor = model_io.load_model(args.model, device=device, dtype=dtype)
    kw = dict(
        batch_size=args.batch_size, adv_clip=args.adv_clip, max_completion_length=args.max_completion_length
    )
    with cli.user_errors():
        data.check_samples(  # every image decodes and every prompt fits, before the first forward
            train_samples + val_samples, tokenizer, image_processor, max_prompt_length=args.max_prompt_length
        )
        batches, val_batches = (
            make_batches(train_samples, tokenizer, **kw),
            make_batches(val_samples, tokenizer, **kw),
        )
    return model, tokenizer, image_processor, batches, val_batches


def with_logprobs(model, batches: list[ScoredBatch], inputs_of, field: str, *, adapters: bool) -> list:
    """The batches with `field` (ref_logp or old_logp) set to frozen log-probs of the current model."""
    logps = frozen_logprobs(model, batches, inputs_of, adapters=adapters)
    return [dataclasses.replace(b, **{field: lp}) for b, lp in zip(batches, logps)]


def run_rce(model, batches, inputs_of, finish, args: Args) -> None:
    """RCE warm-up epochs 1..E: constant lr * rce_lr_scale, tau annealed tau_start -> tau_end."""
    lr = args.lr * args.rce_lr_scale
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=lr, weight_decay=args.weight_decay)
    for e in range(args.rce_epochs):
        t0, tau = time.time(), tau_schedule(e, args.rce_epochs, args.tau_start, args.tau_end)
        order = epoch_order(len(batches), e, args.seed)
        stats = rce_epoch(
            model, batches, order, inputs_of, optimizer, tau=tau, max_grad_norm=args.max_grad_norm
        )
        finish(
            optimizer,
            {"epoch": e + 1, "phase": "rce", "tau": tau, "lr": lr, **stats, "time": time.time() - t0},
        )


def run_grpo(model, batches, inputs_of, finish, args: Args) -> None:
    """GRPO epochs E+1..E+M against the frozen old_logp; a fresh AdamW (the RCE moments fit another loss)."""
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=args.weight_decay)
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
        finish(optimizer, {**record, **stats, "time": time.time() - t0})


def main(args: Args) -> dict:
    check_args(args)
    with cli.user_errors():
        device = distributed.resolve_device(args.device)
    out, t_start = Path(args.output_dir), time.time()
    check_output(out, args.overwrite)
    model, tokenizer, image_processor, batches, val_batches = load_inputs(args, out, device)
    prepare_output(out)
    lora_config = lora.LoRAConfig(
        lora_last_k=args.lora_last_k, lora_r=args.lora_r, lora_alpha=args.lora_alpha
    )
    lora.inject_lora(model, lora_config)
    inputs_of = functools.partial(
        batch_inputs,
        tokenizer=tokenizer,
        image_processor=image_processor,
        device=device,
        max_prompt_length=args.max_prompt_length,
    )
    n_train, n_val = (sum(len(b.samples) for b in bs) for bs in (batches, val_batches))
    print(f"{n_train} training and {n_val} validation groups; {len(batches)} batches")

    # Reference log-probs (adapters off), once and frozen; with LoRA B = 0 they equal the initial policy's.
    val_batches = with_logprobs(model, val_batches, inputs_of, "ref_logp", adapters=False)
    if args.beta > 0:
        batches = with_logprobs(model, batches, inputs_of, "ref_logp", adapters=False)
    if args.old_logp_from == "init":
        batches = with_logprobs(model, batches, inputs_of, "old_logp", adapters=True)
    logs.append_jsonl(out / "metrics.jsonl", {"epoch": 0, **validate(model, val_batches, inputs_of)})
    best: list[float | None] = [None]  # the running best --best-by value, shared by both phases

    def finish(optimizer, record: dict) -> None:  # validate, checkpoint, best/, log
        best[0] = end_epoch(model, optimizer, record, best[0], out, args, val_batches, inputs_of)

    run_rce(model, batches, inputs_of, finish, args)
    if args.old_logp_from == "grpo_start":  # the policy the GRPO phase starts from (after RCE)
        batches = with_logprobs(model, batches, inputs_of, "old_logp", adapters=True)
    run_grpo(model, batches, inputs_of, finish, args)
    model_io.save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    return summarise(out, time.time() - t_start)


def summarise(out: Path, seconds: float) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = [r for r in records if r.get("best")][-1] if any(r.get("best") for r in records) else None
    summary = {"epochs": records[-1]["epoch"], "wall_time_s": round(seconds, 1)}
    if best is not None:
        summary.update(best_epoch=best["epoch"])
    summary.update({f"start_{k[4:]}": records[0][k] for k in ("val/reward", "val/margin")})
    summary.update({f"end_{k[4:]}": records[-1][k] for k in ("val/reward", "val/margin")})
    print(f"done: {json.dumps(summary)}; best in {out / 'best'}, final adapter in {out / 'adapter'}")
    return summary


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
