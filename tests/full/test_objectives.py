"""grpo_vlm/objectives.py on top of grpo.py: a batch split into parts (micro-batches, ranks) gives the whole
batch's loss and gradient for every loss type; the default objective is exactly the reference's; the
variants' settings are checked naming the field; advantages clipped."""

import math

import pytest
import torch

import grpo
from grpo_vlm import objectives, sampling_config

LOSS_TYPES = list(objectives.LOSS_TYPES)


def random_mask(N, T, seed=0):
    lengths = torch.randint(1, T + 1, (N,), generator=torch.Generator().manual_seed(seed))
    return torch.arange(T)[None] < lengths[:, None]


def batch(N=6, T=5):
    torch.manual_seed(0)
    logp = (-3 * torch.rand(N, T)).requires_grad_()
    old_logp = logp.detach() + 0.3 * torch.randn(N, T)  # off-policy enough for some clipping
    ref_logp = logp.detach() + 0.3 * torch.randn(N, T)
    return logp, old_logp, ref_logp, torch.randn(N), random_mask(N, T)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_parts_of_a_batch_sum_to_the_whole_batchs_loss_and_gradient(loss_type):
    logp, old_logp, ref_logp, adv, mask = batch()
    config = objectives.LossConfig(loss_type=loss_type, beta=0.1, clip_eps_low=0.2, clip_eps_high=0.28)
    whole, _ = objectives.grpo_loss(logp, old_logp, ref_logp, adv, mask, config, max_completion_length=5)
    whole.backward()
    grad_whole, logp.grad = logp.grad, None
    totals = objectives.BatchTotals(num_rows=6, num_tokens=mask.sum())
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches, gradients accumulate
        part, _ = objectives.grpo_loss(
            logp[rows],
            old_logp[rows],
            ref_logp[rows],
            adv[rows],
            mask[rows],
            config,
            totals=totals,
            max_completion_length=5,
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(logp.grad, grad_whole)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_references_objectives_are_grpo_py_s_bit_for_bit_in_one_part(loss_type):
    logp, old_logp, ref_logp, adv, mask = batch()
    settings = dict(loss_type=loss_type, beta=0.1, clip_eps_low=0.2, clip_eps_high=0.28)
    ours, ours_stats = objectives.grpo_loss(
        logp,
        old_logp,
        ref_logp,
        adv,
        mask,
        objectives.LossConfig(**settings),
        totals=objectives.BatchTotals(num_rows=6, num_tokens=mask.sum().clamp(min=1)),  # the whole batch
        max_completion_length=5,
    )
    theirs, theirs_stats = grpo.grpo_loss(logp, old_logp, ref_logp, adv, mask, grpo.LossConfig(**settings), 5)
    assert torch.equal(ours, theirs) and ours_stats == theirs_stats


def test_bnpo_is_dapo_in_one_process():
    logp, old_logp, ref_logp, adv, mask = batch()
    losses = [
        objectives.grpo_loss(logp, old_logp, ref_logp, adv, mask, objectives.LossConfig(loss_type=t))[0]
        for t in ("bnpo", "dapo")
    ]
    assert torch.equal(*losses)


def test_group_advantages_clipping():
    # mean 0.25, unbiased std 0.5: [0.75, -0.25, -0.25, -0.25] / 0.5001 = [1.4997, -0.4999, ...], clip at 1.
    config = objectives.AdvantageConfig(adv_clip=1.0)
    adv = objectives.advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), None, None, 4, config)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.4999000, -0.4999000, -0.4999000]))


# --- the settings check their own values, naming the field (a command line names its flag) ------------------

BAD_LOSS_SETTINGS = [
    (dict(beta=-1.0), "beta: must be a number >= 0 (0 drops the KL term), got -1.0"),
    (dict(clip_eps_low=1.5), "clip_eps_low: must be in [0, 1), got 1.5"),
    (dict(clip_eps_high=math.nan), "clip_eps_high: must be a number in [0, 1e38), got nan"),
    (dict(loss_type="sum"), "loss_type: must be one of ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo')"),
    (dict(delta=1.2), "delta: must be > 1 + clip_eps_high, got 1.2"),
    (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos: must be > 0, got 0.0"),
    (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg: must be > 0, got -1.0"),
    (dict(top_entropy_quantile=0.0), "top_entropy_quantile: must be in (0, 1], got 0.0"),
]


@pytest.mark.parametrize(("settings", "message"), BAD_LOSS_SETTINGS)
def test_loss_config_check_names_the_field_and_the_value(settings, message):
    with pytest.raises(ValueError) as error:
        objectives.LossConfig(**settings).check()
    assert str(error.value).startswith(message)


def test_advantage_and_sampling_config_checks_name_the_field_and_the_value_and_defaults_pass():
    with pytest.raises(ValueError) as error:
        objectives.AdvantageConfig(adv_clip=0.0).check()
    assert str(error.value) == "adv_clip: must be > 0, got 0.0"
    with pytest.raises(ValueError) as error:
        sampling_config.SamplingConfig(top_p=0.0).check()
    assert str(error.value) == "top_p: must be in (0, 1], got 0.0"
    objectives.LossConfig().check()
    objectives.AdvantageConfig().check()
    sampling_config.SamplingConfig().check()
    objectives.LossConfig(loss_type="cispo", delta=4.0).check()
