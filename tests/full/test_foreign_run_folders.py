"""A run folder from someone else is data, not code: --resume names the plug-ins it imports and refuses one
whose file changed since the run started; a trainer state is bounded before it loads; a manifest names only
files of its checkpoint; a state or run.json of the wrong shape is one line naming the file and the field.
Each refusal: exit 2, one line, no traceback, the run folder's files byte-identical."""

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from full.helpers import train_args
from grpo_vlm import checkpoints, cli, plugins, trainer

FLAGS = dict(batch_size=2, group_size=2, max_new_tokens=8, eval_every=1000, train_size=16, eval_size=4)
FLAGS |= dict(warmup_steps=1, seed=3, steps=2, save_every=1)
JUDGE = "def judge(completion, sample):\n    return 0.5\n"


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` but the lock file (it names its latest holder)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != checkpoints.LOCK_FILE
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """(a finished 2-step run with checkpoint-000001 and -000002 and the reward plug-in judge.py, the
    plug-in); copy both (`copy_of`) before changing them."""
    root = tmp_path_factory.mktemp("finished")
    plugin = root / "judge.py"
    plugin.write_text(JUDGE)
    out = root / "run"
    trainer.main(train_args(output_dir=str(out), reward=("label", f"{plugin}:judge"), **FLAGS))
    return out, plugin


def copy_of(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """The run and its plug-in copied into `tmp_path`, run.json naming the copy of the plug-in."""
    run, plugin = finished
    run_copy = Path(shutil.copytree(run, tmp_path / "run"))
    plugin_copy = Path(shutil.copy(plugin, tmp_path / "judge.py"))
    text = (run_copy / "run.json").read_text().replace(str(plugin), str(plugin_copy))
    (run_copy / "run.json").write_text(text)
    return run_copy, plugin_copy


def resume(run: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python -m grpo_vlm --resume RUN --steps 3 FLAGS` in a process."""
    command = [sys.executable, "-m", "grpo_vlm", "--resume", str(run), "--steps", "3", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def refused(child: subprocess.CompletedProcess) -> str:
    """The one line of a refusal (exit 2, no traceback), without its 'error: '."""
    assert child.returncode == 2, child.stdout + child.stderr
    assert "Traceback" not in child.stderr
    errors = [line for line in child.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, child.stderr
    return errors[0].removeprefix("error: ")


def command(argv: list[str], capsys) -> tuple[int, str]:
    """`python -m grpo_vlm ARGV` in this process (cli.run, as __main__ calls it): (exit status, stderr)."""
    with pytest.raises(SystemExit) as stopped:
        cli.run(lambda a: trainer.main(trainer.command_line(a), trainer.typed_flags(a)), argv)
    return stopped.value.code, capsys.readouterr().err


def one_line(status: int, err: str) -> str:
    assert status == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0].removeprefix("error: ")


def forge_manifest(checkpoint: Path, name: str, path: Path | None = None) -> None:
    """Make checkpoint.json list `name` with the size and SHA-256 of `path` (default checkpoint/name), as
    whoever replaced the file would."""
    path = path or checkpoint / name
    manifest = json.loads((checkpoint / checkpoints.OWNER_FILE).read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["files"][name] = {"bytes": path.stat().st_size, "sha256": digest}
    (checkpoint / checkpoints.OWNER_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


# --- Plug-ins: named on resume, refused when their file changed --------------------------------------------


def test_run_json_records_each_plugin_file_and_its_sha256(finished):
    run, plugin = finished
    recorded = json.loads((run / "run.json").read_text())["plugins"]
    digest = hashlib.sha256(plugin.read_bytes()).hexdigest()
    assert recorded == [
        {"flag": "--reward", "spec": f"{plugin}:judge", "file": str(plugin), "sha256": digest}
    ]


def test_resume_prints_each_plugin_it_imports_with_its_file_and_hash(finished, tmp_path):
    run, plugin = copy_of(finished, tmp_path)
    child = resume(run)
    assert child.returncode == 0, child.stderr
    digest = hashlib.sha256(plugin.read_bytes()).hexdigest()[: plugins.HASH_SHOWN]
    said = f"imports --reward plug-in {plugin}:judge: {plugin} (sha256 {digest}), as when the run started"
    assert said in child.stdout.splitlines()


def test_a_plugin_file_changed_since_the_run_started_is_refused_and_never_imported(finished, tmp_path):
    run, plugin = copy_of(finished, tmp_path)
    marker = tmp_path / "imported"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n" + JUDGE)  # what a changed file could do
    before = tree_digest(run)
    line = refused(resume(run))
    assert line.startswith(f"--reward: the plug-in {plugin}:judge changed since the run started ({plugin}")
    assert line.endswith(
        f"give --reward label {plugin}:judge again on the command line to accept it as it is now"
    )
    assert not marker.exists()
    assert tree_digest(run) == before


def test_giving_the_flag_again_accepts_the_changed_plugin_and_records_its_new_hash(finished, tmp_path):
    run, plugin = copy_of(finished, tmp_path)
    plugin.write_text(JUDGE + "# edited\n")
    child = resume(run, "--reward", "label", f"{plugin}:judge")
    assert child.returncode == 0, child.stderr
    assert f"imports --reward plug-in {plugin}:judge: {plugin} (sha256 " in child.stdout
    recorded = json.loads((run / "run.json").read_text())["plugins"]
    assert recorded[0]["sha256"] == hashlib.sha256(plugin.read_bytes()).hexdigest()


def test_a_run_json_without_plugin_hashes_is_refused_until_the_flag_is_given_again(
    finished, tmp_path, capsys
):
    run, plugin = copy_of(finished, tmp_path)
    record = json.loads((run / "run.json").read_text())
    del record["plugins"]  # as an older version wrote it, or as whoever edited it would
    (run / "run.json").write_text(json.dumps(record, indent=2))
    before = tree_digest(run)
    line = one_line(*command(["--resume", str(run), "--steps", "3"], capsys))
    assert line.startswith(f"--reward: {run}/run.json records no SHA-256 of the plug-in {plugin}:judge")
    assert tree_digest(run) == before


def test_a_module_plugin_is_recorded_by_the_file_of_its_module_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "pkg" / "judges.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [record] = plugins.plugin_records({"--reward": ("label", "pkg.judges:judge")})
    module_file = tmp_path / "pkg" / "judges.py"
    assert record["file"] == str(module_file.resolve())
    assert record["sha256"] == hashlib.sha256(module_file.read_bytes()).hexdigest()
    assert "pkg" not in sys.modules


# --- Trainer states bounded before they load; manifests confined to their checkpoint ----------------------


def test_a_deflated_state_whose_entries_expand_to_256_mb_is_refused_naming_the_file(finished, tmp_path):
    run, _ = copy_of(finished, tmp_path)
    for old in checkpoints.list_checkpoints(run)[:-1]:
        shutil.rmtree(old)  # the newest is the only one: nothing to fall back to
    checkpoint = checkpoints.list_checkpoints(run)[-1]
    state = checkpoint / checkpoints.STATE_FILE
    original = zipfile.ZipFile(state)
    forged = tmp_path / "forged.pt"
    with zipfile.ZipFile(forged, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for entry in original.infolist():  # torch's records, deflated: torch.load reads them as before
            archive.writestr(entry.filename, original.read(entry))
        prefix = original.infolist()[0].filename.split("/")[0]
        with archive.open(f"{prefix}/padding", "w", force_zip64=True) as padding:
            block = bytes(2**20)
            for _ in range(256):  # 256 MiB of zeros, 256 KB deflated; 1 MiB in memory at a time
                padding.write(block)
    shutil.copy(forged, state)
    forge_manifest(checkpoint, checkpoints.STATE_FILE)
    assert state.stat().st_size < 2**20
    before = tree_digest(run)
    line = refused(resume(run))
    assert f"{state}: its entries would expand to 268," in line and "refusing it" in line
    assert tree_digest(run) == before


@pytest.mark.parametrize("entry", ["../../secret.txt", "ABSOLUTE", "escape"])
def test_a_manifest_entry_outside_its_checkpoint_is_refused_naming_the_checkpoint_and_the_entry(
    finished, tmp_path, entry
):
    run, _ = copy_of(finished, tmp_path)
    checkpoint = run / "checkpoint-000002"
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's\n")
    if entry == "ABSOLUTE":
        entry = str(secret)
    if entry == "escape":  # a symlink inside the folder that leads out of it
        (checkpoint / "escape").symlink_to(secret)
    forge_manifest(checkpoint, entry, secret)
    before = tree_digest(run)
    line = refused(resume(run, "--resume", str(checkpoint)))  # named: no older one taken instead
    assert line.startswith(f"--resume: {checkpoint} is damaged (checkpoint.json lists {entry!r}, which ")
    assert "outside the checkpoint folder" in line or "not a path inside the checkpoint folder" in line
    assert tree_digest(run) == before


# --- States and run.json of the wrong shape: one line naming the file and the field -----------------------


def damage_state(checkpoint: Path, change) -> None:
    """Load the checkpoint's trainer state, `change` it, save it back, and forge the manifest to match."""
    state = torch.load(checkpoint / checkpoints.STATE_FILE, weights_only=True)
    state = change(state)
    torch.save(state, checkpoint / checkpoints.STATE_FILE)
    forge_manifest(checkpoint, checkpoints.STATE_FILE)


def set_field(state: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = state
    for key in parents:
        node = node[key]
    node[last] = value
    return state


STATES = {  # what is done to the state -> the field the one line names
    "empty": (lambda s: {}, "step: missing"),
    "step abc": (lambda s: set_field(s, "step", "abc"), "step: must be an int >= 0, got 'abc' (str)"),
    "beta nan": (lambda s: set_field(s, "beta", float("nan")), "beta: must be a finite number"),
    "rng list": (lambda s: set_field(s, "rng.python.state", [1, 2]), "rng.python.state: must be 625 ints"),
    "rng torch": (
        lambda s: set_field(s, "rng.torch", torch.zeros(3)),
        "rng.torch: must be torch's RNG state",
    ),
    "numpy key": (lambda s: set_field(s, "rng.numpy.key", "x"), "rng.numpy.key: must be an int64 tensor"),
    "optimizer": (lambda s: set_field(s, "optimizer", [1, 2]), "optimizer: must be a dict, got [1"),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_a_state_of_the_wrong_shape_is_one_line_naming_the_file_and_the_field(
    finished, tmp_path, capsys, case
):
    run, _ = copy_of(finished, tmp_path)
    checkpoint = run / "checkpoint-000002"
    change, field = STATES[case]
    damage_state(checkpoint, change)
    before = tree_digest(run)
    line = one_line(*command(["--resume", str(checkpoint), "--steps", "3"], capsys))
    assert f"{checkpoint / checkpoints.STATE_FILE}: {field}" in line
    assert tree_digest(run) == before


def test_a_newest_state_of_the_wrong_shape_falls_back_to_the_older_checkpoint(finished, tmp_path, capsys):
    run, _ = copy_of(finished, tmp_path)
    damage_state(run / "checkpoint-000002", lambda s: set_field(s, "step", "abc"))
    assert (
        trainer.main(trainer.command_line(["--resume", str(run), "--steps", "3"]), {"--reward"})["steps"] == 3
    )
    printed = capsys.readouterr().out
    assert "warning: checkpoint-000002 is damaged (" in printed and "step: must be an int >= 0" in printed


def moment_of_another_shape(state: dict) -> dict:
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)  # fails only at the first step, today
    return state


OPTIMIZERS = {  # a plain-data optimizer or scheduler state that is not this run's -> the field named
    "moment shape": (moment_of_another_shape, "optimizer.state[0].exp_avg: must be a number or a tensor of"),
    "group lr": (
        lambda s: set_field(s, "optimizer.param_groups", [s["optimizer"]["param_groups"][0] | {"lr": "x"}]),
        "optimizer.param_groups[0].lr: must be like",
    ),
    "scheduler key": (lambda s: set_field(s, "scheduler.optimizer", 1), "scheduler: must hold only"),
}


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_an_optimizer_or_scheduler_state_that_is_not_the_runs_is_one_line_naming_file_and_field(
    finished, tmp_path, capsys, case
):
    run, _ = copy_of(finished, tmp_path)
    checkpoint = run / "checkpoint-000002"
    change, field = OPTIMIZERS[case]
    damage_state(checkpoint, change)
    before = tree_digest(run)
    line = one_line(*command(["--resume", str(checkpoint), "--steps", "3"], capsys))
    assert line.startswith(f"--resume: {checkpoint / checkpoints.STATE_FILE}: {field}")
    assert tree_digest(run) == before


RUN_JSONS = {  # run.json changed -> the field the one line names
    "args list": (lambda r: r | {"args": [1, 2]}, "args: not an object of settings (a list)"),
    "batch_size two": (
        lambda r: r | {"args": r["args"] | {"batch_size": "two"}},
        'args: batch_size: "two" is not of type int',
    ),
    "lr text": (lambda r: r | {"args": r["args"] | {"lr": "fast"}}, 'args: lr: "fast" is not of type float'),
    "plugins text": (lambda r: r | {"plugins": "judge.py"}, "plugins: not a list of"),
}


@pytest.mark.parametrize("case", sorted(RUN_JSONS))
def test_a_run_json_of_the_wrong_shape_is_one_line_naming_the_file_and_the_field(
    finished, tmp_path, capsys, case
):
    run, _ = copy_of(finished, tmp_path)
    change, field = RUN_JSONS[case]
    record = change(json.loads((run / "run.json").read_text()))
    (run / "run.json").write_text(json.dumps(record, indent=2))
    before = tree_digest(run)
    line = one_line(*command(["--resume", str(run), "--steps", "3"], capsys))
    assert line.startswith(f"{run}/run.json: {field}")
    assert tree_digest(run) == before
