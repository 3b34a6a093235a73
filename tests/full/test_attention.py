"""The kernel each part of the model runs (grpo_vlm/attention.py): the language model the flag's, the vision
tower FlashAttention-2 where flash-attn can run, sdpa otherwise; the choice printed at start. flash-attn is
made present or absent with a stand-in `importlib.util.find_spec`; with it "present" the real switch would
import the package, so the model's `set_attn_implementation` is a recorder there."""

import importlib.util
import types

import pytest
import torch

import model_io
from full.helpers import train_args
from grpo_vlm import attention, model_files, trainer

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture
def flash_attn(monkeypatch):
    """flash_attn(True / False): the package present or absent, whatever this machine has."""

    def set_present(present: bool) -> None:
        def find_spec(name, *args, **kwargs):
            if name == "flash_attn":
                return types.SimpleNamespace(name=name) if present else None
            return REAL_FIND_SPEC(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return set_present


def tiny(language: str = "sdpa"):
    model, _, _ = model_files.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32, attn_implementation=language
    )
    return model


def recorded_switch(model, monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(model, "set_attn_implementation", calls.append)
    return calls


def test_with_flash_attn_on_cuda_in_bf16_the_vision_tower_runs_flash_attention_2_and_the_lm_its_flag(
    flash_attn, monkeypatch
):
    flash_attn(True)
    model = tiny()
    calls = recorded_switch(model, monkeypatch)
    line = attention.set_per_part(model, "sdpa", CUDA, torch.bfloat16)
    assert calls == [{"text_config": "sdpa", "vision_config": "flash_attention_2"}]
    assert line == "attention: language model sdpa, vision tower flash_attention_2 (flash-attn is installed)"
    assert attention.vision_kernel(CUDA, torch.float16)[0] == "flash_attention_2"


@pytest.mark.parametrize(
    ("present", "device", "dtype", "why"),
    [
        (False, CUDA, torch.bfloat16, "flash-attn is not installed"),
        (True, CPU, torch.bfloat16, "flash-attn runs on CUDA in bf16 or fp16 only"),
        (True, CUDA, torch.float32, "flash-attn runs on CUDA in bf16 or fp16 only"),
    ],
)
def test_without_a_usable_flash_attn_the_vision_tower_runs_sdpa(
    flash_attn, monkeypatch, present, device, dtype, why
):
    flash_attn(present)
    model = tiny()
    calls = recorded_switch(model, monkeypatch)
    line = attention.set_per_part(model, "eager", device, dtype)
    assert calls == [{"text_config": "eager", "vision_config": "sdpa"}]
    assert line == f"attention: language model eager, vision tower sdpa ({why})"


def test_the_switch_reaches_each_part_and_leaves_the_lm_as_loaded(flash_attn):
    flash_attn(False)
    model = tiny("eager")  # the real switch: transformers' per-sub-config attn_implementation
    attention.set_per_part(model, "eager", CPU, torch.float32)
    assert model.model.visual.config._attn_implementation == "sdpa"
    assert model.model.language_model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"  # the top level, which the sampler's plan reads


def test_a_text_only_model_keeps_its_one_kernel(random_causal_lm, monkeypatch):
    calls = recorded_switch(random_causal_lm, monkeypatch)
    assert attention.set_per_part(random_causal_lm, "sdpa", CUDA, torch.bfloat16) == "attention: sdpa"
    assert calls == []


def test_the_choice_is_printed_at_start(flash_attn, tmp_path, capsys):
    flash_attn(False)
    args = train_args(output_dir=str(tmp_path / "run"), device="cpu", train_size=4, eval_size=0, batch_size=2)
    run = trainer.build_run(args, CPU, torch.float32, 0, 1)
    expected = "attention: language model sdpa, vision tower sdpa (flash-attn is not installed)"
    assert expected in capsys.readouterr().out.splitlines()
    assert run.model.model.visual.config._attn_implementation == "sdpa"
