"""memory.py's estimate of a step's GPU memory for Qwen2.5-VL-3B and 7B, with the whole batch in one pass and
with --micro-batch-size auto's choice for a budget (an estimate from shapes, not a measurement).

    python scripts/memory_table.py                     # the full trainer: B=8, G=8, P=1200, T=256, bf16
    python scripts/memory_table.py --prompt-len 600 --device-gib 40
    python scripts/memory_table.py --reference --batch-size 4 --prompt-len 1258   # README's train.py command
    python scripts/memory_table.py --cuda-graph         # the decoding step kept as a CUDA graph
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import tyro
from transformers import Qwen2_5_VLConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_vlm import memory


@dataclass
class TableArgs:
    batch_size: int = 8
    group_size: int = 8
    prompt_len: int = 1200
    """P: the longest prompt, visual tokens included (a photo of about 1,100 visual tokens)."""
    max_new_tokens: int = 256
    lora_last_k: int = 4
    lora_r: int = 16
    dtype_bytes: int = 2
    device_gib: float = 79.1
    """The device's memory (an 80 GB H100 shows 79.1 GiB); auto's budget is memory.SAFETY_FRACTION of it."""
    reference: bool = False
    """The reference's step (train.py, the full trainer's plain path): generate on all N rows, full forwards
    of all N rows at once, their (N, T, V) fp32 logits; no micro-batch to choose."""
    cuda_graph: bool = False
    """The full trainer with --cuda-graph: its decoding step (StaticCache and graph) kept through the step."""


def main(args: TableArgs) -> None:
    budget = int(args.device_gib * memory.SAFETY_FRACTION * memory.GIB)
    shapes = dict(
        rows=args.batch_size * args.group_size,
        prompt_len=args.prompt_len,
        completion_len=args.max_new_tokens,
        last_k=args.lora_last_k,
        lora_r=args.lora_r,
        dtype_bytes=args.dtype_bytes,
        group_size=args.group_size,
        cuda_graph=args.cuda_graph,
    )
    if args.reference:
        shapes |= dict(trunk_reuse=False, shared_prefill=False)
    columns = {}
    for name, numbers in memory.QWEN25_VL.items():
        config = Qwen2_5_VLConfig(**numbers)
        columns[f"{name} whole batch"] = memory.estimate(
            config, micro_batch_size=None, gradient_checkpointing=False, **shapes
        )
        if args.reference:
            continue
        size, checkpointing = memory.choose_micro_batch(config, budget_bytes=budget, **shapes)
        label = f"{name} auto: {size} rows{', ckpt' if checkpointing else ''}"
        columns[label] = memory.estimate(
            config, micro_batch_size=size, gradient_checkpointing=checkpointing, **shapes
        )
    print(f"budget {budget / memory.GIB:.1f} GiB; GiB per phase")
    print("| phase | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for phase in next(iter(columns.values())):
        print(f"| {phase} | " + " | ".join(f"{c[phase] / memory.GIB:.1f}" for c in columns.values()) + " |")


if __name__ == "__main__":
    main(tyro.cli(TableArgs))
