"""The speed-ups change nothing: each is checked against the plain path it replaces (fp32, CPU, tight
tolerance).

Frozen-trunk reuse (speedups.capture_trunk + speedups.trunk_logprobs) against the full forward of
grpo.completion_logprobs, micro-batching (trainer.accumulate_policy_gradient) against one unchunked backward,
and gradient checkpointing against no checkpointing. Models: the random Qwen2.5-VL (6 blocks, with images) and
the random Qwen2 causal LM (4 blocks, left padding) from conftest.py, LoRA in the last K = 2 blocks with
B != 0.
"""

import subprocess
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import IMAGE_PAD_ID, VOCAB, make_random_causal_lm, make_random_vlm
from test_grpo import ALL_LOSS_TYPES, SUPPRESS, hand_completions, text_inputs, vlm_inputs
from transformers import StaticCache

import data
import grpo
import lora
from full.helpers import make_run, sample_with_logprobs, train_args
from grpo_vlm import speedups, trainer

K = 2  # adapted blocks
ROOT = Path(__file__).resolve().parents[2]


def lora_model(kind: str, dropout: float = 0.0) -> torch.nn.Module:
    """A random model with LoRA in its last K blocks and random (non-zero) B, so the adapters matter."""
    model = make_random_vlm() if kind == "vlm" else make_random_causal_lm()
    lora.inject_lora(model, r=4, alpha=8.0, dropout=dropout, last_k=K)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def inputs_for(kind: str, group_size: int = 3) -> dict[str, torch.Tensor]:
    """The B = 2 prompts (for the VLM: 2 + 1 images), each repeated group_size times (N = 6 rows by
    default)."""
    return vlm_inputs(group_size) if kind == "vlm" else text_inputs(group_size)


def logprobs_and_grads(model, logprobs_fn) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """logp, entropy and the LoRA gradients of a random linear function of logp (reaches every position)."""
    model.zero_grad(set_to_none=True)
    logp, entropy = logprobs_fn()
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2))
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), entropy, grads


def assert_same(a, b, atol=1e-5):
    logp_a, entropy_a, grads_a = a
    logp_b, entropy_b, grads_b = b
    torch.testing.assert_close(logp_a, logp_b, atol=atol, rtol=0)
    torch.testing.assert_close(entropy_a, entropy_b, atol=atol, rtol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 7 * 2 * K  # A and B of 7 linears per block
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=atol, rtol=0, msg=name)


# --- frozen-trunk reuse -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vlm", "text"])
def test_trunk_logprobs_and_lora_gradients_equal_the_full_forward(kind):
    model, inputs, ids = lora_model(kind), inputs_for(kind), hand_completions()
    parts = speedups.decoder_parts(model, K)
    plain = logprobs_and_grads(
        model, lambda: grpo.completion_logprobs(model, inputs, ids, temperature=0.7, return_entropy=True)
    )
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    assert not trunk.hidden_states.requires_grad  # nothing flows back into the trunk
    ours = logprobs_and_grads(
        model, lambda: speedups.trunk_logprobs(trunk, ids, temperature=0.7, return_entropy=True, **parts)
    )
    assert_same(ours, plain)
    assert all(grad.abs().sum() > 0 for grad in plain[2].values())  # every LoRA weight is exercised


@pytest.mark.parametrize("kind", ["vlm", "text"])
def test_reference_through_the_trunk_with_adapters_disabled_equals_the_plain_reference(kind):
    model, inputs, ids = lora_model(kind), inputs_for(kind), hand_completions()
    parts = speedups.decoder_parts(model, K)
    # Captured with the adapters ON: none sits in the trunk, so the reference can share it.
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    with torch.no_grad(), lora.adapters_disabled(model):
        ref_plain, _ = grpo.completion_logprobs(model, inputs, ids, temperature=1.0)
        ref_trunk, _ = speedups.trunk_logprobs(trunk, ids, temperature=1.0, **parts)
    with torch.no_grad():
        policy, _ = speedups.trunk_logprobs(trunk, ids, temperature=1.0, **parts)
    torch.testing.assert_close(ref_trunk, ref_plain, atol=1e-5, rtol=0)
    assert not torch.allclose(policy, ref_plain, atol=1e-3)  # the adapters were really off


def test_trunk_capture_stops_before_the_adapted_blocks_and_encodes_images_once():
    model, inputs, ids = lora_model("vlm"), inputs_for("vlm"), hand_completions()
    parts = speedups.decoder_parts(model, K)
    calls = {"visual": 0, "last_block": 0}
    model.model.visual.register_forward_hook(lambda *_: calls.__setitem__("visual", calls["visual"] + 1))
    parts["blocks"][-1].register_forward_hook(
        lambda *_: calls.__setitem__("last_block", calls["last_block"] + 1)
    )
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    assert calls == {"visual": 1, "last_block": 0}
    speedups.trunk_logprobs(trunk, ids, temperature=1.0, **parts)  # policy
    with torch.no_grad(), lora.adapters_disabled(model):
        speedups.trunk_logprobs(trunk, ids, temperature=1.0, **parts)  # reference
    assert calls == {"visual": 1, "last_block": 2}


def count_encoded_images(model) -> list[int]:
    """Images per vision-tower call (rows of its grid_thw), appended by a forward hook."""
    encoded = []
    model.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: encoded.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
    )
    return encoded


@pytest.mark.parametrize("micro_batch_size, expected", [(None, [3]), (4, [3, 1])])
def test_a_trunk_step_encodes_each_prompts_images_once_not_once_per_row(micro_batch_size, expected):
    model = lora_model("vlm")  # 2 prompts with 2 + 1 images, G = 3: the N = 6 rows hold 9 images
    args = train_args(lora_last_k=K, beta=0.1, num_iterations=2, micro_batch_size=micro_batch_size)
    ro = hand_rollout(model, args)  # captures the trunk (its own plain log-probs run before the hook)
    encoded = count_encoded_images(model)
    run = make_run(model, args)
    ro.chunks = speedups.row_chunks(run.model, ro.inputs, ro.completion_ids, None, run.speed)
    trainer.frozen_logprobs(run, ro, args)  # old policy (mu = 2) and reference (beta > 0)
    trainer.accumulate_policy_gradient(run, ro, args, 0.1)
    # B * images once per step; micro-batches of 4 + 2 rows encode prompt 1 (1 image) in both chunks.
    assert encoded == expected


def test_rows_with_different_images_are_each_encoded_and_match_the_full_forward():
    model, inputs, ids = lora_model("vlm"), inputs_for("vlm"), hand_completions()
    inputs["pixel_values"] = torch.randn(
        inputs["pixel_values"].shape, generator=torch.Generator().manual_seed(4)
    )
    parts = speedups.decoder_parts(model, K)
    encoded = count_encoded_images(model)
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    assert encoded == [9]  # no two rows share pixels, so nothing is reused
    with torch.no_grad():
        ours, _ = speedups.trunk_logprobs(trunk, ids, temperature=0.7, **parts)
        plain, _ = grpo.completion_logprobs(model, inputs, ids, temperature=0.7)
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=0)


def test_trunk_capture_refuses_a_trainable_trunk_and_a_bad_block_index():
    model = make_random_causal_lm()
    # LoRA in blocks 1-3: block 1 is in a K = 2 trunk.
    lora.inject_lora(model, r=2, alpha=2.0, last_k=3)
    inputs, ids = text_inputs(group_size=3), hand_completions()
    _, blocks = lora.find_decoder_blocks(model)
    with pytest.raises(ValueError, match="trainable"):
        speedups.capture_trunk(model, inputs, ids, blocks=blocks, first_adapted=2)
    with pytest.raises(ValueError, match="first_adapted"):
        speedups.capture_trunk(model, inputs, ids, blocks=blocks, first_adapted=len(blocks))


def test_sampling_each_prompt_g_times_equals_sampling_repeated_rows_with_each_image_encoded_once():
    model, G = make_random_vlm(), 3
    encodings = []
    model.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: encodings.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
    )
    kwargs = dict(
        max_new_tokens=8,
        temperature=0.7,
        top_p=0.9,
        eos_token_id=1,
        pad_token_id=0,
        suppress_token_ids=SUPPRESS,
    )
    torch.manual_seed(0)
    repeated, repeated_logp = sample_with_logprobs(model, vlm_inputs(group_size=G), **kwargs)
    torch.manual_seed(0)
    once, once_logp = sample_with_logprobs(model, vlm_inputs(group_size=1), num_return_sequences=G, **kwargs)
    assert torch.equal(once, repeated)
    torch.testing.assert_close(once_logp, repeated_logp, atol=1e-5, rtol=0)
    assert encodings == [3 * G, 3]  # 3 images (2 + 1) in the 2 prompts


# --- sampling with a shared prefill -------------------------------------------------------------------------

SAMPLING = dict(eos_token_id=1, pad_token_id=0, suppress_token_ids=SUPPRESS)  # P(EOS) ~ 1/5 per step


@pytest.mark.parametrize("kind", ["vlm", "text"])
def test_shared_prefill_uses_no_deprecated_keyword_of_the_installed_transformers(kind):
    """The KV cache is passed and read under the name this transformers expects (`cache` from 5.24, where
    `past_key_values` warns and is removed in 5.40): any deprecation warning fails here."""
    model = make_random_vlm() if kind == "vlm" else make_random_causal_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, _ = speedups.sample_shared_prefill(
            model, inputs_for(kind, 1), group_size=2, max_new_tokens=4, temperature=1.0, **SAMPLING
        )
    assert ids.shape[1] >= 1


@pytest.mark.parametrize(
    "kind, temperature, top_p",
    [("vlm", 0.7, 0.9), ("vlm", 1.0, 1.0), ("vlm", 0.0, 1.0), ("text", 0.7, 0.9), ("text", 0.0, 1.0)]
    + [("text", 1.0, 1e-6)],  # top_p so small that only the most likely token survives
)
def test_shared_prefill_draws_the_same_tokens_as_generate(kind, temperature, top_p):
    model, G = (make_random_vlm() if kind == "vlm" else make_random_causal_lm()), 4
    options = dict(max_new_tokens=10, temperature=temperature, top_p=top_p, **SAMPLING)
    if kind == "vlm":  # a text-only batch first: its positions must not leak into the image batch
        speedups.sample_shared_prefill(model, text_inputs(group_size=1), group_size=G, **options)
    for seed in range(3):
        torch.manual_seed(seed)
        ours, _ = speedups.sample_shared_prefill(model, inputs_for(kind, 1), group_size=G, **options)
        torch.manual_seed(seed)  # generate on the G-fold repeated rows (greedy refuses num_return_sequences)
        expanded = inputs_for(kind, G)
        reference = grpo.sample_completions(model, expanded, **options)
        assert torch.equal(ours, reference), seed
    # Sampled rows stop at different steps: the padding after EOS was exercised.
    if temperature > 0 and top_p > 0.5:
        lengths = grpo.completion_mask(ours, eos_token_id=1)[0].sum(1)
        assert len(set(lengths.tolist())) > 1


@pytest.mark.parametrize(
    "case, overrides",
    [
        (
            "whole vocabulary, nothing suppressed",
            dict(suppress_token_ids=[]),
        ),  # would expose an inherited top_k
        ("pad == eos", dict(pad_token_id=1)),
        ("one completion per prompt", dict(group_size=1)),
        ("one new token", dict(max_new_tokens=1)),
    ],
)
def test_shared_prefill_matches_generate_at_the_edges(case, overrides):
    model = make_random_vlm()
    options = dict(max_new_tokens=8, temperature=1.0, **SAMPLING) | overrides
    G = options.pop("group_size", 3)
    # an image batch first
    speedups.sample_shared_prefill(model, inputs_for("vlm", 1), group_size=2, **options)
    for kind in ("text", "vlm"):  # then a text batch: the image batch's positions must not leak into it
        inputs = inputs_for(kind, 1)
        torch.manual_seed(0)
        ours, _ = speedups.sample_shared_prefill(model, inputs, group_size=G, **options)
        torch.manual_seed(0)
        expanded = inputs_for(kind, G)
        reference = grpo.sample_completions(model, expanded, **options)
        assert torch.equal(ours, reference), (case, kind)


def test_shared_prefill_refuses_bad_options_and_an_image_model_it_cannot_number_positions_for():
    model = make_random_vlm()
    options = dict(max_new_tokens=4, temperature=1.0, **SAMPLING)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        speedups.sample_shared_prefill(
            model, inputs_for("vlm", 1), group_size=2, **(options | {"max_new_tokens": 0})
        )
    with pytest.raises(ValueError, match="eos_token_id"):
        speedups.sample_shared_prefill(
            model, inputs_for("vlm", 1), group_size=2, **(options | {"suppress_token_ids": [1]})
        )
    for out_of_range in (VOCAB, -3):  # generate would ignore them; a negative id would hit token V - 3
        with pytest.raises(ValueError, match="must lie in"):
            speedups.sample_shared_prefill(
                model,
                inputs_for("vlm", 1),
                group_size=2,
                **(options | {"suppress_token_ids": [out_of_range]}),
            )
    # A multimodal model that keeps no rope_deltas: new tokens would be misnumbered, so it must stop instead.
    real = model.model.compute_3d_position_ids

    def positions_without_deltas(*args, **kwargs):
        position_ids = real(*args, **kwargs)
        model.model.rope_deltas = None
        return position_ids

    model.model.compute_3d_position_ids = positions_without_deltas
    with pytest.raises(ValueError, match="rope_deltas"):
        speedups.sample_shared_prefill(model, inputs_for("vlm", 1), group_size=2, **options)


def test_shared_prefill_runs_each_prompt_once_then_one_token_per_row_and_step():
    model, G = make_random_vlm(), 3
    _, blocks = lora.find_decoder_blocks(model)
    fed, encoded = [], count_encoded_images(model)
    blocks[0].register_forward_pre_hook(lambda _m, args: fed.append(tuple(args[0].shape[:2])))
    torch.manual_seed(0)
    ids, _ = speedups.sample_shared_prefill(
        model, inputs_for("vlm", 1), group_size=G, max_new_tokens=6, temperature=1.0, **SAMPLING
    )
    B, P = inputs_for("vlm", 1)["input_ids"].shape
    T = ids.shape[1]
    assert ids.shape[0] == B * G and encoded == [3]  # 2 + 1 images, each through the tower once
    # generate would feed (B * G, P) first: the prompt G times.
    assert fed == [(B, P)] + [(B * G, 1)] * (T - 1)  # the last drawn token is never fed


@pytest.mark.parametrize("every", [1, 8])  # how often the CPU reads "has every row ended?", and a GPU
def test_rows_that_all_end_early_stop_where_generate_stops_with_its_tokens_and_rng_state(every, monkeypatch):
    monkeypatch.setitem(speedups.FINISHED_CHECK_EVERY, "cpu", every)
    model, G = lora_model("vlm"), 3
    _, blocks = lora.find_decoder_blocks(model)
    fed = []
    blocks[0].register_forward_pre_hook(lambda _m, args: fed.append(tuple(args[0].shape[:2])))
    only_eos = dict(SAMPLING, suppress_token_ids=[t for t in range(VOCAB) if t != 1])  # all rows end at once
    options = dict(max_new_tokens=3 * every, temperature=1.0, **only_eos)
    torch.manual_seed(0)
    ids, recording = speedups.sample_shared_prefill(
        model, inputs_for("vlm", 1), group_size=G, record_block=blocks[-K], **options
    )
    after_ours, fed_ours = torch.rand(4), list(fed)
    torch.manual_seed(0)
    reference = grpo.sample_completions(model, inputs_for("vlm", G), **options)
    assert torch.equal(ids, reference) and ids.shape == (2 * G, 1)
    assert torch.equal(after_ours, torch.rand(4))  # the draws past the end were undone
    B, P = inputs_for("vlm", 1)["input_ids"].shape
    # "Has every row ended?" is read every `every` steps: every - 1 tokens were fed past the end, then undone.
    assert fed_ours == [(B, P)] + [(B * G, 1)] * (every - 1)
    assert recording.shape[:2] == (B * G, P)  # the trunk of the prompt alone: the one token is never fed


def test_decode_steps_have_static_shapes_and_write_into_one_preallocated_cache():
    model, G, T = make_random_vlm(), 3, 10
    steps = []

    def look(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:  # a decode step, not the prefill
            cache = kwargs["cache"]
            shapes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            steps.append((cache, cache.layers[0].keys.data_ptr(), tuple(cache.layers[0].keys.shape), shapes))

    model.base_model.register_forward_pre_hook(look, with_kwargs=True)
    torch.manual_seed(0)
    speedups.sample_shared_prefill(
        model, inputs_for("vlm", 1), group_size=G, max_new_tokens=T, temperature=0.0, **SAMPLING
    )
    B, P = inputs_for("vlm", 1)["input_ids"].shape
    assert len(steps) >= 2  # decode steps
    assert all(isinstance(cache, StaticCache) for cache, *_ in steps)
    assert len({(id(cache), pointer, keys) for cache, pointer, keys, _ in steps}) == 1  # the same buffers
    assert steps[0][2][0] == B * G and steps[0][2][2] == P + T  # (N, heads, P + T, head_dim)
    assert len({tuple(sorted(shapes.items())) for *_, shapes in steps}) == 1  # a CUDA graph could replay it
    assert steps[0][3]["attention_mask"] == (B * G, P + T)


def graph_stand_in(counts: dict[str, int], outputs: int):
    """A `speedups.Capture` that keeps a CUDA graph's contract on the CPU: one real run (the warm-up), a
    capture that runs nothing and hands out output tensors not yet written, and replays that rerun the step
    on its static inputs and refill those same tensors in place. Unlike a graph it reruns Python (hooks too),
    so it checks that what the trunk recorder saw is one of the step's `outputs`: a replay runs no hook."""

    def capture(step):
        first = step()
        assert len(first) == outputs
        static = tuple(torch.full_like(x, float("nan")) for x in first)
        counts["captures"] += 1

        def replay():
            counts["replays"] += 1
            for buffer, x in zip(static, step(), strict=True):
                buffer.copy_(x)

        return first, static, replay

    return capture


@pytest.mark.parametrize("every", [1, 8])  # how often "has every row ended?" is read: the CPU's, a GPU's
@pytest.mark.parametrize(
    "kind, temperature, top_p", [("vlm", 1.0, 1.0), ("vlm", 0.7, 0.9), ("vlm", 0.0, 1.0), ("text", 0.7, 0.9)]
)
def test_a_replayed_decoding_step_draws_the_same_tokens_and_records_the_same_trunk(
    kind, temperature, top_p, every, monkeypatch
):
    monkeypatch.setitem(speedups.FINISHED_CHECK_EVERY, "cpu", every)
    model, G = lora_model(kind), 3
    block = speedups.record_block(model, speedups.decoder_parts(model, K))
    options = dict(group_size=G, max_new_tokens=10, temperature=temperature, top_p=top_p, record_block=block)
    steps = []  # decoding forwards (one new token per row), per sampling call
    model.base_model.register_forward_pre_hook(
        lambda m, a, kw: steps.append(kw["input_ids"].shape[1] == 1), with_kwargs=True
    )
    ended_early = False
    for seed in range(3):  # left-padded prompts (the VLM's with 2 + 1 images), P(EOS) ~ 1/5 per step
        torch.manual_seed(seed)
        eager = speedups.sample_shared_prefill(model, inputs_for(kind, 1), **options, **SAMPLING)
        rng_after, eager_steps, counts = torch.get_rng_state(), sum(steps), {"captures": 0, "replays": 0}
        steps.clear()
        torch.manual_seed(seed)
        replayed = speedups.sample_shared_prefill(
            model, inputs_for(kind, 1), **options, **SAMPLING, capture=graph_stand_in(counts, 2)
        )
        assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1]), seed
        assert torch.equal(torch.get_rng_state(), rng_after)  # the same draws, the same ones undone
        # The first step runs, is captured once, and every later one is a replay.
        assert sum(steps) == eager_steps and counts == {"captures": 1, "replays": eager_steps - 1}, seed
        steps.clear()
        ended_early |= bool((eager[0][:, :-1] == SAMPLING["eos_token_id"]).any())
    assert ended_early or temperature == 0  # a row ended while others went on: padding was fed


def test_the_decoding_step_reads_no_tensor_value_back_to_the_host():
    """On the meta device a tensor has no values: `.item()`, `bool(t)`, `.tolist()` raise there. So a step
    that runs on it neither waits for the device nor branches on data, as a CUDA graph capture needs (with a
    DynamicCache transformers' mask creation would raise here: it reads the padding mask)."""
    for model in (make_random_vlm().to("meta"), make_random_causal_lm().to("meta")):
        config = model.config.get_text_config()
        N, P, T, heads = 6, 5, 4, config.num_key_value_heads
        kv = torch.zeros(N, heads, P, config.hidden_size // config.num_attention_heads, device="meta")
        cache = StaticCache(config=model.config, max_cache_len=P + T)
        for layer in cache.layers:
            layer.update(kv, kv)
        mask = torch.ones(N, P + T, dtype=torch.long, device="meta")
        position = torch.zeros(N, 1, dtype=torch.long, device="meta")
        written = torch.full((1,), P, dtype=torch.long, device="meta")
        head = model.get_output_embeddings().weight
        decoder = speedups._Decoder(cache, mask, position, written, head=head)
        step = speedups._decode_step(model, decoder, [], None)
        with torch.no_grad():
            (logits,) = step(torch.zeros(N, 1, dtype=torch.long, device="meta"))
        assert logits.shape == (N, VOCAB) and logits.device.type == "meta"


def test_cuda_graph_is_ignored_with_a_note_where_it_cannot_act(capsys):
    model = lora_model("text")
    plan = speedups.choose(model, speedups.SpeedConfig(cuda_graph=True), last_k=K)
    assert plan.capture is None  # the CPU: decoding runs eagerly, as without the flag
    assert capsys.readouterr().out == (
        "note: --cuda-graph ignored: it captures --shared-prefill's decoding, on CUDA, with sdpa or eager"
        " attention and no sliding window (here cpu, sdpa)\n"
    )
    assert speedups.choose(model, speedups.SpeedConfig(), last_k=K).capture is None
    assert capsys.readouterr().out == ""


def test_sampling_casts_each_lora_weight_once_and_draws_the_same_tokens_as_casting_per_token(monkeypatch):
    model = make_random_causal_lm().to(torch.bfloat16)  # bf16 base, fp32 adapters: a cast on every forward
    lora.inject_lora(model, r=4, alpha=8.0, last_k=K)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    adapter = next(iter(lora.lora_modules(model).values()))
    trained = (adapter.lora_A.weight, adapter.lora_B.weight)
    seen = []  # the A each forward reads, as a storage address and a dtype
    adapter.register_forward_pre_hook(
        lambda m, args: seen.append((m.lora_A.weight.data_ptr(), m.lora_A.weight.dtype))
    )
    options = dict(group_size=3, max_new_tokens=8, temperature=1.0, **SAMPLING)
    _, blocks = lora.find_decoder_blocks(model)
    torch.manual_seed(0)
    once = speedups.sample_shared_prefill(model, text_inputs(1), record_block=blocks[-K], **options)
    assert len(seen) > 2 and all(cast == seen[0] for cast in seen)  # one cast for every forward
    assert seen[0][1] == torch.bfloat16  # the forward's own `.to` finds it cast already
    assert (adapter.lora_A.weight, adapter.lora_B.weight) == trained  # the trained fp32 weights are back
    assert trained[0].dtype == torch.float32 and lora.lora_parameters(model)[0] is trained[0]
    with speedups.weights_cast_once(model):
        assert not torch.is_grad_enabled()  # the casts are constants: nothing inside may train A or B
    monkeypatch.setattr(speedups, "weights_cast_once", lambda model, kept=None: nullcontext())
    torch.manual_seed(0)
    per_token = speedups.sample_shared_prefill(model, text_inputs(1), record_block=blocks[-K], **options)
    assert torch.equal(once[0], per_token[0]) and torch.equal(once[1], per_token[1])  # a cast is a cast


@pytest.mark.parametrize("kind", ["vlm", "text"])
def test_trunk_recorded_while_sampling_gives_the_full_forward_logprobs_and_gradients(kind):
    model, G = lora_model(kind), 3
    parts = speedups.decoder_parts(model, K)
    torch.manual_seed(0)
    ids, recording = speedups.sample_shared_prefill(
        model,
        inputs_for(kind, 1),
        group_size=G,
        max_new_tokens=6,
        temperature=1.0,
        record_block=parts["blocks"][parts["first_adapted"]],
        **SAMPLING,
    )
    inputs = inputs_for(kind)  # the same prompts, expanded to the N = 2 * G rows
    captured = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    # A KV-cache step adds up attention in another order than a full forward: equal to rounding.
    torch.testing.assert_close(recording, captured.hidden_states, atol=1e-5, rtol=0)
    trunk = speedups.trunk_from_recording(
        model, inputs, ids, recording, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    full = logprobs_and_grads(
        model, lambda: grpo.completion_logprobs(model, inputs, ids, temperature=0.7, return_entropy=True)
    )
    recorded = logprobs_and_grads(
        model, lambda: speedups.trunk_logprobs(trunk, ids, temperature=0.7, return_entropy=True, **parts)
    )
    assert_same(recorded, full)


def test_a_recorded_trunk_refuses_completions_with_image_placeholders():
    # A full forward would fail on them (no pixels for those tokens); the recorded trunk has no pixels at all.
    model = lora_model("vlm")
    parts = speedups.decoder_parts(model, K)
    inputs, ids = inputs_for("vlm"), hand_completions()
    S = inputs["input_ids"].shape[1] + ids.shape[1] - 1
    recording = torch.zeros(ids.shape[0], S, model.config.get_text_config().hidden_size)
    ids[2, 1] = IMAGE_PAD_ID
    with pytest.raises(ValueError, match="placeholder"):
        speedups.trunk_from_recording(
            model, inputs, ids, recording, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
        )


def test_a_recorded_rollout_in_micro_batches_gives_the_full_forward_logprobs():
    model, G = lora_model("vlm"), 3
    args = train_args(lora_last_k=K, group_size=G, temperature=1.0, micro_batch_size=4)  # chunks: 4 + 2 rows
    torch.manual_seed(0)
    ids, recording = speedups.sample_shared_prefill(
        model,
        inputs_for("vlm", 1),
        group_size=G,
        max_new_tokens=6,
        temperature=1.0,
        record_block=speedups.record_block(model, speedups.decoder_parts(model, K)),
        **SAMPLING,
    )
    inputs = inputs_for("vlm")
    run = make_run(model, args)
    chunks = speedups.row_chunks(model, inputs, ids, recording, run.speed)
    assert [c.rows for c in chunks] == [slice(0, 4), slice(4, 6)]
    with torch.no_grad():
        ours = torch.cat(
            [
                speedups.chunk_logprobs(model, c, run.speed, temperature=args.sampling.temperature)[0]
                for c in chunks
            ]
        )
        full, _ = grpo.completion_logprobs(model, inputs, ids, temperature=1.0)
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=0)


# --- micro-batching -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 2, 4])
def test_split_rows_gives_each_chunk_exactly_its_own_images(chunk_size):
    model, inputs, ids = make_random_vlm(), inputs_for("vlm"), hand_completions()
    chunks = speedups.split_rows(inputs, chunk_size)
    assert [c[0] for c in chunks] == [slice(a, min(a + chunk_size, 6)) for a in range(0, 6, chunk_size)]
    with torch.no_grad():
        whole, _ = grpo.completion_logprobs(model, inputs, ids, temperature=1.0)
        pieces = [grpo.completion_logprobs(model, c, ids[rows], temperature=1.0)[0] for rows, c in chunks]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=0)


def hand_rollout(model, args: trainer.Args) -> trainer.Rollout:
    """A rollout of the random VLM with off-policy old_logp and a distinct ref_logp, so every term is live."""
    inputs, ids = inputs_for("vlm"), hand_completions()
    mask, truncated = grpo.completion_mask(ids, eos_token_id=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(model, inputs, ids, temperature=args.sampling.temperature)
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=gen)  # ratios far enough from 1 to clip
    ref_logp = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])
    chunks = speedups.row_chunks(model, inputs, ids, None, make_run(model, args).speed)
    return trainer.Rollout(
        prompts=data.PromptBatch(inputs_for("vlm", 1), images_per_row=[2, 1]),  # the B = 2 prompts
        completion_ids=ids,
        mask=mask,
        truncated=truncated,
        texts=[],
        samples=[],
        reward=torch.zeros(6),
        components={},
        adv=adv,
        chunks=chunks,
        old_logp=old_logp,
        ref_logp=ref_logp,
    )


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_micro_batched_gradients_equal_unchunked_for_every_loss_type(loss_type):
    model = lora_model("vlm")
    results = {}
    # (trunk_reuse, micro_batch_size); 4 gives uneven chunks (4 + 2) that cut between the prompts' rows.
    for trunk_reuse, micro_batch_size in ((False, None), (False, 4), (True, 4), (True, 1)):
        args = train_args(
            lora_last_k=K,
            loss_type=loss_type,
            beta=0.1,
            temperature=0.7,
            max_new_tokens=5,
            num_iterations=2,
            trunk_reuse=trunk_reuse,
            micro_batch_size=micro_batch_size,
        )
        model.zero_grad(set_to_none=True)
        loss, stats, entropy = trainer.accumulate_policy_gradient(
            make_run(model, args), hand_rollout(model, args), args, 0.1
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[trunk_reuse, micro_batch_size] = (loss, stats, entropy, grads)
    loss, stats, entropy, grads = results[False, None]  # the plain path: one full forward, no chunks
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0  # the clip is active somewhere
    for key, (loss2, stats2, entropy2, grads2) in results.items():
        assert loss2 == pytest.approx(loss, abs=1e-6), key
        assert stats2 == pytest.approx(stats, abs=1e-6), key
        torch.testing.assert_close(entropy2, entropy, atol=1e-5, rtol=0)
        for name in grads:
            torch.testing.assert_close(grads2[name], grads[name], atol=1e-6, rtol=1e-5, msg=f"{key} {name}")


# --- gradient checkpointing ---------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_identical_gradients_with_lora_dropout():
    model, inputs, ids = lora_model("vlm", dropout=0.1), inputs_for("vlm"), hand_completions()
    model.train()  # dropout on: the checkpoint must replay the same dropout masks
    parts = speedups.decoder_parts(model, K)
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )

    def run(checkpointed: bool):
        torch.manual_seed(0)
        return logprobs_and_grads(
            model,
            lambda: speedups.trunk_logprobs(
                trunk, ids, temperature=1.0, return_entropy=True, gradient_checkpointing=checkpointed, **parts
            ),
        )

    assert_same(run(True), run(False), atol=1e-6)
    # The plain path uses transformers' own (non-reentrant) checkpointing, as trainer.main sets it up.
    torch.manual_seed(0)
    plain = logprobs_and_grads(
        model, lambda: grpo.completion_logprobs(model, inputs, ids, temperature=1.0, return_entropy=True)
    )
    speedups.enable_plain_checkpointing(model)
    torch.manual_seed(0)
    checkpointed = logprobs_and_grads(
        model, lambda: grpo.completion_logprobs(model, inputs, ids, temperature=1.0, return_entropy=True)
    )
    assert_same(checkpointed, plain, atol=1e-6)


# --- benchmark ----------------------------------------------------------------------------------------------


def test_bench_quick_runs_and_prints_every_phase():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--quick"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for phase in ("sampling", "trunk", "reference/old", "policy fwd+bwd", "optimizer", "step", "encodings"):
        assert phase in out.stdout, phase


def test_bench_refuses_cuda_graph_without_cuda_before_building_a_model():
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--cuda-graph"]
    out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (out.returncode, out.stderr) == (2, "error: --cuda-graph: needs --device cuda\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="here --device cuda would run")
def test_bench_refuses_cuda_where_torch_sees_none_before_building_a_model():
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--device", "cuda"]
    out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (out.returncode, out.stderr) == (
        2,
        "error: --device: cuda asked for, but torch sees no CUDA device here\n",
    )
