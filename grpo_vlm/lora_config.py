"""LoRA on the command line: the settings group `--lora-last-k`, `--lora-r`, `--lora-alpha`, `--lora-fp32`,
`--lora-dropout` and `inject`, which hands them to lora.inject_lora as its plain keywords.

lora.py takes keywords in its own vocabulary (r, alpha, dropout, last_k, fp32) and names no flag; this
group adds the `lora_` prefix that keeps the flags apart from the others and checks the values with the
flag's name. Legend: `K` adapted blocks (the last K decoder blocks of the language model), `r` rank.
"""

from dataclasses import dataclass

from torch import nn

import lora


@dataclass
class LoRAConfig:
    """LoRA's settings, named as the command line's flags (`lora_r` is `--lora-r`)."""

    lora_last_k: int = 4
    """LoRA goes into the last K decoder blocks of the language model (vision tower frozen)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is B @ A * alpha / r."""
    lora_fp32: bool = True
    """LoRA weights and AdamW state in fp32 whatever --dtype (as PEFT); the branch computes in the activation
    dtype. --no-lora-fp32: the base dtype (half the memory, but bf16 rounds small updates away)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch input during the gradient pass."""

    def check(self) -> None:
        """Raise ValueError('--flag: what is wrong, got value') for the first setting out of range."""
        for flag, ok, message in [
            ("--lora-last-k", self.lora_last_k >= 1, "must be >= 1"),
            ("--lora-r", self.lora_r >= 1, "must be >= 1"),
            ("--lora-alpha", self.lora_alpha > 0, "must be > 0"),
            ("--lora-dropout", 0 <= self.lora_dropout < 1, "must be in [0, 1)"),
        ]:
            if not ok:
                raise ValueError(f"{flag}: {message}, got {getattr(self, flag[2:].replace('-', '_'))}")


def inject(model: nn.Module, config: LoRAConfig) -> list[str]:
    """lora.inject_lora with these settings: the last `lora_last_k` decoder blocks; the wrapped names."""
    return lora.inject_lora(
        model,
        r=config.lora_r,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        last_k=config.lora_last_k,
        fp32=config.lora_fp32,
    )
