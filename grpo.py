"""Group Relative Policy Optimization (GRPO) for VLMs: advantages, mask, loss; completion log-probs, sampling.

Papers: GRPO from DeepSeekMath (Shao et al. 2024), on PPO (Schulman et al. 2017); clip-higher and the
token-level normaliser from DAPO (Yu et al. 2025); Dr. GRPO (Liu et al. 2025); GSPO's sequence-level ratio
(Zheng et al. 2025); the k3 KL estimator from Schulman's "Approximating KL Divergence" (2020).

Letters in shape comments: B prompts, G completions per prompt (the group), N = B * G rows, P prompt length
(left-padded), T completion length, V vocabulary, H hidden size. Rows [b*G, (b+1)*G) are prompt b's group.

The objective, minimised, for row i (reward r_i, completion tokens y_i1..y_iT, mask m_it):

    A_i      = (r_i - mean_group(r)) / (std_group(r) + eps)   group-relative advantage
    ratio_it = exp(logp_it - old_logp_it)                 logp_it = log pi(y_it | prompt, y_i<t)
    l_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    k3_it    = exp(d_it) - d_it - 1, d = ref_logp - logp   >= 0, unbiased for KL(pi || ref)
    loss     = aggregate(l, m)                            see `aggregate` for the three ways

Two halves. The loss half (advantages, mask, k3, aggregate, the loss) is tensors in, tensors out: copy it
into any project. The log-prob and sampling half needs a transformers model: `model.base_model(**inputs)`
(the transformer without its LM head), `model.get_output_embeddings()` (a bias-free head whose logits are
neither scaled nor capped; others are refused), `model.generate` and `model.config`. The package grpo_vlm
adds objectives (CISPO, SAPO, RLOO, GDPO, ...) and re-arranges sampling and the log-prob passes for speed.

Choices, where the literature differs:
- Advantage scale: the group's std (DeepSeekMath; unbiased, as TRL), the batch's, or none (Dr. GRPO: the std
  over-weights too-easy and too-hard prompts). The baseline is the group's mean.
- Token normaliser (`aggregate`): per sequence, then over sequences (DeepSeekMath: a long completion's tokens
  weigh less), the batch's tokens (DAPO, the default), or a constant (Dr. GRPO: no length bias).
- Ratio per token, or per sequence (GSPO: one decision per completion, as there is one reward per completion).
- KL: k3 in the loss per token (DeepSeekMath), not in the reward (PPO-RLHF); beta = 0 drops it (DAPO).
- EOS is an action (in the mask, with gradient); tokens after it are padding (exactly zero gradient).
  Truncated completions (no EOS within max_new_tokens) are trained like the others.
- logp is the full temperature-scaled softmax (as TRL), though top_p and suppression truncate the sampler's,
  from an fp32 LM head: a bf16 model's bf16 logits above 16 are spaced 0.125, noise in every log-ratio.
- old_logp: logp.detach() at one optimiser step per rollout; for more, a no-grad `completion_logprobs`, not
  generate's log-probs, so the first ratio is exactly 1.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

LossType = Literal["grpo", "dapo", "dr_grpo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
AdvantageScale = Literal["group", "batch", "none"]
INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _require(config: object, name: str, ok: bool, message: str) -> None:
    if not ok:  # in the config's own terms, the field's name; a command line maps it to its flag
        raise ValueError(f"{name}: {message}, got {getattr(config, name)}")


def check_choices(config: object) -> None:
    """A dataclass does not check its fields' types: refuse a value outside a Literal field's choices."""
    for field in fields(config):
        if getattr(field.type, "__origin__", None) is Literal:
            choices = get_args(field.type)
            _require(config, field.name, getattr(config, field.name) in choices, f"must be one of {choices}")


@dataclass
class LossConfig:
    """The objective's settings, checked when built. Field names are the command line's flags."""

    loss_type: LossType = "dapo"
    """The normaliser (`aggregate`): grpo (per sequence), dapo (the batch's tokens), dr_grpo (a constant)."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """The importance ratio per token, or per sequence (GSPO: exp of the mean log-ratio; eps ~3e-4/4e-4)."""
    beta: float = 0.04
    """KL penalty weight (k3 estimator against the adapter-free reference). 0 skips the reference pass."""
    clip_eps_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """PPO clip: the ratio is clipped above at 1 + clip_eps_high (DAPO's clip-higher when > clip_eps_low)."""

    def __post_init__(self) -> None:
        check_choices(self)
        _require(self, "beta", 0 <= self.beta < math.inf, "must be a number >= 0 (0 drops the KL term)")
        _require(self, "clip_eps_low", 0 <= self.clip_eps_low < 1, "must be in [0, 1)")
        _require(self, "clip_eps_high", 0 <= self.clip_eps_high < 1e38, "must be a number in [0, 1e38)")


# --- Advantages ---------------------------------------------------------------------------------------------
def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Advantages (N,) = (r - group mean) / (std + eps): the group's std, the batch's, or none (Dr. GRPO).
    NOTE: a group of equal rewards gets exactly 0, never NaN: it teaches nothing through the policy term, but
    its tokens still count in the loss's normaliser and still get the KL term's gradient."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"need rewards (N,), N divisible by group_size >= 2: {group_size=}, {rewards.shape}")
    if scale not in get_args(AdvantageScale):
        raise ValueError(f"scale must be one of {get_args(AdvantageScale)}, got {scale!r}")
    if not bool(torch.isfinite(rewards).all()):  # a NaN would spread to its whole group
        raise ValueError("rewards must be finite")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (B, G)
    # The mean of equal floats need not round back to them: force the promised 0.
    centered = torch.where((grouped == grouped[:, :1]).all(dim=1, keepdim=True), 0.0, centered)
    if scale != "none":
        std = grouped.std(dim=1, keepdim=True) if scale == "group" else rewards.std()  # (B, 1) or ()
        centered = centered / (std + eps)  # (B, G)
    return centered.reshape(-1)  # (N,) back to row order


# --- The mask -----------------------------------------------------------------------------------------------
def completion_mask(completion_ids: Tensor, eos_token_id: int | Sequence[int]) -> tuple[Tensor, Tensor]:
    """Loss mask (N, T) and `truncated` (N,). A row's length runs through its first EOS (one id or several;
    EOS-first rows too), else all T (cut at max_new_tokens); the mask is then made from positions, never from
    the token values after that EOS: padding equal to EOS is safe."""
    T = completion_ids.shape[1]
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_token_id, device=completion_ids.device))  # (N, T)
    truncated = ~is_eos.any(dim=1)  # (N,)
    if T == 0:  # NOTE: nothing generated (max_new_tokens == 0); avoids argmax of an empty dim
        return is_eos, truncated
    # argmax returns the FIRST maximal index, i.e. the first EOS; rows without one have length T.
    lengths = torch.where(truncated, T, is_eos.to(torch.int8).argmax(dim=1) + 1)  # (N,) +1: the EOS is in
    return torch.arange(T, device=completion_ids.device)[None, :] < lengths[:, None], truncated


# --- The loss -----------------------------------------------------------------------------------------------
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 per token, exp(d) - d - 1 >= 0 with d = ref_logp - logp: unbiased for KL(pi || ref) on
    tokens sampled from pi. expm1: exp(d) - 1 would cancel for small d (fp32 could go negative)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


def aggregate(
    per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int | None = None
) -> Tensor:
    """Reduce a per-token quantity x (N, T) under mask m (N, T) to a scalar; L_i = sum_t m_it:

        grpo     (1 / N) * sum_i (sum_t m_it x_it) / L_i         per sequence, then over sequences
        dapo     sum_it m_it x_it / sum_it m_it                  the batch's tokens
        dr_grpo  sum_it m_it x_it / (N * max_completion_length)  a constant: no length bias
    Masked positions count nowhere: their values may be anything, inf and NaN included."""
    if loss_type not in get_args(LossType):
        raise ValueError(f"loss_type must be one of {get_args(LossType)}, got {loss_type!r}")
    mask = mask.bool()
    per_token = torch.where(mask, per_token, 0.0)  # (N, T) `where`, not a product: inf * 0 would be NaN
    if loss_type == "grpo":
        lengths = mask.sum(dim=1).clamp(min=1)  # (N,) clamp: only T == 0 gives a zero-length row
        return (per_token.sum(dim=1) / lengths).sum() / mask.shape[0]
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the sampler's max_new_tokens)")
        return per_token.sum() / (mask.shape[0] * max_completion_length)
    return per_token.sum() / mask.sum().clamp(min=1)  # dapo


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """pi / pi_old per token (N, T), or per sequence (N, 1): exp of the row's mean log-ratio (GSPO)."""
    # Mask BEFORE exp, here and in k3: a huge masked log-ratio gives inf, and where's 0 gradient * inf is NaN.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)  # (N, T)
    if level == "sequence":  # length-normalised, so long and short completions move on one scale
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1)
    elif level != "token":
        raise ValueError(f"importance_sampling_level must be one of {get_args(ImportanceSamplingLevel)}")
    return torch.exp(log_ratio)


def clipped_objective(ratio: Tensor, adv: Tensor, config: LossConfig) -> Tensor:
    """PPO's clipped surrogate, minimised: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), per token (or
    per row) of r (N, T) or (N, 1) and A (N, 1). The clip takes the gradient away only where it lowers r A:
    r above 1 + eps_high with A > 0, r below 1 - eps_low with A < 0."""
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_eps_low, 1 + config.clip_eps_high)
    return -torch.minimum(ratio * adv, clipped_ratio * adv)


def loss_stats(ratio: Tensor, adv: Tensor, kl: Tensor | None, mask: Tensor, config: LossConfig) -> dict:
    """Token means over the mask of what the update did: where each clip binds, the ratio, the KL if known."""
    with torch.no_grad():  # a (N, 1) ratio broadcasts over the mask's T
        low = ((ratio < 1 - config.clip_eps_low) & (adv < 0)).float()  # the tokens whose clip binds
        high = ((ratio > 1 + config.clip_eps_high) & (adv > 0)).float()
        values = {"clip_frac_low": low, "clip_frac_high": high, "ratio_mean": ratio, "kl": kl}
        values = {key: v for key, v in values.items() if v is not None}  # no kl without ref_logp
        n = mask.sum().clamp(min=1)
        means = torch.stack([torch.where(mask, v, 0).sum() / n for v in values.values()])
    return dict(zip(values, means.tolist()))  # one device sync for all the stats


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    adv: Tensor,
    mask: Tensor,
    config: LossConfig,
    max_completion_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss (scalar) and its token-mean stats from logp/old_logp/ref_logp/mask (N, T) and adv (N,);
    `max_completion_length` is dr_grpo's constant (the sampler's max_new_tokens)."""
    if config.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    mask = mask.bool()
    adv = adv.to(logp.dtype)[:, None]  # (N, 1) one advantage per sequence, shared by its tokens
    ratio = importance_ratio(logp, old_logp, mask, config.importance_sampling_level)  # (N, T) or (N, 1)
    per_token = clipped_objective(ratio, adv, config).expand(mask.shape)  # (N, T)
    kl = None
    if ref_logp is not None:  # masked first, as the ratio: k3's exp of a garbage log-ratio could be inf
        kl = kl_k3(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0))  # (N, T)
    if config.beta > 0:
        per_token = per_token + config.beta * kl
    loss = aggregate(per_token, mask, config.loss_type, max_completion_length)
    return loss, loss_stats(ratio, adv, kl, mask, config)


# --- Log-probs of the completions: one full forward, the LM head in fp32 ------------------------------------
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


def output_head(model: torch.nn.Module) -> Tensor:
    """The LM head's weight (V, H), after refusing a head that `completion_logprobs` would compute wrongly:
    one with a bias, or a model that scales or caps its logits (Cohere, Granite, Gemma 2)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias, which completion_logprobs leaves out")
    text_config = model.config.get_text_config()
    for name in ("logit_scale", "logits_scaling", "final_logit_softcapping"):
        value = getattr(text_config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__}: {name}={value}, which completion_logprobs leaves out")
    return head.weight


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
    ones = torch.ones_like(completion_ids, dtype=inputs["attention_mask"].dtype)
    attention_mask = torch.cat([inputs["attention_mask"], ones], dim=1)  # (N, P + T)
    input_ids = torch.cat([inputs["input_ids"], completion_ids], dim=1)  # (N, P + T)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inputs:  # 1 marks the prompt's image tokens; the completion after it is text
        types = inputs["mm_token_type_ids"]
        kwargs["mm_token_type_ids"] = F.pad(types, (0, input_ids.shape[1] - types.shape[1]))  # (N, P + T)
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
    T = completion_ids.shape[1]
    weight = output_head(model)  # (V, H)
    # base_model, not model(...): the model would apply its head, in its own dtype (bf16), to all P + T
    # positions of every row (at Qwen2.5-VL-3B, 64 rows x 1,500 positions x 151,936 logits: 29 GB in bf16).
    # Only the T completion positions are needed, in fp32: the head is applied below.
    hidden = model.base_model(**recompute_inputs(inputs, completion_ids), use_cache=False).last_hidden_state
    # Off-by-one: position j predicts token j + 1, so P - 1 predicts completion token 0; the last is dropped.
    # The LM head in fp32: bf16 logits above 16 are spaced 0.125, noise in every log-ratio of mu > 1.
    logits = hidden[:, -T - 1 : -1].float() @ weight.float().T  # (N, T, V) positions P - 1 .. P + T - 2
    return logprobs_from_logits(
        logits, completion_ids, temperature=temperature, return_entropy=return_entropy
    )


# --- Sampling: G completions of each prompt with transformers' generate, no gradient -----------------------
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
    if not (0 <= temperature < math.inf and 0 < top_p <= 1):
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
    num_return_sequences: int = 1,
) -> Tensor:
    """Completion ids (N, T) of num_return_sequences = G samples of each of the B prompts (temperature 0:
    greedy). generate repeats prompt b as rows b*G .. b*G + G - 1, as `repeat_interleave` does (data.py)."""
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
    )
    return out.sequences[:, inputs["input_ids"].shape[1] :]  # (N, T) generate returns prompt + completion
