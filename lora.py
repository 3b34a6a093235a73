"""LoRA adapters on chosen blocks of any model, or on the last K decoder blocks of a transformers LM/VLM.

Implements LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen linear layer
W gets a trainable low-rank update, y = W x + (alpha / r) * B A dropout(x), A kaiming-uniform and B zero, so
training starts exactly at the base model. The GRPO reference policy is the same model with its adapters off
(`adapters_disabled`): no second copy of the weights. Legend: `K` adapted blocks, `r` rank, `alpha` (scaling
= alpha / r), `d_in`/`d_out` a layer's features.

Choices and sharp edges:
- Any model: `inject_lora(model, blocks=[...], targets=[...])`; on a transformers LM or VLM `last_k=K` finds
  the language model's blocks, never the vision tower's (its MLP has `gate_proj` too). Every other parameter
  is frozen, so reentrant checkpointing (not transformers 5's default) needs enable_input_require_grads().
- A and B, and so AdamW's moments, are fp32 whatever the base dtype (as PEFT): bf16 adapters lose every update
  below bf16's spacing. The branch computes in the activation dtype: A and B (tiny) are cast down, never the
  (tokens, d_in) input up (PEFT upcasts it): bf16 matmuls, no fp32 copy of the input kept for backward.
- Dropout acts on the branch's input in training mode only (HF models load in eval; the trainer switches).
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import torch
from torch import Tensor, nn
from torch.nn import functional as F

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# In order: Qwen2/2.5/3-VL (transformers 5), their inner Qwen*VLModel, causal LMs (Qwen2, Qwen3, Llama).
_BLOCK_PATHS = ("model.language_model.layers", "language_model.layers", "model.layers")
Blocks = nn.ModuleList | Sequence[nn.Module]


def check_lora(*, r: int, alpha: float, dropout: float = 0.0) -> None:
    """Refuse settings a LoRALinear cannot take: ValueError naming the argument ('r: must be >= 1, got 0')."""
    if r < 1:
        raise ValueError(f"r: must be >= 1, got {r}")
    if not 0 < alpha < math.inf:
        raise ValueError(f"alpha: must be a number > 0, got {alpha}")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout: must be in [0, 1), got {dropout}")


class LoRALinear(nn.Module):
    """y = base_layer(x) + B(A(dropout(x))) * alpha / r, base_layer frozen; A, B in fp32."""

    def __init__(self, base_layer: nn.Linear, *, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        check_lora(r=r, alpha=alpha, dropout=dropout)
        self.base_layer = base_layer.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, float(alpha), float(alpha) / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = {"bias": False, "device": base_layer.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(base_layer.in_features, r, **kw)  # weight (r, d_in)
        self.lora_B = nn.Linear(r, base_layer.out_features, **kw)  # weight (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init for A
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapted model starts equal to the base
        self.disabled = False  # True inside adapters_disabled(): forward is the base layer alone
        self.train(base_layer.training)  # NOTE: inherited: a new module starts in training mode (dropout on)

    # Code that reads `self.q_proj.weight` (dtype probes, attention kernels) still finds the base weight.
    @property
    def weight(self) -> Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if self.disabled:
            return out
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)  # A, B cast; x never upcast
        lora = F.linear(F.linear(self.dropout(x), a), b)  # (..., d_out)
        return out + (lora * self.scaling).to(out.dtype)


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Dotted path and ModuleList of the language model's decoder blocks (never the vision tower's)."""
    for path in _BLOCK_PATHS:
        with suppress(AttributeError):  # no such submodule
            blocks = model.get_submodule(path)
            if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
                return path, blocks
    raise ValueError(
        f"cannot find the language decoder blocks of {type(model).__name__}: looked for a non-empty "
        f"nn.ModuleList at {', '.join(_BLOCK_PATHS)}; pass blocks= instead"
    )


def target_linears(model: nn.Module, blocks: Blocks, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """Dotted name -> nn.Linear of each `targets` layer in `blocks` (submodules of `model`); no change."""
    names = {id(m): name for name, m in model.named_modules()}
    if outside := [type(b).__name__ for b in blocks if id(b) not in names]:
        raise ValueError(f"blocks {outside} are not submodules of {type(model).__name__}")
    found = {}
    for block in blocks:
        for sub, module in block.named_modules():
            if sub.rpartition(".")[2] in targets and type(module) is nn.Linear:
                found[f"{names[id(block)]}.{sub}".lstrip(".")] = module  # lstrip: the model as its own block
    if not found:
        raise ValueError(f"no nn.Linear named {list(targets)} in blocks {[names[id(b)] for b in blocks]}")
    return found


def lora_modules(model: nn.Module, *, required: bool = False) -> dict[str, LoRALinear]:
    """Every LoRALinear of `model` by dotted name, in module order; `required`: a ValueError when none."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if required and not modules:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; call inject_lora first")
    return modules


def inject_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    last_k: int | None = None,
    blocks: Blocks | None = None,
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Freeze all parameters, wrap the `targets` linears in LoRALinear (rank r, scale alpha / r); their dotted
    names. Where: the last `last_k` of `find_decoder_blocks`, or the given `blocks` (exactly one of the two).
    Every check precedes any change."""
    check_lora(r=r, alpha=alpha, dropout=dropout)
    if (last_k is None) == (blocks is None):
        raise ValueError("give exactly one of last_k (the last K decoder blocks) and blocks")
    if lora_modules(model):
        raise ValueError("model already has LoRA adapters; wrapping them again would nest LoRALinear")
    if blocks is None:
        path, found = find_decoder_blocks(model)
        n = len(found)
        if not 1 <= last_k <= n:
            raise ValueError(f"last_k: must be in [1, {n}] ({path} has {n} blocks), got {last_k}")
        blocks = list(found)[n - last_k :]
    linears = target_linears(model, blocks, targets)
    model.requires_grad_(False)  # only the LoRA parameters, created below, are trainable
    for name, linear in linears.items():  # NOTE: in module order: each A's init draws from the global RNG
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, LoRALinear(linear, r=r, alpha=alpha, dropout=dropout))
    return list(linears)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA parameters (A and B of every adapter), for the optimizer."""
    return [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Detached copies of the LoRA weights, keyed `<module name>.lora_{A,B}.weight` (PEFT's, unprefixed)."""
    keys = {f"{name}.lora_{ab}.weight" for name in lora_modules(model) for ab in "AB"}
    return {k: p.detach().clone() for k, p in model.named_parameters() if k in keys}  # in module order


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block the model is the base model (the GRPO reference policy, without a second copy)."""
    previous = {m: m.disabled for m in lora_modules(model, required=True).values()}  # restored on exit
    for m in previous:
        m.disabled = True
    try:
        yield
    finally:
        for m, flag in previous.items():
            m.disabled = flag
