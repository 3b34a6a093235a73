"""grpo_vlm/adapters.py: adapters read back from PEFT's files (ours, and PEFT's own), refused before any
change when they do not fit the model; adapters folded into the base weights to export a plain model; A and
B in the base dtype (--no-lora-fp32)."""

import re

import pytest
import torch
from conftest import make_random_vlm
from safetensors.torch import load_file, save_file
from torch import nn

import lora
import model_io
from grpo_vlm import adapters, lora_config

INPUT_IDS = torch.tensor([[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]])
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def adapted_vlm(last_k: int = 2, **kwargs) -> nn.Module:
    model = make_random_vlm(**kwargs)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=last_k)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_adapter_round_trips_exactly_into_a_fresh_model(tmp_path):
    model = adapted_vlm()
    adapters.save_adapter(model, tmp_path, base_model_name_or_path="tiny/random-vlm")
    fresh = make_random_vlm()
    names = adapters.load_adapter(fresh, tmp_path)
    assert sorted(names) == sorted(n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear))
    saved, loaded = lora.lora_state_dict(model), lora.lora_state_dict(fresh)
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(logits(fresh), logits(model))
    assert not any(p.requires_grad for n, p in fresh.named_parameters() if "lora_" not in n)
    adapters.load_adapter(fresh, tmp_path)  # into a model that already has the same LoRA config
    assert torch.equal(logits(fresh), logits(model))


def test_saved_files_are_the_references_bytes(tmp_path):
    model = adapted_vlm()
    adapters.save_adapter(model, tmp_path / "package", base_model_name_or_path="tiny")
    model_io.save_adapter(model, tmp_path / "reference", base_model_name_or_path="tiny")
    for name in (model_io.ADAPTER_WEIGHTS, model_io.ADAPTER_CONFIG):
        assert (tmp_path / "package" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


def test_adapter_from_other_hidden_size_fails_naming_key_and_shapes(tmp_path):
    adapters.save_adapter(adapted_vlm(), tmp_path, base_model_name_or_path="tiny")
    config = make_random_vlm().config
    config.text_config.hidden_size = 32
    other = type(make_random_vlm())(config).eval()
    pattern = (
        r"shape mismatch for 'base_model\.model\.model\.language_model\.layers\.4\..*\(4, 64\).*\(4, 32\)"
    )
    with pytest.raises(ValueError, match=pattern):
        adapters.load_adapter(other, tmp_path)
    assert not any(isinstance(m, lora.LoRALinear) for m in other.modules())  # failed load changes nothing


def test_adapter_from_other_layers_fails(tmp_path):
    adapters.save_adapter(adapted_vlm(last_k=2), tmp_path, base_model_name_or_path="tiny")
    with pytest.raises(ValueError, match=r"layers \[4, 5\] out of range.*4 blocks"):
        adapters.load_adapter(make_random_vlm(num_layers=4), tmp_path)
    three = make_random_vlm()
    lora.inject_lora(three, r=4, alpha=8.0, last_k=3)
    with pytest.raises(ValueError, match=r"different config.*\[3, 4, 5\].*\[4, 5\]"):
        adapters.load_adapter(three, tmp_path)


def test_adapter_with_missing_or_unexpected_key_fails_naming_it(tmp_path):
    adapters.save_adapter(adapted_vlm(), tmp_path, base_model_name_or_path="tiny")
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    dropped = "base_model.model.model.language_model.layers.5.mlp.down_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != dropped}, path)
    with pytest.raises(ValueError, match=f"missing 1 key.*{dropped}"):
        adapters.load_adapter(make_random_vlm(), tmp_path)
    extra = "base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_A.weight"
    save_file(tensors | {extra: torch.zeros(4, 32)}, path)
    with pytest.raises(ValueError, match=f"unexpected key.*{extra}"):
        adapters.load_adapter(make_random_vlm(), tmp_path)


def test_we_load_peft_s_adapter_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")  # not a project dependency; runs only where peft is installed
    model = make_random_vlm()
    lora.inject_lora(model, r=4, alpha=8.0, dropout=0.05, last_k=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(std=0.1)
    model_io.save_adapter(model, tmp_path / "ours", base_model_name_or_path="tiny")
    peft_model = peft.PeftModel.from_pretrained(make_random_vlm(), tmp_path / "ours").eval()
    peft_model.save_pretrained(tmp_path / "peft")
    fresh = make_random_vlm()
    adapters.load_adapter(fresh, tmp_path / "peft")
    torch.testing.assert_close(logits(fresh), logits(model), atol=1e-6, rtol=0)


def test_unload_folds_the_adapters_into_plain_linears_with_the_adapted_logits(tmp_path):
    model = adapted_vlm()
    plain_keys = set(make_random_vlm().state_dict())
    adapted = logits(model)
    with lora.adapters_disabled(model):
        base = logits(model)
    assert adapters.unload_lora(model) is model
    assert set(model.state_dict()) == plain_keys
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())
    torch.testing.assert_close(logits(model), adapted, atol=1e-5, rtol=0)
    assert not torch.allclose(logits(model), base, atol=1e-3)  # the update is in the weights now
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    torch.testing.assert_close(logits(reloaded), adapted, atol=1e-5, rtol=0)


def test_lora_in_base_dtype_keeps_a_and_b_in_the_layers_dtype():
    layer = nn.Module()
    layer.q_proj = nn.Linear(8, 4, dtype=torch.bfloat16)
    lora.inject_lora(layer, r=2, alpha=2.0, blocks=[layer], targets=("q_proj",))
    lora_config.lora_in_base_dtype(layer)
    adapted = layer.q_proj
    assert adapted.lora_A.weight.dtype == adapted.lora_B.weight.dtype == torch.bfloat16
    assert adapted(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_nan_or_inf_weights_is_refused_naming_the_file_and_the_tensor(tmp_path, bad):
    model = make_random_vlm()
    lora.inject_lora(model, r=2, alpha=4.0, last_k=1)
    model_io.save_adapter(model, tmp_path, base_model_name_or_path="tiny")
    weights = tmp_path / model_io.ADAPTER_WEIGHTS
    tensors = load_file(weights)
    key = max(tensors)
    tensors[key][0, -1] = bad
    save_file(tensors, weights)
    fresh = make_random_vlm()
    with pytest.raises(ValueError, match=rf"^{re.escape(str(weights))}: .*lora_B.*(not finite|NaN or inf)"):
        adapters.load_adapter(fresh, tmp_path)
    assert not lora.lora_modules(fresh)  # refused before the model changed
