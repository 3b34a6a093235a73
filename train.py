"""GRPO for a vision-language model, one step in one function: `train_step`.

    python train.py                            # the embedded tiny Qwen2.5-VL, inspection task, CPU, ~2 min
    python train.py --help                     # every flag, with its documentation
    python train.py --resume                   # continue from the folder's checkpoint.pt
    python train.py --model Qwen/Qwen2.5-VL-3B-Instruct --data train.jsonl --eval-data val.jsonl \\
        --reward label format --device cuda --dtype bfloat16 --max-new-tokens 256 --lr 2e-5

Each step: B prompts -> G completions each from `generate` (N = B * G rows) -> completion mask -> rewards
-> group advantages -> old and reference log-probs (no grad) -> log-probs with grad from one full forward
-> loss -> backward -> clip -> AdamW step on the LoRA parameters -> metrics. Read grpo.py's docstring (the
objective, every choice where papers differ), `grpo.grpo_loss`, `grpo.group_advantages`, then `train_step`.

Deliberate simplifications, each lifted by the full trainer in grpo_vlm/ (`python -m grpo_vlm`), which
imports these modules and takes the same step (to rounding) much faster:
- every prompt is prefilled G times by `generate`, and each log-prob pass is a full forward of the model;
  the full trainer prefills once, records the frozen trunk while sampling and splits rows into micro-batches.
- one process, no run-folder lock, no verified checkpoints: `checkpoint.pt` holds tensors only (LoRA,
  AdamW, RNG, step) and is written whole (a temporary file renamed over it).
- no dynamic sampling, tools, trackers, image ablation, adaptive KL or plug-in time limits.
B prompts, G completions per prompt, N = B * G rows, P prompt length, T completion length.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

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
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on the CPU), 'float32' or 'bfloat16'."""
    data: str | None = None
    """Training JSONL file (one sample per line, see README). Default: the built-in inspection task."""
    eval_data: str | None = None
    """Held-out JSONL file. Default: the built-in task's held-out split (none for --data)."""
    train_size: int = 2000
    """Built-in task: number of training samples."""
    eval_size: int = 200
    """Number of held-out samples evaluated greedily (the first ones of --eval-data)."""
    reward: tuple[str, ...] = ("label", "format")
    """Rewards summed into each completion's total: built-in names (rewards.BUILTIN_REWARDS) or plug-ins
    'module:function' / 'path/to/file.py:function'. The first one's 1.0 means 'correct'."""
    reward_weight: tuple[float, ...] = ()
    """One weight per --reward (default 1.0 each)."""
    gate: tuple[str, ...] = ()
    """Rewards that zero the total where they are <= 0 (e.g. format)."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image tokens included; a longer one raises (never truncated)."""
    batch_size: int = 8
    """B: prompts per step."""
    group_size: int = 8
    """G: completions sampled per prompt, compared within their group."""
    max_new_tokens: int = 24
    """T: longest completion; one that reaches it without an end of turn is truncated (still trained)."""
    temperature: float = 1.0
    """Sampling temperature; the log-prob passes divide the logits by the same value."""
    num_iterations: int = 1
    """mu: optimizer steps per rollout; > 1 computes old log-probs once, before the first step."""
    loss_type: grpo.LossType = "dapo"
    """Normaliser and objective (grpo.aggregate, grpo.policy_term): grpo, bnpo, dr_grpo, dapo, cispo, sapo."""
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
    lr: float = 2e-3
    """Peak AdamW learning rate (tiny model; about 1e-5 to 5e-5 on real models)."""
    warmup_steps: int = 5
    """Linear warm-up steps before the cosine decay to 0."""
    max_grad_norm: float = 1.0
    """Clip the LoRA gradients' global norm to this."""
    steps: int = 100
    """Training steps (one rollout batch each)."""
    eval_every: int = 25
    """Greedy held-out evaluation every this many steps (and at step 0 and the last)."""
    output_dir: str = "runs/reference"
    """metrics.jsonl, checkpoint.pt (every --eval-every steps) and the final adapter/ (PEFT's format)."""
    resume: bool = False
    """Continue from --output-dir's checkpoint.pt with the same flags (--steps may grow)."""
    seed: int = 0
    """Seeds LoRA's initialisation, the batch order and sampling."""


def loss_config(args: Args) -> grpo.LossConfig:
    """The loss's settings from the flags (grpo.LossConfig holds more variants; its defaults for the rest)."""
    names = ("loss_type", "importance_sampling_level", "beta", "clip_eps_low", "clip_eps_high")
    config = grpo.LossConfig(**{name: getattr(args, name) for name in names})
    config.check()
    return config


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
    G, device, config = args.group_size, model.device, loss_config(args)
    params = lora.lora_parameters(model)

    # 1. Prompts: chat template, image tokens and pixels, left-padded so every completion starts at column P.
    batch = data.prepare_prompts(
        samples, tokenizer, image_processor, device=device, max_prompt_length=args.max_prompt_length
    )
    rows = data.repeat_rows(batch, G).inputs  # N = B * G rows: prompt b's group is rows b*G .. b*G + G - 1

    # 2. Sample G completions per prompt from the current policy: one `generate` call, no gradient.
    ends = data.end_of_turn_ids(tokenizer, model.generation_config)  # every id that ends a turn
    model.eval()
    completion_ids, _ = grpo.sample_completions(
        model,
        batch.inputs,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
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
    scores = rewards.score(
        texts, [s for s in samples for _ in range(G)], reward_fns, completion_lengths=lengths
    )
    reward = torch.tensor(scores.total, dtype=torch.float32, device=device)  # (N,)

    # 5. Advantages: each reward against its own group's mean (and std). A group of equal rewards gets 0.
    adv = grpo.group_advantages(reward, G, scale=args.adv_scale)  # (N,)

    # 6. Frozen log-probs, one full forward each: old_logp (mu > 1) and ref_logp (adapters off, beta > 0).
    old_logp = ref_logp = None
    with torch.no_grad():
        if args.num_iterations > 1:
            old_logp, _ = grpo.completion_logprobs(model, rows, completion_ids, temperature=args.temperature)
        if config.beta > 0:
            with lora.adapters_disabled(model):  # the reference policy: the same weights without LoRA
                ref_logp, _ = grpo.completion_logprobs(
                    model, rows, completion_ids, temperature=args.temperature
                )

    # 7. mu optimizer steps: recompute logp WITH gradient (same inputs, images, mask and temperature).
    totals = grpo.BatchTotals(len(mask), mask.sum().clamp(min=1), args.max_new_tokens)  # normalisers' counts
    model.train()  # only LoRA dropout would react; the base model has none
    for _ in range(args.num_iterations):
        logp, entropy = grpo.completion_logprobs(
            model, rows, completion_ids, temperature=args.temperature, return_entropy=True
        )  # (N, T) each
        # NOTE: at mu = 1 old_logp is logp itself, detached: the ratio is exactly 1, its gradient is not 0.
        old = logp.detach() if old_logp is None else old_logp
        loss, stats = grpo.grpo_loss(logp, old, ref_logp, adv, mask, config, totals=totals)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):  # NOTE: skip the update, log it
            print(f"skipped an update: loss {loss.item()}, gradient norm {grad_norm.item()}")
            break
        optimizer.step()
    model.eval()

    # 8. Metrics: what the rollout earned, and what the update did.
    metrics = {"loss": loss.item(), "grad_norm": grad_norm.item(), **stats}
    metrics["reward/mean"], metrics["reward/std"] = reward.mean().item(), reward.std(correction=0).item()
    for name, values in scores.components.items():
        metrics[f"reward/{name}/mean"] = sum(values) / len(values)
    metrics["entropy"] = (entropy[mask].mean() if mask.any() else entropy.new_zeros(())).item()
    metrics["completion_length/mean"] = sum(lengths) / len(lengths)
    metrics["frac_truncated"] = truncated.float().mean().item()
    return metrics, completion_ids


@torch.no_grad()
def evaluate(
    model, tokenizer, image_processor, samples: list[dict], reward_fns: list[rewards.Reward], args: Args
) -> dict[str, float]:
    """Greedy held-out accuracy (the first reward is 1.0) and mean total reward, 50 samples a batch."""
    ends, correct, total = data.end_of_turn_ids(tokenizer, model.generation_config), 0, 0.0
    for i in range(0, len(samples), 50):
        chunk = samples[i : i + 50]
        batch = data.prepare_prompts(
            chunk, tokenizer, image_processor, device=model.device, max_prompt_length=args.max_prompt_length
        )
        ids, _ = grpo.sample_completions(
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


def load_samples(args: Args) -> tuple[list[dict], list[dict]]:
    """(training, held-out) samples: the JSONL files, or the built-in inspection task's two splits."""
    if args.data is None:
        train = data.inspection_samples(args.train_size, split="train", seed=args.seed)
        return train, data.inspection_samples(args.eval_size, split="test", seed=args.seed)
    held_out = data.read_jsonl(args.eval_data)[: args.eval_size] if args.eval_data else []
    return data.read_jsonl(args.data), held_out


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int) -> None:
    """Tensors only (loadable with weights_only=True), written to a temporary file renamed over `path`."""
    state = {"step": step, "lora": lora.lora_state_dict(model), "optimizer": optimizer.state_dict()}
    state |= {"scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}
    torch.save(state, tmp := path.with_suffix(".tmp"))
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    """Restore LoRA weights, AdamW, the schedule and the RNG from `save_checkpoint`'s file; its step."""
    state = torch.load(path, map_location="cpu", weights_only=True)  # NOTE: refuses pickled code
    model.load_state_dict(state["lora"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def log(record: dict, file) -> None:
    """One line of metrics.jsonl, and a progress line for the terminal."""
    print(json.dumps(record), file=file, flush=True)
    shown = {"reward": "reward/mean", "kl": "kl", "acc": "eval/accuracy"}
    values = "".join(f"  {k} {record[v]:.3g}" for k, v in shown.items() if v in record)
    print(f"step {record['step']:4d}{values}")


def main(args: Args) -> dict:
    """Set up, loop over `train_step`, evaluate and checkpoint, write the adapter; returns the last record."""
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = model_io.resolve_dtype(args.dtype, device)
    model, tokenizer, image_processor = model_io.load_model(args.model, device=device, dtype=dtype)
    train_samples, held_out = load_samples(args)
    if unknown := sorted(set(args.gate) - set(args.reward)):
        raise ValueError(f"--gate: {unknown} are not among the rewards {list(args.reward)}")
    weights = zip(args.reward, args.reward_weight or [1.0] * len(args.reward), strict=True)  # one per reward
    reward_fns = [rewards.Reward(r, rewards.load_reward(r), w, r in args.gate) for r, w in weights]
    rewards.check_needs(train_samples + held_out, reward_fns, locate=data.location)  # a bad line fails now
    torch.manual_seed(args.seed)  # LoRA's A initialisation, then sampling, draw from this stream
    lora.inject_lora(model, r=args.lora_r, alpha=args.lora_alpha, last_k=args.lora_last_k)  # base frozen
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=args.lr, weight_decay=0.0)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=args.warmup_steps, total_steps=args.steps)
    out, started = Path(args.output_dir), time.time()
    out.mkdir(parents=True, exist_ok=True)
    start = load_checkpoint(out / "checkpoint.pt", model, optimizer, scheduler) if args.resume else 0
    policy, record = (model, tokenizer, image_processor), {}
    with open(out / "metrics.jsonl", "a" if args.resume else "w", encoding="utf-8") as file:
        if start == 0 and held_out:
            log(record := {"step": 0, **evaluate(*policy, held_out, reward_fns, args)}, file)
        for step in range(start + 1, args.steps + 1):
            samples = data.batch_for_step(train_samples, step - 1, args.batch_size, args.seed)
            metrics, _ = train_step(*policy, samples, reward_fns, optimizer, args)
            scheduler.step()
            record = {"step": step, "lr": scheduler.get_last_lr()[0], **metrics}
            if step % args.eval_every == 0 or step == args.steps:
                record |= evaluate(*policy, held_out, reward_fns, args) if held_out else {}
                save_checkpoint(out / "checkpoint.pt", model, optimizer, scheduler, step)
            log(record, file)
    model_io.save_adapter(model, out / "adapter", base_model_name_or_path=args.model)
    print(f"done in {time.time() - started:.0f} s; metrics.jsonl, checkpoint.pt and adapter/ in {out}")
    return record


if __name__ == "__main__":
    main(tyro.cli(Args))
