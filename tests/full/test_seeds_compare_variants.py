"""scripts/compare_variants.py's table: each variant as mean ± std [min, max] over its seeds, and its
difference from the default variant seed by seed, never one pair of runs (runs written by hand)."""

import json
from pathlib import Path

from scripts import compare_variants


def write_run(folder: Path, at50: float, at100: float) -> None:
    folder.mkdir(parents=True)
    lines = [{"step": 0, "eval/accuracy": 0.48}, {"step": 50, "eval/accuracy": at50}]
    lines += [{"step": 100, "eval/accuracy": at100, "loss": 0.1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    Path(f"{folder}.time").write_text("100.0\n")


def test_each_variant_is_a_spread_over_seeds_and_its_difference_from_the_default_is_paired_by_seed(tmp_path):
    runs = {"dapo": [(0.7, 0.9), (0.8, 0.8), (0.75, 1.0)], "grpo": [(0.6, 0.8), (0.7, 0.8), (0.8, 0.8)]}
    for name, per_seed in runs.items():
        for seed, (at50, at100) in enumerate(per_seed):
            write_run(tmp_path / f"{name}-s{seed}", at50, at100)
    args = compare_variants.Args(
        out=str(tmp_path), variants=("grpo", "dapo"), seeds=(0, 1, 2), table_only=True
    )
    rows = compare_variants.table(args).splitlines()
    assert rows[2].startswith("| DAPO (the default")  # the baseline first, whatever the order asked
    # dapo @100: 0.9, 0.8, 1.0: mean 0.9, sample std 0.1; @50: 0.7, 0.8, 0.75: mean 0.75, std 0.05
    assert "| 0.750 ± 0.050 [0.700, 0.800] | 0.900 ± 0.100 [0.800, 1.000] | - |" in rows[2]
    # grpo - dapo per seed at 100: -0.1, 0.0, -0.2: mean -0.1, sample std 0.1
    assert "| 0.800 ± 0.000 [0.800, 0.800] | -0.100 ± 0.100 [-0.200, +0.000] |" in rows[3]
