"""model_io.py as the full trainer uses it: adapters written whole (files.py) inside verified checkpoints
(checkpoints.py) and read back field by field (adapters.py), merged models saved, the other built-in
tasks' prompts.
"""

import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import test_model_io
import torch
from test_model_io import ASSET, ROOT
from transformers import Qwen2_5_VLForConditionalGeneration

import data
import grpo
import lora
import model_io
from grpo_vlm import adapters, checkpoints, files, tasks

tiny = test_model_io.tiny  # the embedded asset, loaded once, offline (the reference tests' fixture)


def image_prompt(tok, ip, sample: dict | None = None) -> dict[str, torch.Tensor]:
    sample = sample or tasks.make_task("shapes", 1, seed=0)[0]
    return data.prepare_prompts([sample], tok, ip, device="cpu").inputs


def greedy(model, tok, inputs: dict[str, torch.Tensor], n: int = 6) -> torch.Tensor:
    ids = grpo.sample_completions(
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

    adapters.unload_lora(model)
    files.save_model(model, tok, ip, tmp_path / "merged")
    reloaded, tok2, ip2 = model_io.load_model(str(tmp_path / "merged"), device="cpu", dtype=torch.float32)
    assert type(reloaded) is Qwen2_5_VLForConditionalGeneration and ip2 is not None
    assert not any("lora" in k or "base_layer" in k for k in reloaded.state_dict())
    assert torch.equal(greedy(reloaded, tok2, inputs, n=8), tokens)
    torch.testing.assert_close(full_logits(reloaded, inputs, tokens), logits, atol=1e-5, rtol=0)


# What `--resume` reads: the checkpoint's trainer state, then its adapter into the model.
RESUME = """
import sys, torch, model_io
from grpo_vlm import adapters, checkpoints
from pathlib import Path
model = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)[0]
for run in sys.argv[1:]:
    try:
        adapters.load_adapter(model, checkpoints.checkpoint_to_resume(run, Path(run))[0])
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
