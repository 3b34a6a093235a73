"""scripts/seeds.py: a command over several seeds, as a distribution. Two tiny runs of a stand-in trainer
whose accuracies are chosen, so that every mean, std, min and max is checked by hand; the verdict against a
control; resuming; refusals; and two real tiny runs of `python train.py`."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_vlm import cli
from scripts import seeds

ROOT = Path(__file__).resolve().parents[2]

# A stand-in trainer: `--curves A,B/C,D` gives seed 0 the accuracies A, B and seed 1 C, D at steps 0 and 10;
# it notes each call (seed, OMP_NUM_THREADS) in calls.jsonl beside --output-dir's parent.
FAKE = """
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
value = lambda flag: argv[argv.index(flag) + 1]
seed, out = int(value("--seed")), Path(value("--output-dir"))
if "--fail" in argv:
    print("error: --fail: this run fails"); sys.exit(2)
if "--sleep" in argv:  # a long run that stops cleanly (130) on SIGINT or SIGTERM, as the trainers do
    import signal, time
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(130))
    out.mkdir(parents=True)
    print("started", flush=True)
    time.sleep(120)
curve = [float(v) for v in value("--curves").split("/")[seed].split(",")]
out.mkdir(parents=True)
lines = [json.dumps({"step": step, "eval/accuracy": v, "loss": 0.1}) for step, v in zip((0, 10), curve)]
(out / "metrics.jsonl").write_text("".join(line + "\\n" for line in lines))
with open(out.parent.parent / "calls.jsonl", "a") as f:
    f.write(json.dumps({"seed": seed, "threads": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
"""


@pytest.fixture
def fake(tmp_path) -> str:
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE)
    return f"python {path}"


def sweep(out: Path, runs: dict[str, str], **flags) -> seeds.Args:
    return seeds.Args(out=str(out), run=tuple(f"{k}={v}" for k, v in runs.items()), seeds=(0, 1), **flags)


def calls(out: Path) -> list[dict]:
    path = out / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_spread_is_the_mean_sample_std_min_and_max_by_hand():
    s = seeds.spread([0.975, 0.785, 0.81])  # the three seeds at step 100
    assert s.mean == pytest.approx(0.856667, abs=1e-6)
    # deviations 0.118333, -0.071667, -0.046667; squares sum 0.021317; / (3 - 1); sqrt
    assert s.std == pytest.approx(0.103239, abs=1e-6)  # sample std (n - 1); the population one is 0.0843
    assert (s.low, s.high, s.n) == (0.785, 0.975, 3)
    assert str(s) == "0.857 ± 0.103 [0.785, 0.975]"
    one = seeds.spread([0.5])
    assert math.isnan(one.std) and str(one) == "0.500 ± n/a [0.500, 0.500]"


def test_two_tiny_runs_give_each_steps_mean_std_min_max_and_the_difference_from_the_control(tmp_path, fake):
    out = tmp_path / "sweep"
    runs = {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9", "coin": f"{fake} --curves 0.5,0.5/0.5,0.6"}
    summary = seeds.main(sweep(out, runs, control=("coin",), figure=str(tmp_path / "fig.png")))
    trained, coin = summary["spread"]["trained"], summary["spread"]["coin"]
    assert trained[0] == seeds.Spread(0.5, 0.0, 0.5, 0.5, 2)
    assert trained[10].mean == pytest.approx(0.8) and trained[10].std == pytest.approx(math.sqrt(0.02))
    assert (trained[10].low, trained[10].high) == (0.7, 0.9)
    assert coin[10].mean == pytest.approx(0.55) and coin[10].std == pytest.approx(math.sqrt(0.005))
    # per seed: 0.7 - 0.5 = 0.2 and 0.9 - 0.6 = 0.3: mean 0.25 > std sqrt(0.005) = 0.0707: learns
    pair = summary["differences"]["trained - coin"]
    d = pair["by_step"][10]
    assert d.mean == pytest.approx(0.25) and d.std == pytest.approx(math.sqrt(0.005))
    assert (d.low, d.high) == pytest.approx((0.2, 0.3))
    assert pair["learns"] is True
    assert pair["verdict"].startswith(
        "trained learns against coin: at step 10, trained - coin = +0.250 ± 0.071"
    )
    table = (out / "table.md").read_text()
    assert "| trained (2 seeds) | 0.500 ± 0.000 [0.500, 0.500] | 0.800 ± 0.141 [0.700, 0.900] |" in table
    assert "| trained - coin | +0.000 ± 0.000 [+0.000, +0.000] | +0.250 ± 0.071 [+0.200, +0.300] |" in table
    assert "| trained, seed 1 | 0.500 | 0.900 |" in table
    written = json.loads((out / "summary.json").read_text())
    assert written["spread"]["trained"]["10"] == pytest.approx(
        {"mean": 0.8, "std": math.sqrt(0.02), "min": 0.7, "max": 0.9, "n": 2}
    )
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_setting_within_the_spread_of_its_control_does_not_learn(tmp_path, fake):
    runs = {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9", "coin": f"{fake} --curves 0.5,0.5/0.5,0.9"}
    summary = seeds.main(sweep(tmp_path / "sweep", runs, control=("coin",)))
    pair = summary["differences"]["trained - coin"]  # differences 0.2 and 0.0: mean 0.1 < std 0.141
    assert pair["learns"] is False and "does NOT learn against coin" in pair["verdict"]
    assert (tmp_path / "sweep" / "seeds.png").is_file()  # the default figure's place


def test_finished_seeds_are_not_run_again_and_an_unfinished_one_is_run_afresh(tmp_path, fake):
    out, runs = tmp_path / "sweep", {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9"}
    first = seeds.main(sweep(out, runs))
    assert [c["seed"] for c in calls(out)] == [0, 1]
    assert seeds.main(sweep(out, runs))["spread"] == first["spread"]
    assert len(calls(out)) == 2  # nothing ran again
    (out / "trained" / "seed-1.done.json").unlink()  # seed 1 as a stopped run leaves it: folder, no marker
    assert seeds.main(sweep(out, runs))["spread"] == first["spread"]
    assert [c["seed"] for c in calls(out)] == [0, 1, 1]  # its folder deleted, then run again whole


def test_a_seed_finished_with_another_command_is_refused(tmp_path, fake):
    out = tmp_path / "sweep"
    seeds.main(sweep(out, {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9"}))
    with pytest.raises(cli.UsageError, match="seed-0.done.json was finished with"):
        seeds.main(sweep(out, {"trained": f"{fake} --curves 0.5,0.8/0.5,0.9"}))


def test_a_folder_the_script_did_not_write_is_refused_and_left_as_it_is(tmp_path, fake):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(cli.UsageError, match="holds files this script did not write"):
        seeds.main(sweep(out, {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9"}))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_runs_in_parallel_share_the_cores_and_say_so(tmp_path, fake, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(seeds.os, "cpu_count", lambda: 8)
    out = tmp_path / "sweep"
    seeds.main(sweep(out, {"trained": f"{fake} --curves 0.5,0.7/0.5,0.9"}, jobs=2))
    assert {c["threads"] for c in calls(out)} == {"4"}
    assert json.loads((out / "trained" / "seed-0.done.json").read_text())["threads"] == "4"


def test_a_failing_run_is_one_line_naming_the_setting_the_seed_and_its_log(tmp_path, fake):
    argv = [sys.executable, "scripts/seeds.py", "--out", str(tmp_path / "sweep"), "--seeds", "0"]
    done = subprocess.run(
        [*argv, "--run", f"broken={fake} --fail"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: --run: broken, seed 0: exited 2: error: --fail: this run fails")
    assert "seed-0.log" in error and "Traceback" not in done.stderr
    refused = subprocess.run(
        [*argv, "--run", "x=python train.py --seed 3"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2 and "--seed is added by this script" in refused.stderr


def test_two_real_tiny_reference_runs_start_from_the_same_held_out_accuracy(tmp_path):
    small = "--steps 1 --eval-every 1 --train-size 8 --eval-size 6 --batch-size 2 --group-size 2"
    small += " --max-new-tokens 8"
    summary = seeds.main(
        seeds.Args(out=str(tmp_path / "sweep"), run=(f"trained=python train.py {small}",), seeds=(0, 1))
    )
    per_seed = summary["per_seed"]["trained"]
    assert set(per_seed) == {0, 1} and all(set(points) == {0, 1} for points in per_seed.values())
    assert summary["spread"]["trained"][0].std == 0.0  # step 0: one held-out set, one base model, any seed


def test_ctrl_c_stops_the_runs_exits_130_without_a_traceback_and_leaves_nothing(tmp_path, fake):
    out = tmp_path / "sweep"
    argv = [sys.executable, str(ROOT / "scripts" / "seeds.py"), "--out", str(out), "--seeds", "0", "1"]
    child = subprocess.Popen(
        [*argv, "--run", f"slow={fake} --sleep"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which a terminal's Ctrl-C reaches as a whole
    )
    log = out / "slow" / "seed-0.log"
    deadline = time.time() + 120
    while not (log.is_file() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGINT)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 130, (stdout + stderr)[-3000:]
    assert "Traceback" not in stdout + stderr and "a rerun continues" in stderr
    assert not out.exists()  # the stopped run's folder and log, the marker and the lock: all gone
