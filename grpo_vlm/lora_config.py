"""LoRA on the command line: the settings group `--lora-last-k`, `--lora-r`, `--lora-alpha`, `--lora-fp32`,
`--lora-dropout` and `inject`, which hands them to lora.inject_lora as its plain keywords.

lora.py takes keywords in its own vocabulary (r, alpha, dropout, last_k) and names no flag; this group adds
the `lora_` prefix that keeps the flags apart from the others and checks the values with the flag's name,
and --no-lora-fp32 (adapters in the base dtype: `lora_in_base_dtype`), which the reference has not.
Legend: `K` adapted blocks (the last K decoder blocks of the language model), `r` rank.
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
        """Raise ValueError('--flag: what is wrong, got value') for the first setting out of range: lora.py's
        own checks (lora.check_lora names r, alpha, dropout), then the number of blocks."""
        try:
            lora.check_lora(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout)
        except ValueError as e:
            raise ValueError(f"--lora-{e}") from None
        if self.lora_last_k < 1:
            raise ValueError(f"--lora-last-k: must be >= 1, got {self.lora_last_k}")


def training_bytes(model: nn.Module, config: LoRAConfig) -> int:
    """Bytes the adapters `inject` adds hold while training: A and B, their gradients and AdamW's two moments
    (four copies), in fp32 (`lora_fp32`) or the base dtype. Computed from the layers' shapes, nothing made."""
    _, blocks = lora.find_decoder_blocks(model)
    linears = lora.target_linears(model, list(blocks)[-config.lora_last_k :], lora.DEFAULT_TARGETS)
    itemsize = 4 if config.lora_fp32 else next(model.parameters()).element_size()
    return 4 * itemsize * config.lora_r * sum(lin.in_features + lin.out_features for lin in linears.values())


def check_fits(model: nn.Module, config: LoRAConfig, budget_bytes: int) -> None:
    """Refuse (ValueError naming --lora-r) adapters whose training memory, beside the model's weights, is
    more than `budget_bytes`, before any is allocated: a huge rank would otherwise fill the machine first."""
    need = training_bytes(model, config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if need + weights > budget_bytes:
        gib = 2**30
        raise ValueError(
            f"--lora-r: {config.lora_r} on the last {config.lora_last_k} blocks needs {need / gib:,.1f} GiB "
            f"(A, B, gradients, AdamW moments) beside {weights / gib:,.1f} GiB of weights, more than the "
            f"{budget_bytes / gib:,.1f} GiB this device has to spare; lower --lora-r or --lora-last-k"
        )


def inject(model: nn.Module, config: LoRAConfig) -> list[str]:
    """lora.inject_lora with these settings: the last `lora_last_k` decoder blocks; the wrapped names."""
    names = lora.inject_lora(
        model,
        r=config.lora_r,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        last_k=config.lora_last_k,
    )
    if not config.lora_fp32:
        lora_in_base_dtype(model)
    return names


def lora_in_base_dtype(model: nn.Module) -> None:
    """--no-lora-fp32: each adapter's A and B in its base weight's dtype (half the memory of fp32 in bf16, but
    updates below bf16's spacing round away); before the optimizer is made."""
    for m in lora.lora_modules(model, required=True).values():
        m.lora_A.to(m.base_layer.weight.dtype)
        m.lora_B.to(m.base_layer.weight.dtype)
