"""Mock rollouts from a prompts file (seeded), so that scoring can be tried without a model.

    python scripts/mock_rollouts.py --write-prompts 4 --prompts runs/mock/prompts.jsonl \\
        --output runs/mock/rollouts.jsonl
    python scripts/score_rollouts.py --rollouts runs/mock/rollouts.jsonl \\
        --prompts runs/mock/prompts.jsonl
    python scripts/mock_rollouts.py --prompts my_prompts.jsonl --group-size 8 --steps 3 --seed 1 \\
        --output r.jsonl

For each step and each prompt (a JSONL line with `prompt_id` and its ground truth) it writes G candidate
lines `{"step", "prompt_id", "group_id", "text", "meta": {"kind"}}`, each drawn correct, wrong or
malformed with probabilities --p-correct, 1 - --p-correct - --p-malformed and --p-malformed:
- prompts with a `label` (verdict tasks): correct = the label and a `理由:` line (the prompt's own
  two-line `answer` when it has one), wrong = the opposite verdict, malformed = a broken layout (one line,
  verdict and reason on one line, empty reason, an unknown verdict, an empty text);
- prompts with an `answer` only: correct = the answer, wrong = another prompt's answer (or the answer
  plus one for numbers), malformed = an unclosed `<answer>` tag or an empty text.
The same prompts, seed and options always give the same file.

`--write-prompts N` first writes N prompts of the built-in inspection task to --prompts (prompt_id, prompt,
label, answer; no images, which scoring does not need), so that the whole loop runs without any input.

`write_scored_demo` writes pre-scored groups of the same task, with their images, for
`scripts/train_offline.py --demo`.

A bad flag, a missing prompts file, a malformed prompts line or an --output that is --prompts prints one line
`error: ...` naming the flag or file:line and exits with status 2 (cli.py); a file that cannot be written,
`error: cannot write FILE: <cause>` and status 74. Each file is written whole (beside it, then renamed), so
it takes no lock: two runs at once leave one whole file or the other.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # NOTE: a Ctrl-C while the imports run exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_vlm import cli, tasks
from scripts import outputs


@dataclass
class Args:
    prompts: str = "runs/mock/prompts.jsonl"
    """Prompts JSONL (prompt_id plus label and/or answer). Written first with --write-prompts."""
    output: str = "runs/mock/rollouts.jsonl"
    """Rollouts JSONL to write."""
    write_prompts: int | None = None
    """Write this many built-in inspection prompts to --prompts first."""
    group_size: int = 8
    """G: candidates per prompt and step."""
    steps: int = 1
    """Number of steps; every prompt gets a group in each."""
    p_correct: float = 0.5
    """Probability that a candidate is correct."""
    p_malformed: float = 0.2
    """Probability that a candidate is malformed (the rest are wrong)."""
    seed: int = 0
    """Seeds the candidates (and the built-in prompts of --write-prompts)."""


FLIP = {"通过": "不通过", "不通过": "通过", "pass": "fail", "fail": "pass"}


def builtin_prompts(n: int, seed: int) -> list[dict]:
    samples = tasks.make_task("inspection", n, seed=seed)
    return [
        {"prompt_id": s["id"], "prompt": s["prompt"], "label": s["label"], "answer": s["answer"]}
        for s in samples
    ]


def verdict_text(kind: str, prompt: dict, rng: random.Random) -> str:
    label = str(prompt["label"])
    answer = str(prompt.get("answer", ""))
    if kind == "correct":
        return (
            answer if answer.split("\n")[0] == label else f"{label}\n理由: mock reason {rng.randint(0, 99)}"
        )
    if kind == "wrong":
        return f"{FLIP.get(label.casefold(), '通过')}\n理由: mock reason"
    return rng.choice([label, f"{label} 理由: 无缺陷", f"{label}\n理由:", "也许\n理由: 看不清", ""])


def answer_text(kind: str, prompt: dict, answers: list[str], rng: random.Random) -> str:
    answer = str(prompt["answer"])
    if kind == "correct":
        return answer
    if kind == "wrong":
        try:
            return str(float(answer) + 1)
        except ValueError:
            others = [a for a in answers if a != answer]
            return rng.choice(others) if others else f"not {answer}"
    return rng.choice([f"<answer>{answer}", ""])


def mock_rollouts(prompts: list[dict], args: Args) -> list[dict]:
    rng = random.Random(f"mock_rollouts/{args.seed}")
    answers = sorted({str(p["answer"]) for p in prompts if "answer" in p})
    kinds = ["correct", "wrong", "malformed"]
    weights = [args.p_correct, 1 - args.p_correct - args.p_malformed, args.p_malformed]
    lines = []
    for step in range(args.steps):
        for prompt in prompts:
            pid = prompt["prompt_id"]
            for _ in range(args.group_size):
                kind = rng.choices(kinds, weights)[0]
                if "label" in prompt:
                    text = verdict_text(kind, prompt, rng)
                else:
                    text = answer_text(kind, prompt, answers, rng)
                group_id = f"{step}/{pid}"
                lines.append(
                    {
                        "step": step,
                        "prompt_id": pid,
                        "group_id": group_id,
                        "text": text,
                        "meta": {"kind": kind},
                    }
                )
    return lines


def write_scored_demo(directory: Path, n: int, seed: int) -> tuple[Path, Path]:
    """Pre-scored groups for train_offline.py --demo: train.jsonl (n inspection prompts) and val.jsonl
    (n // 4, held-out split) with PNG images, under `directory`; returns both. Each group holds G = 4
    candidates, shuffled: right 1.0, wrong verdict 0.0, broken format with the right verdict 0.1-0.2, neither
    0.0-0.1."""
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n), ("val", max(n // 4, 1))):
        rows = []
        for s in tasks.make_task("inspection", count, split="test" if split == "val" else "train", seed=seed):
            images = [f"images/{split}-{s['id']}-{k}.png" for k in range(len(s["images"]))]
            for image, name in zip(s["images"], images):
                image.save(directory / name)
            label, other, reason = s["label"], FLIP[s["label"]], s["answer"].split("\n", 1)[1]
            wrong = "理由: 无缺陷" if other == "通过" else f"理由: 图片{rng.randint(1, len(images))}有缺陷"
            broken = rng.choice([label, f"{label} {reason}", f"{reason}\n{label}"])  # the right verdict
            group = [(s["answer"], 1.0), (f"{other}\n{wrong}", 0.0), (broken, rng.uniform(0.1, 0.2))]
            group.append((rng.choice([other, reason, "理由:"]), rng.uniform(0.0, 0.1)))
            rng.shuffle(group)
            row = {"id": s["id"], "images": images, "prompt": s["prompt"], "label": label}
            row.update(completions=[c for c, _ in group], scores=[round(x, 3) for _, x in group])
            rows.append(row)
        write_jsonl(str(directory / f"{split}.jsonl"), rows)
    return directory / "train.jsonl", directory / "val.jsonl"


def read_prompts(path: str) -> list[dict]:
    """The prompts of a JSONL file (blank lines skipped); a malformed line is a UsageError at file:line."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
        except json.JSONDecodeError as e:
            raise cli.UsageError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(p, dict) or "prompt_id" not in p or not ("label" in p or "answer" in p):
            raise cli.UsageError(f"{path}:{lineno}: a prompt needs prompt_id and a label or an answer")
        prompts.append(p)
    cli.check(bool(prompts), "--prompts", f"{path} holds no prompts")
    return prompts


def write_jsonl(path: str, records: list[dict]) -> None:
    """Write the whole file at once (outputs.write_text_atomic): no lock needed, a second writer at the same
    time leaves one whole file or the other."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    outputs.write_text_atomic(Path(path), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def check_args(args: Args) -> None:
    """Every flag's range and the prompts file, before anything is written (cli.UsageError)."""
    for flag, value in (("--group-size", args.group_size), ("--steps", args.steps)):
        cli.check(value >= 1, flag, f"must be >= 1, got {value}")
    n = args.write_prompts
    cli.check(n is None or n >= 1, "--write-prompts", f"must be >= 1, got {n}")
    for flag, p in (("--p-correct", args.p_correct), ("--p-malformed", args.p_malformed)):
        cli.check(0 <= p <= 1, flag, f"must be a probability in [0, 1], got {p}")
    total = args.p_correct + args.p_malformed
    cli.check(
        total <= 1, "--p-correct/--p-malformed", f"must sum to at most 1 (the rest are wrong), got {total}"
    )
    for flag, path in (("--prompts", args.prompts), ("--output", args.output)):
        cli.check(not Path(path).is_dir(), flag, f"{path} is a folder; give a .jsonl file")
    # --prompts is an input, or with --write-prompts an output: either way not the file --output replaces
    outputs.refuse_overwriting_inputs({"--output": [args.output]}, {"--prompts": [args.prompts]})
    if n is None:
        cli.check(
            Path(args.prompts).is_file(),
            "--prompts",
            f"{args.prompts} does not exist; write it with --write-prompts N",
        )


def main(args: Args) -> list[dict]:
    check_args(args)
    with cli.signals():
        try:
            return write_files(args)
        except cli.Stopped:
            raise cli.Stopped(
                "stopped; no file is half-written (each is written whole or not at all)"
            ) from None


def write_files(args: Args) -> list[dict]:
    if args.write_prompts:
        prompts = builtin_prompts(args.write_prompts, args.seed)
        with cli.writing(args.prompts):  # e.g. a folder that cannot be written
            write_jsonl(args.prompts, prompts)
        print(f"wrote {args.write_prompts} prompts to {args.prompts}")
    with cli.user_errors("--prompts: "):  # unreadable or not UTF-8
        prompts = read_prompts(args.prompts)
    lines = mock_rollouts(prompts, args)
    with cli.writing(args.output):
        write_jsonl(args.output, lines)
    counts = {k: sum(line["meta"]["kind"] == k for line in lines) for k in ("correct", "wrong", "malformed")}
    print(f"wrote {len(lines)} candidates to {args.output}: {counts}")
    return lines


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
