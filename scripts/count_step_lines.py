"""How many lines a reader follows for one training step: every function body the step runs, one process.

    python scripts/count_step_lines.py            # the reference, the full trainer's default and plain paths

It runs the reference's `train.main`, then the full trainer's (`grpo_vlm.trainer.main`), for one step on the
embedded tiny model and records, with `sys.setprofile`, every function of this project's modules (the six
at the top and the package's) that is called while `train_step` runs (the rollout, the rewards, the update;
evaluation, checkpoints and set-up are outside it). A function counts once, however often it runs.
"Body lines" are the non-blank lines after the signature (docstring, comments and code); "with signatures"
adds the `def` lines and decorators. Nested functions count inside their parent.
"The plain path" is the full trainer's `--no-shared-prefill --no-trunk-reuse` (transformers' generate and a
full forward for each log-prob pass, as the reference does).
"""

from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tyro

import train
from grpo_vlm import trainer as full

PROJECT_FILES = {str(p) for p in [*ROOT.glob("*.py"), *ROOT.glob("grpo_vlm/*.py")]}


def function_spans(path: str) -> dict[int, tuple[int, int, int]]:
    """first line (a decorator's, if any, as co_firstlineno) -> (that line, first body line, last line)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    spans = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans[first] = (first, node.body[0].lineno, node.end_lineno)
    return spans


def traced_step(main, args) -> set[tuple[str, int, str]]:
    """(file, first line, name) of every project function called inside train_step during one step."""
    called: set[tuple[str, int, str]] = set()
    depth = 0  # > 0 while a train_step frame is on the stack

    def profile(frame, event, arg):
        nonlocal depth
        code = frame.f_code
        if event not in ("call", "return") or code.co_filename not in PROJECT_FILES:
            return
        if code.co_name == "train_step":
            depth += 1 if event == "call" else -1
        if depth and event == "call" and not code.co_name.startswith("<"):
            called.add((code.co_filename, code.co_firstlineno, code.co_name))

    sys.setprofile(profile)
    try:
        main(args)
    finally:
        sys.setprofile(None)
    return called


def count(called: set[tuple[str, int, str]], verbose: bool = False) -> tuple[dict[str, tuple[int, int]], int]:
    """Per module: (body lines, lines with signatures), unions over the called functions; and their number."""
    per_module: dict[str, tuple[int, int]] = {}
    for path in sorted({f for f, _, _ in called}):
        spans = function_spans(path)
        text = Path(path).read_text(encoding="utf-8").splitlines()
        body: set[int] = set()
        whole: set[int] = set()
        for _, first, name in sorted(c for c in called if c[0] == path):
            start, body_start, end = spans[first]
            own = {i for i in range(body_start, end + 1) if text[i - 1].strip()}
            if verbose:
                print(f"  {Path(path).name}:{start} {name}: {len(own)}")
            body |= own
            whole |= {i for i in range(start, end + 1) if text[i - 1].strip()}
        per_module[str(Path(path).relative_to(ROOT))] = (len(body), len(whole))
    return per_module, len(called)


def main() -> None:
    shape = [
        "--steps",
        "1",
        "--batch-size",
        "4",
        "--group-size",
        "4",
        "--train-size",
        "16",
        "--eval-size",
        "0",
    ]
    paths = {
        "reference (python train.py)": (train, []),
        "full trainer, default (python -m grpo_vlm)": (full, []),
        "full trainer, plain (--no-shared-prefill --no-trunk-reuse)": (
            full,
            ["--no-shared-prefill", "--no-trunk-reuse"],
        ),
    }
    for label, (module, flags) in paths.items():
        with tempfile.TemporaryDirectory() as tmp:
            args = tyro.cli(module.Args, args=[*shape, "--output-dir", f"{tmp}/run", *flags])
            per_module, functions = count(traced_step(module.main, args), verbose="-v" in sys.argv)
        body, whole = (sum(n[k] for n in per_module.values()) for k in (0, 1))
        ranked = sorted(per_module.items(), key=lambda kv: -kv[1][0])
        modules = ", ".join(f"{name} {n[0]}" for name, n in ranked)
        print(f"{label}: {body} body lines ({whole} with signatures) in {functions} functions ({modules})")


if __name__ == "__main__":
    main()
