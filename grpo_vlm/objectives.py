"""Every objective the package's flags select, built from grpo.py's parts (its loss half is the card's:
PPO-clip with eps_low / eps_high, the k3 KL, the grpo / dapo / dr_grpo normalisers, the token or sequence
ratio, group advantages). The policy term of each, on one screen (minimised; at r = 1 all are -A grad logp):

    PPO / GRPO / DAPO / Dr. GRPO  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)      grpo.clipped_objective
      two-sided (INTELLECT-2)     -min(min(r, delta) A, clip(r, ...) A)                caps r when A < 0
    CISPO (MiniMax-M1, 2025)      -sg(min(r, 1 + eps_high)) A logp                     clipped still learn
    SAPO (Qwen, 2025)             -sigmoid(tau (r - 1)) 4 / tau A, tau = tau_pos if A > 0 else tau_neg

and around it: bnpo (TRL's per-process token mean: dapo's in one process), cispo normalised as dapo and sapo
as grpo (as TRL); the policy term on the top-entropy share of tokens only (Wang et al. 2025, "Beyond the 80/20
rule"; the KL and the normaliser still count every token); the KL times the ratio (DeepSeek-V3.2's
bias-corrected KL); advantages against the other G - 1 (RLOO, Ahmadian et al. 2024) or the batch's mean
(REINFORCE++, Hu 2025), GDPO's rewards normalised one by one (TRL's normalize_then_sum), and clipped.

Parts of a batch (micro-batches, ranks): `grpo_loss(..., totals=)` scales a part's loss by its share of the
whole batch's rows or tokens, so the parts' losses and gradients sum to the whole batch's (to rounding; one
part: exactly, the share is 1). docs/variants.md compares the objectives on the default task.
Letters as in grpo.py: B prompts, G group size, N = B * G rows, T completion length, K rewards.
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

import grpo

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
AdvantageBaseline = Literal["group", "rloo", "batch"]
LOSS_TYPES = get_args(LossType)
# The reference's normaliser (grpo.aggregate) each loss type divides by.
NORMALISER = {
    "grpo": "grpo",
    "bnpo": "dapo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "cispo": "dapo",
    "sapo": "grpo",
}


def _require(config: object, name: str, ok: bool, message: str) -> None:
    if not ok:  # the field's name, as grpo.py's settings raise; the command line names the flag
        raise ValueError(f"{name}: {message}, got {getattr(config, name)}")


@dataclass
class LossConfig(grpo.LossConfig):
    """grpo.LossConfig's settings and the variants'. Field names are the command line's flags."""

    loss_type: LossType = "dapo"
    """grpo, bnpo, dr_grpo, dapo: PPO-clip normalised per sequence, per process's tokens, by a constant, by
    the batch's tokens; cispo (MiniMax-M1): truncated detached ratio; sapo (Qwen): smooth gate."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): cap the ratio at delta for negative advantages too (e.g. 4.0)."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for positive advantages."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for negative advantages (steeper: a tighter trust region)."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on this top share of the batch's tokens by entropy (0.2: "80/20")."""
    use_bias_correction_kl: bool = False
    """Weight the k3 KL term by the importance ratio (DeepSeek-V3.2; TRL's default is on, ours off)."""

    def __post_init__(self) -> None:
        """Checked by `check` once the command line is parsed, not here: tyro draws its own box around an
        error raised while it builds the settings, where the command line prints one line naming the flag."""

    def check(self) -> None:
        grpo.LossConfig.__post_init__(self)  # the reference's checks, the loss types this class allows
        _require(
            self,
            "delta",
            self.delta is None or self.delta > 1 + self.clip_eps_high,
            "must be > 1 + clip_eps_high",
        )
        _require(self, "sapo_temperature_pos", self.sapo_temperature_pos > 0, "must be > 0")
        _require(self, "sapo_temperature_neg", self.sapo_temperature_neg > 0, "must be > 0")
        _require(self, "top_entropy_quantile", 0 < self.top_entropy_quantile <= 1, "must be in (0, 1]")


@dataclass
class AdvantageConfig:
    """How rewards become advantages. Field names are the command line's flags."""

    adv_scale: grpo.AdvantageScale = "group"
    """Divide centred rewards by the group's std, the batch's std, or nothing (Dr. GRPO)."""
    adv_baseline: AdvantageBaseline = "group"
    """Compare a reward with its group's mean (GRPO), the other G - 1's (RLOO), the batch's (REINFORCE++)."""
    adv_clip: float | None = None
    """Clip advantages to [-c, c] (e.g. 5.0). None: no clipping."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """With several rewards: advantages of the weighted sum (default), or each reward normalised within its
    group first, then summed and normalised over the batch (GDPO; TRL's normalize_then_sum; no gate)."""

    def check(self) -> None:
        grpo.check_choices(self)
        _require(self, "adv_clip", self.adv_clip is None or self.adv_clip > 0, "must be > 0")


@dataclass
class BatchTotals:
    """The whole batch's counts when its rows are split (micro-batches, ranks): a part's loss is its share."""

    num_rows: int
    num_tokens: float | Tensor


# --- The loss -----------------------------------------------------------------------------------------------
def policy_term(ratio: Tensor, adv: Tensor, logp: Tensor, config: LossConfig) -> Tensor:
    """The per-token policy loss of each objective (the table above), from the importance ratio r (N, T) or
    (N, 1), adv (N, 1) and logp (N, T)."""
    if config.loss_type == "cispo":
        # NOTE: TRL's epsilon_high is the bound (5.0 advised), ours 1 + clip_eps_high: TRL's 5.0 is our 4.0.
        return -torch.clamp(ratio, max=1 + config.clip_eps_high).detach() * adv * logp
    if config.loss_type == "sapo":  # a smooth gate, not a hard clip, steeper (smaller trust region) for A < 0
        tau_pos = adv.new_tensor(config.sapo_temperature_pos)
        tau = torch.where(adv > 0, tau_pos, adv.new_tensor(config.sapo_temperature_neg))
        return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    if config.delta is not None:  # NOTE: for A < 0 the plain min keeps r unbounded above; delta caps it
        ratio = torch.clamp(ratio, max=config.delta)  # clip(min(r, delta)) = clip(r): delta > 1 + eps_high
    return grpo.clipped_objective(ratio, adv, config)


def high_entropy_mask(
    entropy: Tensor, mask: Tensor, quantile: float, *, pool: Tensor | None = None
) -> Tensor:
    """(N, T) bool: unmasked tokens in the top `quantile` by entropy ("forking" tokens carry the signal) of
    `pool` if given (all ranks' tokens), else of these rows'."""
    pool = entropy[mask.bool()] if pool is None else pool  # the unmasked tokens only
    return (entropy >= torch.quantile(pool.float(), 1 - quantile)) & mask.bool()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    token_mask: Tensor | None = None,
    totals: BatchTotals | None = None,
    max_completion_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """grpo.grpo_loss with the variants: `policy_term`, the policy term on `token_mask` (N, T) only, the
    bias-corrected KL, and with `totals`, these rows' loss as their share of the whole batch's."""
    if config.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    mask = mask.bool()
    adv = adv.to(logp.dtype)[:, None]  # (N, 1)
    ratio = grpo.importance_ratio(logp, old_logp, mask, config.importance_sampling_level)  # (N, T) or (N, 1)
    per_token = policy_term(ratio, adv, logp, config).expand(mask.shape)  # (N, T)
    if token_mask is not None:  # the top-entropy tokens: the policy term only
        per_token = torch.where(token_mask, per_token, 0.0)
    kl = None
    if ref_logp is not None:
        kl = grpo.kl_k3(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0))  # (N, T)
        if config.use_bias_correction_kl:  # DeepSeek-V3.2
            kl = kl * ratio
    if config.beta > 0:
        per_token = per_token + config.beta * kl
    normaliser = NORMALISER[config.loss_type]
    loss = grpo.aggregate(per_token, mask, normaliser, max_completion_length)
    if totals is not None:  # these rows' share of the batch's tokens (dapo) or rows (grpo, dr_grpo)
        if normaliser == "dapo":  # in the loss's dtype: a float32 share would round a float64 loss
            loss = loss * (mask.sum().to(loss.dtype) / totals.num_tokens)
        else:
            loss = loss * (mask.shape[0] / totals.num_rows)
    return loss, grpo.loss_stats(ratio, adv, kl, mask, config)


# --- Advantages ---------------------------------------------------------------------------------------------
def batch_baseline(rewards: Tensor, group_size: int, scale: str, eps: float = 1e-4) -> Tensor:
    """Advantages (N,) against the batch's mean (REINFORCE++), divided by the group's std, the batch's, or
    nothing."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"need rewards (N,), N divisible by group_size >= 2: {group_size=}, {rewards.shape}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, group_size)  # (B, G)
    centered = grouped - rewards.mean()  # (B, G)
    if scale != "none":
        std = grouped.std(dim=1, keepdim=True) if scale == "group" else rewards.std()  # (B, 1) or ()
        centered = centered / (std + eps)
    return centered.reshape(-1)


def normalized_reward_sum(
    components: Tensor, weights: Tensor, group_size: int, *, eps: float = 1e-4
) -> Tensor:
    """GDPO: each of components (N, K) z-scored in its group, then weighted by weights (K,) and summed (N,).
    A reward constant in a group adds 0 there, so a binary format reward cannot drown another's signal."""
    grouped = components.to(torch.promote_types(components.dtype, torch.float32))
    grouped = grouped.view(-1, group_size, components.shape[1])  # (B, G, K)
    z = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)  # (B, G, K)
    z = torch.where((grouped == grouped[:, :1]).all(dim=1, keepdim=True), 0.0, z)  # constant: 0, not NaN
    # weights.to(z): z's device as well as its dtype (weights made on the CPU meet components on a GPU).
    return (z.reshape(components.shape) * weights.to(z)).sum(dim=1)  # (N,)


def advantages(
    rewards: Tensor,
    components: Tensor | None,
    weights: Tensor | None,
    group_size: int,
    config: AdvantageConfig,
) -> Tensor:
    """Advantages (N,) of rewards (N,) as `config` asks: grpo.group_advantages, RLOO's, the batch's, or GDPO's
    of components (N, K) and weights (K,); clipped to +-adv_clip. NOTE: GDPO ignores scale and baseline."""
    if config.multi_objective_aggregation != "sum_then_normalize":
        if components is None or weights is None:
            raise ValueError("normalize_then_sum needs components (N, K) and weights (K,)")
        summed = normalized_reward_sum(components, weights, group_size)
        adv = batch_baseline(summed, group_size, "batch")
    elif config.adv_baseline == "batch":
        adv = batch_baseline(rewards, group_size, config.adv_scale)
    else:
        adv = grpo.group_advantages(rewards, group_size, scale=config.adv_scale)
        if config.adv_baseline == "rloo":  # r_i - (sum - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
            adv = adv * (group_size / (group_size - 1))
    return adv if config.adv_clip is None else adv.clamp(-config.adv_clip, config.adv_clip)
