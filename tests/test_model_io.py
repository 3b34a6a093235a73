"""model_io.py: the embedded tiny VLM loads offline like a real checkpoint, a LoRA-merged export reloads
identically, damaged adapter files are refused; plus the project-wide import-direction guard."""

import math
import re
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import make_random_causal_lm
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2ForCausalLM

import lora
import model_io

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "assets" / "tiny-qwen2.5-vl"
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")


def _no_network(*args, **kwargs):
    raise AssertionError("the embedded asset must load without any network access")


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer, image_processor) of the asset, loaded once, offline, with sockets disabled."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import, so patch it too
        mp.setattr(socket.socket, "connect", _no_network)
        return model_io.load_model(str(ASSET), device="cpu", dtype=torch.float32)


# --- the embedded asset -------------------------------------------------------------------------------------


def test_tiny_asset_loads_offline_as_a_frozen_qwen2_5_vl(tiny):
    model, tok, ip = tiny
    assert type(model) is Qwen2_5_VLForConditionalGeneration
    assert ip is not None and ip.merge_size == 2
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 8 * 2**20
    assert 300_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    assert (
        tok.padding_side == "left" and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    )


def test_tokenizer_has_chat_and_vision_tokens_and_round_trips_the_verdict_words(tiny):
    _, tok, _ = tiny
    for token in SPECIAL_TOKENS:
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(token), token
        assert tok.decode(ids) == token
    assert tok.eos_token == "<|im_end|>"
    for text in ("通过", "不通过", "理由", "不通过\n理由: 图片2有缺陷"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text


# --- the learning-rate schedule -----------------------------------------------------------------------------


def test_cosine_with_warmup_climbs_linearly_then_decays_to_zero_and_stays_there():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=2, total_steps=6)
    lrs = []
    for _ in range(8):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    # warm-up 1/2, 2/2; then cos over 4 steps: progress 0, 1/4, 2/4, 3/4, 1, then held at 1 (lr 0)
    expected = [0.5, 1.0, 1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2, 0.0, 0.0]
    assert lrs == pytest.approx(expected, abs=1e-12)


# --- a run's checkpoint: written whole, read back or refused by name -------------------------------------


def small_training_state():
    model = make_random_causal_lm()
    lora.inject_lora(model, r=2, alpha=4.0, last_k=1)
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-3)
    scheduler = model_io.cosine_with_warmup(optimizer, warmup_steps=1, total_steps=4)
    return model, optimizer, scheduler


def test_a_checkpoint_restores_lora_adamw_the_schedule_and_the_rng_state(tmp_path):
    model, optimizer, scheduler = small_training_state()
    for p in lora.lora_parameters(model):
        p.grad = torch.ones_like(p)
    optimizer.step()
    scheduler.step()
    path = tmp_path / "checkpoint.pt"
    model_io.save_checkpoint(path, model, optimizer, scheduler, step=3, settings={"a": 1})
    drawn = torch.rand(3)  # what the run draws next
    fresh, fresh_optimizer, fresh_scheduler = small_training_state()
    state = model_io.load_checkpoint(path)
    assert model_io.restore_checkpoint(state, fresh, fresh_optimizer, fresh_scheduler) == 3
    assert state["settings"] == {"a": 1} and not (tmp_path / "checkpoint.tmp").exists()
    assert all(torch.equal(a, b) for a, b in zip(lora.lora_parameters(fresh), lora.lora_parameters(model)))
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1 and fresh_scheduler.last_epoch == 1
    assert torch.equal(torch.rand(3), drawn)


INTERRUPTED_WRITES = {  # what stops torch.save half-way -> what save_checkpoint raises
    "a full disk": (
        OSError(28, "No space left on device"),
        OSError,
        "cannot write {path}: No space left on device",
    ),
    "a Ctrl-C": (KeyboardInterrupt(), KeyboardInterrupt, ""),
}


@pytest.mark.parametrize("case", INTERRUPTED_WRITES)
def test_a_write_stopped_half_way_leaves_the_previous_checkpoint_whole_and_no_temporary_file(
    tmp_path, monkeypatch, case
):
    cause, raised, message = INTERRUPTED_WRITES[case]
    model, optimizer, scheduler = small_training_state()
    path = tmp_path / "checkpoint.pt"
    model_io.save_checkpoint(path, model, optimizer, scheduler, step=1, settings={})
    before = path.read_bytes()

    def stopped(state, target):  # half a file written, then the disk fills or the SIGINT arrives
        Path(target).write_bytes(b"half")
        raise cause

    monkeypatch.setattr(torch, "save", stopped)
    with pytest.raises(raised) as error:
        model_io.save_checkpoint(path, model, optimizer, scheduler, step=2, settings={})
    assert str(error.value) == message.format(path=path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("damage", ["missing", "cut", "not a checkpoint"])
def test_a_missing_cut_or_foreign_checkpoint_is_one_error_naming_the_file(tmp_path, damage):
    model, optimizer, scheduler = small_training_state()
    path = tmp_path / "checkpoint.pt"
    model_io.save_checkpoint(path, model, optimizer, scheduler, step=1, settings={})
    if damage == "missing":
        path.unlink()
    elif damage == "cut":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text("notes, not tensors\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} cannot be read as a checkpoint"):
        model_io.load_checkpoint(path)


# --- load_model errors and text-only models -----------------------------------------------------------------


def test_load_model_on_a_missing_path_raises_file_not_found_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        model_io.load_model(str(missing), device="cpu", dtype=torch.float32)


def test_load_model_on_a_folder_without_config_raises_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot load a model config from .*config\.json"):
        model_io.load_model(str(tmp_path), device="cpu", dtype=torch.float32)


def test_text_only_causal_lm_loads_through_auto_model_for_causal_lm_without_image_processor(tmp_path):
    original = make_random_causal_lm()
    original.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(ASSET)).save_pretrained(tmp_path)
    model, tok, ip = model_io.load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    assert type(model) is Qwen2ForCausalLM and ip is None
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert tok.pad_token_id is not None and tok.padding_side == "left"
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, original(input_ids=ids).logits, atol=0, rtol=0
        )
