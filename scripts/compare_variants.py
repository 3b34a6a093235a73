"""Train the default demo with each GRPO variant and several seeds, then print the README's comparison table.

    python scripts/compare_variants.py                       # 8 variants x 3 seeds, two runs at a time
    python scripts/compare_variants.py --seeds 0 1 --parallel 1 --extra-flags --num-iterations 2
    python scripts/compare_variants.py --table-only          # re-read the finished runs, print the table

Each run is `python -m grpo_vlm --seed S --eval-every 50 --output-dir <out>/<variant>-s<S> <flags>` with one
torch thread; its wall time is measured around the process. A finished run (its metrics.jsonl reaches the
last step) is not run again. The table gives, per variant, the held-out accuracy at steps 50 and 100 as
mean ± std [min, max] over the seeds (sample std, scripts/seeds.py's `spread`), its difference from the
default variant (dapo) at the last step, seed by seed (each seed's runs answer the same held-out questions
and start from the same LoRA initialisation), as mean ± std [min, max], the median wall time and, for
dynamic sampling, the mean number of groups sampled per step. A comparison is never one pair of runs: a
difference within twice its spread is no difference this grid can show.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # NOTE: a Ctrl-C while the imports run exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from grpo_vlm import cli
from scripts import outputs, seeds

VARIANTS = {  # name -> (label, flags)
    "dapo": ("DAPO (the default: token-mean loss, clip-higher)", ""),
    "grpo": ("GRPO (z-score, per-sequence mean)", "--loss-type grpo"),
    "dr_grpo": ("Dr. GRPO", "--loss-type dr_grpo --adv-scale none"),
    "dapo_ds": ("DAPO + dynamic sampling", "--loss-type dapo --dynamic-sampling"),
    "gspo": (
        "GSPO",
        "--loss-type grpo --importance-sampling-level sequence --clip-eps-low 3e-4 --clip-eps-high 4e-4",
    ),
    "cispo": ("CISPO", "--loss-type cispo --clip-eps-high 4.0"),
    "sapo": ("SAPO", "--loss-type sapo"),
    "rloo": ("RLOO", "--loss-type dapo --adv-baseline rloo --adv-scale none"),
}


@dataclass
class Args:
    out: str = "runs/variants"
    """Folder of the runs (one sub-folder per variant and seed) and their wall times."""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """Which variants (names of VARIANTS)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 100
    parallel: int = 2
    """Runs at a time (each on one thread)."""
    extra_flags: tuple[str, ...] = ()
    """More trainer.py flags for every run, e.g. --num-iterations 2."""
    table_only: bool = False


def run_one(args: Args, name: str, seed: int) -> None:
    out = Path(args.out) / f"{name}-s{seed}"
    if finished(out, args.steps):
        return
    command = [sys.executable, "-m", "grpo_vlm", "--seed", str(seed), "--steps", str(args.steps)]
    command += ["--eval-every", "50", "--log-completions-every", "0", "--output-dir", str(out), "--overwrite"]
    command += VARIANTS[name][1].split() + list(args.extra_flags)
    start, log_path = time.time(), Path(f"{out}.log")
    with open(log_path, "w") as log:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # finds grpo_vlm
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode == cli.EXIT_STOPPED:  # Ctrl-C reached the run too: it stopped cleanly
        raise cli.Stopped("stopped")
    done.check_returncode()
    Path(f"{out}.time").write_text(f"{time.time() - start:.1f}\n")


def finished(out: Path, steps: int) -> bool:
    path = out / "metrics.jsonl"
    return path.is_file() and any(
        json.loads(line).get("step") == steps for line in path.read_text().splitlines()
    )


BASELINE = "dapo"  # each variant's difference is taken from this one's runs, seed by seed


def evaluations(out: Path) -> tuple[dict[int, float], list[dict]]:
    """{step: held-out accuracy} of a run, and its metrics.jsonl records."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}, records


def table(args: Args) -> str:
    header = "variant | flags | accuracy @50 | accuracy @100 | @100 minus the default, per seed"
    rows = [f"| {header} | wall (median) | groups sampled / step |", "|---|---|---|---|---|---|---|"]
    last: dict[str, dict[int, float]] = {}  # variant -> {seed: accuracy at the last step}
    for name in sorted(args.variants, key=lambda name: name != BASELINE):  # the default first
        at50, walls, sampled, last[name] = [], [], [], {}
        for seed in args.seeds:
            out = Path(args.out) / f"{name}-s{seed}"
            evals, records = evaluations(out)
            at50 += [evals[50]] if 50 in evals else []
            last[name][seed] = evals[args.steps]
            walls.append(float(Path(f"{out}.time").read_text()))
            sampled += [r["dynamic/groups_sampled"] for r in records if "dynamic/groups_sampled" in r]
        cells = [str(seeds.spread(values)) if values else "-" for values in (at50, list(last[name].values()))]
        base = last.get(BASELINE)
        paired = [last[name][s] - base[s] for s in args.seeds] if base and name != BASELINE else []
        cells.append(seeds.spread(paired).signed() if paired else "-")
        groups = f"{statistics.mean(sampled):.2f}" if sampled else "-"
        label, flags = VARIANTS[name]
        flags = f"`{flags}`" if flags else "(none)"
        rows.append(
            f"| {label} | {flags} | {' | '.join(cells)} | {statistics.median(walls):.0f} s | {groups} |"
        )
    return "\n".join(rows)


def run_all(args: Args) -> None:
    jobs = [(name, seed) for seed in args.seeds for name in args.variants]
    pool = ThreadPoolExecutor(args.parallel)
    try:
        list(pool.map(lambda job: run_one(args, *job), jobs))
    except cli.Stopped:
        pool.shutdown(cancel_futures=True)  # no new run starts; the running ones stop themselves
        for name, seed in jobs:  # the log of a run that wrote nothing goes too
            if not (Path(args.out) / f"{name}-s{seed}").exists():
                Path(args.out, f"{name}-s{seed}.log").unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def main(args: Args) -> None:
    """Run what is not finished (one process per --out: its lock is <out>/.lock), then print the table. A
    Ctrl-C in the terminal reaches the runs too: each stops after its step with a checkpoint, then this
    script exits 130; a rerun skips the finished runs."""
    if not args.table_only:
        with cli.signals(), outputs.claimed({"--out": [Path(args.out)]}, folder=True):
            try:
                run_all(args)
            except cli.Stopped:
                raise cli.Stopped(
                    f"stopped; the finished runs are in {args.out}, a rerun skips them"
                ) from None
    print(table(args))


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
