"""The two rooms: six reference modules at the top, the full trainer in grpo_vlm/, imports one way.

grpo.py, lora.py and rewards.py each import alone from an empty folder (copy one, it works) and name no
command-line flag; data.py and model_io.py may use transformers and PIL; no reference module imports the
package; the package's modules import the reference, never the reverse.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("grpo", "lora", "rewards", "data", "model_io", "train")
# Third-party packages each reference module may import besides the standard library.
THIRD_PARTY = {
    "grpo": {"torch"},
    "lora": {"torch"},
    "rewards": set(),
    "data": {"torch", "PIL", "transformers"},
    "model_io": {"torch", "transformers", "safetensors"},
    "train": {"torch", "tyro"},
}


def imported(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in it ('.' for a relative import)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_the_top_level_holds_the_six_reference_modules_and_nothing_else():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(REFERENCE)
    assert (ROOT / "grpo_vlm" / "__init__.py").is_file() and (ROOT / "grpo_vlm" / "__main__.py").is_file()


@pytest.mark.parametrize("name", REFERENCE)
def test_each_reference_module_imports_only_the_reference_and_its_allowed_libraries(name):
    names = imported(ROOT / f"{name}.py")
    own = names & set(REFERENCE)
    extra = names - set(sys.stdlib_module_names) - THIRD_PARTY[name] - own
    assert not extra, f"{name}.py imports {sorted(extra)}"
    assert "grpo_vlm" not in names and "." not in names
    if name in ("grpo", "lora", "rewards"):
        assert not own, f"{name}.py imports {sorted(own)}: it must copy alone"


@pytest.mark.parametrize("name", ["grpo", "lora", "rewards"])
def test_a_leaf_module_imports_alone_from_an_empty_folder_and_names_no_flag(name, tmp_path):
    shutil.copy(ROOT / f"{name}.py", tmp_path)
    command = [sys.executable, "-c", f"import {name}"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}  # not the project's folder
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    flags = re.findall(r"--[a-z][a-z-]*", (ROOT / f"{name}.py").read_text(encoding="utf-8"))
    assert not flags, f"{name}.py names flags {flags}: it raises in its own terms, train.py names the flag"


def test_the_package_imports_the_reference_and_is_never_imported_by_it():
    package = {p.stem for p in (ROOT / "grpo_vlm").glob("*.py")}
    for path in (ROOT / "grpo_vlm").glob("*.py"):
        names = imported(path)
        assert "." not in names, f"{path.name} uses a relative import: write `from grpo_vlm import x`"
        assert not names & (package - {"__init__", "__main__"}), f"{path.name}: import as grpo_vlm.<module>"
    assert any("grpo" in imported(p) for p in (ROOT / "grpo_vlm").glob("*.py"))  # it extends the reference
