"""Evaluate a model (base, or base + a LoRA adapter) on JSONL files or a built-in task: batch inference.

    python scripts/evaluate.py --task inspection --eval-size 50 --output runs/eval/base.jsonl
    python scripts/evaluate.py --adapter runs/grpo/adapter --output runs/eval/adapter.jsonl
    python scripts/evaluate.py --adapter runs/grpo/adapter --compare --output runs/eval/cmp.jsonl
    python scripts/evaluate.py --num-samples 4 --temperature 1.0 --output runs/eval/pass4.jsonl   # pass@4
    python scripts/evaluate.py --data a.jsonl b.jsonl --reward label format --batch-size 32 --output out.jsonl
    tail -f runs/eval/base.jsonl                      # one line per sample, as soon as it is done

Each output line is one sample: `id` (the sample's id, else `file:line`), `source` (its file, or
`builtin:<task>`), `completions` (k texts), `rewards` (every component, unweighted, one value per
completion), `total`, `gate_failed` (if there are gates), `correct` (accuracy reward == 1), `pass_at_k` (any
of the k correct), `format_valid` (samples with a `label` only), `completion_tokens`, `truncated` and
`ground_truth` (whichever of label / answer / bbox / boxes / region / count the sample has).

k = --num-samples. k = 1 decodes greedily (--temperature is ignored); k > 1 samples k completions per
prompt at --temperature / --top-p, and the summary gives pass@1 .. pass@k from those same k samples by the
unbiased estimator of Chen et al. 2021 (grpo_vlm/pass_at_k.py: 1 - C(k - c, j) / C(k, j) per prompt with c
correct, averaged): pass@1 is the share of correct completions, pass@k the share of samples with any
correct, and the curve between shows whether training sharpened pass@1 or widened pass@k. Each batch of
--batch-size samples is seeded from --seed and its index, so the draws do not depend on what ran before:
a resumed run, and both columns of --compare, draw the same completions as an uninterrupted single run.

Resuming: every line is written with its newline, flushed and fsynced before the next sample. On start the
existing output is read, a torn last line (a kill mid-write: no newline, or invalid JSON) is cut off the
file, and samples already written (by source and id) are skipped; so rerunning the same command neither
duplicates nor loses a line. `<output stem>.settings.json` records what decides the results (model,
adapter, sampling, rewards, seed): a rerun with different settings into the same file is refused instead
of silently mixing two evaluations (pass --overwrite or another --output). An existing output without
that settings file, or with another script's, is not evaluate.py's to continue (a file of yours, another
script's output): it is refused, left as it is, unless --overwrite replaces it.

Summary: printed and written atomically to `<output stem>.summary.json`, computed from ALL lines of the
output file (so a resumed run's summary covers every sample): accuracy (share of correct completions),
pass@1 .. pass@k, mean total reward and mean of each component, format-valid fraction (share of completions
with format reward 1; only when samples have a `label`), mean completion length, fraction truncated. A mean
leaves out a value that is no finite number (NaN or Infinity an older version wrote: null when none is left).

--image-ablation blank|shuffle evaluates the same samples again with every image replaced by a grey one of
the same size, or with the images permuted across samples (dataset.ablate_images), and reports those columns
beside the real-image ones: a policy that scores as well without its images answers from the text prior.

--compare evaluates the base model (adapters switched off with lora.adapters_disabled, which is the base
exactly) and base + adapter on the same samples and seed, into `<stem>.base.jsonl` and
`<stem>.adapter.jsonl` (each resumable, each with its summary), and writes one report with both columns
to `<stem>.compare.json`.

Errors: a bad flag, a missing file, a malformed data line, a reward that cannot be loaded or fails on a sample
(its ground truth missing or malformed), or an output written by another evaluation print one line
`error: ...` naming the flag or file:line and exit with status 2 (cli.py); a bug keeps its traceback (1).

Outputs (scripts/outputs.py): an output over an input (--data, --prompt-template, a plug-in's file, or inside
--adapter / --model) is refused, even with --overwrite; one process per output file (a second one is refused
at once, naming the holder; the lock is `.<output name>.lock` beside it); an output that cannot be written
(read-only, full, no permission) is one line `error: cannot write FILE: <cause>`, status 74, found before
the model loads when it can be. An output that is a symbolic link is refused (--overwrite replaces the link
itself, never its target); one that is a FIFO or another non-regular file is refused, --overwrite or not.
Ctrl-C or SIGTERM stops at once (status 130): every finished line is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import signal
import sys
from dataclasses import dataclass, field
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
import rewards
from grpo_vlm import (
    adapters,
    cli,
    dataset,
    distributed,
    grounding,
    model_files,
    multiturn,
    pass_at_k,
    sampling_config,
    scoring,
    speedups,
    tasks,
    tools,
)
from scripts import outputs

PRODUCER = "evaluate.py"  # named in the settings file beside each output: it continues only its own


@tyro.conf.configure(tyro.conf.OmitArgPrefixes)  # flat flag names, as trainer.py's: `--reward`, `--gate`
@dataclass
class Args:
    # --- model ---
    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of the base model. The default is the tiny Qwen2.5-VL shipped in assets/."""
    adapter: str | None = None
    """A PEFT-format LoRA adapter folder (runs/grpo/adapter, or the reference's). None: the base model."""
    compare: bool = False
    """Evaluate the base model AND base + --adapter, and write one report with both columns."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""

    # --- data ---
    data: tuple[str, ...] = ()
    """JSONL file(s) to evaluate. Empty: the held-out split of the built-in task `--task`."""
    task: Literal["inspection", "shapes", "summaries", "inspection-zoom"] = "inspection"
    """Built-in synthetic task used when --data is empty (its held-out split, as in trainer.py)."""
    prompt_template: str | None = None
    """Text file rendering samples that carry per-image `summaries`, as trainer.py's --prompt-template."""
    eval_size: int = 200
    """Number of built-in held-out samples."""
    max_prompt_length: int = 4096
    """Longest prompt in tokens, image tokens included. Longer prompts raise (never truncated)."""
    min_pixels: int | None = None
    """Qwen-VL resizes every image to at least this many pixels (default: the checkpoint's), as trainer.py."""
    max_pixels: int | None = None
    """... and at most this many (default: the checkpoint's), as trainer.py."""

    # --- generation ---
    batch_size: int = 16
    """Prompts per generate call (each sampled --num-samples times). With --num-samples > 1 it also decides
    the draws: each batch is seeded by --seed and its index."""
    num_samples: int = 1
    """k completions per prompt. 1: greedy. > 1: sampled at --temperature, and pass@k is reported."""
    temperature: float = 1.0
    """Sampling temperature when --num-samples > 1."""
    top_p: float = 1.0
    """Nucleus sampling threshold when --num-samples > 1 (1.0: off)."""
    max_new_tokens: int = 24
    """Longest completion; one that reaches it without EOS is flagged truncated."""
    seed: int = 0
    """Seeds sampling (--num-samples > 1); the built-in task's held-out split is the trainers', whatever
    --seed."""

    # --- output ---
    output: str = "runs/eval/predictions.jsonl"
    """Output JSONL (one line per sample). With --compare, <stem>.base.jsonl and <stem>.adapter.jsonl."""
    overwrite: bool = False
    """Start the output file(s) afresh instead of resuming them."""
    image_ablation: tuple[Literal["blank", "shuffle"], ...] = ()
    """Does the model look at the images? Also evaluate the same samples with every image replaced by a grey
    one of the same size (blank) or with the images permuted across samples (shuffle), into
    <stem>.blank.jsonl / <stem>.shuffle.jsonl (each model of --compare too), reported beside the real ones."""
    rewards: scoring.RewardConfig = field(default_factory=scoring.RewardConfig)
    """Rewards, as trainer.py reads them (scoring.py); default: the built-in task's (required with --data)."""
    tools: tools.ToolConfig = field(default_factory=tools.ToolConfig)
    """Tool calls, as trainer.py's (tools.py, multiturn.py): completions are multi-turn, scored on their final
    answers; each line then has each completion's `turns` and `tool_calls`."""


GROUND_TRUTH = ("label", "answer", "bbox", "boxes", "region", "count")


# --------------------------------------------------------------------------------------------------
# Samples and output files


def load_eval_samples(args: Args) -> tuple[list[dict], str | None]:
    """The samples, each with `_source` and `_id` (its key in the output), and the built-in task or None."""
    template = dataset.read_prompt_template(args.prompt_template) if args.prompt_template else None
    if not args.data:
        # seed 0, as the trainers draw it for every --seed: the questions their runs were evaluated on
        samples = tasks.make_task(args.task, args.eval_size, split="test", seed=0)
        samples = [{**s, "_source": f"builtin:{args.task}", "_id": s["id"]} for s in samples]
        return dataset.apply_prompt_template(samples, template), args.task
    samples, seen = [], {}
    for path in args.data:
        for s in dataset.read_samples(path):
            s = {**s, "_source": path, "_id": str(s["id"]) if "id" in s else s["_where"]}
            key = (s["_source"], s["_id"])
            # NOTE: a repeated id would make resuming skip the second sample as already done.
            if key in seen:
                raise ValueError(f"{s['_where']}: id {s['_id']!r} already used at {seen[key]}")
            seen[key] = s["_where"]
            samples.append(s)
    return dataset.apply_prompt_template(samples, template), None


# --------------------------------------------------------------------------------------------------
# Generation, scoring, summary


@torch.no_grad()
def generate(
    model, tokenizer, image_processor, samples: list[dict], args: Args, device, frame: str | None, use=None
) -> list[dict]:
    """Per sample, its k completions: `texts`, `lengths` (tokens, EOS included) and `truncated` flags, and
    the `sample` with its image frame for the grounding rewards (dataset.with_grounding). With tools (`use`, a
    multiturn.ToolUse): multi-turn completions, their final answers as `texts`, the model's tokens as
    `lengths`, and each completion's own `samples` (its trajectory and calls) and `turns`."""
    k = args.num_samples
    greedy = k == 1
    options = sampling_config.sampler_options(
        tokenizer,
        model.generation_config,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if greedy else args.temperature,
        top_p=1.0 if greedy else args.top_p,
    )
    batch = dataset.prepare_prompts(samples, tokenizer, image_processor, device=device)  # lengths: checked
    rows = [slice(b * k, (b + 1) * k) for b in range(len(samples))]
    samples = dataset.with_grounding(samples, image_processor, frame)
    if use is not None:  # multi-turn, turn by turn (multiturn.py); rows b*k .. b*k+k-1 are sample b's
        turns = multiturn.sample(model, batch, samples, use, group_size=k, sampling=options)
        lengths, truncated = turns.mask.sum(1).tolist(), turns.truncated.tolist()
        return [
            {"texts": turns.texts[r], "lengths": lengths[r], "truncated": truncated[r], "sample": s}
            | {
                "samples": turns.samples[r],
                "turns": turns.turns[r],
                "calls": turns.counts["calls"][r].tolist(),
            }
            for r, s in zip(rows, samples)
        ]
    # each prompt's prefill runs once; rows b*k .. b*k+k-1 are sample b's
    ids, _ = speedups.sample_shared_prefill(model, batch.inputs, group_size=k, **options)  # (B*k, T)
    ends = options["eos_token_id"]
    mask, truncated = grpo.completion_mask(ids, ends)  # (B*k, T), (B*k,)
    texts = data.decode_completions(tokenizer, ids, mask, ends)
    lengths, truncated = mask.sum(1).tolist(), truncated.tolist()
    return [
        {"texts": texts[r], "lengths": lengths[r], "truncated": truncated[r], "sample": s}
        for r, s in zip(rows, samples)
    ]


def resolve_rewards(args: Args, task: str | None) -> list[rewards.Reward]:
    """--reward, --reward-weight and --gate as the trainer reads them; with no --reward, the task's."""
    names = args.rewards.reward or tasks.TASK_REWARDS.get(task, ())
    cli.check(bool(names), "--reward", "is required with --data (e.g. --reward label format)")
    config = args.rewards
    with cli.user_errors():
        config.check()
        return scoring.rewards_from_flags(names, config.reward_weight, config.gate)


@contextlib.contextmanager
def reward_errors(sample: dict):
    """A reward failing on a sample (its ground truth missing or malformed, a plug-in returning NaN) is an
    input error naming the sample's file:line; anything else a plug-in raises keeps its traceback."""
    try:
        yield
    except (ValueError, KeyError) as e:
        reason = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        notes = "".join(f" ({note})" for note in getattr(e, "__notes__", []))
        where = sample.get("_where") or f"{sample['_source']} sample {sample['_id']}"
        raise cli.UsageError(f"{where}: {reason}{notes}; fix the sample or the --reward") from e


def score_sample(sample: dict, completions: dict, reward_fns, accuracy_name: str, timeout=None) -> dict:
    """The output line of one sample and its k completions (`timeout`: --reward-timeout)."""
    texts, lengths = completions["texts"], completions["lengths"]
    grounded = completions["sample"]  # with its image frame, when a reward reads coordinates
    scored = completions.get("samples") or [grounded] * len(texts)  # with tools: each its trajectory
    scores = scoring.score(texts, scored, reward_fns, completion_lengths=lengths, timeout=timeout)
    correct = [v >= 1.0 for v in scores.components[accuracy_name]]
    record = {"id": sample["_id"], "source": sample["_source"], "completions": texts}
    record.update(rewards=scores.components, total=scores.total)
    if scores.gate_failed:
        record["gate_failed"] = scores.gate_failed
    record.update(correct=correct, pass_at_k=any(correct))
    if "label" in sample:  # the two-line verdict format only exists for verdict tasks
        record["format_valid"] = [rewards.format_reward(t, sample) == 1.0 for t in texts]
    record.update(completion_tokens=lengths, truncated=completions["truncated"])
    record["ground_truth"] = {f: sample[f] for f in GROUND_TRUTH if f in sample}
    if "turns" in completions:
        record.update(tool_calls=completions["calls"], turns=completions["turns"])
    return record


def _mean(values) -> float | None:
    """The mean of the finite numbers among `values` (a line an older version wrote may hold NaN, Infinity
    or null: left out), None when there is none."""
    values = [float(v) for v in values if isinstance(v, numbers.Real) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarise(records: list[dict]) -> dict:
    """Accuracy, pass@1 .. pass@k (unbiased, from each line's k completions), reward means, format-valid
    fraction, lengths; over every line of the output."""
    if not records:
        return {"samples": 0}
    summary = {"samples": len(records), "completions": sum(len(r["completions"]) for r in records)}
    summary["accuracy"] = _mean(c for r in records for c in r["correct"])
    counts = [(len(r["correct"]), sum(r["correct"])) for r in records]  # (n, c) per sample
    for k in range(1, min(n for n, _ in counts) + 1):  # the settings file gives every line the same n
        summary[f"pass@{k}"] = _mean(pass_at_k.pass_at_k(n, c, k) for n, c in counts)
    summary["reward/mean"] = _mean(t for r in records for t in r["total"])
    for name in records[0]["rewards"]:
        summary[f"reward/{name}/mean"] = _mean(v for r in records for v in r["rewards"][name])
    valid = [v for r in records for v in r.get("format_valid", [])]
    if valid:
        summary["format_valid"] = _mean(valid)
    summary["completion_tokens/mean"] = _mean(n for r in records for n in r["completion_tokens"])
    summary["frac_truncated"] = _mean(t for r in records for t in r["truncated"])
    calls = [n for r in records for n in r.get("tool_calls", [])]
    if calls:
        summary["tool_calls/mean"] = _mean(calls)
    return summary


def print_table(columns: dict[str, dict]) -> None:
    """Metrics as rows, one column per evaluated model."""
    keys = list(dict.fromkeys(k for summary in columns.values() for k in summary))
    width = max(12, *(len(name) + 2 for name in columns))
    print(f"{'':24s}" + "".join(f"{name:>{width}s}" for name in columns))
    for key in keys:
        cells = [summary.get(key) for summary in columns.values()]
        shown = [
            f"{c:{width}d}" if isinstance(c, int) else f"{c:{width}.4f}" if c is not None else "–"
            for c in cells
        ]
        print(f"{key:24s}" + "".join(f"{c:>{width}s}" for c in shown))


# --------------------------------------------------------------------------------------------------
# Main


def batch_seed(seed: int, index: int) -> int:
    """The RNG seed of batch `index`: each batch's draws depend on --seed and its place, nothing else."""
    return seed * 1_000_000 + index


def read_resumable(path: Path) -> list[dict]:
    with cli.user_errors():
        return outputs.read_resumable(path, "id", PRODUCER)


def evaluate_to_file(
    model, tokenizer, image_processor, samples, reward_fns, accuracy_name, args, device, path, frame, use=None
):
    """Evaluate the samples not yet in `path`, one appended line each; return the whole file's summary.

    The samples are cut into the same batches on every run, each seeded by `batch_seed`, so a resumed sampled
    run draws what an uninterrupted one draws: a batch that was partly written is generated again in whole
    (the same draws) and only its missing samples are written.
    """
    done = {(r["source"], r["id"]) for r in read_resumable(path)}
    is_done = [(s["_source"], s["_id"]) in done for s in samples]
    print(f"{path}: {sum(is_done)} of {len(samples)} samples already done")
    bs = args.batch_size
    with cli.writing(path):
        f = path.open("a", encoding="utf-8")
    with f:
        for index, start in enumerate(range(0, len(samples), bs)):
            batch, batch_done = samples[start : start + bs], is_done[start : start + bs]
            if all(batch_done):
                continue
            torch.manual_seed(batch_seed(args.seed, index))
            generated = generate(model, tokenizer, image_processor, batch, args, device, frame, use)
            for sample, completions, written in zip(batch, generated, batch_done):
                if not written:
                    with reward_errors(sample):
                        timeout = args.rewards.reward_timeout
                        record = score_sample(sample, completions, reward_fns, accuracy_name, timeout)
                    with cli.writing(path):
                        outputs.append_line(f, record)
            print(f"  batch {index + 1}/{-(-len(samples) // bs)}", flush=True)
    summary = summarise(read_resumable(path))
    with cli.writing(path.with_suffix(".summary.json")):
        outputs.write_json_atomic(path.with_suffix(".summary.json"), summary)
    return summary


def planned_runs(args: Args) -> list[tuple[str, Path, bool, str | None]]:
    """(column name, output file, adapter on, image ablation or None) for each evaluation."""
    out = Path(args.output)
    if args.compare:
        models = [
            ("base", out.with_suffix(".base.jsonl"), False),
            ("adapter", out.with_suffix(".adapter.jsonl"), True),
        ]
    else:
        models = [("adapter", out, True) if args.adapter else ("base", out, False)]
    runs = [(name, path, on, None) for name, path, on in models]
    for mode in args.image_ablation:
        runs += [
            (f"{name}+{mode}", path.with_suffix(f".{mode}.jsonl"), on, mode) for name, path, on in models
        ]
    return runs


def settings_of(
    args: Args, reward_fns, accuracy_name: str, adapter_on: bool, ablation: str | None, frame: str | None
) -> dict:
    sampled = args.num_samples > 1
    return {
        "image_ablation": ablation,
        "box_frame": frame,
        "model": args.model,
        "adapter": str(Path(args.adapter).resolve()) if adapter_on else None,
        "num_samples": args.num_samples,
        "temperature": args.temperature if sampled else 0.0,
        "top_p": args.top_p if sampled else 1.0,
        "max_new_tokens": args.max_new_tokens,
        "prompt_template": args.prompt_template,
        "rewards": [[r.name, r.weight, r.gate] for r in reward_fns],
        "accuracy_reward": accuracy_name,
        "seed": args.seed,
        "batch_size": args.batch_size if sampled else None,  # sampled draws are seeded per batch
        "dtype": args.dtype,
        "pixels": [args.min_pixels, args.max_pixels] if args.min_pixels or args.max_pixels else None,
        **(
            {"tools": list(args.tools.tools), "max_tool_calls": args.tools.max_tool_calls}
            if args.tools.tools
            else {}
        ),
    }


def check_args(args: Args) -> None:
    """Every flag's range and every file it names, before anything is loaded (cli.UsageError)."""
    cli.check(not args.compare or args.adapter is not None, "--compare", "needs --adapter")
    cli.check(args.num_samples >= 1, "--num-samples", f"must be >= 1, got {args.num_samples}")
    sampled = args.num_samples > 1
    cli.check(
        not sampled or args.temperature > 0,
        "--temperature",
        f"must be > 0 with --num-samples > 1 (else k equal copies), got {args.temperature}",
    )
    cli.check(not sampled or 0 < args.top_p <= 1, "--top-p", f"must be in (0, 1], got {args.top_p}")
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-prompt-length", args.max_prompt_length),
    ):
        cli.check(value >= 1, flag, f"must be >= 1, got {value}")
    cli.check(bool(args.data) or args.eval_size >= 1, "--eval-size", f"must be >= 1, got {args.eval_size}")
    with cli.user_errors():
        args.tools.check()
    for flag, paths in (("--data", args.data), ("--prompt-template", [args.prompt_template])):
        for path in paths:
            cli.check(path is None or Path(path).is_file(), flag, f"{path} does not exist (or is not a file)")
    if args.adapter is not None:
        config = Path(args.adapter) / model_io.ADAPTER_CONFIG
        cli.check(
            config.is_file(),
            "--adapter",
            f"{config} does not exist: give a folder written by trainer.py",
        )
    written = []
    for _, path, _, _ in planned_runs(args):
        cli.check(not path.is_dir(), "--output", f"{path} is a folder; give a .jsonl file")
        written += [path, path.with_suffix(".settings.json"), path.with_suffix(".summary.json")]
    written += [Path(args.output).with_suffix(".compare.json")] if args.compare else []
    read = {"--data": args.data, "--prompt-template": [args.prompt_template], "--adapter": [args.adapter]}
    read.update({"--model": [args.model] if Path(args.model).is_dir() else []})
    plugins = {"--reward": reward_files(args), "--tools": outputs.plugin_files(args.tools.tools)}
    outputs.refuse_overwriting_inputs({"--output": written}, {**read, **plugins})
    for _, path, _, _ in planned_runs(args):  # a user's file, or another script's, is never continued
        outputs.check_own_output(path, "--output", args.overwrite, PRODUCER)


def load_model(args: Args, device: torch.device):
    """(model, tokenizer, image_processor), with --adapter loaded; a path or adapter that does not fit is a
    UsageError."""
    with cli.user_errors("--dtype: "):
        dtype = model_files.resolve_dtype(args.dtype, device)
    with cli.user_errors("--model: "):
        model, tokenizer, image_processor = model_files.load_model(args.model, device=device, dtype=dtype)
    with cli.user_errors():
        dataset.set_pixel_budget(image_processor, args.min_pixels, args.max_pixels)
    if args.adapter:
        with cli.user_errors(f"--adapter {args.adapter}: "):  # e.g. made for another model (keys, shapes)
            adapters.load_adapter(model, args.adapter)
    return model.eval(), tokenizer, image_processor


def reward_files(args: Args) -> list[str]:
    return outputs.plugin_files(args.rewards.reward)


def evaluate(args: Args) -> dict[str, dict]:
    with cli.user_errors():
        device = distributed.resolve_device(args.device)
    with cli.user_errors():  # data.py's messages name file:line
        samples, task = load_eval_samples(args)
    reward_fns = resolve_rewards(args, task)
    with cli.user_errors():  # the fields each reward reads, on every sample, before the model loads
        rewards.check_needs(samples, reward_fns, locate=data.location)
    accuracy_name = args.rewards.accuracy_reward or reward_fns[0].name
    names = [r.name for r in reward_fns]
    cli.check(
        accuracy_name in names, "--accuracy-reward", f"{accuracy_name!r} is not among the rewards {names}"
    )
    model, tokenizer, image_processor = load_model(args, device)
    with cli.user_errors("--box-frame: "):
        frame = grounding.resolve_frame(
            args.rewards.box_frame, model.config.model_type, image_processor, names
        )
    with cli.user_errors():  # every image decodes and every prompt fits, before the first batch
        dataset.check_samples(samples, tokenizer, image_processor, max_prompt_length=args.max_prompt_length)
    use = None
    if args.tools.max_tool_calls:  # multi-turn completions with tool calls, as trainer.py samples them
        suppressed = data.suppressed_tokens(
            tokenizer, data.end_of_turn_ids(tokenizer, model.generation_config)
        )
        options = dict(
            box_frame=args.rewards.box_frame, model_type=model.config.model_type, suppressed=suppressed
        )
        with cli.user_errors():
            max_length = args.max_prompt_length + args.max_new_tokens
            use = multiturn.tool_use(args.tools, tokenizer, image_processor, max_length=max_length, **options)

    summaries = {}
    for name, path, adapter_on, ablation in planned_runs(args):
        settings = settings_of(args, reward_fns, accuracy_name, adapter_on, ablation, frame)
        with cli.user_errors(), cli.writing(path.with_suffix(".settings.json")):
            outputs.check_settings(path, settings, args.overwrite, PRODUCER, companions=(".summary.json",))
        with cli.user_errors():
            ablated = dataset.ablate_images(samples, ablation) if ablation else samples  # as the trainer's
        # The base column of --compare: the same model with its adapters switched off (exactly the base).
        off = lora.adapters_disabled(model) if args.adapter and not adapter_on else contextlib.nullcontext()
        with off:
            summaries[name] = evaluate_to_file(
                model,
                tokenizer,
                image_processor,
                ablated,
                reward_fns,
                accuracy_name,
                args,
                device,
                path,
                frame,
                use,
            )
    print_table(summaries)
    if args.compare:
        report = {**summaries, "args": dataclasses.asdict(args)}
        with cli.writing(Path(args.output).with_suffix(".compare.json")):
            outputs.write_json_atomic(Path(args.output).with_suffix(".compare.json"), report)
    return summaries


def main(args: Args) -> dict[str, dict]:
    """Evaluate into --output. A bad flag, an output that is an input, or an output another process writes
    is refused before anything is loaded or written."""
    check_args(args)
    with cli.signals(), outputs.claimed({"--output": [path for _, path, _, _ in planned_runs(args)]}):
        try:
            return evaluate(args)
        except cli.Stopped:  # Ctrl-C / SIGTERM stop at once: every finished line is already on disk
            raise cli.Stopped(
                f"stopped; every finished sample is in {args.output} (or its --compare / ablation files): "
                "run the same command to continue"
            ) from None


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
