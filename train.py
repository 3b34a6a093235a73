"""GRPO for a vision-language model, one step in one function: `train_step`.

    python train.py                            # the embedded tiny Qwen2.5-VL, inspection task, CPU, ~2 min
    python train.py --help                     # every flag, with its documentation
    python train.py --resume --steps 200       # continue the run in --output-dir from its checkpoint.pt
    python train.py --model Qwen/Qwen2.5-VL-3B-Instruct --data train.jsonl --eval-data val.jsonl \\
        --reward label format --device cuda --batch-size 4 --max-new-tokens 256 --lr 2e-5 --output-dir runs/3b

Each step: B prompts -> G completions each from `generate` (N = B * G rows of T tokens at most) -> mask ->
rewards -> group advantages -> old and reference log-probs (no grad) -> log-probs with grad from one full
forward -> loss -> backward -> clip -> AdamW step on the LoRA parameters -> metrics. Read grpo.py's docstring
(the objective, every choice where papers differ), `grpo.grpo_loss`, `grpo.group_advantages`, `train_step`.

Simplifications the full trainer (`python -m grpo_vlm`: the same step to rounding) lifts: each prompt is
prefilled G times and each log-prob pass is a full forward of all N rows; one process; a run folder of three
things; no dynamic sampling, tools, trackers, other objectives or plug-in time limits.
"""

import math
import re
import sys
import time
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
    """GRPO with LoRA on a Qwen-VL model or a text-only causal LM; defaults train the embedded tiny VLM."""

    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, or a text-only causal LM."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """'auto': bf16 on CUDA, fp32 on the CPU."""
    data: str | None = None
    """Training JSONL file (one sample per line, see README). Default: the built-in inspection task."""
    eval_data: str | None = None
    """Held-out JSONL file. Default: the built-in task's held-out split (none for --data)."""
    train_size: int = 2000
    """Built-in task: number of training samples."""
    eval_size: int = 200
    """Number of held-out samples evaluated greedily (the first ones of --eval-data)."""
    reward: tuple[str, ...] = ("label", "format")
    """Rewards summed: built-ins (rewards.py), 'module:function', 'file.py:function'; the first: accuracy."""
    reward_weight: tuple[float, ...] = ()
    """One weight per --reward (default 1.0 each)."""
    gate: tuple[str, ...] = ()
    """Rewards that zero the total where they are <= 0 (e.g. format)."""
    batch_size: int = 8
    """B: prompts per step."""
    group_size: int = 8
    """G: completions sampled per prompt, compared within their group."""
    max_new_tokens: int = 24
    """T: longest completion; one that reaches it without an end of turn is truncated (still trained)."""
    temperature: float = 1.0
    """Sampling temperature; the log-prob passes divide the logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability (1.0: all)."""
    num_iterations: int = 1
    """mu: optimizer steps per rollout; > 1 computes old log-probs once, before the first step."""
    loss_type: grpo.LossType = "dapo"
    """The loss's normaliser (grpo.aggregate): grpo (per sequence), dapo (the batch's tokens), dr_grpo."""
    importance_sampling_level: grpo.ImportanceSamplingLevel = "token"
    """The ratio per token, or per sequence (GSPO)."""
    adv_scale: grpo.AdvantageScale = "group"
    """Divide centred rewards by the group's std, the batch's, or nothing (Dr. GRPO)."""
    beta: float = 0.04
    """KL penalty weight (k3, against the adapters-off model); 0 skips the reference pass."""
    clip_eps_low: float = 0.2
    """The ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """... and above at 1 + clip_eps_high (DAPO's clip-higher)."""
    lora_last_k: int = 4
    """LoRA in the last K decoder blocks of the language model; everything else frozen."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is B @ A * alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input during the update."""
    lr: float = 2e-3
    """Peak AdamW learning rate (tiny model; about 1e-5 to 5e-5 on real models); 0: a no-update control."""
    warmup_steps: int = 5
    """Linear warm-up steps before the cosine decay to 0."""
    max_grad_norm: float = 1.0
    """Clip the LoRA gradients' global norm to this."""
    steps: int = 100
    """Training steps (one rollout batch each)."""
    eval_every: int = 25
    """Greedy held-out evaluation and checkpoint every this many steps (and at step 0 and the last)."""
    output_dir: str = "runs/reference"
    """A new or empty folder for metrics.jsonl, checkpoint.pt and the final adapter/ (PEFT's format)."""
    resume: bool = False
    """Continue the run in --output-dir from its checkpoint.pt, with the same flags (--steps may grow)."""
    seed: int = 0
    """Seeds LoRA's initialisation, the batch order and sampling (not the built-in task's samples)."""


def loss_config(args: Args) -> grpo.LossConfig:
    """The loss's settings from the flags of the same names; grpo.LossConfig checks them as it is built."""
    names = ("loss_type", "importance_sampling_level", "beta", "clip_eps_low", "clip_eps_high")
    return grpo.LossConfig(**{name: getattr(args, name) for name in names})


def train_step(
    model: torch.nn.Module,
    tokenizer,
    image_processor,
    samples: list[dict],
    reward_fns: list[rewards.Reward],
    optimizer: torch.optim.Optimizer,
    args: Args,
) -> tuple[dict[str, float], torch.Tensor]:
    """One GRPO step on B samples; returns its metrics and the sampled completion ids (N, T)."""
    G = args.group_size

    # 1. Prompts: chat template, image tokens and pixels, left-padded so every completion starts at column P.
    batch = data.prepare_prompts(samples, tokenizer, image_processor, device=model.device)
    # N = B * G rows, prompt b's group at rows b*G .. b*G + G - 1 (repeat_interleave, images with their row):
    # the order in which generate's num_return_sequences=G repeats the prompts below, so row i of `rows` is
    # the very prompt that completion i was sampled from.
    rows = data.repeat_rows(batch, G).inputs

    # 2. Sample G completions per prompt from the current policy: one `generate` call, no gradient.
    ends = data.end_of_turn_ids(tokenizer, model.generation_config)  # every id that ends a turn
    model.eval()
    completion_ids = grpo.sample_completions(
        model,
        batch.inputs,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_token_id=ends,
        pad_token_id=tokenizer.pad_token_id,
        suppress_token_ids=data.suppressed_tokens(tokenizer, ends),  # no image or chat-control tokens
        num_return_sequences=G,
    )  # (N, T)

    # 3. Mask: 1 up to and including each row's first end of turn; the padding after it gets no gradient.
    mask, truncated = grpo.completion_mask(completion_ids, ends)  # (N, T), (N,)

    # 4. Rewards on the decoded text, each sample repeated for its G completions.
    texts = data.decode_completions(tokenizer, completion_ids, mask, ends)
    lengths = mask.sum(dim=1).tolist()
    row_samples = [sample for sample in samples for _ in range(G)]
    scores = rewards.score(texts, row_samples, reward_fns, completion_lengths=lengths)
    reward = torch.tensor(scores.total, dtype=torch.float32, device=model.device)  # (N,)

    # 5. Advantages: each reward against its own group's mean (and std). A group of equal rewards gets 0.
    adv = grpo.group_advantages(reward, G, scale=args.adv_scale)  # (N,)

    # 6. Frozen log-probs, one full forward each: old_logp (mu > 1) and ref_logp (adapters off, beta > 0).
    config = loss_config(args)
    old_logp = ref_logp = None  # (N, T) each, when computed
    with torch.no_grad():
        if args.num_iterations > 1:
            old_logp, _ = grpo.completion_logprobs(model, rows, completion_ids, temperature=args.temperature)
        if config.beta > 0:
            with lora.adapters_disabled(model):  # the reference policy: the same weights without LoRA
                ref_logp, _ = grpo.completion_logprobs(
                    model, rows, completion_ids, temperature=args.temperature
                )

    # 7. mu optimizer steps: recompute logp WITH gradient (same inputs, images, mask and temperature).
    model.train()  # only LoRA dropout reacts to it; the base model has none
    for _ in range(args.num_iterations):
        logp, entropy = grpo.completion_logprobs(
            model, rows, completion_ids, temperature=args.temperature, return_entropy=True
        )  # (N, T) each
        # NOTE: at mu = 1 old_logp is logp itself, detached: the ratio is exactly 1, its gradient is not 0.
        old = logp.detach() if old_logp is None else old_logp
        loss, stats = grpo.grpo_loss(logp, old, ref_logp, adv, mask, config, args.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(lora.lora_parameters(model), args.max_grad_norm)
        skipped = not (torch.isfinite(loss) and torch.isfinite(grad_norm))
        if skipped:  # NOTE: no update from a non-finite loss or gradient; metrics.jsonl says so
            break
        optimizer.step()
    model.eval()

    # 8. Metrics: what the rollout earned, and what the update did.
    metrics = {"loss": loss.item(), "grad_norm": grad_norm.item(), **stats, "skipped": skipped}
    metrics["reward/mean"] = reward.mean().item()
    metrics["reward/std"] = reward.std(correction=0).item()
    metrics |= {f"reward/{name}/mean": sum(v) / len(v) for name, v in scores.components.items()}
    metrics["entropy"] = (entropy[mask].mean() if mask.any() else entropy.new_zeros(())).item()
    metrics["completion_length/mean"] = sum(lengths) / len(lengths)
    metrics["frac_truncated"] = truncated.float().mean().item()
    return metrics, completion_ids


@torch.no_grad()
def evaluate(
    model, tokenizer, image_processor, samples: list[dict], reward_fns: list[rewards.Reward], args: Args
) -> dict[str, float]:
    """Greedy held-out accuracy (the first reward is 1.0) and mean total reward, 50 samples a batch."""
    ends = data.end_of_turn_ids(tokenizer, model.generation_config)
    correct = total = 0
    for i in range(0, len(samples), 50):
        chunk = samples[i : i + 50]
        batch = data.prepare_prompts(chunk, tokenizer, image_processor, device=model.device)
        ids = grpo.sample_completions(
            model,
            batch.inputs,
            max_new_tokens=args.max_new_tokens,
            temperature=0.0,  # greedy
            eos_token_id=ends,
            pad_token_id=tokenizer.pad_token_id,
            suppress_token_ids=data.suppressed_tokens(tokenizer, ends),
        )
        mask, _ = grpo.completion_mask(ids, ends)
        texts = data.decode_completions(tokenizer, ids, mask, ends)
        scores = rewards.score(texts, chunk, reward_fns, completion_lengths=mask.sum(dim=1).tolist())
        correct += sum(v >= 1.0 for v in scores.components[reward_fns[0].name])
        total += sum(scores.total)
    return {"eval/accuracy": correct / len(samples), "eval/reward": total / len(samples)}


# --- Checks before anything loads; the run folder -------------------------------------------------------
def check_args(args: Args) -> None:
    """Refuse a flag out of range before anything is loaded: ValueError('--flag: why, got value')."""
    try:  # each names its own field; the flags are --lora-r, --lora-alpha, --lora-dropout and the loss's
        lora.check_lora(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
        loss_config(args)  # grpo.LossConfig checks itself as it is built
    except ValueError as e:  # "r: must be >= 1, got 0" is the flag --lora-r
        name, _, why = str(e).partition(": ")
        name = f"lora_{name}" if name in ("r", "alpha", "dropout") else name
        raise ValueError(f"--{name.replace('_', '-')}: {why}") from None
    positive = ("batch_size", "max_new_tokens", "num_iterations", "lora_last_k", "steps", "eval_every")
    finite = ("max_grad_norm", "temperature")
    for flag, ok, why in [
        *((name, getattr(args, name) >= 1, "must be >= 1") for name in positive),
        *((name, 0 < getattr(args, name) < math.inf, "must be a number > 0") for name in finite),
        ("lr", 0 <= args.lr < 1, "must be a number in [0, 1) (AdamW moves a weight by about lr a step)"),
        ("dtype", args.dtype in ("auto", *model_io.DTYPES), "must be auto, float32 or bfloat16"),
        ("device", re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device), "must be auto, cpu, cuda or cuda:N"),
        ("device", "cuda" not in args.device or torch.cuda.is_available(), "names no GPU of this machine"),
        ("top_p", 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("group_size", args.group_size >= 2, "must be >= 2: a completion is compared with its group"),
        ("warmup_steps", args.warmup_steps >= 0, "must be >= 0"),
        ("seed", 0 <= args.seed < 2**32, "must be in [0, 2**32)"),
        ("reward", len(set(args.reward)) == len(args.reward) >= 1, "must name one or more different rewards"),
        ("reward_weight", len(args.reward_weight) in (0, len(args.reward)), "needs one weight per --reward"),
        ("reward_weight", all(math.isfinite(w) for w in args.reward_weight), "must be finite numbers"),
        ("gate", set(args.gate) <= set(args.reward), "must name rewards of --reward"),
    ]:
        if not ok:
            raise ValueError(f"--{flag.replace('_', '-')}: {why}, got {getattr(args, flag)}")


def check_same_flags(settings: dict, step: int, args: Args) -> None:
    """Refuse to continue a checkpoint written with other flags, but --steps (>= its step), --eval-every and
    --device: the continued run computes what the uninterrupted one would have."""
    for name, value in vars(args).items():
        if name not in ("steps", "eval_every", "device", "resume") and settings.get(name) != value:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"--resume: the run was written with {flag} {settings.get(name)}, not {value}")
    if args.steps < step:
        raise ValueError(f"--steps: the checkpoint is at step {step}; give --steps >= it")


def log(record: dict, path: Path) -> None:
    """One line of metrics.jsonl (strict JSON; an error names the file), a progress line for the terminal."""
    model_io.append_line(path, record)
    shown = {"reward": "reward/mean", "kl": "kl", "acc": "eval/accuracy"}
    values = "".join(f"  {k} {record[v]:.3g}" for k, v in shown.items() if v in record)
    skipped = "  (no update: a non-finite loss or gradient)" if record.get("skipped") else ""
    print(f"step {record['step']:4d}{values}{skipped}")


def main(args: Args) -> dict:
    """Check, set up, loop over `train_step`, evaluate and checkpoint, write the adapter; the last record."""
    check_args(args)
    out = Path(args.output_dir)
    model_io.check_run_folder(out, resume=args.resume)  # only into a new or empty folder, or its own run
    resumed = model_io.load_checkpoint(out / "checkpoint.pt") if args.resume else None
    if resumed is not None:
        check_same_flags(resumed["settings"], resumed["step"], args)
    train_samples, held_out = data.load_samples(  # a bad line, field or image fails now, before the model
        args.data, args.eval_data, train_size=args.train_size, eval_size=args.eval_size
    )
    reward_fns = rewards.load_rewards(args.reward, args.reward_weight, args.gate)
    rewards.check_needs(train_samples + held_out, reward_fns, locate=data.location)  # a bad line fails now
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = model_io.resolve_dtype(args.dtype, device)  # bf16 on CUDA, fp32 on the CPU
    model, tokenizer, image_processor = model_io.load_model(args.model, device=device, dtype=dtype)
    torch.manual_seed(args.seed)  # LoRA's A initialisation, then sampling, draw from this stream
    lora.inject_lora(
        model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, last_k=args.lora_last_k
    )  # the base frozen
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=0.0)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=args.steps)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    checkpoint = out / "checkpoint.pt"
    settings = vars(args)  # stored in each checkpoint: a resumed run must be given the same
    saved = 0
    if resumed is None:  # checkpoint.pt first: it marks the folder as this run's, resumable from now on
        model_io.save_checkpoint(checkpoint, model, optimizer, scheduler, step=0, settings=settings)
    else:  # metrics.jsonl's lines past the checkpoint go: the continued run writes them again
        saved = model_io.restore_checkpoint(resumed, model, optimizer, scheduler)
        model_io.keep_lines_up_to(metrics_path, saved)
    record = {}
    if saved == 0 and held_out and not metrics_path.exists():
        record = {"step": 0, **evaluate(model, tokenizer, image_processor, held_out, reward_fns, args)}
        log(record, metrics_path)
    started = time.time()
    step = saved
    try:
        for step in range(saved + 1, args.steps + 1):
            samples = data.batch_for_step(train_samples, step - 1, args.batch_size, args.seed)
            metrics, _ = train_step(model, tokenizer, image_processor, samples, reward_fns, optimizer, args)
            scheduler.step()
            record = {"step": step, "lr": scheduler.get_last_lr()[0], **metrics}
            if held_out and (step % args.eval_every == 0 or step == args.steps):
                record |= evaluate(model, tokenizer, image_processor, held_out, reward_fns, args)
            log(record, metrics_path)  # before the checkpoint: a stop in between repeats it, never loses it
            if step % args.eval_every == 0 or step == args.steps:
                model_io.save_checkpoint(
                    checkpoint, model, optimizer, scheduler, step=step, settings=settings
                )
                saved = step
    except KeyboardInterrupt:  # Ctrl-C: one line saying where the run stands (checkpoint.pt is whole)
        print(f"\nstopped in step {step}; {checkpoint} is at step {saved}: add --resume", file=sys.stderr)
        raise
    model_io.save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    print(f"done in {time.time() - started:.0f} s; metrics.jsonl, checkpoint.pt and adapter/ in {out}")
    return record


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:  # main said where it stopped and how to continue
        sys.exit(130)
    except (ValueError, OSError) as e:  # a bad flag, file, data line or plug-in; a full disk: one line each
        print(f"error: {'; '.join([str(e), *getattr(e, '__notes__', [])])}", file=sys.stderr)
        sys.exit(2)
