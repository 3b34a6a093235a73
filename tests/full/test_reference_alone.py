"""The reference stands alone: its six modules, tests/ (not tests/full/) and the embedded model, copied into
an empty folder, pass their own tests; and the package imports the reference, never the reverse."""

import shutil
import subprocess
import sys
from pathlib import Path

from test_layout import REFERENCE, imported

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_passes_its_tests_in_a_folder_without_the_package(tmp_path):
    for name in REFERENCE:
        shutil.copy(ROOT / f"{name}.py", tmp_path)
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("full", "__pycache__"))
    shutil.copytree(ROOT / "assets" / "tiny-qwen2.5-vl", tmp_path / "assets" / "tiny-qwen2.5-vl")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "error" not in done.stdout.splitlines()[-1]
    assert not (tmp_path / "grpo_vlm").exists()


def test_the_package_imports_the_reference_and_is_never_imported_by_it():
    package = {p.stem for p in (ROOT / "grpo_vlm").glob("*.py")}
    for path in (ROOT / "grpo_vlm").glob("*.py"):
        names = imported(path)
        assert "." not in names, f"{path.name} uses a relative import: write `from grpo_vlm import x`"
        assert not names & (package - {"__init__", "__main__"}), f"{path.name}: import as grpo_vlm.<module>"
    assert any("grpo" in imported(p) for p in (ROOT / "grpo_vlm").glob("*.py"))  # it extends the reference
