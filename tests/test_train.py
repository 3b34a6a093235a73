"""The reference trainer, train.py, end to end on the embedded tiny model: a step, a run, a resume.

`train_step` trains the LoRA parameters only (the base, the vision tower and the merger stay bit-identical),
`main` writes metrics.jsonl, checkpoint.pt (tensors only) and a PEFT-format adapter, and a resumed run
continues exactly where an uninterrupted one would be.
"""

import json

import pytest
import torch

import data
import lora
import model_io
import rewards
import train

TINY = dict(batch_size=2, group_size=2, max_new_tokens=8, train_size=8, eval_size=4, eval_every=1)


def test_a_step_changes_the_lora_weights_only_and_reports_its_metrics():
    torch.manual_seed(0)
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2)
    args = train.Args(**TINY)
    samples = data.inspection_samples(2, seed=0)
    reward_fns = [rewards.Reward(r, rewards.load_reward(r)) for r in args.reward]
    metrics, completion_ids = train.train_step(
        model, tokenizer, image_processor, samples, reward_fns, optimizer, args
    )
    assert completion_ids.shape == (4, completion_ids.shape[1]) and completion_ids.shape[1] <= 8
    for key in ("loss", "grad_norm", "kl", "reward/mean", "reward/label/mean", "entropy", "frac_truncated"):
        assert key in metrics and metrics[key] == metrics[key], key  # present and not NaN
    after = dict(model.named_parameters())
    for name, value in base.items():  # LoRALinear keeps each base weight under base_layer
        module, _, leaf = name.rpartition(".")
        key = name if name in after else f"{module}.base_layer.{leaf}"
        assert torch.equal(after[key], value), name
    assert any(not torch.equal(after[n], v) for n, v in adapters.items())  # B moved off 0 (A too, via B)


def test_main_writes_metrics_a_tensor_only_checkpoint_and_an_adapter_that_reloads(tmp_path):
    out = tmp_path / "run"
    last = train.main(train.Args(**TINY, steps=2, output_dir=str(out)))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[-1] == last
    assert all(0 <= line["eval/accuracy"] <= 1 for line in lines)
    state = torch.load(out / "checkpoint.pt", weights_only=True)  # no pickled code: tensors and numbers
    assert state["step"] == 2 and set(state) == {"step", "lora", "optimizer", "scheduler", "rng"}
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32)
    model_io.load_adapter(model, out / "adapter")
    loaded = lora.lora_state_dict(model)
    assert loaded.keys() == state["lora"].keys()
    assert all(torch.equal(loaded[k], state["lora"][k]) for k in loaded)


def test_a_run_stopped_after_a_checkpoint_and_resumed_writes_the_uninterrupted_runs_bytes(
    tmp_path, monkeypatch
):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(train.Args(**TINY, steps=4, output_dir=str(whole)))
    real, calls = train.train_step, []

    def stops_at_step_3(*args, **kwargs):  # as a crash would: after step 2's checkpoint, before step 3's line
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", stops_at_step_3)
    try:
        train.main(train.Args(**TINY, steps=4, output_dir=str(parts)))
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(train, "train_step", real)
    assert len((parts / "metrics.jsonl").read_text().splitlines()) == 3  # steps 0, 1, 2
    train.main(train.Args(**TINY, steps=4, output_dir=str(parts), resume=True))
    assert (parts / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(reward_weight=(1.0,)), r"zip\(\) argument 2 is shorter than argument 1"),
        (dict(gate=("iou",)), r"--gate: \['iou'\] are not among the rewards"),
    ],
)
def test_main_refuses_a_weight_per_reward_mismatch_and_a_gate_that_is_no_reward(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        train.main(train.Args(**TINY, steps=1, output_dir=str(tmp_path), **flags))
