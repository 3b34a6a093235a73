"""Offline GRPO on pre-scored groups (G given completions per prompt, with scores): no sampling.

    python scripts/train_offline.py --demo           # built-in pre-scored inspection groups, CPU, < 1 min
    python scripts/train_offline.py --demo --curriculum-top-k 2 --curriculum-epochs 1 --best-by kl
    python scripts/train_offline.py --data scored.jsonl --val-data scored_val.jsonl --adv-clip 5 \\
        --model Qwen/Qwen2.5-VL-3B-Instruct --device cuda --lr 1e-5 --batch-size 4

Input: JSONL lines as data.py reads them, plus `completions: [text, ...]` and `scores: [float, ...]` of equal
length G >= 2 (G may differ between lines). B prompts per batch, N = B*G rows, T completion length.

The algorithm (`main`), epochs over the same fixed groups:
1. ref_logp: one no-grad pass with the adapters off (over the training rows only when beta > 0).
2. rce_epochs of reward-weighted cross-entropy, per group sum_i softmax(scores / tau)_i * CE_i with CE_i the
   MEAN token NLL of completion i, EOS included (a long completion must not outweigh a better-scored short
   one); tau linear from tau_start to tau_end; a constant learning rate lr * rce_lr_scale.
3. old_logp: one no-grad pass with the policy GRPO starts from, frozen for all GRPO epochs: pi / pi_old
   measures the phase's total drift and the PPO clip bounds it. (--old-logp-from init: the reference's;
   after RCE the first ratio is then != 1 and the clip may already bind.)
4. grpo_epochs of grpo.grpo_loss on grpo.group_advantages of the scores; a fresh AdamW at lr, warm-up +
   cosine. NOTE: a group of equal scores has adv 0 (no GRPO signal); RCE still imitates it, uniformly.
   Curriculum: in the first curriculum_epochs only each group's top-k completions enter the loss, with the
   FULL group's advantages (the baseline does not change).
5. After each epoch: validation, checkpoint-<epoch>/ (newest keep_last kept), best/ by --best-by, metrics.

Choices:
- A batch holds prompts of one G and is fixed for the run (only the batch order is shuffled), so the first
  GRPO step sees the padding old_logp saw: its ratio is 1 to rounding. Prompts are prepared anew in every
  pass (pixel values need not fit in memory). Completions are given text: logp at temperature 1, EOS
  appended (an action, as in grpo.py); one that holds the EOS text or is too long raises (never truncated).
- Validation (--val-data, or a seeded --val-fraction of the prompts): val/kl, the token mean of grpo.kl_k3
  against the reference (NOTE: on fixed text, not the policy's samples: a divergence, not a KL estimate; by it
  the least-moved epoch wins); val/reward, the group mean of (1/G) sum_i adv_i * mean_logp_i (how much the
  policy prefers the higher-scored completions); val/margin, the group mean of mean_logp(best-scored) -
  mean_logp(worst-scored), reported only.
- Adaptive KL (a per-step beta) and normalize_then_sum (several rewards) have no meaning here: refused.
- One process per --output-dir (its lock: <output-dir>/.lock, as trainer.py's); an --output-dir that holds
  --data / --val-data or is inside --model is refused; a failed write is one line, status 74 (cli.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Literal

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data
import grpo
import lora
import model_io
from grpo_vlm import (
    adapters,
    checkpoints,
    cli,
    dataset,
    distributed,
    logs,
    lora_config,
    model_files,
    objectives,
)
from scripts import mock_rollouts, outputs


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # flat flag names: `--beta`, not `--loss.beta`
@dataclasses.dataclass
class Args:
    """Offline GRPO: this script's flags, then the settings groups it shares with trainer.py."""

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
    """AdamW weight decay of the LoRA parameters."""
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
    adv: objectives.AdvantageConfig = dataclasses.field(default_factory=objectives.AdvantageConfig)
    """Advantages of the scores (grpo_vlm/objectives.py, grpo.py)."""
    loss: objectives.LossConfig = dataclasses.field(default_factory=objectives.LossConfig)
    """The GRPO loss and its variants (grpo_vlm/objectives.py, grpo.py)."""
    lora: lora_config.LoRAConfig = dataclasses.field(default_factory=lora_config.LoRAConfig)
    """LoRA (lora.py, grpo_vlm/lora_config.py): where, its rank and scale."""


# --- Pure pieces of the algorithm ---------------------------------------------------------------------------
def epoch_schedule(epoch: int, args: Args) -> dict:
    """The first keys of epoch `epoch`'s record (1-based): RCE epochs' tau, linear from tau_start (first) to
    tau_end (last); then GRPO epochs' top_k, curriculum_top_k in the first curriculum_epochs, else None."""
    if epoch <= args.rce_epochs:
        tau = args.tau_start + (args.tau_end - args.tau_start) * (epoch - 1) / max(args.rce_epochs - 1, 1)
        return {"epoch": epoch, "phase": "rce", "tau": tau}
    top_k = args.curriculum_top_k if epoch - args.rce_epochs <= args.curriculum_epochs else None
    return {"epoch": epoch, "phase": "grpo", "curriculum": top_k is not None, "top_k": top_k}


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


def is_better(metric: str, value: float, best: float | None) -> bool:
    """Whether `value` of val/<metric> beats `best`: kl lower, reward higher; NaN never; ties keep the old."""
    return math.isfinite(value) and (best is None or (value < best if metric == "kl" else value > best))


def sequence_mean_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) mean log-prob per completion token under mask (N, T)."""
    return torch.where(mask, logp, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


# --- Data: scored lines, fixed batches ----------------------------------------------------------------------
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
            number = isinstance(x, (int, float)) and not isinstance(x, bool)
            # NOTE: json reads NaN and Infinity, and 1e39 becomes inf in the float32 tensor of scores
            if not number or not abs(x) <= torch.finfo(torch.float32).max:
                what = "finite in float32 (|score| <= 3.4e38)" if number else "a number"
                raise ValueError(f"{where}: scores[{i}] = {x!r} is not {what}")
        if (G := len(completions)) != len(scores):
            raise ValueError(f"{where}: {G} completions but {len(scores)} scores (must be equal)")
        if G < 2:
            raise ValueError(f"{where}: a group needs G >= 2 completions for a baseline, got {G}")
    return dataset.apply_prompt_template(samples, None)  # per-image `summaries`, if any, into the prompt


def split_validation(samples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, validation): a seeded random `fraction` of the prompts (at least one) is held out."""
    n_val = max(1, round(fraction * len(samples)))
    if n_val >= len(samples):
        raise ValueError(f"cannot hold out {n_val} of {len(samples)} prompts; pass --val-data instead")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_val])
    return [s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)]


@dataclasses.dataclass
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


def make_batches(samples: list[dict], tokenizer, args: Args) -> list[ScoredBatch]:
    """Fixed batches of up to --batch-size prompts with equal G (prompts bucketed by G, file order kept). A
    completion that holds the EOS text or is longer than --max-completion-length raises naming its line."""
    eos, limit, by_g = tokenizer.eos_token_id, args.max_completion_length, {}
    for s in samples:
        where = data.location(s)
        rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in s["completions"]]
        for ids in rows:
            if eos in ids[:-1]:  # the mask would end there and drop the rest silently
                raise ValueError(f"{where}: a completion contains the EOS token {tokenizer.eos_token!r}")
            if len(ids) > limit:
                raise ValueError(
                    f"{where}: a completion is {len(ids)} tokens (EOS included), more than "
                    f"max_completion_length={limit}; raise the limit (it is never truncated)"
                )
        by_g.setdefault(len(rows), []).append((s, rows))
    B, a, batches = args.batch_size, args.adv, []
    chunks = [(G, bucket[i : i + B]) for G, bucket in sorted(by_g.items()) for i in range(0, len(bucket), B)]
    for G, chunk in chunks:
        rows = [ids for _, sample_rows in chunk for ids in sample_rows]
        T = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (T - len(r)) for r in rows])  # (N, T)
        mask = torch.arange(T)[None, :] < torch.tensor([len(r) for r in rows])[:, None]  # (N, T)
        scores = torch.tensor([x for s, _ in chunk for x in s["scores"]], dtype=torch.float32)  # (N,)
        adv = objectives.advantages(scores, None, None, G, a)
        batches.append(ScoredBatch([s for s, _ in chunk], G, ids, mask, scores, adv))
    return batches


# --- Passes over the batches --------------------------------------------------------------------------------
@torch.no_grad()
def with_logprobs(model, batches: list[ScoredBatch], logprobs_of, field: str, *, adapters: bool) -> list:
    """The batches with `field` (ref_logp, old_logp) set to frozen log-probs (N, T), fp32 on the CPU."""
    model.eval()
    with contextlib.nullcontext() if adapters else lora.adapters_disabled(model):
        return [dataclasses.replace(b, **{field: logprobs_of(b)[0].float().cpu()}) for b in batches]


def train_epoch(model, batches, logprobs_of, optimizer, scheduler, args: Args, epoch: int) -> dict:
    """Epoch `epoch` (1-based, batches in a seeded order): RCE, or GRPO against the frozen old_logp / ref_logp
    with each group's top_k rows in the loss. Its record: the schedule, mean statistics and for GRPO the first
    step's max |log ratio| (0 to rounding when old_logp was taken just before)."""
    t0, record = time.time(), epoch_schedule(epoch, args)
    tau, top_k, record["lr"] = record.get("tau"), record.get("top_k"), optimizer.param_groups[0]["lr"]
    shuffle = torch.Generator().manual_seed(args.seed * 100_003 + epoch - 1)  # the batch order
    params, steps, quantile = lora.lora_parameters(model), [], args.loss.top_entropy_quantile
    max_len = max(b.completion_ids.shape[1] for b in batches)  # dr_grpo's constant normaliser
    model.train()  # LoRA dropout, if any
    for b in (batches[i] for i in torch.randperm(len(batches), generator=shuffle).tolist()):
        logp, entropy = logprobs_of(b, return_entropy=tau is None and quantile < 1)
        if tau is not None:  # CE_i: the mean token NLL, EOS included
            nll = -sequence_mean_logp(logp, b.mask.to(logp.device)).view(-1, b.group_size)  # (B, G)
            loss, stats = rce_loss(nll, b.scores.to(logp.device).view(-1, b.group_size), tau), {}
        else:
            rows = curriculum_mask(b.scores, b.group_size, top_k)  # (N,) adv stays the full group's
            mask = (b.mask & rows[:, None]).to(logp.device)  # (N, T)
            token_mask = objectives.high_entropy_mask(entropy, mask, quantile) if quantile < 1 else None
            old_logp, adv = b.old_logp.to(logp.device), b.adv.to(logp.device)
            ref_logp = None if b.ref_logp is None else b.ref_logp.to(logp.device)
            # num_rows: "grpo" averages over the rows in the loss; dr_grpo divides by the longest completion.
            totals = objectives.BatchTotals(num_rows=int(rows.sum()), num_tokens=mask.sum().clamp(min=1))
            loss, stats = objectives.grpo_loss(
                logp,
                old_logp,
                ref_logp,
                adv,
                mask,
                args.loss,
                token_mask=token_mask,
                totals=totals,
                max_completion_length=max_len,
            )
            stats["log_ratio_absmax"] = torch.where(mask, logp.detach() - old_logp, 0.0).abs().max().item()
            stats["frac_rows_in_loss"] = rows.float().mean().item()  # < 1 while the curriculum is on
        stats["rce_loss" if tau is not None else "loss"] = loss.item()
        if not torch.isfinite(loss):  # NOTE: stepping on a NaN loss would poison the adapter for good
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        steps.append(stats)
    model.eval()
    record.update({k: sum(s[k] for s in steps) / len(steps) for k in steps[0]})
    if tau is None:
        record["log_ratio_absmax/first_step"] = steps[0]["log_ratio_absmax"]
    return {**record, "time": time.time() - t0}


@torch.no_grad()
def validate(model, batches: list[ScoredBatch], logprobs_of) -> dict:
    """val/kl, val/reward and val/margin of the current policy (definitions in the module docstring)."""
    kl_sum, tokens, reward, margin, groups = 0.0, 0, 0.0, 0.0, 0
    model.eval()
    for b in batches:
        G, logp = b.group_size, logprobs_of(b)[0].float().cpu()  # (N, T)
        kl = grpo.kl_k3(torch.where(b.mask, logp, 0.0), torch.where(b.mask, b.ref_logp, 0.0))  # (N, T)
        kl_sum, tokens = kl_sum + kl[b.mask].sum().item(), tokens + int(b.mask.sum())
        mean_logp, scores = sequence_mean_logp(logp, b.mask).view(-1, G), b.scores.view(-1, G)  # (B, G)
        reward += (b.adv.view(-1, G) * mean_logp).mean(dim=1).sum().item()
        best, worst = scores.argmax(dim=1, keepdim=True), scores.argmin(dim=1, keepdim=True)  # (B, 1)
        margin += (mean_logp.gather(1, best) - mean_logp.gather(1, worst)).sum().item()
        groups += len(b.samples)
    return {"val/kl": kl_sum / tokens, "val/reward": reward / groups, "val/margin": margin / groups}


# --- Set-up, epochs' end, main ------------------------------------------------------------------------------
def check_args(a: Args) -> None:
    """Each settings group's checks, then every flag's range and file: a cli.UsageError before any write."""
    with cli.user_errors():
        with cli.fields_as_flags(a.adv, a.loss):  # grpo.py's settings name fields
            a.adv.check()
            a.loss.check()
        a.lora.check()
    either = a.demo != (a.data is not None) and not (a.demo and a.val_data)
    cli.check(either, "--data", "pass either --data FILE [--val-data FILE] or --demo")
    for flag, path in (("--data", a.data), ("--val-data", a.val_data)):
        cli.check(path is None or Path(path).is_file(), flag, f"{path} does not exist (or is not a file)")
    split = a.data is None or a.val_data is not None or 0 < a.val_fraction < 1
    cli.check(split, "--val-fraction", f"must be in (0, 1), got {a.val_fraction}")
    ones = "curriculum-top-k demo-size max-prompt-length max-completion-length batch-size keep-last"
    zeros = "rce-epochs grpo-epochs curriculum-epochs warmup-steps weight-decay"
    for minimum, flag in [(1, f"--{f}") for f in ones.split()] + [(0, f"--{f}") for f in zeros.split()]:
        value = getattr(a, flag[2:].replace("-", "_"))
        cli.check(value is None or value >= minimum, flag, f"must be >= {minimum}, got {value}")
    for flag in ("--tau-start", "--tau-end", "--rce-lr-scale", "--lr", "--max-grad-norm"):
        value = getattr(a, flag[2:].replace("-", "_"))
        cli.check(0 < value < math.inf, flag, f"must be a positive number, got {value}")
    cli.check(a.rce_epochs + a.grpo_epochs >= 1, "--rce-epochs/--grpo-epochs", "together must be >= 1, got 0")
    one = a.adv.multi_objective_aggregation == "sum_then_normalize"
    cli.check(one, "--multi-objective-aggregation", "needs several rewards; a line has one score")
    out = Path(a.output_dir)
    cli.check(not out.exists() or out.is_dir(), "--output-dir", f"{out} is a file, not a folder")
    held = f"{out} already holds a run; pass --overwrite to replace it, or another --output-dir"
    cli.check(a.overwrite or not (out / "metrics.jsonl").exists(), "--output-dir", held)
    model = [a.model] if Path(a.model).is_dir() else []
    read = {"--data": [a.data], "--val-data": [a.val_data], "--model": model}
    outputs.refuse_overwriting_inputs({"--output-dir": [out]}, read)


def load_inputs(args: Args):
    """The model with LoRA, logprobs_of (a batch's log-probs under it) and the (train, validation) batches,
    every input read and checked: a bad model, line, image or length is a UsageError before any write."""
    with cli.user_errors():  # data.py's and read_scored's messages name file:line
        device = distributed.resolve_device(args.device)
        if args.demo:
            with cli.writing(Path(args.output_dir) / "demo"):
                demo = mock_rollouts.write_scored_demo(
                    Path(args.output_dir) / "demo", args.demo_size, args.seed
                )
            train, val = (read_scored(p) for p in demo)
        elif args.val_data is not None:
            train, val = read_scored(args.data), read_scored(args.val_data)
        else:
            train, val = split_validation(read_scored(args.data), args.val_fraction, args.seed)
    with cli.user_errors("--dtype: "):
        dtype = model_files.resolve_dtype(args.dtype, device)
    torch.manual_seed(args.seed)  # LoRA's A matrices are drawn from it
    with cli.user_errors("--model: "):
        model, tokenizer, processor = model_files.load_model(args.model, device=device, dtype=dtype)
    with cli.user_errors("--lora-last-k: "):
        lora_config.inject(model, args.lora)
    with cli.user_errors():  # every image decodes and every prompt and completion fits, before any forward
        dataset.check_samples(train + val, tokenizer, processor, max_prompt_length=args.max_prompt_length)
        batches, val_batches = make_batches(train, tokenizer, args), make_batches(val, tokenizer, args)
    print(f"{len(train)} training and {len(val)} validation groups; {len(batches)} batches")

    def logprobs_of(b: ScoredBatch, return_entropy: bool = False):
        """logp [and entropy] (N, T) of b's completions at temperature 1; prompt b in rows b*G .. b*G+G-1."""
        prompts = dataset.prepare_prompts(b.samples, tokenizer, processor, device=device)  # lengths: checked
        inputs, ids = data.repeat_rows(prompts, b.group_size).inputs, b.completion_ids.to(device)
        return grpo.completion_logprobs(model, inputs, ids, temperature=1.0, return_entropy=return_entropy)

    return model, logprobs_of, batches, val_batches


def end_epoch(model, optimizer, records: list, record: dict, args: Args, val_batches, logprobs_of) -> None:
    """Validate; checkpoint; replace best/ if the --best-by metric beats the best epoch's so far; log."""
    out, key = Path(args.output_dir), f"val/{args.best_by}"
    record.update(validate(model, val_batches, logprobs_of))
    best = next((r[key] for r in reversed(records) if r.get("best")), None)
    record["best"] = is_better(args.best_by, record[key], best)
    state = {"epoch": record["epoch"], "metrics": record, "optimizer": optimizer.state_dict()}
    state["args"] = dataclasses.asdict(args)
    adapter = functools.partial(adapters.save_adapter, model, base_model_name_or_path=args.model)
    save = functools.partial(checkpoints.save_checkpoint, write_adapter=adapter, state=state)
    with cli.writing(out):  # a full disk or a vanished folder: one line, status 74
        save(out / f"checkpoint-{record['epoch']:06d}", keep_last=args.keep_last)
        if record["best"]:  # written as best.tmp, then swapped in: best/ is never half-written
            save(out / "best", keep_last=None)
        logs.append_jsonl(out / "metrics.jsonl", record)
    records.append(record)
    if record["phase"] == "rce":
        head = f"tau {record['tau']:.2f}  rce_loss {record['rce_loss']:.4f}"
    else:
        head = f"top_k {record['top_k'] or 'all'}  loss {record['loss']:+.4f}  kl {record.get('kl', 0):.4f}"
    vals = "  ".join(f"{k} {record[k]:+.4f}" for k in ("val/kl", "val/reward", "val/margin"))
    print(f"epoch {record['epoch']:2d} {record['phase']:4s}  {head}  {vals}{'  best' * record['best']}")


def train(args: Args) -> dict:
    t_start, out = time.time(), Path(args.output_dir)
    model, logprobs_of, batches, val_batches = load_inputs(args)
    mode = "replace" if (out / "metrics.jsonl").exists() else "new"  # replace: check_args saw --overwrite
    with cli.writing(out):
        if mode == "replace":
            shutil.rmtree(out / "best", ignore_errors=True)  # not among checkpoints.py's run files
        checkpoints.open_run_folder(out, mode, uuid.uuid4().hex, 0, dataclasses.asdict(args))

    # Reference log-probs (adapters off), once and frozen; with LoRA B = 0 they equal the initial policy's.
    val_batches = with_logprobs(model, val_batches, logprobs_of, "ref_logp", adapters=False)
    if args.loss.beta > 0:
        batches = with_logprobs(model, batches, logprobs_of, "ref_logp", adapters=False)
    if args.old_logp_from == "init":
        batches = with_logprobs(model, batches, logprobs_of, "old_logp", adapters=True)
    records = [{"epoch": 0, **validate(model, val_batches, logprobs_of)}]
    with cli.writing(out):
        logs.append_jsonl(out / "metrics.jsonl", records[0])

    # Epochs 1..E: RCE at a constant lr * rce_lr_scale. Epochs E+1..E+M: GRPO against old_logp frozen where
    # it starts, with a fresh AdamW (the RCE moments fit another loss), warm-up and cosine decay.
    params, steps = lora.lora_parameters(model), args.grpo_epochs * len(batches)
    rce_optimizer = torch.optim.AdamW(params, lr=args.lr * args.rce_lr_scale, weight_decay=args.weight_decay)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=steps)
    for epoch in range(1, args.rce_epochs + args.grpo_epochs + 1):
        if epoch == args.rce_epochs + 1 and args.old_logp_from == "grpo_start":
            batches = with_logprobs(model, batches, logprobs_of, "old_logp", adapters=True)
        opt, sched = (rce_optimizer, None) if epoch <= args.rce_epochs else (optimizer, scheduler)
        record = train_epoch(model, batches, logprobs_of, opt, sched, args, epoch)
        end_epoch(model, opt, records, record, args, val_batches, logprobs_of)
    with cli.writing(out):
        adapters.save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    summary = {"epochs": records[-1]["epoch"], "wall_time_s": round(time.time() - t_start, 1)}
    if best := [r["epoch"] for r in records if r.get("best")]:
        summary["best_epoch"] = best[-1]
    for when, r in (("start", records[0]), ("end", records[-1])):
        summary.update({f"{when}_{k}": r[f"val/{k}"] for k in ("reward", "margin")})
    print(f"done: {json.dumps(summary)}; best in {out / 'best'}, final adapter in {out / 'adapter'}")
    return summary


def main(args: Args) -> dict:
    """Train; returns the summary. A bad flag, file or line, an --output-dir that holds an input or that
    another process writes, is a cli.UsageError before anything is written."""
    check_args(args)
    with cli.signals(), outputs.claimed({"--output-dir": [Path(args.output_dir)]}, folder=True):
        try:
            return train(args)
        except cli.Stopped:
            if (Path(args.output_dir) / "metrics.jsonl").exists():
                raise cli.Stopped(
                    f"stopped; every finished epoch is checkpointed in {args.output_dir}"
                ) from None
            raise cli.Stopped("stopped before training started; no run was written") from None


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
