"""Group Relative Policy Optimization (GRPO) for VLMs: advantages, loss, completion log-probs, sampling.

Torch and the standard library only: copy it alone. Papers: GRPO from DeepSeekMath (Shao et al. 2024), on
PPO (Schulman et al. 2017); clip-higher and the token-level normaliser from DAPO (Yu et al. 2025); Dr. GRPO
(Liu et al. 2025); the k3 KL estimator from Schulman's "Approximating KL Divergence" (2020); the RLOO
(Ahmadian et al. 2024) and REINFORCE++ (Hu 2025) baselines.

Letters in shape comments: B prompts, G completions per prompt (the group), N = B * G rows, P prompt length
(left-padded), T completion length, V vocabulary. Rows [g*G, (g+1)*G) are prompt g's group.

The objective, minimised, for row i (reward r_i, completion tokens y_i1..y_iT, mask m_it):

    A_i      = (r_i - mean_group(r)) / (std_group(r) + eps)   group-relative advantage
    ratio_it = exp(logp_it - old_logp_it)                 logp_it = log pi(y_it | prompt, y_i<t)
    l_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    k3_it    = exp(d_it) - d_it - 1, d = ref_logp - logp   >= 0, unbiased for KL(pi || ref)
    loss     = aggregate(l, m)                            see `aggregate` for the four ways

In order below: advantages, the loss, the mask, log-probs, sampling. The package grpo_vlm re-arranges the
sampling (the same tokens) and the log-prob passes (equal to rounding) to use less time and memory.

Choices, where the literature differs:
- Advantage scale: the group's std (DeepSeekMath; unbiased, as TRL), the batch's, or none (Dr. GRPO: the std
  over-weights too-easy and too-hard prompts). Baseline: the group's mean, the other G - 1's (RLOO) or the
  batch's (REINFORCE++). Several rewards: summed then normalised, or each normalised in its group (GDPO).
- Token normaliser (`aggregate`): per sequence, then over sequences (DeepSeekMath: a long completion's tokens
  weigh less), the batch's tokens (DAPO), or a constant (Dr. GRPO: no length bias).
- Objective (`policy_term`): PPO's clip with two epsilons (DAPO's clip-higher), CISPO or SAPO; `delta` caps
  the ratio for A < 0 too. Ratio per token, or per sequence (GSPO: one decision per completion, one reward).
- KL: k3 in the loss per token (DeepSeekMath), not in the reward (PPO-RLHF); beta = 0 drops it and the
  reference pass (DAPO, Dr. GRPO); optionally times the ratio (DeepSeek-V3.2).
- EOS is an action (in the mask, with gradient); tokens after it are padding (exactly zero gradient).
  Truncated completions keep their tokens unless masked (DAPO's overlong filtering).
- Tokens trained: all, or the top-entropy share (`high_entropy_mask`, "80/20"); KL and normaliser count all.
- logp is the full temperature-scaled softmax (as TRL), though top_p and suppression truncate the sampler's,
  from an fp32 LM head: a bf16 model's bf16 logits above 16 are spaced 0.125, noise in every log-ratio.
- old_logp: logp.detach() at one optimiser step per rollout; for more, a no-grad `completion_logprobs`, not
  generate's log-probs, so the first ratio is exactly 1.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
AdvantageScale = Literal["group", "batch", "none"]
AdvantageBaseline = Literal["group", "rloo", "batch"]
LOSS_TYPES = get_args(LossType)
INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _require(config: object, name: str, ok: bool, message: str) -> None:
    if not ok:  # in the config's own terms, the field's name; a command line maps it to its flag
        raise ValueError(f"{name}: {message}, got {getattr(config, name)}")


@dataclass
class AdvantageConfig:
    """How rewards become advantages. Field names are the command line's flags."""

    adv_scale: AdvantageScale = "group"
    """Divide centred rewards by the group's std, the batch's std, or nothing (Dr. GRPO)."""
    adv_baseline: AdvantageBaseline = "group"
    """Compare a reward with its group's mean (GRPO), the other G - 1's (RLOO), the batch's (REINFORCE++)."""
    adv_clip: float | None = None
    """Clip advantages to [-c, c] (e.g. 5.0). None: no clipping."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """With several rewards: advantages of the weighted sum (default), or each reward normalised within its
    group first, then summed and normalised over the batch (GDPO; TRL's normalize_then_sum; no gate)."""

    def check(self) -> None:
        _require(self, "adv_clip", self.adv_clip is None or self.adv_clip > 0, "must be > 0")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
    baseline: str = "group",
) -> Tensor:
    """Advantages (N,) = (r - baseline) / (std + eps), clipped to [-clip, clip] if given (`AdvantageConfig`
    lists the choices). NOTE: a zero-variance group gets exactly 0, never NaN, with a group baseline."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"need rewards (N,), N divisible by group_size >= 2: {group_size=}, {rewards.shape}")
    scales, baselines = get_args(AdvantageScale), get_args(AdvantageBaseline)
    if scale not in scales or baseline not in baselines:
        raise ValueError(f"need scale in {scales} and baseline in {baselines}")
    if not bool(torch.isfinite(rewards).all()):  # a NaN would spread to its whole group
        raise ValueError("rewards must be finite")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, group_size)  # (B, G)
    mean = rewards.mean() if baseline == "batch" else grouped.mean(dim=1, keepdim=True)  # () or (B, 1)
    centered = grouped - mean  # (B, G)
    if baseline != "batch":  # the mean of equal floats need not round back to them: force the promised 0
        centered = torch.where((grouped == grouped[:, :1]).all(dim=1, keepdim=True), 0.0, centered)
    if baseline == "rloo":  # r_i - (sum - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
        centered = centered * (group_size / (group_size - 1))
    if scale != "none":
        std = grouped.std(dim=1, keepdim=True) if scale == "group" else rewards.std()  # (B, 1) or ()
        centered = centered / (std + eps)  # (B, G)
    adv = centered.reshape(-1)  # (N,) back to row order
    return adv if clip is None else adv.clamp(-clip, clip)


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
    """Advantages (N,): `group_advantages` of rewards (N,), or (GDPO) of `normalized_reward_sum` of components
    (N, K) and weights (K,) over the batch. NOTE: GDPO ignores adv_scale and adv_baseline, not adv_clip."""
    scale, baseline = config.adv_scale, config.adv_baseline
    if config.multi_objective_aggregation != "sum_then_normalize":
        if components is None or weights is None:
            raise ValueError("normalize_then_sum needs components (N, K) and weights (K,)")
        rewards, scale, baseline = normalized_reward_sum(components, weights, group_size), "batch", "batch"
    return group_advantages(rewards, group_size, scale=scale, clip=config.adv_clip, baseline=baseline)


@dataclass
class LossConfig:
    """The objective's settings. Field names are the command line's flags."""

    loss_type: LossType = "dapo"
    """grpo, bnpo, dr_grpo, dapo: PPO-clip normalised per sequence, per process's tokens, by a constant, by
    the batch's tokens; cispo (MiniMax-M1): truncated detached ratio; sapo (Qwen): smooth gate."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """The importance ratio per token, or per sequence (GSPO: exp of the mean log-ratio; eps ~3e-4/4e-4)."""
    beta: float = 0.04
    """KL penalty weight (k3 estimator against the adapter-free reference). 0 skips the reference pass."""
    clip_eps_low: float = 0.2
    """PPO clip: ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """PPO clip: ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher when > clip_eps_low)."""
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

    def check(self) -> None:
        delta_ok = self.delta is None or self.delta > 1 + self.clip_eps_high
        _require(self, "beta", self.beta >= 0, "must be >= 0 (0 drops the KL term and the reference pass)")
        _require(self, "clip_eps_low", 0 <= self.clip_eps_low < 1, "must be in [0, 1)")
        _require(self, "clip_eps_high", self.clip_eps_high >= 0, "must be >= 0")
        _require(self, "delta", delta_ok, "must be > 1 + clip_eps_high")
        _require(self, "sapo_temperature_pos", self.sapo_temperature_pos > 0, "must be > 0")
        _require(self, "sapo_temperature_neg", self.sapo_temperature_neg > 0, "must be > 0")
        _require(self, "top_entropy_quantile", 0 < self.top_entropy_quantile <= 1, "must be in (0, 1]")


@dataclass
class BatchTotals:
    """The whole batch's counts a loss is normalised by, when the rows are split (micro-batches, ranks)."""

    num_rows: int
    num_tokens: float | Tensor
    max_completion_length: int | None = None  # dr_grpo's constant (the sampler's max_new_tokens)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 per token, exp(d) - d - 1 >= 0 with d = ref_logp - logp: unbiased for KL(pi || ref) on
    tokens sampled from pi. expm1: exp(d) - 1 would cancel for small d (fp32 could go negative)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


def aggregate(per_token: Tensor, mask: Tensor, loss_type: str, totals: BatchTotals | None = None) -> Tensor:
    """Reduce a per-token quantity x (N, T) under mask m (N, T) to a scalar; L_i = sum_t m_it:

        grpo, sapo         (1 / num_rows) * sum_i (sum_t m_it x_it) / L_i        per sequence, then over them
        bnpo, dapo, cispo  sum_it m_it x_it / num_tokens                          this process's / the batch's
        dr_grpo            sum_it m_it x_it / (num_rows * max_completion_length)  a constant: no length bias
    sapo and cispo as TRL. `totals`: the whole batch's counts when the rows are split, so the parts sum."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    mask = mask.bool()
    per_token = torch.where(mask, per_token, 0.0)  # (N, T) `where`, not a product: inf * 0 would be NaN
    num_rows = mask.shape[0] if totals is None else totals.num_rows
    if loss_type in ("grpo", "sapo"):
        lengths = mask.sum(dim=1).clamp(min=1)  # (N,) clamp: only T == 0 gives a zero-length row
        return (per_token.sum(dim=1) / lengths).sum() / num_rows
    if loss_type == "dr_grpo":
        if totals is None or totals.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the sampler's max_new_tokens)")
        return per_token.sum() / (num_rows * totals.max_completion_length)
    return per_token.sum() / (mask.sum().clamp(min=1) if totals is None else totals.num_tokens)  # num_tokens


def policy_term(ratio: Tensor, adv: Tensor, logp: Tensor, config: LossConfig) -> Tensor:
    """The per-token policy loss of each objective, from the importance ratio r (N, T) or (N, 1), adv (N, 1)
    and logp (N, T); minimised. One screen to diff them (gradients at r = 1 are all -A grad logp):

        PPO / GRPO / DAPO / Dr. GRPO  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)      clip: no gradient
          two-sided (INTELLECT-2)     -min(min(r, delta) A, clip(r, ...) A)                caps r when A < 0
        CISPO (MiniMax-M1, 2025)      -sg(min(r, 1 + eps_high)) A logp                     clipped still learn
        SAPO (Qwen, 2025)             -sigmoid(tau (r - 1)) 4 / tau A, tau = tau_pos if A > 0 else tau_neg
    """
    if config.loss_type == "cispo":
        # NOTE: TRL's epsilon_high is the bound (5.0 advised), ours 1 + clip_eps_high: TRL's 5.0 is our 4.0.
        return -torch.clamp(ratio, max=1 + config.clip_eps_high).detach() * adv * logp
    if config.loss_type == "sapo":  # a smooth gate, not a hard clip, steeper (smaller trust region) for A < 0
        tau_pos = adv.new_tensor(config.sapo_temperature_pos)
        tau = torch.where(adv > 0, tau_pos, adv.new_tensor(config.sapo_temperature_neg))
        return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_eps_low, 1 + config.clip_eps_high)
    if config.delta is not None:  # NOTE: for A < 0 the plain min keeps r unbounded above; delta caps it
        ratio = torch.clamp(ratio, max=config.delta)
    return -torch.minimum(ratio * adv, clipped_ratio * adv)  # pessimistic: clipped only where that lowers r A


def high_entropy_mask(
    entropy: Tensor, mask: Tensor, quantile: float, *, pool: Tensor | None = None
) -> Tensor:
    """(N, T) bool: unmasked tokens in the top `quantile` by entropy (Wang et al. 2025, "Beyond the 80/20
    rule": "forking" tokens carry the signal) of `pool` if given (all ranks' tokens), else of these rows'."""
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
) -> tuple[Tensor, dict[str, float]]:
    """The loss (scalar) and token-mean stats from logp/old_logp/ref_logp/mask/token_mask (N, T), adv (N,)."""
    if config.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    if config.importance_sampling_level not in get_args(ImportanceSamplingLevel):
        raise ValueError(f"importance_sampling_level must be one of {get_args(ImportanceSamplingLevel)}")
    mask = mask.bool()
    adv = adv.to(logp.dtype)[:, None]  # (N, 1) one advantage per sequence, shared by its tokens
    # Mask BEFORE exp, here and in k3: a huge masked log-ratio gives inf, and where's 0 gradient * inf is NaN.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)  # (N, T)
    if config.importance_sampling_level == "sequence":  # one ratio per row, length-normalised (GSPO)
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1)
    ratio = torch.exp(log_ratio)  # (N, T) or (N, 1)
    per_token = policy_term(ratio, adv, logp, config).expand(mask.shape)  # (N, T) from (N, T) or (N, 1)
    per_token = per_token if token_mask is None else torch.where(token_mask, per_token, 0.0)
    kl = None if ref_logp is None else kl_k3(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0))
    if kl is not None and config.use_bias_correction_kl:  # DeepSeek-V3.2
        kl = kl * ratio
    if config.beta > 0:  # ref_logp is given (checked above)
        per_token = per_token + config.beta * kl
    loss = aggregate(per_token, mask, config.loss_type, totals)
    with torch.no_grad():  # a (N, 1) ratio broadcasts over the mask's T
        low = ((ratio < 1 - config.clip_eps_low) & (adv < 0)).float()  # the tokens whose clip binds
        high = ((ratio > 1 + config.clip_eps_high) & (adv > 0)).float()
        values = {"clip_frac_low": low, "clip_frac_high": high, "ratio_mean": ratio, "kl": kl}
        values = {key: v for key, v in values.items() if v is not None}  # no kl without ref_logp
        n = mask.sum().clamp(min=1)
        means = torch.stack([torch.where(mask, v, 0).sum() / n for v in values.values()])
    return loss, dict(zip(values, means.tolist()))  # one device sync for all the stats


def completion_mask(completion_ids: Tensor, eos_token_id: int | Sequence[int]) -> tuple[Tensor, Tensor]:
    """Loss mask (N, T) and `truncated` (N,), from lengths, never token values (pad == eos is safe): a row
    runs through its first EOS (one id or several; EOS-first rows too), else all T (cut at max_new_tokens)."""
    T = completion_ids.shape[1]
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_token_id, device=completion_ids.device))  # (N, T)
    truncated = ~is_eos.any(dim=1)  # (N,)
    if T == 0:  # NOTE: nothing generated (max_new_tokens == 0); avoids argmax of an empty dim
        return is_eos, truncated
    # argmax returns the FIRST maximal index, i.e. the first EOS; rows without one have length T.
    lengths = torch.where(truncated, T, is_eos.to(torch.int8).argmax(dim=1) + 1)  # (N,) +1: the EOS is in
    return torch.arange(T, device=completion_ids.device)[None, :] < lengths[:, None], truncated


def logprobs_from_logits(
    logits: Tensor, completion_ids: Tensor, *, temperature: float, return_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """logp [and entropy] (N, T) of shifted logits (N, T, V), temperature 0 as 1; holds (N, T, V) in fp32."""
    temperature = temperature if temperature > 0 else 1.0
    # fp32, divided after the upcast: a bf16 logsumexp of ~10-20 is off by up to ~0.06, 6% in the ratio.
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, T, V)
    logp = logprobs.gather(-1, completion_ids[..., None]).squeeze(-1)  # (N, T)
    if not return_entropy:
        return logp, None
    with torch.no_grad():  # a metric; entr(p) = -p log p with entr(0) = 0: -inf logits give 0, not NaN
        return logp, torch.special.entr(torch.softmax(logits.float() / temperature, dim=-1)).sum(dim=-1)


def check_inputs(inputs: dict[str, Tensor]) -> None:
    """Refuse prompt batches that generation and the recompute would silently read differently."""
    if set(inputs) - set(INPUT_KEYS):
        raise ValueError(f"unexpected prompt inputs {sorted(inputs)}; expected a subset of {INPUT_KEYS}")
    if not bool(inputs["attention_mask"][:, -1].all()):  # NOTE: right padding: generate only warns
        raise ValueError("prompts must be LEFT-padded: attention_mask[:, -1] must be 1 on every row")
    if "image_grid_thw" in inputs and "mm_token_type_ids" not in inputs:  # NOTE: else a silent 1D fallback
        raise ValueError("image inputs need mm_token_type_ids to build Qwen-VL's 3D mRoPE positions")
    if ("pixel_values" in inputs) != ("image_grid_thw" in inputs):
        raise ValueError("pixel_values and image_grid_thw must be given together")


def recompute_inputs(inputs: dict[str, Tensor], completion_ids: Tensor) -> dict[str, Tensor]:
    """The model inputs for prompt + completion (N, P + T): exactly what generate saw, in one forward pass."""
    check_inputs(inputs)
    # Ones over the whole completion, as generate appends them: tokens after EOS reach only masked positions.
    T, ones = completion_ids.shape[1], torch.ones_like(completion_ids, dtype=inputs["attention_mask"].dtype)
    attention_mask = torch.cat([inputs["attention_mask"], ones], dim=1)  # (N, P + T)
    input_ids = torch.cat([inputs["input_ids"], completion_ids], dim=1)  # (N, P + T)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inputs:  # (N, P), text after it; (N, P + T'): tool images too (multiturn.py)
        kwargs["mm_token_type_ids"] = F.pad(inputs["mm_token_type_ids"], (0, T))[:, : input_ids.shape[1]]
    if "image_grid_thw" in inputs:  # 3D mRoPE positions come from mm_token_type_ids + attention_mask
        kwargs.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    else:  # NOTE: numbered from each row's first real token, as generate does; arange agrees only to rounding
        kwargs["position_ids"] = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (N, P + T)
    return kwargs


def completion_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, Tensor],
    completion_ids: Tensor,
    *,
    temperature: float,
    return_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(completion token | prompt, earlier tokens) (N, T) [and the entropy], in one forward pass."""
    T, head = completion_ids.shape[1], model.get_output_embeddings()  # NOTE: read as bias-free, uncapped
    hidden = model.base_model(**recompute_inputs(inputs, completion_ids), use_cache=False).last_hidden_state
    # Off-by-one: position j predicts token j + 1, so P - 1 predicts completion token 0; the last is dropped.
    # The LM head in fp32: bf16 logits above 16 are spaced 0.125, noise in every log-ratio of mu > 1.
    logits = hidden[:, -T - 1 : -1].float() @ head.weight.float().T  # (N, T, V) positions P - 1 .. P + T - 2
    return logprobs_from_logits(
        logits, completion_ids, temperature=temperature, return_entropy=return_entropy
    )


@dataclass
class SamplingConfig:
    """How completions are drawn. Field names are the command line's flags."""

    max_new_tokens: int = 24
    """Longest completion; a completion that reaches it without EOS counts as truncated."""
    temperature: float = 1.0
    """Sampling temperature; the recompute divides logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""

    def check(self) -> None:
        greedy = "must be > 0: at 0 every completion of a group is the same"
        _require(self, "max_new_tokens", self.max_new_tokens >= 1, "must be >= 1")
        _require(self, "temperature", self.temperature > 0, greedy)
        _require(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")


# generate() fills every option it is not given from the checkpoint's generation_config, then from library
# defaults (top_k=50; Qwen2.5-VL-Instruct ships a repetition penalty). These switch every other processor off.
NO_OTHER_PROCESSORS = {
    **dict(top_k=None, min_p=None, top_h=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0),
    **dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0),
    **dict(encoder_no_repeat_ngram_size=0, bad_words_ids=None, sequence_bias=None),
    **dict(min_length=0, min_new_tokens=None, exponential_decay_length_penalty=None, num_beams=1),
    **dict(forced_bos_token_id=None, forced_eos_token_id=None, begin_suppress_tokens=None),
    **dict(guidance_scale=None, watermarking_config=None, remove_invalid_values=False),
}


def check_sampling(
    temperature: float, top_p: float, eos_token_id: int | Sequence[int], suppress_token_ids: Sequence[int]
) -> None:
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    if set(torch.as_tensor(eos_token_id).reshape(-1).tolist()) & set(suppress_token_ids):
        raise ValueError("suppress_token_ids must not contain eos_token_id: the model could never stop")


@torch.no_grad()
def sample_completions(
    model: torch.nn.Module,
    inputs: dict[str, Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    suppress_token_ids: Sequence[int] = (),
    return_logprobs: bool = False,
    num_return_sequences: int = 1,
) -> tuple[Tensor, Tensor | None]:
    """Completion ids (N, T) [and log-probs, for tests] of num_return_sequences = G samples of each prompt."""
    check_inputs(inputs)
    check_sampling(temperature, top_p, eos_token_id, suppress_token_ids)
    greedy = temperature == 0
    out = model.generate(
        **inputs,  # input_ids, attention_mask and the image tensors (INPUT_KEYS)
        **NO_OTHER_PROCESSORS,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else top_p,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,  # else the checkpoint's own list, which completion_mask would not know
        pad_token_id=pad_token_id,
        suppress_tokens=list(suppress_token_ids) or None,
        num_return_sequences=num_return_sequences,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=return_logprobs,
    )
    completion_ids = out.sequences[:, inputs["input_ids"].shape[1] :]  # (N, T) generate returns prompt + new
    if not return_logprobs:
        return completion_ids, None
    logits = torch.stack(out.logits, dim=1)  # (N, T, V) raw: before temperature, top_p and suppression
    logp, _ = logprobs_from_logits(logits, completion_ids, temperature=temperature, return_entropy=False)
    return completion_ids, logp
