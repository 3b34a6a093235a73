"""lora.py: equivalence with the unadapted model (a transformers VLM and a hand-written GPT), the disable
switch (the reference policy), the settings' checks; model_io.py's PEFT-format adapter files of it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_random_causal_lm, make_random_vlm
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import (
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

import lora
import model_io

INPUT_IDS = torch.tensor([[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25]])
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def randomize_b(model: nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def adapted_vlm(last_k: int = 2, seed: int = 0, **kwargs) -> nn.Module:
    model = make_random_vlm(seed=seed, **kwargs)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=last_k)
    randomize_b(model)
    return model


TINY_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
TOKEN_IDS = {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}


def make_random_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    cfg = Qwen2VLConfig(
        text_config=dict(TINY_TEXT, rope_parameters=rope),
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
        **TOKEN_IDS,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def make_random_qwen3_vl() -> Qwen3VLForConditionalGeneration:
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 1e4}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    cfg = Qwen3VLConfig(
        text_config=dict(TINY_TEXT, head_dim=16, rope_parameters=rope),
        vision_config=dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        **TOKEN_IDS,
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(cfg).eval()


# --- equivalence with the unadapted model ---


@pytest.mark.parametrize("make", [make_random_vlm, make_random_causal_lm])
def test_zero_b_gives_exactly_the_base_logits(make):
    model = make()
    base = logits(model)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=2)
    assert torch.equal(logits(model), base)
    randomize_b(model)
    assert not torch.allclose(logits(model), base)  # the adapters are really in the forward path


def test_lora_linear_computes_base_plus_scaled_low_rank_update():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = lora.LoRALinear(base, r=2, alpha=3.0)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 6)
    a, b = layer.lora_A.weight, layer.lora_B.weight  # (r, d_in), (d_out, r)
    assert a.shape == (2, 6) and b.shape == (5, 2)
    expected = x @ base.weight.T + base.bias + (x @ a.T @ b.T) * (3.0 / 2)
    torch.testing.assert_close(layer(x), expected)


def test_lora_parameters_are_fp32_on_a_bf16_layer_whose_output_stays_bf16():
    layer = lora.LoRALinear(nn.Linear(8, 4, dtype=torch.bfloat16), r=2, alpha=2.0)
    assert layer.lora_A.weight.dtype == layer.lora_B.weight.dtype == torch.float32
    assert layer(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(r=0, alpha=16.0), "r: must be >= 1, got 0"),
        (dict(r=8, alpha=float("nan")), "alpha: must be a number > 0, got nan"),
        (dict(r=8, alpha=float("inf")), "alpha: must be a number > 0, got inf"),
        (dict(r=8, alpha=16.0, dropout=1.0), "dropout: must be in [0, 1), got 1.0"),
    ],
)
def test_lora_settings_out_of_range_are_refused_naming_the_argument(settings, message):
    with pytest.raises(ValueError) as error:
        lora.LoRALinear(nn.Linear(4, 4), **settings)
    assert str(error.value) == message


def test_injecting_into_an_eval_model_keeps_lora_dropout_off_until_train():
    model = make_random_vlm()  # eval mode
    lora.inject_lora(model, r=4, alpha=8.0, dropout=0.5, last_k=2)
    randomize_b(model)
    assert torch.equal(logits(model), logits(model))
    model.train()
    assert not torch.equal(logits(model), logits(model))


# --- what gets wrapped ---


def test_only_targets_of_last_k_language_blocks_are_wrapped_and_trainable():
    model = make_random_vlm()
    names = lora.inject_lora(model, r=4, alpha=8.0, last_k=2)
    wrapped = {n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    assert set(names) == wrapped and len(names) == 2 * len(TARGETS)
    assert {n.split(".")[3] for n in names} == {"4", "5"}
    assert all(n.startswith("model.language_model.layers.") for n in names)
    assert {n.rsplit(".", 1)[1] for n in names} == TARGETS
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{ab}.weight" for n in names for ab in ("lora_A", "lora_B")}
    assert not any("visual" in n for n in trainable | wrapped)
    assert {id(p) for p in lora.lora_parameters(model)} == {
        id(p) for n, p in model.named_parameters() if n in trainable
    }


def test_gradient_reaches_only_lora_parameters():
    model = adapted_vlm()
    model(input_ids=INPUT_IDS).logits.square().mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
    assert all(p.grad.abs().sum() > 0 for p in lora.lora_parameters(model))


@pytest.mark.parametrize("last_k", [0, 7, -1])
def test_last_k_out_of_range_raises_and_leaves_model_untouched(last_k):
    model = make_random_vlm()
    with pytest.raises(ValueError, match=r"last_k: must be in \[1, 6\].*6 blocks"):
        lora.inject_lora(model, r=4, alpha=8.0, last_k=last_k)
    assert all(p.requires_grad for p in model.parameters())


def test_no_matching_target_or_second_injection_raises():
    model = make_random_vlm()
    with pytest.raises(ValueError, match="no nn.Linear named"):
        lora.inject_lora(model, r=4, alpha=8.0, last_k=1, targets=("qkv",))
    assert all(p.requires_grad for p in model.parameters())
    lora.inject_lora(model, r=4, alpha=8.0, last_k=1)
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.inject_lora(model, r=4, alpha=8.0, last_k=1)


@pytest.mark.parametrize("make", [make_random_qwen2_vl, make_random_qwen3_vl])
def test_decoder_blocks_of_qwen2_vl_and_qwen3_vl_are_the_language_model_layers(make):
    model = make()
    path, blocks = lora.find_decoder_blocks(model)
    assert path == "model.language_model.layers"
    assert blocks is model.model.language_model.layers
    base = logits(model)
    names = lora.inject_lora(model, r=2, alpha=4.0, last_k=1)
    assert all(n.startswith("model.language_model.layers.2.") for n in names)
    assert torch.equal(logits(model), base)


def test_decoder_blocks_of_causal_lm_and_vlm():
    assert lora.find_decoder_blocks(make_random_causal_lm())[0] == "model.layers"
    path, blocks = lora.find_decoder_blocks(make_random_vlm())
    assert path == "model.language_model.layers" and len(blocks) == 6


def test_unrecognised_model_raises_naming_class_and_paths():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"Sequential.*model\.language_model\.layers.*model\.layers"):
        lora.find_decoder_blocks(model)


# --- any model: blocks passed by hand ---


class ToyAttention(nn.Module):
    """nanoGPT's CausalSelfAttention with one head: c_attn makes q, k, v; c_proj projects back."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)  # each (batch, T, d)
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class ToyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), ToyAttention(d), nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))


class ToyGPT(nn.Module):
    """nanoGPT's layout (`transformer.wte`, `.h`, `.ln_f`, `lm_head`); not a transformers model."""

    def __init__(self, vocab: int = 32, d: int = 16, n_layer: int = 4) -> None:
        super().__init__()
        blocks = nn.ModuleList(ToyBlock(d) for _ in range(n_layer))
        self.transformer = nn.ModuleDict(
            {"wte": nn.Embedding(vocab, d), "h": blocks, "ln_f": nn.LayerNorm(d)}
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)  # (batch, T, d)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (batch, T, vocab)


@torch.no_grad()
def test_blocks_passed_by_hand_adapt_a_gpt_that_transformers_did_not_build():
    torch.manual_seed(0)
    gpt = ToyGPT().eval()
    idx = torch.randint(0, 32, (2, 8))
    base = gpt(idx)
    with pytest.raises(ValueError, match="cannot find the language decoder blocks of ToyGPT"):
        lora.inject_lora(gpt, r=8, alpha=16.0, last_k=4)  # no transformers layout to find
    targets = ("c_attn", "c_proj", "c_fc")
    names = lora.inject_lora(gpt, r=2, alpha=4.0, blocks=gpt.transformer.h[-2:], targets=targets)
    leaves = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert (
        names
        == list(lora.lora_modules(gpt))
        == [f"transformer.h.{i}.{leaf}" for i in (2, 3) for leaf in leaves]
    )
    trainable = {n for n, p in gpt.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    assert torch.equal(gpt(idx), base)  # B = 0
    randomize_b(gpt)
    adapted = gpt(idx)
    assert not torch.allclose(adapted, base)
    with lora.adapters_disabled(gpt):
        assert torch.equal(gpt(idx), base)
    assert torch.equal(gpt(idx), adapted)


def test_a_block_that_is_not_part_of_the_model_is_refused_before_any_change():
    gpt = ToyGPT()
    with pytest.raises(ValueError, match=r"blocks \['ToyBlock'\] are not submodules of ToyGPT"):
        lora.inject_lora(gpt, r=8, alpha=16.0, blocks=[ToyBlock(16)], targets=("c_fc",))
    assert all(p.requires_grad for p in gpt.parameters())


def test_injection_takes_exactly_one_of_last_k_and_blocks_before_any_change():
    gpt = ToyGPT()
    for where in ({}, {"last_k": 2, "blocks": gpt.transformer.h[-2:]}):
        with pytest.raises(ValueError, match="give exactly one of last_k .* and blocks"):
            lora.inject_lora(gpt, r=2, alpha=4.0, **where)
    assert all(p.requires_grad for p in gpt.parameters()) and not lora.lora_modules(gpt)


# --- the disable switch (reference policy) ---


def test_disabled_adapters_give_base_logits_and_restore_after():
    model = make_random_vlm()
    base = logits(model)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=3)
    randomize_b(model)
    adapted = logits(model)
    with lora.adapters_disabled(model):
        assert torch.equal(logits(model), base)
    assert torch.equal(logits(model), adapted)


def test_disabled_adapters_are_restored_after_an_exception():
    model = adapted_vlm()
    adapted = logits(model)
    with pytest.raises(KeyError), lora.adapters_disabled(model):
        raise KeyError("boom")
    assert torch.equal(logits(model), adapted)


def test_disable_without_adapters_raises():
    with pytest.raises(ValueError, match="no LoRA adapters"), lora.adapters_disabled(make_random_vlm()):
        pass


# --- adapter files in PEFT's format (model_io.py) ---


def test_saved_adapter_holds_exactly_the_lora_weights_and_gives_the_adapted_logits(tmp_path):
    model = adapted_vlm()
    model_io.save_adapter(model, tmp_path, base_model_name_or_path="tiny/random-vlm")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    saved = {k.removeprefix(model_io.PEFT_PREFIX): v for k, v in tensors.items()}
    weights = lora.lora_state_dict(model)
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
    fresh = make_random_vlm()  # the same base: the files and the config's placement rebuild the model
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    blocks = [lora.find_decoder_blocks(fresh)[1][i] for i in config["layers_to_transform"]]
    lora.inject_lora(fresh, r=config["r"], alpha=config["lora_alpha"], blocks=blocks)
    fresh.load_state_dict(saved, strict=False)
    assert torch.equal(logits(fresh), logits(model))


def test_adapter_keys_and_config_follow_peft(tmp_path):
    model_io.save_adapter(adapted_vlm(), tmp_path, base_model_name_or_path="tiny/random-vlm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.language_model.layers.5.self_attn.q_proj"
    assert tensors[f"{key}.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{key}.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * 2 * len(TARGETS)
    assert not any("base_layer" in k or "visual" in k for k in tensors)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    expected = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "layers_to_transform": [4, 5],
        "layers_pattern": "layers",
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny/random-vlm",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    assert {k: config[k] for k in expected} == expected


def test_peft_loads_our_adapter_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")  # not a project dependency; runs only where peft is installed
    model = make_random_vlm()
    lora.inject_lora(model, r=4, alpha=8.0, dropout=0.05, last_k=2)
    randomize_b(model)
    model_io.save_adapter(model, tmp_path / "ours", base_model_name_or_path="tiny")
    peft_model = peft.PeftModel.from_pretrained(make_random_vlm(), tmp_path / "ours").eval()
    wrapped = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "lora_" not in n}
    assert len(wrapped) == 2 * len(TARGETS) and not any("visual" in n for n in wrapped)
    torch.testing.assert_close(logits(peft_model), logits(model), atol=1e-6, rtol=0)


# --- module boundary ---


def test_lora_py_imports_alone_from_an_empty_folder(tmp_path):
    (tmp_path / "lora.py").write_text((Path(__file__).parents[1] / "lora.py").read_text())
    code = "import pathlib, lora; print(pathlib.Path(lora.__file__).resolve().parent)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    assert done.stdout.strip() == str(tmp_path.resolve())
