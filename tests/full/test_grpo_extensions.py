"""grpo.py's functions as the full trainer re-arranges and extends them: the row-by-row fp32 LM head
(speedups.py) against the plain ops, rollout metrics (metrics.py), adaptive KL (adaptive_kl.py).
"""

import math

import pytest
import torch

from grpo_vlm import adaptive_kl, metrics, speedups


def head_inputs(dtype: torch.dtype, N: int = 3, T: int = 4, H: int = 16, V: int = 1000):
    """Hidden states (N, T, H), an LM head weight (V, H) giving logits of std ~5, and token ids (N, T)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, T, H, generator=gen).to(dtype)
    weight = (1.25 * torch.randn(V, H, generator=gen)).to(dtype)
    return hidden, weight, torch.randint(0, V, (N, T), generator=gen)


def reference_logprobs(hidden, weight, index, temperature=1.0):
    """log_softmax + gather of the fp32 head's logits (upcast first, then divided), and the entropy."""
    logits = hidden.float() @ weight.float().T / temperature  # (N, T, V)
    logp = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    return logp, torch.special.entr(torch.softmax(logits, -1)).sum(-1)


def row_by_row_and_reference(dtype: torch.dtype, temperature: float):
    """(logp, entropy, grad of hidden, grad of weight) of speedups.logprobs_row_by_row, then of the reference,
    the reference's leaves in fp32 holding the same (rounded) values."""
    hidden, weight, index = head_inputs(dtype)
    upstream = torch.randn(index.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fn, cast in ((speedups.logprobs_row_by_row, dtype), (None, torch.float32)):
        h, w = (x.to(cast).detach().requires_grad_() for x in (hidden, weight))
        if fn is None:
            logp, entropy = reference_logprobs(h, w, index, temperature)
        else:
            logp, entropy = fn(h, w, index, temperature=temperature, return_entropy=True)
        (logp * upstream).sum().backward()
        results.append((logp, entropy, h.grad, w.grad))
    return results


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_by_row_logprobs_entropy_and_gradients_equal_the_fp32_reference(temperature):
    (logp, entropy, grad_h, grad_w), ref = row_by_row_and_reference(torch.float32, temperature)
    for ours, theirs in zip((logp, entropy, grad_h, grad_w), ref):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_by_row_logprobs_of_a_bf16_head_are_those_of_its_values_in_fp32(temperature):
    (logp, entropy, grad_h, grad_w), (ref, ref_entropy, ref_grad_h, ref_grad_w) = row_by_row_and_reference(
        torch.bfloat16, temperature
    )
    assert logp.dtype == entropy.dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16  # gradients in their leaves' dtype
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)  # no bf16 rounding of the logits
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad_h.float(), ref_grad_h, atol=1e-2, rtol=1e-2)  # stored in bf16
    torch.testing.assert_close(grad_w.float(), ref_grad_w, atol=1e-2, rtol=1e-2)
    hidden, weight, index = head_inputs(torch.bfloat16)
    bf16_logits = (hidden @ weight.T).float() / temperature  # the head in bf16 (the old way): far worse
    rounded = torch.log_softmax(bf16_logits, -1).gather(-1, index[..., None]).squeeze(-1)
    assert (rounded - ref).abs().max() > 100 * (logp - ref).abs().max()


def test_row_by_row_logprobs_gradcheck_fp64_hidden_and_weight():
    hidden, weight, index = head_inputs(torch.float64, N=2, T=3, H=4, V=7)
    hidden.requires_grad_(), weight.requires_grad_()

    def logp(h, w):
        return speedups.logprobs_row_by_row(h, w, index, temperature=0.6, return_entropy=False)[0]

    assert torch.autograd.gradcheck(logp, (hidden, weight))


def test_row_by_row_logprobs_save_no_logits_and_no_fp32_copy_of_the_head():
    hidden, weight, index = head_inputs(torch.bfloat16, N=8, T=16, H=32, V=512)
    hidden.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        speedups.logprobs_row_by_row(hidden, weight, index, temperature=1.0, return_entropy=True)
    # What backward keeps: the inputs themselves, the token ids and the (N, T) logsumexp.
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    others = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert sorted(tuple(t.shape) for t in others) == [(8, 16), (8, 16)]


def test_rollout_metrics_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # group 2 has zero variance
    components = {"accuracy": torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]), "format": torch.ones(8)}
    lengths = torch.tensor([1, 2, 3, 4, 4, 4, 4, 2])
    mask = torch.arange(4)[None] < lengths[:, None]  # (8, 4)
    truncated = torch.tensor([False, False, False, True, True, False, False, False])
    correct = components["accuracy"].bool()
    m = metrics.rollout_metrics(rewards, components, mask, truncated, correct, 4)
    assert m["reward/mean"] == pytest.approx(0.75) and m["reward/std"] == pytest.approx(math.sqrt(0.1875))
    assert m["reward/format/mean"] == 1.0 and m["reward/format/std"] == 0.0
    assert m["frac_zero_std_groups"] == 0.5 and m["frac_truncated"] == 0.25 and m["frac_correct"] == 0.75
    assert m["completion_length/mean"] == 3.0 and m["completion_length/max"] == 4.0
    assert m["completion_length/correct"] == pytest.approx(19 / 6)  # (1 + 4 + 4 + 4 + 4 + 2) / 6
    assert m["completion_length/incorrect"] == 2.5  # (2 + 3) / 2
    # No correct completion: the key is left out rather than NaN.
    m = metrics.rollout_metrics(rewards, {}, mask, truncated, torch.zeros(8, dtype=torch.bool), 4)
    assert "completion_length/correct" not in m and all(math.isfinite(v) for v in m.values())


def test_adaptive_beta_rises_above_the_band_falls_below_it_and_holds_inside():
    band = adaptive_kl.AdaptiveKLConfig(kl_target_low=0.01, kl_target_high=0.1, kl_adapt_factor=2.0)
    beta, trace = 0.04, []
    for kl in [0.5, 0.5, 0.05, 0.001, 0.001, float("nan")]:  # a synthetic KL sequence
        beta = adaptive_kl.adapt_beta(beta, kl, band)
        trace.append(beta)
    assert trace == pytest.approx([0.08, 0.16, 0.16, 0.08, 0.04, 0.04])


def test_adaptive_beta_rejects_an_empty_band():
    with pytest.raises(ValueError):
        empty = adaptive_kl.AdaptiveKLConfig(kl_target_low=0.1, kl_target_high=0.1, kl_adapt_factor=2.0)
        adaptive_kl.adapt_beta(0.04, 0.05, empty)


def test_adaptive_beta_without_a_band_leaves_beta_unchanged():
    assert adaptive_kl.adapt_beta(0.04, 5.0, adaptive_kl.AdaptiveKLConfig()) == 0.04  # no targets: no band


BAD_ADAPTIVE_KL_SETTINGS = [
    (dict(kl_adapt_factor=1.0), "--kl-adapt-factor: must be > 1, got 1.0"),
    (dict(kl_target_low=0.1), "--kl-target-low/--kl-target-high: give both or neither"),
    (dict(kl_target_low=0.2, kl_target_high=0.1), "--kl-target-low: must be >= 0 and < --kl-target-high"),
]


@pytest.mark.parametrize(("settings", "message"), BAD_ADAPTIVE_KL_SETTINGS)
def test_adaptive_kl_config_check_names_the_flag_and_the_value(settings, message):
    with pytest.raises(ValueError) as error:
        adaptive_kl.AdaptiveKLConfig(**settings).check()
    assert str(error.value) == message
    adaptive_kl.AdaptiveKLConfig().check()
    adaptive_kl.AdaptiveKLConfig(kl_target_low=0.0, kl_target_high=0.1).check()
