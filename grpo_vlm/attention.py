"""Which attention kernel each part of a vision-language model runs: the language model's, the vision tower's.

The language model runs the kernel `--attn-implementation` names. The vision tower runs FlashAttention-2 when
it can (the flash-attn package installed, a CUDA device, bf16 or fp16 weights), sdpa otherwise. Why it
differs from the language model's: Qwen2.5-VL's vision tower attends within windows of 112 x 112 pixels, and
under sdpa (or eager) it makes one attention call per window, image and block (`cu_seqlens` split into a
Python loop: thousands of small calls per step for 8 large images), while FlashAttention-2 takes all the
windows of a block in one variable-length call. The two give the same attention to rounding.

transformers sets a kernel per part through the model's sub-configs (`set_attn_implementation` with a dict
keyed by `text_config` and `vision_config`); a model without a vision tower (a text-only causal LM) keeps the
one kernel it was loaded with.
"""

from __future__ import annotations

import importlib.util

import torch


def vision_kernel(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(flash_attention_2 where flash-attn runs: installed, CUDA, 16-bit weights; else sdpa; the reason)."""
    if importlib.util.find_spec("flash_attn") is None:
        return "sdpa", "flash-attn is not installed"
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "sdpa", "flash-attn runs on CUDA in bf16 or fp16 only"
    return "flash_attention_2", "flash-attn is installed"


def set_per_part(model: torch.nn.Module, language: str, device: torch.device, dtype: torch.dtype) -> str:
    """Give the vision tower `vision_kernel`'s choice and the language model `language`; returns the line
    that says which part runs which kernel."""
    if "vision_config" not in getattr(model.config, "sub_configs", {}):
        return f"attention: {language}"
    vision, why = vision_kernel(device, dtype)
    model.set_attn_implementation({"text_config": language, "vision_config": vision})
    return f"attention: language model {language}, vision tower {vision} ({why})"
