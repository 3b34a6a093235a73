"""Run training commands over several seeds; report held-out accuracy as a distribution, against controls.

    python scripts/seeds.py --out runs/seeds/reference --run \\
        "trained=python train.py" \\
        "random reward=python train.py --reward label examples/random_reward.py:coin --reward-weight 0 1" \\
        "no update=python train.py --lr 0" \\
        --control "random reward" "no update" --figure docs/seeds_reference.png
    python scripts/seeds.py --out runs/seeds/package --run "trained=python -m grpo_vlm" \\
        "no update=python -m grpo_vlm --lr 0" --control "no update"
    python scripts/seeds.py --out runs/seeds/reference --run ... --table-only   # re-read, run nothing

Each `--run NAME=COMMAND` is run once per seed as typed (in the current folder, a leading `python` being
this interpreter), with `--seed S --output-dir OUT/NAME/seed-S` added; its output goes to
OUT/NAME/seed-S.log. A run is finished once its command exited 0: OUT/NAME/seed-S.done.json then records the
command, and a rerun of this script skips it (resumable: a stopped sweep continues where it was; a run
folder left unfinished is deleted and run again). A finished seed recorded with another command is refused.

What it reports, from each run's metrics.jsonl (`--metric`, default eval/accuracy, the greedy held-out
accuracy both trainers log): a table with, per evaluation step, the mean ± std [min, max] over the seeds of
every setting, then each setting minus each control, seed S paired with seed S (every seed answers the
same held-out questions, and the two runs start from the same LoRA initialisation): the difference per seed,
then its mean ± std [min, max]; and one line per pair: the setting "learns" only where its mean difference
from the control at the last evaluation is more than the spread of those differences. The figure: one
panel per setting, one thin line per seed, the mean bold, each control beside it in the same panel. All of
it goes to OUT/table.md, OUT/summary.json and the figure (--figure, default OUT/seeds.png).

Choices:
- std is the sample standard deviation (n - 1): a handful of seeds estimates the spread of all seeds, and
  the population form (n) would understate it (for 3 seeds by a factor of 0.82). One seed has no spread.
- "Learns": the mean per-seed difference from the control exceeds its sample std, i.e. the setting beats
  the control by more than the seeds' spread. A bar any reader checks by eye in the table, and a necessary
  condition, not a significance test: it is a paired t statistic above sqrt(n) (1.73 for 3 seeds, one-sided
  p about 0.11; a one-sided t-test at 5% would ask 1.69 x the std for 3 seeds, 0.95 x for 5). The line
  gives the numbers, min and max included, for a stricter reading.
- Runs go one at a time by default (--jobs 1), each with the threads torch chooses, as a single run would
  go: float sums depend on the number of threads, so a run's figures match `COMMAND --seed S` typed alone.
  With --jobs N each run gets OMP_NUM_THREADS = cores // N (unless already set): N runs at once, with
  other (equally valid) rounding; done.json records the threads.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
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
from scripts import outputs

MARKER = "seeds.json"  # in --out: the folder is this script's, so it may delete its unfinished runs


@dataclass
class Args:
    run: tuple[str, ...] = ()
    """The settings, each `NAME=COMMAND` ("trained=python train.py"); --seed and --output-dir are added."""
    control: tuple[str, ...] = ()
    """Names of --run settings that are controls (random reward, lr 0): every other setting is compared with
    each of them, and said to learn only where it beats it by more than the seeds' spread."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """The seeds each setting runs with."""
    out: str = "runs/seeds"
    """Folder of the runs (OUT/NAME/seed-S/), their logs and done markers, table.md and summary.json."""
    jobs: int = 1
    """Runs at a time. More than 1: each with OMP_NUM_THREADS = cores // jobs (other rounding than alone)."""
    metric: str = "eval/accuracy"
    """The metrics.jsonl key reported per evaluation step."""
    figure: str | None = None
    """The figure's file (PNG). Default: OUT/seeds.png."""
    title: str | None = None
    """The figure's title. Default: the --out folder's name."""
    table_only: bool = False
    """Run nothing: report the seeds already finished (the others are left out, and named)."""


@dataclass(frozen=True)
class Spread:
    """Values over seeds: their mean, sample std (n - 1; NaN for one value), min and max."""

    mean: float
    std: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        std = "n/a" if math.isnan(self.std) else f"{self.std:.3f}"
        return f"{self.mean:.3f} ± {std} [{self.low:.3f}, {self.high:.3f}]"

    def signed(self) -> str:
        """As str, with the sign of the mean and of the bounds (a difference)."""
        std = "n/a" if math.isnan(self.std) else f"{self.std:.3f}"
        return f"{self.mean:+.3f} ± {std} [{self.low:+.3f}, {self.high:+.3f}]"


def spread(values: list[float]) -> Spread:
    """Mean, sample std (n - 1), min and max of `values` (one value: std NaN)."""
    std = statistics.stdev(values) if len(values) >= 2 else math.nan
    return Spread(statistics.fmean(values), std, min(values), max(values), len(values))


# --- Settings, commands and the run folders ----------------------------------------------------------------


def settings_of(args: Args) -> dict[str, str]:
    """NAME -> COMMAND from --run, every name and control checked (cli.UsageError)."""
    settings = {}
    for entry in args.run:
        name, sep, command = entry.partition("=")
        name, command = name.strip(), command.strip()
        cli.check(bool(sep and name and command), "--run", f"each must be NAME=COMMAND, got {entry!r}")
        cli.check(name not in settings, "--run", f"the name {name!r} is given twice")
        words = shlex.split(command)
        for flag in ("--seed", "--output-dir"):
            given = any(w == flag or w.startswith(f"{flag}=") for w in words)
            cli.check(not given, "--run", f"{name}: {flag} is added by this script; leave it out")
        settings[name] = command
    cli.check(bool(settings), "--run", "give at least one NAME=COMMAND")
    slugs = [slug(name) for name in settings]
    cli.check(len(set(slugs)) == len(slugs), "--run", f"two names make the same folder name: {slugs}")
    for name in args.control:
        cli.check(name in settings, "--control", f"{name!r} is not a --run name ({', '.join(settings)})")
    cli.check(len(set(args.seeds)) == len(args.seeds) >= 1, "--seeds", "must be one or more different seeds")
    cli.check(args.jobs >= 1, "--jobs", f"must be >= 1, got {args.jobs}")
    return settings


def slug(name: str) -> str:
    """A setting's folder name: letters, digits, '.', '_' and '-' kept, any other run of characters '-'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"


def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / slug(name) / f"seed-{seed}"


def done_file(out: Path, name: str, seed: int) -> Path:
    return out / slug(name) / f"seed-{seed}.done.json"


def argv_of(command: str, seed: int, folder: Path) -> list[str]:
    """The command's words with --seed and --output-dir added; a leading `python` is this interpreter."""
    words = shlex.split(command)
    if words and re.fullmatch(r"python(3(\.\d+)?)?", words[0]):
        words[0] = sys.executable
    return [*words, "--seed", str(seed), "--output-dir", str(folder)]


def finished(out: Path, name: str, command: str, seed: int) -> bool:
    """Whether this seed of this setting finished (its done marker); one finished with another command is
    refused (cli.UsageError): its figures would be another setting's."""
    path = done_file(out, name, seed)
    if not path.is_file():
        return False
    recorded = json.loads(path.read_text(encoding="utf-8")).get("command")
    why = f"{path} was finished with {recorded!r}, not {command!r}: give another --out, or delete that run"
    cli.check(recorded == command, "--run", why)
    return True


def check_ours(out: Path) -> None:
    """Refuse an --out holding anything this script did not write (it deletes unfinished runs in its own)."""
    present = sorted(p.name for p in out.iterdir() if p.name != ".lock") if out.is_dir() else []
    listed = ", ".join(present[:3])
    message = f"{out} holds files this script did not write ({listed}); give a new or empty folder"
    cli.check(not present or (out / MARKER).is_file(), "--out", message)


# --- Running ------------------------------------------------------------------------------------------------


class Runner:
    """Runs the seeds not finished, --jobs at a time; on a stop, the runs going on are sent SIGTERM (each
    trainer stops after its step) and waited for."""

    def __init__(self, args: Args, out: Path, settings: dict[str, str]) -> None:
        self.args, self.out, self.settings = args, out, settings
        self.running: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def environment(self) -> tuple[dict[str, str], str]:
        """The runs' environment (PYTHONPATH finds the project's modules, OMP threads when --jobs > 1)."""
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        if self.args.jobs > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.args.jobs))
        return env, env.get("OMP_NUM_THREADS", "torch's default")

    def one(self, name: str, seed: int, index: str) -> None:
        command, folder = self.settings[name], run_dir(self.out, name, seed)
        if folder.exists():  # NOTE: a run stopped before its done marker: this script's, deleted, run again
            print(f"{index} {name}, seed {seed}: an unfinished run from before, deleted; running it again")
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        env, threads = self.environment()
        log_path, start = folder.parent / f"seed-{seed}.log", time.time()
        print(f"{index} {name}, seed {seed}: running (log: {log_path})", flush=True)
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(
                argv_of(command, seed, folder), stdout=log, stderr=subprocess.STDOUT, env=env
            )
            with self.lock:
                self.running.add(process)
            code = process.wait()
            with self.lock:
                self.running.discard(process)
        if code == cli.EXIT_STOPPED:
            raise cli.Stopped("stopped")
        last = (log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines() or [""])[-1]
        cli.check(code == 0, "--run", f"{name}, seed {seed}: exited {code}: {last} (the log: {log_path})")
        seconds = time.time() - start
        record = {"command": command, "seed": seed, "seconds": round(seconds, 1), "threads": threads}
        outputs.write_json_atomic(done_file(self.out, name, seed), record)
        print(f"{index} {name}, seed {seed}: done in {seconds:.0f} s", flush=True)

    def all(self) -> None:
        jobs = [
            (name, seed)
            for name, command in self.settings.items()
            for seed in self.args.seeds
            if not finished(self.out, name, command, seed)
        ]
        pool = ThreadPoolExecutor(self.args.jobs)
        try:
            list(pool.map(lambda job: self.one(*job[1], f"[{job[0] + 1}/{len(jobs)}]"), enumerate(jobs)))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # no new run starts
            with self.lock:
                for process in self.running:
                    process.send_signal(signal.SIGTERM)  # each trainer stops cleanly after its step
            raise
        finally:
            pool.shutdown(wait=True)


def forget_unfinished(out: Path, settings: dict[str, str], seeds: tuple[int, ...]) -> None:
    """After a stop: the stopped runs' folders and logs go (a rerun runs them afresh), and the marker too if
    no seed finished, so that a stop soon after the start leaves nothing behind."""
    for name, command in settings.items():
        for seed in seeds:
            if not finished(out, name, command, seed):
                shutil.rmtree(run_dir(out, name, seed), ignore_errors=True)
                (out / slug(name) / f"seed-{seed}.log").unlink(missing_ok=True)
        if (out / slug(name)).is_dir() and not any((out / slug(name)).iterdir()):
            (out / slug(name)).rmdir()
    if not [p for p in out.iterdir() if p.name not in (MARKER, ".lock")]:
        (out / MARKER).unlink(missing_ok=True)


# --- Reading and reporting ----------------------------------------------------------------------------------


def read_series(path: Path, metric: str) -> dict[int, float]:
    """{step: value} of `metric` in a metrics.jsonl."""
    series = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise cli.UsageError(f"{path}:{number}: not JSON ({e.msg})") from None
        if metric in record:
            series[int(record["step"])] = float(record[metric])
    return series


def collect(out: Path, settings: dict[str, str], seeds: tuple[int, ...], metric: str) -> dict:
    """{name: {seed: {step: value}}} of the finished seeds; those not finished are named on stdout."""
    series = {}
    for name, command in settings.items():
        series[name] = {}
        for seed in seeds:
            if not finished(out, name, command, seed):
                print(f"{name}, seed {seed}: not finished, left out")
                continue
            series[name][seed] = read_series(run_dir(out, name, seed) / "metrics.jsonl", metric)
    return series


def common_steps(per_seed: dict[int, dict[int, float]]) -> list[int]:
    """The steps every seed evaluated."""
    steps = [set(points) for points in per_seed.values()]
    return sorted(set.intersection(*steps)) if steps else []


def at_steps(per_seed: dict[int, dict[int, float]]) -> dict[int, Spread]:
    """{step: the seeds' Spread} over the steps every seed evaluated."""
    return {step: spread([points[step] for points in per_seed.values()]) for step in common_steps(per_seed)}


def differences(setting: dict, control: dict) -> dict[int, Spread]:
    """{step: Spread of (setting - control) per seed}, over the seeds both ran and steps both evaluated."""
    seeds = sorted(set(setting) & set(control))
    paired_setting, paired_control = {s: setting[s] for s in seeds}, {s: control[s] for s in seeds}
    steps = sorted(set(common_steps(paired_setting)) & set(common_steps(paired_control)))
    return {step: spread([setting[s][step] - control[s][step] for s in seeds]) for step in steps}


def verdict(name: str, control: str, diffs: dict[int, Spread]) -> tuple[bool | None, str]:
    """Whether `name` learns against `control`: at the last evaluation both made, the mean per-seed
    difference is more than its sample std (None: fewer than 2 seeds, nothing to say)."""
    if not diffs:
        return None, f"{name} vs {control}: no evaluation step and seed in common"
    step = max(diffs)
    d = diffs[step]
    if d.n < 2:
        return None, f"{name} vs {control}: one seed has no spread; run more seeds before saying it learns"
    learns = d.mean > d.std
    said = "learns" if learns else "does NOT learn"
    why = "more than" if learns else "not more than"
    line = (
        f"{name} {said} against {control}: at step {step}, {name} - {control} = {d.mean:+.3f} ± {d.std:.3f}"
    )
    return learns, f"{line} [{d.low:+.3f}, {d.high:+.3f}] over {d.n} seeds, {why} its spread"


def comparisons(series: dict, controls: tuple[str, ...]) -> dict[str, dict]:
    """{"setting - control": its verdict and per-step differences} for every setting and control run."""
    pairs = {}
    for name in (n for n in series if n not in controls and series[n]):
        for control in (c for c in controls if series[c]):
            diffs = differences(series[name], series[control])
            learns, line = verdict(name, control, diffs)
            pairs[f"{name} - {control}"] = {"learns": learns, "verdict": line, "by_step": diffs}
    return pairs


def markdown(series: dict, pairs: dict[str, dict], metric: str) -> str:
    """Three tables, a column per evaluation step: each setting's Spread over its seeds, each seed's value,
    and each setting's difference from each control (paired by seed)."""
    spreads = {name: at_steps(per_seed) for name, per_seed in series.items() if per_seed}
    steps = sorted({step for by_step in spreads.values() for step in by_step})

    def row(label: str, cells: dict) -> str:
        return f"| {label} | " + " | ".join(str(cells[s]) if s in cells else "-" for s in steps) + " |"

    def head(label: str) -> list[str]:
        return [row(label, {s: f"step {s}" for s in steps}), "|---" * (len(steps) + 1) + "|"]

    lines = head(f"{metric}, mean ± std [min, max]")
    lines += [row(f"{name} ({len(series[name])} seeds)", spreads[name]) for name in spreads]
    lines += ["", *head(f"{metric}, per seed")]
    for name, per_seed in series.items():
        lines += [
            row(f"{name}, seed {seed}", {k: f"{v:.3f}" for k, v in p.items()}) for seed, p in per_seed.items()
        ]
    if pairs:
        lines += ["", *head("difference, per seed paired: mean ± std [min, max]")]
        lines += [row(pair, {k: d.signed() for k, d in c["by_step"].items()}) for pair, c in pairs.items()]
    return "\n".join(lines)


def as_json(value):
    """summary.json's content: Spreads as dicts, int keys as strings, NaN as null."""
    if isinstance(value, Spread):
        value = dict(mean=value.mean, std=value.std, min=value.low, max=value.high, n=value.n)
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def draw(series: dict, controls: tuple[str, ...], path: Path, metric: str, title: str) -> None:
    """One panel per setting: each seed a thin line, the mean bold, each control beside it (same panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [name for name in series if name not in controls and series[name]] or list(controls)[:1]
    others = [c for c in controls if series.get(c)]
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], settings):
        for colour, shown in enumerate(dict.fromkeys([name, *others])):
            per_seed = series[shown]
            for points in per_seed.values():
                steps = sorted(points)
                ax.plot(steps, [points[s] for s in steps], color=f"C{colour}", lw=0.8, alpha=0.5)
            means = {s: d.mean for s, d in at_steps(per_seed).items()}
            label = f"{shown} (mean of {len(per_seed)} seeds)"
            ax.plot(
                list(means), list(means.values()), color=f"C{colour}", lw=2.6, marker="o", ms=3.5, label=label
            )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="best")
    axes[0][0].set_ylabel(metric)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------------------


def report(args: Args, out: Path, settings: dict[str, str]) -> dict:
    """Read the finished runs; print and write the table, the verdicts, summary.json and the figure."""
    series = collect(out, settings, args.seeds, args.metric)
    pairs = comparisons(series, args.control)
    said = [pair["verdict"] for pair in pairs.values()]
    text = markdown(series, pairs, args.metric)
    print(text, "", *said, sep="\n")
    outputs.write_text_atomic(out / "table.md", "\n".join([text, "", *said]) + "\n")
    spreads = {name: at_steps(per_seed) for name, per_seed in series.items()}
    summary = dict(metric=args.metric, settings=settings, per_seed=series, spread=spreads, differences=pairs)
    outputs.write_json_atomic(out / "summary.json", as_json(summary))
    figure = Path(args.figure) if args.figure else out / "seeds.png"
    if any(series.values()):
        draw(series, args.control, figure, args.metric, args.title or out.name)
        print(f"figure: {figure}")
    return summary


def main(args: Args) -> dict:
    """Run the seeds not finished (one process per --out: its lock), then report. Ctrl-C or SIGTERM stops the
    runs going on (each after its step) and exits 130; a rerun continues."""
    settings = settings_of(args)
    out = Path(args.out).resolve()
    check_ours(out)  # before its lock is taken: a folder refused is left as it was
    with cli.signals(), outputs.claimed({"--out": [out]}, folder=True):
        outputs.write_json_atomic(out / MARKER, {"producer": "scripts/seeds.py"})
        if not args.table_only:
            try:
                Runner(args, out, settings).all()
            except (cli.Stopped, KeyboardInterrupt):
                forget_unfinished(out, settings, args.seeds)
                raise cli.Stopped(f"stopped; the finished seeds are in {out}, a rerun continues") from None
        return report(args, out, settings)


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
