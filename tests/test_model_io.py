"""model_io.py: the embedded tiny VLM loads offline like a real checkpoint, a LoRA-merged export reloads
identically, damaged adapter files are refused; plus the project-wide import-direction guard."""

import ast
import copy
import functools
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import make_random_causal_lm
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2ForCausalLM

import data
import grpo
import lora
import model_io
from grpo_vlm import checkpoints, files, tasks

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


def image_prompt(tok, ip, sample: dict | None = None) -> dict[str, torch.Tensor]:
    sample = sample or tasks.make_task("shapes", 1, seed=0)[0]
    return data.prepare_prompts([sample], tok, ip, device="cpu").inputs


def greedy(model, tok, inputs: dict[str, torch.Tensor], n: int = 6) -> torch.Tensor:
    ids, _ = grpo.sample_completions(
        model,
        inputs,
        max_new_tokens=n,
        temperature=0.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return ids  # (N, T)


def full_logits(model, inputs: dict[str, torch.Tensor], completion: torch.Tensor) -> torch.Tensor:
    """Logits (N, P + T, V) of prompt + completion in one forward pass, no KV cache."""
    ones = torch.ones_like(completion)
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    if "mm_token_type_ids" in inputs:
        extra["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(completion)], 1)
    with torch.no_grad():
        return model(
            input_ids=torch.cat([inputs["input_ids"], completion], 1),
            attention_mask=torch.cat([inputs["attention_mask"], ones], 1),
            use_cache=False,
            **extra,
        ).logits


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


def test_tiny_model_greedy_generation_from_an_image_prompt_is_the_argmax_of_a_full_forward(tiny):
    model, tok, ip = tiny
    inputs = image_prompt(tok, ip)
    completion = greedy(model, tok, inputs, n=4)
    assert 1 <= completion.shape[1] <= 4
    P = inputs["input_ids"].shape[1]
    # Independent reference: one forward over prompt + completion without the KV cache; position j
    # predicts j+1.
    argmax = full_logits(model, inputs, completion)[:, P - 1 : -1].argmax(-1)  # (1, T)
    mask, _ = grpo.completion_mask(completion, tok.eos_token_id)
    assert torch.equal(argmax[mask], completion[mask])


def test_a_different_image_changes_the_completion_logprobs(tiny):
    model, tok, ip = tiny
    a, b = tasks.make_task("shapes", 2, seed=1)
    assert a["prompt"] == b["prompt"] and a["images"][0].tobytes() != b["images"][0].tobytes()
    batch = data.prepare_prompts([a, b, dict(a)], tok, ip, device="cpu")
    assert torch.equal(batch.inputs["input_ids"][0], batch.inputs["input_ids"][1])  # same text, same length
    completion = torch.tensor(
        [tok("red circle", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]] * 3
    )
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, batch.inputs, completion, temperature=1.0)
    assert (logp[0] - logp[1]).abs().max() > 1e-3  # the pixels reach the language model
    torch.testing.assert_close(logp[0], logp[2], atol=1e-5, rtol=0)  # and the same image gives the same logp


def test_lora_merged_model_saved_with_save_pretrained_reloads_and_generates_the_same_tokens(tiny, tmp_path):
    base, tok, ip = tiny
    model = copy.deepcopy(base)
    lora.inject_lora(model, r=4, alpha=8.0, last_k=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    inputs = image_prompt(tok, ip)
    tokens = greedy(model, tok, inputs, n=8)
    logits = full_logits(model, inputs, tokens)
    assert not torch.allclose(logits, full_logits(base, inputs, tokens), atol=1e-3)  # the adapter matters

    lora.unload_lora(model)
    files.save_model(model, tok, ip, tmp_path / "merged")
    reloaded, tok2, ip2 = model_io.load_model(str(tmp_path / "merged"), device="cpu", dtype=torch.float32)
    assert type(reloaded) is Qwen2_5_VLForConditionalGeneration and ip2 is not None
    assert not any("lora" in k or "base_layer" in k for k in reloaded.state_dict())
    assert torch.equal(greedy(reloaded, tok2, inputs, n=8), tokens)
    torch.testing.assert_close(full_logits(reloaded, inputs, tokens), logits, atol=1e-5, rtol=0)


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


# --- damaged or odd adapter files ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_nan_or_inf_weights_is_refused_naming_the_file_and_the_tensor(tmp_path, bad):
    model = make_random_causal_lm()
    lora.inject_lora(model, r=2, alpha=4.0, last_k=1)
    model_io.save_adapter(model, tmp_path, base_model_name_or_path="tiny")
    weights = tmp_path / model_io.ADAPTER_WEIGHTS
    tensors = load_file(weights)
    key = max(tensors)
    tensors[key][0, -1] = bad
    save_file(tensors, weights)
    fresh = make_random_causal_lm()
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{weights}: {key!r}')} holds NaN or inf values"):
        model_io.load_adapter(fresh, tmp_path)
    assert not lora.lora_modules(fresh)  # refused before the model changed


# What `--resume` reads: the checkpoint's trainer state, then its adapter into the model.
RESUME = """
import sys, torch, model_io
from grpo_vlm import checkpoints
from pathlib import Path
model = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)[0]
for run in sys.argv[1:]:
    try:
        model_io.load_adapter(model, checkpoints.checkpoint_to_resume(run, Path(run))[0])
    except ValueError as e:
        print(e)
"""


def test_a_fifo_or_folder_named_like_a_checkpoint_file_is_refused_instead_of_blocking_the_resume(
    tiny, tmp_path
):
    model = copy.deepcopy(tiny[0])
    lora.inject_lora(model, r=2, alpha=4.0, last_k=1)
    write = functools.partial(model_io.save_adapter, model, base_model_name_or_path=str(ASSET))
    names = (model_io.ADAPTER_WEIGHTS, model_io.ADAPTER_CONFIG)
    names += (checkpoints.STATE_FILE, checkpoints.OWNER_FILE)
    runs, expected = [], []
    for i, (name, make) in enumerate([*((name, os.mkfifo) for name in names), (names[0], Path.mkdir)]):
        for manifest in (True, False):  # verified against the manifest; an older checkpoint, without one
            if name == checkpoints.OWNER_FILE and not manifest:
                continue
            checkpoint = tmp_path / f"run-{i}-{manifest}" / "checkpoint-000001"
            checkpoints.save_checkpoint(checkpoint, write_adapter=write, state={"step": 1}, keep_last=None)
            if not manifest:
                (checkpoint / checkpoints.OWNER_FILE).write_text('{"run_id": null, "step": 1}')
            (checkpoint / name).unlink()
            make(checkpoint / name)
            runs.append(str(checkpoint.parent))
            reason = "is unreadable" if name == checkpoints.OWNER_FILE else "is not a regular file"
            damaged = f"no intact checkpoint in {checkpoint.parent}: checkpoint-000001 ({name} {reason})"
            refused = f"{checkpoint / name} is not a regular file; refusing to read it"
            if name == checkpoints.STATE_FILE and not manifest:  # read while looking for an intact checkpoint
                refused = f"no intact checkpoint in {checkpoint.parent}: checkpoint-000001 ({refused})"
            expected.append(damaged if manifest else refused)
    # In a child process: opening a FIFO blocks until a writer comes, so a regression times out, not hangs.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    child = subprocess.run(
        [sys.executable, "-c", RESUME, *runs],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == expected


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


# --- import direction (STYLE rule 1) ------------------------------------------------------------------------


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (anywhere in the file); relative imports as '.'."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_project_modules_import_in_one_direction():
    project = {p.stem for p in ROOT.glob("*.py")}
    expected = {"data", "grpo", "lora", "model_io", "checkpoints", "rewards", "speedups", "distributed"}
    expected |= {"tasks", "train"}
    assert expected <= project
    stdlib = set(sys.stdlib_module_names)
    # Third-party packages each leaf module may use besides the standard library (None: not restricted).
    allowed = {
        "lora": {"torch"},
        "grpo": {"torch"},
        "rewards": set(),
        "grounding": set(),
        "speedups": {"torch", "transformers"},  # its StaticCache: the sampler's pre-allocated KV cache
        "distributed": {"torch"},
        "tasks": {"PIL"},
        "trackers": {"torch"},  # SummaryWriter, imported inside open_tracker for --report-to tensorboard
        "data": None,
        "model_io": None,
        "checkpoints": {"torch", "numpy"},
    }
    # The project modules each may import: a speed-up re-arranges grpo.py (never the reverse); data.py imports
    # no project module (tasks.py draws the inspection task from it); model_io writes lora.py's adapters to
    # files; checkpoints writes through files.py's whole-file writes, reads through model_io's regular_file
    # and holds the run folder's lock (cli.hold_lock); train wires all.
    allowed_project = {"speedups": {"grpo", "lora"}, "model_io": {"lora"}, "tasks": {"data"}}
    allowed_project["checkpoints"] = {"model_io", "files", "cli"}
    allowed_project["dataset"] = {"data", "tasks"}
    allowed_project["tools"] = {"data", "dataset", "grounding", "rewards"}  # zoom's frames; rewards' plug-ins
    allowed_project["multiturn"] = {"data", "grounding", "grpo", "tools"}  # prompts, sampler, frames, calls
    for name in sorted(project - {"train"}):
        imports = imported_modules(ROOT / f"{name}.py")
        assert "." not in imports, f"{name}.py uses a relative import"
        own = imports & project
        assert own <= allowed_project.get(name, set()), f"{name}.py imports project modules {sorted(own)}"
        if allowed.get(name) is not None:
            extra = imports - stdlib - allowed[name] - own
            assert not extra, f"{name}.py imports {sorted(extra)} (allowed: stdlib + {sorted(allowed[name])})"
