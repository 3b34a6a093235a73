"""The GRPO variants, each against numbers worked out by hand on a tiny batch (and gradcheck where
autograd carries a formula): CISPO, SAPO, GSPO's sequence-level ratio, two-sided clipping, high-entropy
token selection, the bias-corrected KL, and the RLOO / REINFORCE++ / normalise-then-sum advantages."""

import json
import math

import pytest
import torch

from full.helpers import train_args
from grpo_vlm import objectives

COMMON = dict(clip_eps_low=0.2, clip_eps_high=0.28, beta=0.0)


def config(**settings) -> objectives.LossConfig:
    return objectives.LossConfig(**{**COMMON, **settings})


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# --- CISPO --------------------------------------------------------------------------------------------------


def test_cispo_weights_logp_by_the_truncated_detached_ratio_so_clipped_tokens_keep_their_gradient():
    # One row, three tokens; ratios e^0.5 = 1.65 (past 1 + 0.28: truncated to 1.28), e^0 = 1, e^-0.5 = 0.61.
    logp = leaf([[-1.0, -2.0, -3.0]])
    old_logp = torch.tensor([[-1.5, -2.0, -2.5]], dtype=torch.float64)
    adv, mask = torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    loss, _ = objectives.grpo_loss(logp, old_logp, None, adv, mask, config(loss_type="cispo"))
    w = [1.28, 1.0, math.exp(-0.5)]  # min(r, 1 + eps_high), no lower bound
    expected = -sum(wi * 2.0 * lp for wi, lp in zip(w, [-1.0, -2.0, -3.0])) / 3  # "dapo" token mean
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # d/dlogp = -w A / 3: the truncated token still learns (PPO's clip would give it exactly 0).
    torch.testing.assert_close(
        grad_of(loss, logp), torch.tensor([[-w[0] * 2 / 3, -2 / 3, -w[2] * 2 / 3]]).double()
    )
    ppo, _ = objectives.grpo_loss(logp, old_logp, None, adv, mask, config(loss_type="dapo"))
    assert grad_of(ppo, logp)[0, 0] == 0


# --- SAPO ---------------------------------------------------------------------------------------------------


def test_sapo_gate_value_and_its_gradient_equal_the_hand_formula_with_each_sides_temperature():
    logp = leaf([[-1.0, -1.2], [-0.5, -0.9]])
    old_logp = torch.tensor([[-1.3, -1.2], [-0.2, -1.0]], dtype=torch.float64)
    adv = torch.tensor([1.5, -1.0], dtype=torch.float64)  # row 0 uses tau_pos = 1.0, row 1 tau_neg = 1.05
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, _ = objectives.grpo_loss(logp, old_logp, None, adv, mask, config(loss_type="sapo"))

    def gate(r, tau):
        return 1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau

    r = [[math.exp(0.3), 1.0], [math.exp(-0.3), math.exp(0.1)]]
    rows = [
        -(gate(r[0][0], 1.0) + gate(r[0][1], 1.0)) * 1.5 / 2,
        -(gate(r[1][0], 1.05) + gate(r[1][1], 1.05)) * -1.0 / 2,
    ]
    assert loss.item() == pytest.approx(sum(rows) / 2, rel=1e-12)  # per-sequence mean, then mean ("grpo")
    # At r = 1 the gate's slope is 1, so the gradient is the policy gradient -A / (L * N) exactly.
    assert grad_of(loss, logp)[0, 1].item() == pytest.approx(-1.5 / 2 / 2, rel=1e-12)

    def f(lp):
        return objectives.grpo_loss(lp, old_logp, None, adv, mask, config(loss_type="sapo"))[0]

    assert torch.autograd.gradcheck(f, (logp,))


# --- GSPO: one ratio per sequence ---------------------------------------------------------------------------


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio_clipped_as_a_whole():
    logp = leaf([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]])
    old_logp = torch.tensor([[-1.6, -1.0, -1.3], [-2.1, -1.9, 5.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # row 1's last token is padding
    gspo = config(loss_type="grpo", importance_sampling_level="sequence")
    loss, stats = objectives.grpo_loss(logp, old_logp, None, adv, mask, gspo)
    s0 = math.exp((0.6 + 0.0 + 0.3) / 3)  # 1.35: past 1.28, and A > 0, so the clip binds at 1.28
    s1 = math.exp((0.1 - 0.1) / 2)  # 1.0 exactly; the padded token's huge log-ratio is not averaged in
    expected = (-min(s0 * 1.0, 1.28 * 1.0) + -min(s1 * -1.0, s1 * -1.0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    g = grad_of(loss, logp)
    assert torch.all(g[0] == 0)  # row 0 is clipped as a whole: no token of it gets gradient
    torch.testing.assert_close(g[1], torch.tensor([0.25, 0.25, 0.0]).double())  # s1 * A / L / N on each token
    assert stats["clip_frac_high"] == pytest.approx(3 / 5)


# --- two-sided clipping -------------------------------------------------------------------------------------


def test_delta_caps_the_ratio_of_a_negative_advantage_which_plain_clipping_leaves_unbounded():
    logp = leaf([[0.0]])
    old_logp = torch.tensor([[-2.0]], dtype=torch.float64)  # ratio e^2 = 7.39
    adv, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    plain, _ = objectives.grpo_loss(logp, old_logp, None, adv, mask, config(loss_type="dapo"))
    capped, _ = objectives.grpo_loss(logp, old_logp, None, adv, mask, config(loss_type="dapo", delta=4.0))
    assert plain.item() == pytest.approx(math.exp(2), rel=1e-12)  # -min(7.39 * -1, 1.28 * -1) = 7.39
    assert capped.item() == pytest.approx(4.0, rel=1e-12)  # -min(4 * -1, 1.28 * -1) = 4
    assert grad_of(capped, logp).item() == 0  # past delta: no gradient pushes the ratio further


# --- high-entropy tokens ------------------------------------------------------------------------------------


def test_high_entropy_mask_keeps_the_top_quantile_of_unmasked_tokens_and_the_kl_still_counts_all():
    entropy = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.0, 3.0, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # 9.0 is padding: not in the pool
    keep = objectives.high_entropy_mask(entropy, mask, 0.5)
    # Unmasked entropies 0.1 2.0 0.5 1.0 3.0 0.2 0.0: the median of 7 is 0.5, so 0.5 and above stay.
    assert keep.tolist() == [[False, True, True, False], [True, True, False, False]]

    logp = leaf([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    ref = logp.detach() - 0.5
    loss, _ = objectives.grpo_loss(
        logp, logp.detach(), ref, adv, mask, config(loss_type="dapo", beta=0.1), token_mask=keep
    )
    k3 = math.exp(-0.5) + 0.5 - 1
    assert loss.item() == pytest.approx((-4 + 0.1 * k3 * 7) / 7, rel=1e-12)  # 4 policy tokens, 7 KL tokens
    g = grad_of(loss, logp)
    assert g[0, 0] != 0 and g[0, 0] == g[1, 3]  # unselected tokens keep only the KL's gradient
    assert g[0, 1] < g[0, 0]


# --- bias-corrected KL --------------------------------------------------------------------------------------


def test_bias_corrected_kl_weights_k3_by_the_ratio_and_equals_plain_k3_at_ratio_one():
    logp = leaf([[-1.0, -2.0]])
    old_logp = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    adv, mask = torch.tensor([0.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    options = dict(clip_eps_low=0.2, clip_eps_high=0.28, beta=1.0, loss_type="bnpo")
    plain, _ = objectives.grpo_loss(logp, old_logp, ref, adv, mask, objectives.LossConfig(**options))
    corrected_kl = objectives.LossConfig(**options, use_bias_correction_kl=True)
    corrected, stats = objectives.grpo_loss(logp, old_logp, ref, adv, mask, corrected_kl)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert plain.item() == pytest.approx(sum(k3) / 2, rel=1e-12)
    assert corrected.item() == pytest.approx((k3[0] * math.exp(0.2) + k3[1] * 1.0) / 2, rel=1e-12)
    assert stats["kl"] == pytest.approx(corrected.item(), rel=1e-12)  # the logged KL is the estimator used


# --- advantages ---------------------------------------------------------------------------------------------


def test_rloo_advantage_is_the_reward_minus_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    rloo = objectives.AdvantageConfig(adv_baseline="rloo", adv_scale="none")
    adv = objectives.advantages(rewards, None, None, 4, rloo)
    # 1 - (0 + 0 + 1) / 3 = 2/3; 0 - (1 + 0 + 1) / 3 = -2/3; the constant group gives exactly 0.
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert torch.equal(adv[4:], torch.zeros(4))


def test_reinforce_plus_plus_advantage_normalises_over_the_batch_not_the_group():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    adv = objectives.batch_baseline(rewards, 2, "batch", eps=0.0)
    mean, std = 1.25, math.sqrt(((0.25**2) + 1.25**2 + 2 * 0.75**2) / 3)
    torch.testing.assert_close(adv, (rewards - mean) / std)
    assert adv[2] != 0  # a constant group still moves: its reward is above the batch's mean


def test_normalize_then_sum_z_scores_each_reward_within_its_group_before_weighting():
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])  # (N=4, K=2), G = 2
    summed = objectives.normalized_reward_sum(components, torch.tensor([1.0, 0.5]), 2, eps=0.0)
    z = 0.5 / math.sqrt(0.5)  # (1 - 0.5) / std([1, 0]), the unbiased std being sqrt(0.5)
    # Group 0: reward 1 is (+z, -z), reward 2 (-z, +z); group 1: reward 1 is constant (0), reward 2 (+z, -z).
    torch.testing.assert_close(summed, torch.tensor([z - 0.5 * z, -z + 0.5 * z, 0.5 * z, -0.5 * z]))


def test_normalize_then_sum_advantages_by_hand_scale_over_the_batch_and_clip():
    # G = 2, weights (1, 0.5). Group 0: reward 1 is (1, 0), reward 2 constant; group 1: the reverse.
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])  # (N=4, K=2)
    rewards = components @ torch.tensor([1.0, 0.5])  # (1, 0, 1.5, 1): the weighted totals
    gdpo = objectives.AdvantageConfig(multi_objective_aggregation="normalize_then_sum")
    adv = objectives.advantages(rewards, components, torch.tensor([1.0, 0.5]), 2, gdpo)
    # z = 0.5 / (sqrt(0.5) + 1e-4) = 0.7070068 (std of (1, 0) is sqrt(0.5)); the sums are (z, -z, z/2, -z/2),
    # mean 0, unbiased std sqrt((2 z^2 + 2 z^2 / 4) / 3) = 0.6454060; divided by (0.6454060 + 1e-4):
    torch.testing.assert_close(adv, torch.tensor([1.0952754, -1.0952754, 0.5476377, -0.5476377]))
    # Summed first, each group is z-scored alone: 0.5 / (sqrt(0.5) + 1e-4) and 0.25 / (sqrt(0.125) + 1e-4),
    # the same but for eps: reward 2's smaller weight no longer shows.
    summed_first = objectives.advantages(
        rewards, components, torch.tensor([1.0, 0.5]), 2, objectives.AdvantageConfig()
    )
    torch.testing.assert_close(summed_first, torch.tensor([0.7070068, -0.7070068, 0.7069068, -0.7069068]))
    clipped = objectives.AdvantageConfig(
        multi_objective_aggregation="normalize_then_sum", adv_clip=1.0, adv_scale="none"
    )
    adv = objectives.advantages(
        rewards, components, torch.tensor([1.0, 0.5]), 2, clipped
    )  # adv_scale: not read
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.5476377, -0.5476377]))


def test_normalized_reward_sum_moves_cpu_weights_to_the_components_device():
    # "meta" stands in for a GPU: its tensors refuse to meet CPU tensors, as CUDA ones do.
    components = torch.zeros(4, 2, device="meta")
    summed = objectives.normalized_reward_sum(components, torch.tensor([1.0, 0.5]), 2)
    assert summed.device == components.device and summed.shape == (4,)


# --- end to end ---------------------------------------------------------------------------------------------

VARIANT_FLAGS = {
    "cispo": dict(loss_type="cispo", clip_eps_high=4.0),
    "sapo": dict(loss_type="sapo"),
    "gspo": dict(
        loss_type="grpo", importance_sampling_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4
    ),
    "two-sided": dict(delta=4.0, num_iterations=2),
    "80/20": dict(top_entropy_quantile=0.2, num_iterations=2),
    "bias-corrected kl": dict(use_bias_correction_kl=True, num_iterations=2),
    "rloo": dict(adv_baseline="rloo", adv_scale="none"),
    "reinforce++": dict(adv_baseline="batch", adv_scale="batch"),
    "normalize_then_sum": dict(multi_objective_aggregation="normalize_then_sum"),
}


@pytest.mark.parametrize("variant", VARIANT_FLAGS)
def test_every_variant_trains_end_to_end_without_a_skipped_step(tmp_path, variant):
    from grpo_vlm import trainer

    args = train_args(
        output_dir=str(tmp_path / "run"),
        device="cpu",
        train_size=16,
        eval_size=0,
        batch_size=2,
        group_size=4,
        max_new_tokens=8,
        steps=2,
        warmup_steps=1,
        **VARIANT_FLAGS[variant],
    )
    trainer.main(args)
    records = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and '"skipped": ""' in records[-1]


# --- DAPO dynamic sampling ----------------------------------------------------------------------------------

HALF_CONSTANT = (
    "def reward(completion, sample):\n"
    "    n = int(sample['id'].split('-')[-1])\n"
    "    return 1.0 if n % 2 == 0 else float(len(completion) % 2)  # even ids: always 1, a dead group\n"
)


def dynamic_args(out, plugin, **overrides):
    kwargs = dict(
        output_dir=str(out),
        device="cpu",
        train_size=32,
        eval_size=0,
        batch_size=2,
        group_size=4,
        max_new_tokens=8,
        steps=3,
        save_every=1,
        warmup_steps=5,
        dynamic_sampling=True,
        reward=(f"{plugin}:reward",),
    )
    return train_args(**{**kwargs, **overrides})


def test_dynamic_sampling_drops_groups_without_signal_and_replaces_them_from_more_prompts(tmp_path):
    from grpo_vlm import trainer

    plugin = tmp_path / "half.py"
    plugin.write_text(HALF_CONSTANT)
    trainer.main(dynamic_args(tmp_path / "run", plugin))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert any(r["dynamic/groups_sampled"] > 2 for r in records)  # some step needed a second round
    for record in records:
        assert (
            1 <= record["dynamic/rounds"] <= 3
            and record["dynamic/groups_sampled"] == 2 * record["dynamic/rounds"]
        )
        groups = {}
        for row in (r for r in rows if r["step"] == record["step"]):
            groups.setdefault(row["group"], []).append(row)
        assert len(groups) == 2  # always B groups trained
        live = [g for g in groups.values() if len({row["reward"] for row in g}) > 1]
        assert len(live) == record["dynamic/groups_kept"]
        assert all(int(g[0]["sample_id"].split("-")[-1]) % 2 == 1 for g in live)  # even ids carry no signal


def test_dynamic_sampling_stops_after_the_bounded_rounds_and_trains_on_what_there_is(tmp_path):
    from grpo_vlm import trainer

    plugin = tmp_path / "constant.py"
    plugin.write_text("def reward(completion, sample):\n    return 1.0\n")
    trainer.main(dynamic_args(tmp_path / "run", plugin, steps=1, max_sampling_rounds=2))
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][
        1:
    ]
    assert record["dynamic/rounds"] == 2 and record["dynamic/groups_kept"] == 0 and record["skipped"] == ""


def test_dynamic_sampling_resumes_exactly(tmp_path):
    from grpo_vlm import trainer

    plugin = tmp_path / "half.py"
    plugin.write_text(HALF_CONSTANT)
    trainer.main(dynamic_args(tmp_path / "whole", plugin))
    trainer.main(dynamic_args(tmp_path / "cut", plugin, steps=2))
    trainer.main(dynamic_args(tmp_path / "cut", plugin, steps=3, resume=str(tmp_path / "cut")))
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
