"""Equivalence with TRL 1.16 for the package's objectives (grpo_vlm/objectives.py): loss and gradient of
`objectives.grpo_loss` and TRL's `GRPOTrainer._compute_loss` on the reference tests' crafted batch
(tests/test_trl_equivalence.py: how, and the semantic differences 1-6 these tests pin), for every loss type
and option, and the parts of a batch against TRL's gradient accumulation. Skips unless trl 1.16.x is
importable (see that file's docstring for a throwaway venv)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "trl", reason="TRL is not a dependency; install trl==1.16.0 in a throwaway venv to run these"
)
from test_trl_equivalence import (
    CLIP_EPS_HIGH,
    CLIP_EPS_LOW,
    DELTA,
    HALVES,
    MAX_COMPLETION_LENGTH,
    SAPO_TEMPERATURES,
    TOL,
    N,
    assert_equal_to_trl,
    crafted_batch,
    loss_and_grad,
    rows_of,
    trl_loss,
    trl_trainer,
)

from grpo_vlm import objectives

LOSS_TYPES = list(objectives.LOSS_TYPES)
CLIPPED_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]  # the PPO clip; the ones delta applies to


def our_loss(
    batch: SimpleNamespace,
    logp: torch.Tensor,
    loss_type: str,
    *,
    beta: float = 0.0,
    top_entropy_quantile: float = 1.0,
    sapo_temperatures: tuple[float, float] = SAPO_TEMPERATURES,
    on_policy: bool = False,
    num_rows: int | None = None,
    num_tokens: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """objectives.grpo_loss on `batch` with TRL's knobs translated; the entropy mask from TRL's entropies.
    num_rows / num_tokens: the whole batch's, when `batch` is a micro-batch (default: its own)."""
    token_mask = None
    if top_entropy_quantile < 1:
        token_mask = objectives.high_entropy_mask(batch.entropy, batch.mask, top_entropy_quantile)
    config = objectives.LossConfig(
        loss_type=loss_type,
        beta=beta,
        clip_eps_low=CLIP_EPS_LOW,
        clip_eps_high=CLIP_EPS_HIGH,
        sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1],
        **options,
    )
    totals = objectives.BatchTotals(
        num_rows=len(batch.mask) if num_rows is None else num_rows,
        num_tokens=batch.mask.sum().clamp(min=1) if num_tokens is None else num_tokens,
    )
    return objectives.grpo_loss(
        logp,
        logp.detach() if on_policy else batch.old_logp,
        batch.ref_logp,
        batch.adv,
        batch.mask,
        config,
        token_mask=token_mask,
        totals=totals,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )


@pytest.mark.parametrize("on_policy", [False, True], ids=["mu>1", "mu=1"])
@pytest.mark.parametrize("loss_type", CLIPPED_LOSS_TYPES)
def test_plain_clipped_losses_with_k3_kl_equal_trl(loss_type, on_policy):
    assert_equal_to_trl(loss_type, on_policy=on_policy, beta=0.04, ours_fn=our_loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_equals_trl_whose_epsilon_high_is_the_ratio_bound(level):
    assert_equal_to_trl("cispo", importance_sampling_level=level, beta=0.04, ours_fn=our_loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_soft_gate_equals_trl(level):
    assert_equal_to_trl("sapo", importance_sampling_level=level, beta=0.04, ours_fn=our_loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_default_temperatures_equal_trl_up_to_trls_float32_temperature(level):
    """Difference 6: TRL's `torch.where(adv > 0, 1.0, 1.05)` makes a float32 tau (1.05 -> 1.0499999523);
    ours keeps the temperature in the ratio's dtype. A relative difference of about 2e-7, visible only in
    float64."""
    defaults = dict(sapo_temperatures=(1.0, 1.05), tol=dict(rtol=1e-6, atol=1e-9))
    assert_equal_to_trl("sapo", importance_sampling_level=level, beta=0.04, **defaults, ours_fn=our_loss)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_level_importance_ratio_equals_trl(loss_type):
    assert_equal_to_trl(loss_type, importance_sampling_level="sequence", ours_fn=our_loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)  # cispo and sapo ignore delta on both sides
def test_two_sided_clipping_with_delta_equals_trl(loss_type, level):
    assert_equal_to_trl(loss_type, importance_sampling_level=level, delta=DELTA, ours_fn=our_loss)


@pytest.mark.parametrize("quantile", [0.5, 0.2])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_high_entropy_token_mask_equals_trl_fed_the_same_entropies(loss_type, quantile):
    # beta > 0: the mask must drop the policy term only, the KL still counts on every token (both sides).
    assert_equal_to_trl(loss_type, top_entropy_quantile=quantile, beta=0.04, ours_fn=our_loss)


@pytest.mark.parametrize("on_policy", [False, True], ids=["mu>1", "mu=1"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bias_corrected_kl_equals_trl(loss_type, level, on_policy):
    # On-policy the weight pi / pi_old is 1 in value but not in gradient: mu=1 checks that term too.
    options = dict(importance_sampling_level=level, use_bias_correction_kl=True, beta=0.1)
    assert_equal_to_trl(loss_type, on_policy=on_policy, **options, ours_fn=our_loss)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_option_at_once_equals_trl(loss_type):
    options = dict(importance_sampling_level="sequence", delta=DELTA, top_entropy_quantile=0.5)
    assert_equal_to_trl(loss_type, beta=0.1, use_bias_correction_kl=True, **options, ours_fn=our_loss)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_token_level_stats_equal_trl_metrics(loss_type):
    batch = crafted_batch()
    trainer = trl_trainer(loss_type, beta=0.1, use_bias_correction_kl=True)
    trl_loss(trainer, batch, batch.logp)
    _, stats = our_loss(batch, batch.logp, loss_type, beta=0.1, use_bias_correction_kl=True)
    metrics = {key: values[0] for key, values in trainer._metrics["train"].items()}
    assert stats["kl"] == pytest.approx(metrics["kl"], rel=1e-12)
    if loss_type == "cispo":  # TRL logs only the upper bound; cispo has no lower one
        assert stats["clip_frac_high"] == pytest.approx(metrics["cispo_clip_ratio"], rel=1e-12)
        return
    assert stats["clip_frac_low"] == pytest.approx(metrics["clip_ratio/low_mean"], rel=1e-12)
    assert stats["clip_frac_high"] == pytest.approx(metrics["clip_ratio/high_mean"], rel=1e-12)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


def test_sequence_level_clip_fractions_weigh_tokens_here_and_sequences_in_trl():
    """Difference 4: at sequence level a row's clip counts once in TRL and once per token here."""
    batch = crafted_batch()
    trainer = trl_trainer("grpo", importance_sampling_level="sequence")
    trl_loss(trainer, batch, batch.logp)
    _, stats = our_loss(batch, batch.logp, "grpo", importance_sampling_level="sequence")
    # Only row 0 (5 tokens, A > 0) is clipped above and only row 1 (3 tokens, A < 0) below: 20 tokens, 6 rows.
    assert stats["clip_frac_high"] == pytest.approx(5 / 20)
    assert trainer._metrics["train"]["clip_ratio/high_mean"] == [pytest.approx(1 / 6)]
    assert stats["clip_frac_low"] == pytest.approx(3 / 20)
    assert trainer._metrics["train"]["clip_ratio/low_mean"] == [pytest.approx(1 / 6)]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_chunks_normalised_by_the_whole_batch_sum_to_trl_gradient_accumulation(loss_type):
    """train.py's chunks (num_rows, num_tokens of the whole batch) == TRL's two accumulated micro-batches."""
    batch = crafted_batch()
    trainer = trl_trainer(loss_type, accumulation_steps=2, beta=0.04)
    num_items = int(batch.mask.sum())  # TRL's num_items_in_batch spans the generation batch: both halves

    def trl_accumulated(logp):
        losses = [trl_loss(trainer, rows_of(batch, r), logp[r], num_items_in_batch=num_items) for r in HALVES]
        return sum(losses)

    def ours_chunked(logp):
        totals = dict(num_rows=N, num_tokens=batch.mask.sum())  # what train.py passes for every chunk
        return sum(our_loss(rows_of(batch, r), logp[r], loss_type, beta=0.04, **totals)[0] for r in HALVES)

    theirs, their_grad = loss_and_grad(batch, trl_accumulated)
    ours, our_grad = loss_and_grad(batch, ours_chunked)
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(our_grad, their_grad, **TOL)


def test_trl_bnpo_averages_micro_batch_means_where_ours_takes_the_batch_token_mean():
    """Difference 2: TRL's accumulated bnpo is (mean_1 + mean_2) / 2; train.py's is the batch's token mean."""
    batch = crafted_batch()
    parts = [rows_of(batch, rows) for rows in HALVES]
    trainer = trl_trainer("bnpo", accumulation_steps=2)
    theirs = sum(trl_loss(trainer, part, part.logp) for part in parts)
    per_chunk_means = sum(our_loss(part, part.logp, "bnpo")[0] for part in parts) / 2
    batch_mean = sum(our_loss(p, p.logp, "bnpo", num_tokens=batch.mask.sum())[0] for p in parts)
    torch.testing.assert_close(per_chunk_means, theirs, **TOL)
    assert abs(float(batch_mean - theirs)) > 1e-3


def test_trl_takes_the_entropy_quantile_per_micro_batch_and_train_py_over_the_batch():
    """Difference 1: the same entropies give another mask when TRL sees the batch in two micro-batches."""
    batch = crafted_batch()
    trainer = trl_trainer("grpo", top_entropy_quantile=0.5)
    batch_wide = objectives.high_entropy_mask(batch.entropy, batch.mask, 0.5)  # train.py's, over all N rows
    first = rows_of(batch, HALVES[0])
    micro_batch = objectives.high_entropy_mask(
        first.entropy, first.mask, 0.5
    )  # over the first micro-batch only
    their_mask = trainer.get_high_entropy_mask(first.entropy, first.mask, 1 - 0.5)  # as `_compute_loss` does
    assert torch.equal(their_mask, micro_batch)
    assert not torch.equal(micro_batch, batch_wide[HALVES[0]])
