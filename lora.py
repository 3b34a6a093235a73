"""LoRA adapters on chosen blocks of any model, or on the last K decoder blocks of a transformers LM/VLM.

Implements LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen linear layer
W gets a trainable low-rank update, y = W x + (alpha / r) * B A dropout(x), A kaiming-uniform and B zero, so
training starts exactly at the base model. model_io.py saves and loads adapters in PEFT's format.
Legend: `K` adapted blocks, `r` rank, `alpha` (scaling = alpha / r), `d_in`/`d_out` a layer's features.

Choices and sharp edges:
- Never the vision tower (its MLP has `gate_proj` too); `inject_lora` freezes every other parameter, so
  reentrant checkpointing (not transformers 5's default) needs `model.enable_input_require_grads()`.
- A and B, and so AdamW's moments, are fp32 whatever the base dtype (as PEFT): bf16 adapters lose every update
  below bf16's spacing. `fp32=False` keeps them in the base dtype, half the memory, at that cost.
- The branch computes in the activation dtype: A and B (tiny) are cast down, never the (tokens, d_in) input
  up (PEFT upcasts it): bf16 matmuls, no fp32 copy of the input kept for backward. A sampler may cast them
  once for all of its token steps (`LoRALinear.cast`; the package grpo_vlm does).
- Dropout follows the wrapped layer's mode (HF models load in eval). Merging (in fp32, rounded once) is
  explicit, never a side effect of `.train()`/`.eval()`; misuse (merging twice, inside `adapters_disabled`,
  ...) raises RuntimeError. A bf16 merge/unmerge round trip rounds W (~2**-8): merge once, to export.
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


class LoRALinear(nn.Module):
    """y = base_layer(x) + B(A(dropout(x))) * alpha / r, base_layer frozen; A, B in `dtype` (None: base's)."""

    def __init__(
        self,
        base_layer: nn.Linear,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.base_layer = base_layer.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, float(alpha), float(alpha) / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = {"bias": False, "device": base_layer.weight.device, "dtype": dtype or base_layer.weight.dtype}
        self.lora_A = nn.Linear(base_layer.in_features, r, **kw)  # weight (r, d_in)
        self.lora_B = nn.Linear(r, base_layer.out_features, **kw)  # weight (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init for A
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapted model starts equal to the base
        self.merged = False  # True while B @ A * scaling is folded into base_layer.weight
        self.disabled = False  # True inside adapters_disabled(): forward is the base layer alone
        self.cast: tuple[Tensor, Tensor] | None = None  # A, B already in the base dtype (set by a sampler)
        self.train(base_layer.training)  # NOTE: inherited: a new module starts in training mode (dropout on)

    # Code that reads `self.q_proj.weight` (dtype probes, attention kernels) still finds the base weight.
    @property
    def weight(self) -> Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base_layer.bias

    def delta_weight(self) -> Tensor:
        """B @ A * scaling in fp32, shape (d_out, d_in)."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if self.disabled or self.merged:  # merged: the update is already inside base_layer.weight
            return out
        a, b = self.cast or [w.to(x.dtype) for w in (self.lora_A.weight, self.lora_B.weight)]  # x not upcast
        lora = F.linear(F.linear(self.dropout(x), a), b)  # (..., d_out)
        return out + (lora * self.scaling).to(out.dtype)


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Dotted path and ModuleList of the language model's decoder blocks (never the vision tower's)."""
    for path in _BLOCK_PATHS:
        with suppress(AttributeError):  # no such submodule
            if isinstance(blocks := model.get_submodule(path), nn.ModuleList) and len(blocks) > 0:
                return path, blocks
    raise ValueError(
        f"cannot find the language decoder blocks of {type(model).__name__}: looked for a non-empty "
        f"nn.ModuleList at {', '.join(_BLOCK_PATHS)}"
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
    if not (modules := {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}) and required:
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
    fp32: bool = True,
) -> list[str]:
    """Freeze all parameters, wrap the `targets` linears in LoRALinear (rank r, scale alpha / r, A and B in
    fp32 or the base dtype); their dotted names. Where: the last `last_k` of `find_decoder_blocks`, or the
    given `blocks` (exactly one of the two). Every check precedes any change."""
    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    if (last_k is None) == (blocks is None):
        raise ValueError("give exactly one of last_k (the last K decoder blocks) and blocks")
    if lora_modules(model):
        raise ValueError("model already has LoRA adapters; wrapping them again would nest LoRALinear")
    if blocks is None:
        path, found = find_decoder_blocks(model)
        n = len(found)
        if not 1 <= last_k <= n:
            raise ValueError(f"last_k must be in [1, {n}] ({path} has {n} blocks), got {last_k}")
        blocks = list(found)[n - last_k :]
    linears = target_linears(model, blocks, targets)
    model.requires_grad_(False)  # only the LoRA parameters, created below, are trainable
    dtype = torch.float32 if fp32 else None
    for name, linear in linears.items():  # NOTE: in module order: each A's init draws from the global RNG
        parent, _, leaf = name.rpartition(".")
        adapted = LoRALinear(linear, r=r, alpha=alpha, dropout=dropout, dtype=dtype)
        setattr(model.get_submodule(parent), leaf, adapted)
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
    if any(m.merged for m in previous):  # NOTE: merged W is not the base W exactly: refuse, not approximate
        raise RuntimeError("cannot disable merged adapters; call unmerge_lora first")
    for m in previous:
        m.disabled = True
    try:
        yield
    finally:
        for m, flag in previous.items():
            m.disabled = flag


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold B @ A * scaling into every base weight (in its own dtype). Merging twice raises RuntimeError."""
    modules = list(lora_modules(model, required=True).values())
    if any(m.merged for m in modules):
        raise RuntimeError("LoRA weights are already merged")
    if any(m.disabled for m in modules):
        raise RuntimeError("cannot merge inside adapters_disabled()")
    for m in modules:
        m.weight.copy_((m.weight.float() + m.delta_weight()).to(m.weight.dtype))  # sum in fp32, round once
        m.merged = True


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> None:
    """Subtract B @ A * scaling from every base weight. Unmerging an unmerged model raises RuntimeError."""
    modules = list(lora_modules(model, required=True).values())
    if not all(m.merged for m in modules):
        raise RuntimeError("LoRA weights are not merged")
    for m in modules:
        m.weight.copy_((m.weight.float() - m.delta_weight()).to(m.weight.dtype))
        m.merged = False


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge (if not yet merged) and put the plain base nn.Linear back; state_dict keys become standard."""
    modules = lora_modules(model, required=True)
    if not any(m.merged for m in modules.values()):
        merge_lora(model)
    for name, m in modules.items():
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, m.base_layer)
    return model
