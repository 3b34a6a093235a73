"""LoRA adapters on the last K decoder blocks of a language or vision-language model.

Implements LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen
linear layer W gets a trainable low-rank update, y = W x + (alpha / r) * B A dropout(x), with A
kaiming-uniform and B zero so that training starts exactly at the base model. Adapters are saved and
loaded in PEFT's on-disk format, so `peft.PeftModel.from_pretrained(base, dir)` reads them.

Legend: `K` adapted (last) decoder blocks, `r` rank, `alpha` the scale numerator (scaling = alpha / r),
`d_in` / `d_out` the wrapped layer's in and out features.

Choices and sharp edges, stated openly:
- Only the language model's decoder blocks are adapted; the vision tower and merger are never touched
  (Qwen2.5-VL's vision MLP also has `gate_proj`/`up_proj`/`down_proj`, so matching by name alone
  would wrongly adapt it).
- `inject_lora` freezes every existing parameter. With everything frozen, reentrant activation
  checkpointing (not transformers 5's default) needs `model.enable_input_require_grads()`.
- A and B are fp32 whatever the base dtype (as PEFT's default), so AdamW's moments are fp32 too: in a
  bf16 model, bf16 adapters would lose every update below bf16's spacing (an A entry of 0.1 cannot move by
  less than 2**-11; at lr 2e-5 most entries of A never move). `dtype=None` keeps them in the base dtype to
  halve their memory, at that cost.
- The LoRA branch computes in the activation dtype: A and B are cast down (r x d_in, d_out x r, tiny), never
  the (tokens, d_in) input up, so a bf16 forward stays on bf16 matmuls and saves no fp32 copy of each
  adapted layer's input for backward (PEFT upcasts the input instead). The gradients reach the fp32
  parameters through the cast; `delta_weight` (merge, unmerge) is computed in fp32 and rounded once.
- LoRA dropout follows the wrapped layer's train/eval mode at injection and `.train()`/`.eval()` after;
  HF models load in eval mode.
- Merging is an explicit call, never a side effect of `.train()`/`.eval()`. Merging twice, unmerging
  an unmerged model, merging inside `adapters_disabled`, or disabling merged adapters raise
  RuntimeError. While merged, `forward` skips the LoRA branch, so LoRA parameters get no gradient.
- In bf16 a merge/unmerge round trip rounds the base weight (relative error ~2**-8): do not merge and
  unmerge every step; merge once for export (`unload_lora`).
- While adapters are injected, `model.state_dict()` names the frozen weights `...q_proj.base_layer.weight`;
  call `unload_lora` before `save_pretrained` to get a standard checkpoint.
"""

import json
import math
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checked in order. transformers 5 puts every Qwen VLM's text blocks under `language_model`.
_BLOCK_PATHS = (
    "model.language_model.layers",  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL (ForConditionalGeneration)
    "language_model.layers",  # the same, handed the inner Qwen*VLModel
    "model.layers",  # Qwen2, Qwen3, Llama (ForCausalLM)
)
_PEFT_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> original model
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoRALinear(nn.Module):
    """y = base_layer(x) + B(A(dropout(x))) * alpha / r, with base_layer frozen."""

    def __init__(
        self,
        base_layer: nn.Linear,
        *,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        dtype: torch.dtype | None = torch.float32,
    ) -> None:
        """`dtype` of A and B: fp32 by default whatever the base dtype; None takes the base weight's."""
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        w = base_layer.weight
        self.base_layer = base_layer.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, float(alpha), float(alpha) / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = {"bias": False, "device": w.device, "dtype": w.dtype if dtype is None else dtype}
        self.lora_A = nn.Linear(base_layer.in_features, r, **kw)  # weight (r, d_in)
        self.lora_B = nn.Linear(r, base_layer.out_features, **kw)  # weight (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init for A
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapted model starts equal to the base
        self.merged = False  # True while B @ A * scaling is folded into base_layer.weight
        self.disabled = False  # True inside adapters_disabled(): forward is the base layer alone
        # NOTE: a new nn.Module starts in training mode; inherit the mode so that injecting into an
        # eval-mode model does not silently switch LoRA dropout on.
        self.train(base_layer.training)

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
        # The branch runs in the activation dtype: the (r, d_in) and (d_out, r) weights are cast down, never
        # the (tokens, d_in) activation up, and autograd casts the gradient back to the fp32 parameters.
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)  # no-ops when dtypes match
        lora = F.linear(F.linear(self.dropout(x), a), b)  # (..., d_out)
        return out + (lora * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, merged={self.merged}, disabled={self.disabled}"


def find_decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Dotted path and ModuleList of the language model's decoder blocks (never the vision tower's)."""
    for path in _BLOCK_PATHS:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return path, blocks
    raise ValueError(
        f"cannot find the language decoder blocks of {type(model).__name__}: looked for a non-empty "
        f"nn.ModuleList at {', '.join(_BLOCK_PATHS)}"
    )


def _lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _require_lora(model: nn.Module) -> dict[str, LoRALinear]:
    modules = _lora_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; call inject_lora first")
    return modules


def _plan(
    model: nn.Module, layers: list[int], target_modules: tuple[str, ...], r: int
) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, dotted name) of every target linear in blocks `layers`; mutates nothing."""
    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    if _lora_modules(model):
        raise ValueError("model already has LoRA adapters; wrapping them again would nest LoRALinear")
    path, blocks = find_decoder_blocks(model)
    if any(i < 0 or i >= len(blocks) for i in layers):
        raise ValueError(f"LoRA layers {layers} out of range: {path} has {len(blocks)} blocks")
    plan = []
    for i in layers:
        for sub, module in blocks[i].named_modules():
            parent_name, _, leaf = sub.rpartition(".")
            if leaf in target_modules and type(module) is nn.Linear:
                plan.append((blocks[i].get_submodule(parent_name), leaf, f"{path}.{i}.{sub}"))
    if not plan:
        raise ValueError(f"no nn.Linear named {list(target_modules)} in blocks {layers} of {path}")
    return plan


def _wrap(
    model: nn.Module,
    plan: list[tuple[nn.Module, str, str]],
    *,
    r: int,
    alpha: float,
    dropout: float,
    dtype: torch.dtype | None,
) -> list[str]:
    model.requires_grad_(False)  # only the LoRA parameters, created below, are trainable
    for parent, leaf, _ in plan:
        lin = getattr(parent, leaf)
        setattr(parent, leaf, LoRALinear(lin, r=r, alpha=alpha, dropout=dropout, dtype=dtype))
    return [name for _, _, name in plan]


def inject_lora(
    model: nn.Module,
    *,
    last_k: int,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    dtype: torch.dtype | None = torch.float32,
) -> list[str]:
    """Freeze all parameters, wrap the target linears of the last `last_k` decoder blocks; their names.

    A and B are created in `dtype` (fp32 by default, whatever the base dtype); None takes each base
    weight's dtype, which halves their memory in bf16 but loses small AdamW updates (module docstring).
    """
    path, blocks = find_decoder_blocks(model)
    if not 1 <= last_k <= len(blocks):
        raise ValueError(
            f"last_k must be in [1, {len(blocks)}] ({path} has {len(blocks)} blocks), got {last_k}"
        )
    plan = _plan(model, list(range(len(blocks) - last_k, len(blocks))), tuple(target_modules), r)
    return _wrap(model, plan, r=r, alpha=alpha, dropout=dropout, dtype=dtype)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA parameters (A and B of every adapter), for the optimizer."""
    return [p for m in _lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Detached copies of the LoRA weights under PEFT's keys: base_model.model.<path>.lora_{A,B}.weight."""
    out = {}
    for name, m in _lora_modules(model).items():
        out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().clone()
        out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().clone()
    return out


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block the model is the base model (the GRPO reference policy, without a second copy)."""
    modules = list(_require_lora(model).values())
    if any(m.merged for m in modules):
        # NOTE: the merged weight no longer contains the base weight exactly; refuse rather than approximate.
        raise RuntimeError("cannot disable merged adapters; call unmerge_lora first")
    previous = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield
    finally:
        for m, flag in zip(modules, previous):
            m.disabled = flag


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold B @ A * scaling into every base weight (in its own dtype). Merging twice raises RuntimeError."""
    modules = list(_require_lora(model).values())
    if any(m.merged for m in modules):
        raise RuntimeError("LoRA weights are already merged")
    if any(m.disabled for m in modules):
        raise RuntimeError("cannot merge inside adapters_disabled()")
    for m in modules:
        w = m.base_layer.weight
        w.copy_((w.float() + m.delta_weight()).to(w.dtype))  # sum in fp32, round once
        m.merged = True


@torch.no_grad()
def unmerge_lora(model: nn.Module) -> None:
    """Subtract B @ A * scaling from every base weight. Unmerging an unmerged model raises RuntimeError."""
    modules = list(_require_lora(model).values())
    if not all(m.merged for m in modules):
        raise RuntimeError("LoRA weights are not merged")
    for m in modules:
        w = m.base_layer.weight
        w.copy_((w.float() - m.delta_weight()).to(w.dtype))
        m.merged = False


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge (if not yet merged) and put the plain base nn.Linear back; state_dict keys become standard."""
    modules = _require_lora(model)
    if not any(m.merged for m in modules.values()):
        merge_lora(model)
    for name, m in modules.items():
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, m.base_layer)
    return model


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write to a temp file in the same directory, then os.replace: readers never see a partial file."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)  # atomic on POSIX within one filesystem
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _hyperparameters(model: nn.Module) -> dict:
    """The injected adapters' settings under PEFT's LoraConfig field names."""
    modules = _require_lora(model)
    path, _ = find_decoder_blocks(model)
    hyper = {(m.r, m.alpha, getattr(m.dropout, "p", 0.0)) for m in modules.values()}
    if len(hyper) != 1:
        raise ValueError(f"adapters have different (r, alpha, dropout): {sorted(hyper)}")
    ((r, alpha, dropout),) = hyper
    rest = [name[len(path) + 1 :].split(".") for name in modules]  # [layer, ..., leaf]
    return {
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({parts[-1] for parts in rest}),
        "layers_to_transform": sorted({int(parts[0]) for parts in rest}),
        # layers_pattern keeps PEFT from matching same-named linears in the vision tower (`visual.blocks`).
        "layers_pattern": path.rpartition(".")[2],
    }


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, base_model_name_or_path: str) -> None:
    """Write adapter_model.safetensors and adapter_config.json in PEFT's format, each atomically."""
    directory = os.fspath(directory)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", **_hyperparameters(model)}
    config |= {"bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    config |= {"inference_mode": True, "base_model_name_or_path": base_model_name_or_path}
    tensors = {k: v.contiguous() for k, v in lora_state_dict(model).items()}
    os.makedirs(directory, exist_ok=True)
    _atomic_write(os.path.join(directory, ADAPTER_WEIGHTS), lambda p: save_file(tensors, p, {"format": "pt"}))
    text = json.dumps(config, indent=2)
    _atomic_write(os.path.join(directory, ADAPTER_CONFIG), lambda p: Path(p).write_text(text))


def _check_loadable(config: dict) -> None:
    """Reject PEFT options this module does not implement, rather than load them wrongly."""
    bad = {
        k: config.get(k)
        for k in ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
    }
    bad = {k: v for k, v in bad.items() if v}  # rslora would change scaling to alpha / sqrt(r)
    if config.get("peft_type") != "LORA" or config.get("bias", "none") != "none":
        bad |= {"peft_type": config.get("peft_type"), "bias": config.get("bias")}
    if not isinstance(config.get("target_modules"), list):  # PEFT also allows one regex string
        bad["target_modules"] = config.get("target_modules")
    if bad:
        raise ValueError(f"adapter_config.json uses options lora.py does not implement: {bad}")


def _check_tensors(shapes: dict[str, tuple[int, ...]], tensors: dict[str, Tensor]) -> None:
    if missing := sorted(shapes.keys() - tensors.keys()):
        raise ValueError(f"adapter is missing {len(missing)} key(s), e.g. {missing[0]!r}")
    if unexpected := sorted(tensors.keys() - shapes.keys()):
        raise ValueError(f"adapter has {len(unexpected)} unexpected key(s), e.g. {unexpected[0]!r}")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(
                f"shape mismatch for {key!r}: adapter {tuple(tensors[key].shape)}, model {shape}"
            )


def load_adapter(
    model: nn.Module, directory: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32
) -> list[str]:
    """Load a PEFT LoRA adapter strictly, injecting it first if the model has none; return the wrapped names.

    Every check (config, keys, shapes) runs before the model is changed, so a failed load leaves it intact.
    The saved tensors are copied into the LoRA weights' own dtype: `dtype` (as in `inject_lora`) when this
    call injects, the existing adapters' dtype otherwise.
    """
    with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    _check_loadable(config)
    r, alpha, targets = int(config["r"]), float(config["lora_alpha"]), tuple(config["target_modules"])
    layers = config.get("layers_to_transform")
    if layers is None:  # PEFT's "every layer"
        layers = list(range(len(find_decoder_blocks(model)[1])))
    layers = sorted([layers] if isinstance(layers, int) else layers)
    tensors = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    if modules := _lora_modules(model):
        keys = ("r", "lora_alpha", "target_modules", "layers_to_transform")
        have = {k: v for k, v in _hyperparameters(model).items() if k in keys}
        want = {"r": r, "lora_alpha": alpha, "target_modules": sorted(targets), "layers_to_transform": layers}
        if have != want:
            raise ValueError(f"model already has LoRA with a different config: model {have}, adapter {want}")
        if any(m.merged for m in modules.values()):
            raise RuntimeError("cannot load an adapter into merged weights; call unmerge_lora first")
        linears = {name: m.base_layer for name, m in modules.items()}
    else:
        plan = _plan(model, layers, targets, r)
        linears = {name: getattr(parent, leaf) for parent, leaf, name in plan}
    shapes = {}
    for name, lin in linears.items():
        shapes[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = (r, lin.in_features)
        shapes[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = (lin.out_features, r)
    _check_tensors(shapes, tensors)
    if not modules:
        dropout = float(config.get("lora_dropout", 0.0))
        _wrap(model, plan, r=r, alpha=alpha, dropout=dropout, dtype=dtype)
        modules = _lora_modules(model)
    with torch.no_grad():
        for name, m in modules.items():
            for part in ("lora_A", "lora_B"):
                w = getattr(m, part).weight
                w.copy_(tensors[f"{_PEFT_PREFIX}{name}.{part}.weight"].to(device=w.device, dtype=w.dtype))
    return list(modules)
