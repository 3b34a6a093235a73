"""Equivalence with TRL 1.16: `grpo.grpo_loss` and TRL's `GRPOTrainer._compute_loss` give the same loss and
the same gradient w.r.t. the policy log-probs, on one crafted batch, for the reference's objectives (grpo,
dapo, dr_grpo; token or sequence ratio; k3 KL; mu = 1 and mu > 1). The package's other objectives and
options are compared the same way in tests/full/test_trl_equivalence_objectives.py, which imports this
file's crafted batch and TRL stand-in.

TRL is not a dependency, so these tests skip unless `trl` 1.16.x is importable. To run them, use a throwaway
venv (a new one as below, or `cp -a` of the project's venv, then only the trl install):

    python -m venv /tmp/venv-trl
    /tmp/venv-trl/bin/python -m pip install -r requirements.txt trl==1.16.0
    /tmp/venv-trl/bin/python -m pytest -q tests/test_trl_equivalence.py tests/full/test_trl_equivalence_*.py

How: TRL's real `_compute_loss` runs on a `GRPOTrainer` made with `object.__new__` (no model, no dataset,
no Accelerator) that carries only the attributes this method reads. Its model call,
`_get_per_token_logps_and_entropies`, is replaced by one that returns our crafted logp leaf and entropies.
Everything is float64, so "equal" means equal to rounding: the two sides differ only in the order of
operations (and in expm1(d) - d against exp(d) - d - 1).

Names: TRL epsilon = clip_eps_low and epsilon_high = clip_eps_high, except for cispo, where TRL reads
epsilon_high as the ratio bound itself (5.0 recommended) and ours is 1 + clip_eps_high;
use_bias_correction_kl has the same name; num_items_in_batch = objectives.BatchTotals.num_tokens (dapo,
cispo); top_entropy_quantile = the quantile of `objectives.high_entropy_mask`.

Semantic differences (the package's trainer, python -m grpo_vlm, against TRL's; difference 3 and the
sequence ratio are pinned here, the others in the objectives' file). Each test compares under matched
settings; the last tests pin the differences.
1. Where the entropy threshold comes from. TRL computes it inside the loss, from the entropies of the policy
   being trained, over one micro-batch (gathered across processes), afresh at every iteration. train.py
   computes it once per rollout, from the sampling policy's entropies, over the whole (global) batch, and
   keeps the mask for all mu iterations. The two agree with mu = 1 and one micro-batch per step.
2. bnpo under gradient accumulation. TRL divides each micro-batch by its own token count, then by the
   number of micro-batches (a mean of means). train.py passes the whole batch's token count for every
   loss_type, so our bnpo is dapo's global token mean. The two agree when all micro-batches hold as many
   tokens.
3. Padding. TRL exponentiates log-ratios and the KL at padded positions and masks them by multiplication
   afterwards, so a non-finite value there (an old or ref log-prob of -inf) makes its loss NaN. Ours masks
   before exp: the loss stays finite and the gradient there is 0.
4. Stats. At importance_sampling_level="sequence", TRL's clip fractions weigh each sequence once, ours each
   token (the row's ratio repeated over its tokens). Ours also logs clip fractions for cispo (the low one
   means nothing: cispo has no lower bound) and for sapo (hard thresholds on a soft gate). TRL logs
   `cispo_clip_ratio` (= our clip_frac_high) and nothing for sapo. TRL logs kl only when beta != 0, ours
   whenever ref_logp is given.
5. Defaults, not semantics: TRL has use_bias_correction_kl=True and beta=0.0, train.py False and 0.04. TRL
   adds the KL term for any beta != 0, ours for beta > 0 only.
6. Rounding only: TRL's sapo temperature is a float32 tensor (1.05 becomes 1.0499999523), ours stays in the
   ratio's dtype (see the test on the default temperatures).
Identical, and checked there: the delta cap (which cispo and sapo ignore on both sides); the entropy mask on
the policy term only (the KL and the normaliser still count every token); the sequence-level ratio
broadcast onto the bias-corrected KL; sapo's temperature for adv == 0 (tau_neg, multiplied by 0); and here,
dr_grpo's N * max_completion_length.
"""

import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import grpo

trl = pytest.importorskip(
    "trl", reason="TRL is not a dependency; install trl==1.16.0 in a throwaway venv to run these"
)
if not trl.__version__.startswith("1.16."):
    pytest.skip(
        f"written against TRL 1.16's _compute_loss, found trl {trl.__version__}", allow_module_level=True
    )

from trl import GRPOConfig, GRPOTrainer  # only after the version check above

N, T = 6, 5
LENGTHS = [5, 3, 1, 4, 2, 5]  # a length-1 row (EOS at once) and rows padded by 1..4 tokens
ADV = [1.2, -0.7, 0.0, 0.5, -1.5, 0.9]  # both signs and an exact 0
# Per-row drift of log(pi / pi_old), so that the sequence-level ratio is clipped too: row 0 (A > 0) past
# 1 + eps_high, row 1 (A < 0) below 1 - eps_low, row 4 (A < 0) above delta, row 3 (A > 0) below 1, unclipped.
DRIFT = [0.3, -0.3, 0.1, -0.25, 0.35, 0.05]
CLIP_EPS_LOW, CLIP_EPS_HIGH, DELTA, MAX_COMPLETION_LENGTH = 0.2, 0.28, 1.3, 8
LOSS_TYPES = ["grpo", "dr_grpo", "dapo"]  # the reference's (grpo.py); the package's others: tests/full
TOL = dict(rtol=1e-12, atol=1e-15)  # float64: equal up to the order of operations
# SAPO's temperatures in every test but the one on the defaults: exact in float32, as TRL stores them.
SAPO_TEMPERATURES = (0.5, 2.0)


def crafted_batch(seed: int = 0) -> SimpleNamespace:
    """N=6 rows of T=5 tokens in float64: logp, old_logp = logp - (drift + noise), ref_logp = logp +- 0.3,
    and entropies distinct and exact in float32 (multiples of 1/8: the float32 threshold cannot tie)."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # (N, T) long, as TRL's
    logp = -0.05 - 2 * torch.rand(N, T, generator=gen, dtype=torch.float64)  # (N, T)
    noise = 0.3 * torch.rand(N, T, generator=gen, dtype=torch.float64) - 0.15  # (N, T) in [-0.15, 0.15)
    old_logp = logp - (torch.tensor(DRIFT, dtype=torch.float64)[:, None] + noise)  # (N, T)
    ref_logp = logp + 0.6 * torch.rand(N, T, generator=gen, dtype=torch.float64) - 0.3  # (N, T)
    entropy = torch.randperm(N * T, generator=gen).view(N, T).double() / 8  # (N, T)
    adv = torch.tensor(ADV, dtype=torch.float64)  # (N,)
    return SimpleNamespace(
        logp=logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy, adv=adv, mask=mask
    )


def rows_of(batch: SimpleNamespace, rows: slice) -> SimpleNamespace:
    """The micro-batch of `batch` made of `rows`."""
    return SimpleNamespace(**{name: tensor[rows] for name, tensor in vars(batch).items()})


HALVES = [
    slice(0, N // 2),
    slice(N // 2, N),
]  # two micro-batches of 3 rows: 9 and 11 tokens, unequal on purpose


class OneProcess:
    """The slice of accelerate.Accelerator that `_compute_loss` uses, for a single process."""

    num_processes = 1

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def trl_trainer(
    loss_type: str,
    *,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    top_entropy_quantile: float = 1.0,
    use_bias_correction_kl: bool = False,
    sapo_temperatures: tuple[float, float] = SAPO_TEMPERATURES,
    accumulation_steps: int = 1,
) -> GRPOTrainer:
    """A GRPOTrainer with exactly the attributes `_compute_loss` reads, in our parameters' terms."""
    args = SimpleNamespace(
        delta=delta,
        sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1],
        use_bias_correction_kl=use_bias_correction_kl,
        steps_per_generation=accumulation_steps,  # one generation batch per optimiser step
    )
    # A renamed field in a later TRL would otherwise read as a silently ignored option.
    assert set(vars(args)) <= {field.name for field in dataclasses.fields(GRPOConfig)}
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type,
        beta=beta,
        epsilon_low=CLIP_EPS_LOW,
        # NOTE: the cispo naming difference: TRL's epsilon_high is the bound on the ratio itself.
        epsilon_high=1 + CLIP_EPS_HIGH if loss_type == "cispo" else CLIP_EPS_HIGH,
        importance_sampling_level=importance_sampling_level,
        top_entropy_quantile=top_entropy_quantile,
        args=args,
        off_policy_mask_threshold=None,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=MAX_COMPLETION_LENGTH,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        accelerator=OneProcess(),
    )
    return trainer


def trl_loss(
    trainer: GRPOTrainer,
    batch: SimpleNamespace,
    logp: torch.Tensor,
    *,
    on_policy: bool = False,
    num_items_in_batch: int | None = None,
) -> torch.Tensor:
    """TRL's loss for `batch`, with `logp` (a leaf with grad) standing in for the model's log-probs."""
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, batch.entropy, None)
    num_items = int(batch.mask.sum()) if num_items_in_batch is None else num_items_in_batch
    inputs = {
        "prompt_ids": torch.ones(len(logp), 2, dtype=torch.long),
        "prompt_mask": torch.ones(len(logp), 2, dtype=torch.long),
        "completion_ids": torch.ones_like(batch.mask),
        "completion_mask": batch.mask,
        "advantages": batch.adv,
        "ref_per_token_logps": batch.ref_logp,
        "num_items_in_batch": torch.tensor(num_items),
    }
    if not on_policy:  # absent: TRL uses logp.detach() (mu = 1), as train.py does
        inputs["old_per_token_logps"] = batch.old_logp
    return trainer._compute_loss(None, inputs)


def our_loss(
    batch: SimpleNamespace,
    logp: torch.Tensor,
    loss_type: str,
    *,
    beta: float = 0.0,
    on_policy: bool = False,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo.grpo_loss on `batch` with TRL's knobs translated (dr_grpo's constant: MAX_COMPLETION_LENGTH)."""
    config = grpo.LossConfig(
        loss_type=loss_type,
        beta=beta,
        clip_eps_low=CLIP_EPS_LOW,
        clip_eps_high=CLIP_EPS_HIGH,
        importance_sampling_level=importance_sampling_level,
    )
    old_logp = logp.detach() if on_policy else batch.old_logp
    return grpo.grpo_loss(
        logp, old_logp, batch.ref_logp, batch.adv, batch.mask, config, MAX_COMPLETION_LENGTH
    )


def loss_and_grad(batch: SimpleNamespace, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logp) for loss_fn(logp) at the batch's logp, a fresh leaf."""
    logp = batch.logp.clone().requires_grad_()
    loss = loss_fn(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def assert_equal_to_trl(
    loss_type: str, on_policy: bool = False, tol: dict = TOL, *, ours_fn=None, **options
) -> None:
    """Ours (`ours_fn`, default grpo.grpo_loss's `our_loss`) and TRL's loss and gradient agree for
    `loss_type` with `options` (in TRL's parameter names)."""
    ours_fn = our_loss if ours_fn is None else ours_fn
    batch = crafted_batch()
    trainer = trl_trainer(loss_type, **options)
    theirs, their_grad = loss_and_grad(
        batch, lambda logp: trl_loss(trainer, batch, logp, on_policy=on_policy)
    )
    ours, our_grad = loss_and_grad(
        batch, lambda logp: ours_fn(batch, logp, loss_type, on_policy=on_policy, **options)[0]
    )
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(our_grad, their_grad, **tol)
    assert bool(our_grad.ne(0).any()), "a vacuous comparison: no gradient at all"


def test_the_crafted_batch_clips_on_both_sides_at_token_and_sequence_level():
    batch = crafted_batch()
    mask, adv = batch.mask.bool(), batch.adv[:, None]
    token_ratio = torch.exp(batch.logp - batch.old_logp)  # (N, T)
    lengths = batch.mask.sum(dim=1, keepdim=True)
    seq_ratio = torch.exp(((batch.logp - batch.old_logp) * batch.mask).sum(dim=1, keepdim=True) / lengths)
    for ratio in (token_ratio, seq_ratio.expand(N, T)):
        assert bool((mask & (ratio > 1 + CLIP_EPS_HIGH) & (adv > 0)).any())  # the upper clip binds
        assert bool((mask & (ratio < 1 - CLIP_EPS_LOW) & (adv < 0)).any())  # the lower clip binds
        assert bool((mask & (ratio > DELTA) & (adv < 0)).any())  # delta caps an unclipped ratio
        assert bool((mask & (ratio < 1) & (adv > 0)).any())  # the min picks r * A, no clip
    assert bool(
        ((batch.ref_logp - batch.logp)[mask] > 0).any() & ((batch.ref_logp - batch.logp)[mask] < 0).any()
    )


@pytest.mark.parametrize("on_policy", [False, True], ids=["mu>1", "mu=1"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_plain_clipped_losses_with_k3_kl_equal_trl(loss_type, on_policy):
    assert_equal_to_trl(loss_type, on_policy=on_policy, beta=0.04)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_level_importance_ratio_equals_trl(loss_type):
    assert_equal_to_trl(loss_type, importance_sampling_level="sequence")


def test_minus_inf_at_padding_makes_trl_nan_and_leaves_ours_finite():
    """Difference 3: old/ref log-probs of -inf at padded positions (never read by either loss's math)."""
    batch = crafted_batch()
    pad = ~batch.mask.bool()
    batch.old_logp = batch.old_logp.masked_fill(pad, float("-inf"))
    batch.ref_logp = batch.ref_logp.masked_fill(pad, float("-inf"))
    trainer = trl_trainer("dapo", beta=0.04)
    theirs, their_grad = loss_and_grad(batch, lambda logp: trl_loss(trainer, batch, logp))
    ours, our_grad = loss_and_grad(batch, lambda logp: our_loss(batch, logp, "dapo", beta=0.04)[0])
    assert theirs.isnan() and their_grad.isnan().any()
    assert ours.isfinite() and our_grad.isfinite().all() and bool((our_grad[pad] == 0).all())
