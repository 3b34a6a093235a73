"""Group Relative Policy Optimization (GRPO) for VLMs: sampling, log-probs, advantages, loss.

Pure functions on tensors; this module imports torch and the standard library only, so it can be copied alone.
Papers: GRPO from DeepSeekMath (Shao et al. 2024), built on PPO (Schulman et al. 2017); clip-higher and the
token-level normaliser from DAPO (Yu et al. 2025); the unbiased variant Dr. GRPO (Liu et al. 2025); the k3 KL
estimator from Schulman's note "Approximating KL Divergence" (2020).

Letters used in shape comments:
    B  prompts in the batch             G  completions per prompt (group size)
    N  = B * G rows                      P  prompt length (left-padded)
    T  completion length (longest row)   V  vocabulary size
    L  decoder blocks                    K  adapted (LoRA) blocks, the last K; H hidden size
Rows are grouped contiguously: rows [g*G, (g+1)*G) are the G completions of prompt g (the caller expands the
prompts with `repeat_interleave`, images included, in row order).

The objective, minimised, for row i (reward r_i, completion tokens y_i1..y_iT, mask m_it):

    A_i      = (r_i - mean_group(r)) / (std_group(r) + eps)   group-relative advantage
    ratio_it = exp(logp_it - old_logp_it)                 logp_it = log pi(y_it | prompt, y_i<t)
    l_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    k3_it    = exp(d_it) - d_it - 1, d = ref_logp - logp   >= 0, unbiased for KL(pi || ref)
    loss     = aggregate(l, m)                            see `aggregate` for the four ways

Pipeline: `sample_completions` (or `sample_shared_prefill`) -> `completion_mask` -> (rewards, elsewhere) ->
`group_advantages` -> `completion_logprobs` (with grad for logp, without for old_logp/ref_logp) -> `grpo_loss`
-> backward.

Speed-ups, each an exact re-arrangement of that pipeline (tests/test_speed.py compares tokens, log-probs and
gradients):
- `sample_completions(..., num_return_sequences=G)` samples the B prompts G times: each image encoded once.
- `sample_shared_prefill` goes further: our own decoding loop runs each prompt's prefill (vision tower and all
  blocks over its P tokens) once and copies the KV cache to its G rows, where generate prefills every prompt G
  times. It draws generate's tokens for the same seed.
- Frozen-trunk reuse: with LoRA only in the last K of L blocks, the vision tower and the first L - K blocks
  compute the same activations for policy, old policy and reference. `capture_trunk` runs them once, without
  grad, and keeps what block L - K receives; `trunk_logprobs` runs only the K adapted blocks from there.
  The G rows of a prompt share its images, so the capture encodes each of them once, not G times. Better
  still, sampling has already computed those activations, one token at a time: `sample_shared_prefill` can
  record them and `trunk_from_recording` turns the recording into the trunk, so no trunk forward runs at all
  (equal to the captured trunk to rounding: a KV-cache step sums in another order).
- Micro-batches: `split_rows` cuts the N rows (and their images) into chunks; `aggregate` takes the whole
  batch's num_rows / num_tokens, so the accumulated gradient equals the unchunked one.
- Memory: `selective_log_softmax` never holds an (N, T, V) log-softmax; `trunk_logprobs` can checkpoint the
  adapted blocks (non-reentrant, so gradients reach LoRA weights behind a frozen, grad-free input).

Choices, where the literature differs:
- Advantage scale: `scale="group"` divides by the group's std (DeepSeekMath; unbiased std with G - 1, as TRL),
  `"batch"` by the std of all N rewards, `"none"` not at all (Dr. GRPO: the std division over-weights
  near-uniform groups, i.e. too-easy or too-hard prompts).
- Normalisation over tokens (`loss_type`): "grpo" averages each sequence, then the sequences (DeepSeekMath;
  a token of a long completion weighs less), "bnpo"/"dapo" average over all tokens of the batch (DAPO),
  "dr_grpo" divides by a constant N * max_completion_length (Dr. GRPO; no length bias at all).
- KL: the k3 estimator, added to the loss per token (DeepSeekMath), not folded into the reward (PPO-RLHF).
  beta = 0 drops it and the reference model with it (DAPO, Dr. GRPO).
- Clipping: two epsilons (DAPO's clip-higher); clip_eps_low == clip_eps_high is plain PPO.
- EOS is an action: the model chose to stop, so the EOS token is in the mask and gets gradient. Tokens after
  it are padding and get exactly zero gradient.
- Truncated completions (no EOS within max_new_tokens) keep all their tokens in the loss. DAPO's overlong
  filtering would mask them; a caller who wants that can zero their advantage using `truncated`.
- Sampling uses temperature and top_p, never top_k. logp is the full temperature-scaled softmax, although
  top_p < 1 and `suppress_token_ids` make the sampler draw from a truncated, renormalised distribution (the
  standard choice, as in TRL): ratio and KL compare two policies under the same definition, so this is
  consistent; it is just not the exact sampling probability.
- With one optimiser step per rollout (mu = 1) pass old_logp = logp.detach(): ratio == 1, nothing is clipped
  and the gradient is REINFORCE with the group mean as baseline. For mu > 1 compute old_logp with
  `completion_logprobs` under no_grad before the first step, not from generate: the same numerical path makes
  the first ratio exactly 1 (generate's KV-cache path agrees only to rounding, which matters in bf16).
"""

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ADVANTAGE_SCALES = ("group", "batch", "none")

# The keys a prompt batch may carry. Anything else is an error rather than silently dropped: the recompute
# must see exactly what generation saw.
_INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


# --- log-probabilities --------------------------------------------------------------------------------------


def _upcast(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in at least fp32 (a bf16 logsumexp of ~10-20 is off by up to ~0.06, a 6% error in
    the ratio); no copy when there is nothing to do (fp32 logits, temperature 1)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1 else logits / temperature


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(logits / temperature)[index] with a hand-written backward, one row at a time both ways.

    Autograd through a plain row loop would keep every row's fp32 upcast alive for logsumexp's backward (twice
    the size of a bf16 logits tensor). Here only the logits (alive anyway) and an (N, T) logsumexp are saved.
    The temperature divides each upcast row, so bf16 logits are never divided (and rounded again) in bf16.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
        # One (T, V) upcast (plus logsumexp's temporaries) is alive at a time, never an (N, T, V) one.
        lse = torch.stack([torch.logsumexp(_upcast(row, temperature), dim=-1) for row in logits])  # (N, T)
        picked = _upcast(logits.gather(-1, index.unsqueeze(-1)).squeeze(-1), temperature)  # (N, T)
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, index, lse = ctx.saved_tensors
        scale = grad / ctx.temperature  # (N, T) the chain rule through logits / temperature
        grad_logits = torch.empty_like(logits)  # (N, T, V) the only full-size allocation, as for any backward
        for i in range(logits.shape[0]):
            # d logp / d z = onehot(index) - softmax(z) for z = logits / temperature, times the incoming grad.
            z = _upcast(logits[i], ctx.temperature)  # (T, V); may be logits[i] itself: no in-place op on it
            row = torch.exp(z - lse[i, :, None]).mul_(-scale[i, :, None])  # (T, V)
            row.scatter_add_(-1, index[i, :, None], scale[i, :, None])
            grad_logits[i] = row
        return grad_logits, None, None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(index) = logits.gather(index) / temperature - logsumexp(logits / temperature), for logits (N, T, V)
    and index (N, T).

    Equal to `log_softmax(logits / temperature, -1).gather(-1, index)` without ever holding an (N, T, V)
    log-softmax or a divided copy of the logits: the logsumexp is computed row by row, so the extra peak memory
    is one row's (T, V) temporaries, about 2/N of an fp32 logits tensor (4/N of a bf16 one, whose rows are
    upcast). Autograd saves nothing beyond the logits.
    Returns (N, T) in fp32 for fp32/bf16/fp16 logits (fp64 stays fp64): for bf16 the division and the
    logsumexp are done in fp32, since that is where a log-prob loses its precision; the gathered logit is
    exact in any dtype.
    NOTE: non-finite logits are not sanitised: -inf at a non-chosen token is fine (it has zero probability);
    NaN anywhere in a row, or -inf at the chosen token, makes that log-prob NaN/-inf.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _SelectiveLogSoftmax.apply(logits, index, float(temperature))


def _entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (N, T) of softmax(logits / temperature) for logits (N, T, V), row by row, without grad (a
    metric)."""
    with torch.no_grad():
        # entr(p) = -p log p with entr(0) = 0, so -inf logits (probability 0) give 0, not 0 * -inf = NaN.
        return torch.stack(
            [torch.special.entr(torch.softmax(_upcast(row, temperature), dim=-1)).sum(-1) for row in logits]
        )


def _check_inputs(inputs: dict[str, torch.Tensor]) -> None:
    unknown = set(inputs) - set(_INPUT_KEYS)
    if unknown:
        raise ValueError(f"unexpected prompt inputs {sorted(unknown)}; expected a subset of {_INPUT_KEYS}")
    # NOTE: with right padding the completion would follow pad tokens; generate only warns about it.
    if not bool(inputs["attention_mask"][:, -1].all()):
        raise ValueError("prompts must be LEFT-padded: attention_mask[:, -1] must be 1 on every row")
    # NOTE: without mm_token_type_ids, transformers 5 silently falls back to 1D positions for Qwen-VL.
    if "image_grid_thw" in inputs and "mm_token_type_ids" not in inputs:
        raise ValueError("image inputs need mm_token_type_ids to build Qwen-VL's 3D mRoPE positions")
    if ("pixel_values" in inputs) != ("image_grid_thw" in inputs):
        raise ValueError("pixel_values and image_grid_thw must be given together")


def _check_sampling(
    temperature: float, top_p: float, eos_token_id: int, suppress_token_ids: Sequence[int]
) -> None:
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
    if eos_token_id in suppress_token_ids:
        raise ValueError("suppress_token_ids must not contain eos_token_id: the model could never stop")


def _generation_kwargs(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_token_id: int,
    pad_token_id: int,
    suppress_token_ids: Sequence[int],
    return_logprobs: bool,
    num_return_sequences: int = 1,
) -> dict:
    """Every generate() option that can change which tokens are drawn, set explicitly.

    generate() fills each option it is not given (or given as a GenerationConfig field left at None) from the
    checkpoint's generation_config, then from library defaults: top_k=50 by default, and Qwen2.5-VL-Instruct,
    for one, ships a repetition penalty and a top_k. Keyword arguments win over both; None switches a
    processor off.
    """
    sample = temperature > 0
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": sample,
        "temperature": temperature if sample else None,
        "top_p": top_p if sample else None,
        # NOTE: top_k is off on purpose; left unset it would be inherited (50, or the checkpoint's value).
        "top_k": None,
        "min_p": None,
        "top_h": None,
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "repetition_penalty": 1.0,
        "encoder_repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "encoder_no_repeat_ngram_size": 0,
        "bad_words_ids": None,
        "sequence_bias": None,
        "guidance_scale": None,
        "min_length": 0,
        "min_new_tokens": None,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "exponential_decay_length_penalty": None,
        "begin_suppress_tokens": None,
        "suppress_tokens": list(suppress_token_ids) or None,
        "watermarking_config": None,
        "remove_invalid_values": False,
        "num_beams": 1,
        "num_return_sequences": num_return_sequences,
        # A single EOS id: a checkpoint's list of several would end rows on tokens we do not treat as EOS.
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
        "return_dict_in_generate": True,
        "output_logits": return_logprobs,
    }


@torch.no_grad()
def sample_completions(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    eos_token_id: int,
    pad_token_id: int,
    suppress_token_ids: Sequence[int] = (),
    return_logprobs: bool = False,
    num_return_sequences: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one completion per row with a single batched `model.generate` call.

    `inputs` holds N already-expanded rows: `input_ids` and `attention_mask` (N, P), LEFT-padded, and for
    image batches `pixel_values` (patches, 1176), `image_grid_thw` (images, 3), `mm_token_type_ids` (N, P).
    temperature > 0 samples from softmax(logits / temperature) truncated to top_p; temperature == 0 is greedy.
    top_k is always off and no other option is inherited from the model's generation_config.
    `suppress_token_ids` (vision placeholders and markers, chat-control tokens other than EOS) can never be
    sampled, so a completion cannot contain image tokens that the recompute would have no pixels for.
    `num_return_sequences` = G instead takes the B un-expanded prompts and returns G completions for each, rows
    in `repeat_interleave` order (prompt b -> rows b*G .. b*G+G-1): the same rows and, for the same seed, the
    same draws as sampling the expanded rows (tested), but generate encodes each image once, not G times.

    Returns completion ids (N, T), only the new tokens, T <= max_new_tokens, rows that stopped early padded
    with pad_token_id; and, if `return_logprobs`, the generation-time log-probs (N, T) of the drawn tokens:
    generate's raw logits / temperature (1 if greedy), log-softmaxed over the full vocabulary, the definition
    of `completion_logprobs`. This keeps (N, T, V) logits, so it is for tests and diagnostics only. Values
    after a row's EOS are log-probs of padding, finite and meaningless: mask them with `completion_mask`.
    """
    _check_inputs(inputs)
    _check_sampling(temperature, top_p, eos_token_id, suppress_token_ids)
    kwargs = _generation_kwargs(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        suppress_token_ids=suppress_token_ids,
        return_logprobs=return_logprobs,
        num_return_sequences=num_return_sequences,
    )
    out = model.generate(**inputs, **kwargs)
    P = inputs["input_ids"].shape[1]
    completion_ids = out.sequences[:, P:]  # (N, T) decoder-only generate returns prompt + new tokens
    if not return_logprobs:
        return completion_ids, None
    # out.logits are the raw logits, before temperature, top_p and suppression are applied.
    logits = torch.stack(out.logits, dim=1)  # (N, T, V)
    logp, _ = _logprobs_and_entropy(logits, completion_ids, temperature=temperature, return_entropy=False)
    return completion_ids, logp


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask (N, T) bool and `truncated` (N,) bool, built from each row's length, never from token values.

    A row's length runs up to and including its first EOS (EOS is an action); everything after it is padding,
    whatever its value, so this is right when pad == eos (a test `ids != pad` would drop the EOS). A row with
    no EOS was cut at max_new_tokens: all T positions count and it is flagged `truncated`.
    NOTE: an empty completion (EOS as the first token) has length 1: stopping at once is a decision to learn.
    """
    T = completion_ids.shape[1]
    is_eos = completion_ids == eos_token_id  # (N, T)
    truncated = ~is_eos.any(dim=1)  # (N,)
    if T == 0:  # NOTE: nothing generated (max_new_tokens == 0); avoids argmax of an empty dim
        return is_eos, truncated
    # argmax returns the FIRST maximal index, i.e. the first EOS; rows without one have length T.
    first_eos = is_eos.to(torch.int8).argmax(dim=1)  # (N,)
    lengths = torch.where(truncated, T, first_eos + 1)  # (N,) +1: the EOS itself is in
    positions = torch.arange(T, device=completion_ids.device)  # (T,)
    return positions[None, :] < lengths[:, None], truncated


def _recompute_kwargs(
    inputs: dict[str, torch.Tensor], completion_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The model inputs for prompt + completion (N, P + T): exactly what generate saw, as one forward pass."""
    _check_inputs(inputs)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]  # (N, P)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P + T)
    # Ones over the whole completion, as generate appends them: tokens after EOS are seen only by later,
    # masked positions (attention is causal), so they cannot change any unmasked log-prob.
    ones = torch.ones_like(completion_ids, dtype=prompt_mask.dtype)  # (N, T)
    attention_mask = torch.cat([prompt_mask, ones], dim=1)  # (N, P + T)
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inputs:
        # Completion tokens are text (type 0): image tokens were suppressed at sampling time.
        kwargs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(ones)], dim=1)
    if "image_grid_thw" in inputs:
        # The model derives 3D mRoPE positions from mm_token_type_ids + attention_mask, as generate did.
        kwargs.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    else:
        # NOTE: without positions the model would use arange(P + T), but generate numbered each row from its
        # first real token (cumsum of the mask). With left padding the two differ by the row's pad count:
        # RoPE only sees position differences, so there it costs rounding; learned absolute positions break.
        kwargs["position_ids"] = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (N, P + T)
    return kwargs


def _logprobs_and_entropy(
    logits: torch.Tensor, completion_ids: torch.Tensor, *, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp (N, T) of the completion tokens [and the entropy (N, T)] under softmax(logits / temperature), from
    the already shifted logits (N, T, V). Temperature 0 (greedy) counts as 1."""
    temperature = temperature if temperature > 0 else 1.0
    logp = selective_log_softmax(logits, completion_ids, temperature)  # (N, T)
    return logp, (_entropy(logits, temperature) if return_entropy else None)


def completion_logprobs(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_ids: torch.Tensor,
    *,
    temperature: float,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(completion token | prompt, earlier tokens) (N, T), recomputed with one forward pass.

    This is the gradient-carrying logp of the loss (call it under no_grad for old_logp and ref_logp). It
    rebuilds exactly what generate saw: the same ids, pixels and grids, the mask extended with ones, positions
    from the mask. The distribution is softmax(logits / temperature) over the full vocabulary (temperature 0,
    greedy, counts as 1). Sampling with top_p < 1 or suppressed tokens drew from a truncated, renormalised
    version of it; logp deliberately ignores that (see the module docstring). With `return_entropy`, also the
    entropy (N, T) of that distribution, without grad (a metric). Values after a row's EOS are finite and must
    be masked.
    """
    T = completion_ids.shape[1]
    # Only the last T + 1 positions' logits: the prompt's are never needed. use_cache=False: no KV cache.
    out = model(**_recompute_kwargs(inputs, completion_ids), logits_to_keep=T + 1, use_cache=False)
    # Off-by-one: the logit at position j predicts token j + 1. Position P - 1 (last prompt token) predicts
    # completion token 0; the last position predicts a token past the end and is dropped.
    logits = out.logits[:, :-1]  # (N, T, V) positions P - 1 .. P + T - 2
    return _logprobs_and_entropy(
        logits, completion_ids, temperature=temperature, return_entropy=return_entropy
    )


# --- speed: micro-batches and the frozen trunk ---------------------------------------------------------------
# Each function below is an exact re-arrangement of `completion_logprobs`; tests/test_speed.py checks log-probs
# and gradients against it.


def _images_per_row(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) images in each row, counted as runs of 1s in mm_token_type_ids (checked against the grid count).

    Qwen-VL wraps every image in <|vision_start|> .. <|vision_end|> text tokens, so two images never merge into
    one run.
    """
    is_image = inputs["mm_token_type_ids"] == 1  # (N, P)
    before = torch.cat([torch.zeros_like(is_image[:, :1]), is_image[:, :-1]], dim=1)  # (N, P) shifted right
    images_per_row = (is_image & ~before).sum(dim=1)  # (N,) one run start per image
    num_grids = inputs["image_grid_thw"].shape[0]
    if int(images_per_row.sum()) != num_grids:
        raise ValueError(f"mm_token_type_ids has {int(images_per_row.sum())} image runs, {num_grids} grids")
    return images_per_row


def split_rows(
    inputs: dict[str, torch.Tensor], chunk_size: int
) -> list[tuple[slice, dict[str, torch.Tensor]]]:
    """Cut N prompt rows into consecutive chunks of at most `chunk_size` rows, each with only its own images.

    Returns (rows, chunk inputs) pairs for micro-batching. (N, P) tensors are sliced by rows; the flat
    `pixel_values` (patches, D) and `image_grid_thw` (images, 3) are cut where the chunk's images end (a row's
    images are counted by `_images_per_row`).
    NOTE: a chunk whose rows carry no image drops the image keys (the model cannot encode zero images).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_inputs(inputs)
    N = inputs["input_ids"].shape[0]
    bounds = [(start, min(start + chunk_size, N)) for start in range(0, N, chunk_size)]
    row_keys = [k for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs]
    if "image_grid_thw" not in inputs:
        return [(slice(a, b), {k: inputs[k][a:b] for k in row_keys}) for a, b in bounds]
    grid = inputs["image_grid_thw"]  # (images, 3)
    images_per_row = _images_per_row(inputs)  # (N,)
    first_image = [0, *images_per_row.cumsum(0).tolist()]  # (N + 1,) index of each row's first image
    first_patch = [0, *grid.prod(-1).cumsum(0).tolist()]  # (images + 1,) t * h * w patches per image
    chunks = []
    for a, b in bounds:
        chunk = {k: inputs[k][a:b] for k in row_keys}
        i, j = first_image[a], first_image[b]  # the chunk owns images i .. j - 1
        if j > i:
            chunk["image_grid_thw"] = grid[i:j]
            chunk["pixel_values"] = inputs["pixel_values"][first_patch[i] : first_patch[j]]
        chunks.append((slice(a, b), chunk))
    return chunks


@dataclass
class Trunk:
    """What the frozen trunk (vision tower, embeddings, blocks[:first_adapted]) hands to blocks[first_adapted].

    With LoRA only in the last K blocks, everything before them computes the same activations for the policy,
    the old policy and the reference. `capture_trunk` records them once per batch; `trunk_logprobs` runs only
    the K adapted blocks from there, for each of the three.
    """

    # (n, P + T - 1, H) the input of blocks[first_adapted], detached; the last completion token is left out
    hidden_states: torch.Tensor
    # The keyword arguments the model passed to that block, untouched: attention_mask (4D, or None),
    # position_embeddings (cos, sin), Qwen-VL's multimodal RoPE included, position_ids, use_cache, ...
    block_kwargs: dict[str, Any]


class _TrunkCaptured(Exception):
    """Raised by a block's forward pre-hook to end the model's forward there."""

    def __init__(self, hidden_states: torch.Tensor, block_kwargs: dict[str, Any]) -> None:
        super().__init__("trunk captured")
        self.hidden_states, self.block_kwargs = hidden_states, block_kwargs


def _check_frozen_trunk(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], first_adapted: int
) -> None:
    """The trunk is shared only if nothing before blocks[first_adapted] trains (K <= L, vision tower frozen)."""
    if not 0 <= first_adapted < len(blocks):
        raise ValueError(f"need 1 <= K <= L adapted blocks, i.e. 0 <= first_adapted < {len(blocks)}")
    adapted = {id(p) for block in blocks[first_adapted:] for p in block.parameters()}
    # NOTE: strict on purpose: a trainable lm_head tied to the input embeddings would change the trunk too.
    outside = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in adapted]
    if outside:
        raise ValueError(
            f"trunk reuse needs every trainable parameter in blocks[{first_adapted}:]: {outside[:3]}"
        )


def _accepts_encoder_outputs(model: torch.nn.Module) -> bool:
    """Whether the model takes precomputed image features (`mm_encoder_outputs`, transformers >= 5)."""
    # NOTE: a forward without the parameter would swallow it in **kwargs and leave the image tokens unfilled.
    parameters = inspect.signature(model.forward).parameters
    return hasattr(model, "get_image_features") and "mm_encoder_outputs" in parameters


def _encode_images_once(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """The vision tower's output for every image of the rows, each run of identical rows encoded only once.

    The N rows hold each prompt's images G times, in consecutive rows (`repeat_interleave` order). A row whose
    grids and pixels equal the previous row's (compared exactly) reuses that row's embeddings, so the tower sees
    the B prompts' images, not the N rows' (fewer if neighbouring prompts carry identical photos). Returns what the model's own `get_image_features` returns, with its
    per-image tuples (`pooler_output`, and Qwen3-VL's `deepstack_features`) re-indexed to one entry per image
    of the N rows, in row order: what the forward accepts as `mm_encoder_outputs["image"]` in place of
    `pixel_values`. Repeated entries are the same tensors, not copies.
    NOTE: equal to encoding every row up to rounding (the tower's matmuls see fewer patches at once); on CPU
    fp32 the trunk's hidden states came out bit-identical.
    """
    images_per_row = _images_per_row(inputs).tolist()  # (N,)
    row_grids = inputs["image_grid_thw"].split(images_per_row)  # N blocks of (images of the row, 3)
    row_pixels = inputs["pixel_values"].split([int(g.prod(-1).sum()) for g in row_grids])  # t * h * w patches
    encoded, source = [], []  # rows to encode; for each image of the N rows, its index among the encoded ones
    num_encoded = 0
    for r, n in enumerate(images_per_row):
        same = r > 0 and torch.equal(row_grids[r], row_grids[r - 1])  # shapes differ -> False, no error
        if not (same and torch.equal(row_pixels[r], row_pixels[r - 1])):
            encoded.append(r)
            num_encoded += n
        # A repeat of the previous row points at the last n encoded images: that row's (by induction).
        source += range(num_encoded - n, num_encoded)
    pixels = torch.cat([row_pixels[r] for r in encoded])  # (patches of the encoded rows, D)
    grids = torch.cat([row_grids[r] for r in encoded])  # (encoded images, 3)
    features = model.get_image_features(pixels, grids, return_dict=True)
    features.pooler_output = tuple(features.pooler_output[i] for i in source)  # (tokens of image i, H) each
    if getattr(features, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, per image
        features.deepstack_features = [
            tuple(layer[i] for i in source) for layer in features.deepstack_features
        ]
    return features


def _capture_block_input(
    model: torch.nn.Module, kwargs: dict[str, Any], block: torch.nn.Module
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run model(**kwargs) up to `block` and return (hidden states, keyword arguments) that the block receives.

    A forward pre-hook records them and raises to end the forward there: the model's own code builds the masks
    and (m)RoPE, none of it is re-implemented here, and nothing from `block` on (nor the LM head) is computed.
    """

    def stop(module: torch.nn.Module, args: tuple, block_kwargs: dict[str, Any]) -> None:
        hidden_states = args[0] if args else block_kwargs.pop("hidden_states")
        raise _TrunkCaptured(hidden_states, dict(block_kwargs))

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(**kwargs, logits_to_keep=1, use_cache=False)
    except _TrunkCaptured as captured:
        return captured.hidden_states.detach(), captured.block_kwargs
    finally:
        handle.remove()
    raise RuntimeError("the block was never called: pass one of the model's own decoder blocks")


def _without_last_token(completion_ids: torch.Tensor) -> torch.Tensor:
    """(n, T - 1): the last completion token is never an input that matters (its output would predict a token
    past the end), so the trunk stops before it: P + T - 1 positions."""
    if completion_ids.shape[1] == 0:
        raise ValueError("no completion tokens: nothing to compute log-probs for")
    return completion_ids[:, :-1]


@torch.no_grad()
def capture_trunk(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_ids: torch.Tensor,
    *,
    blocks: Sequence[torch.nn.Module],
    first_adapted: int,
) -> Trunk:
    """Run the model up to blocks[first_adapted] once, without grad, and keep what that block receives.

    Same inputs as `completion_logprobs`. A forward pre-hook records the block's hidden states and keyword
    arguments and ends the forward there (`_capture_block_input`), which skips the K adapted blocks and the LM
    head (their output is not needed).
    Images shared by consecutive rows (a prompt's G copies) go through the vision tower once
    (`_encode_images_once`); a prompt whose rows fall into several micro-batches is encoded once per chunk.
    The adapters may be on or off: none sits in the trunk (checked: no trainable parameter outside
    blocks[first_adapted:]).
    NOTE: assumptions, true for Qwen2 / Qwen2.5-VL, stated for other models: every adapted block receives the
    same keyword arguments (one attention type, so no sliding/full alternation), and after blocks[first_adapted]
    the model only runs the remaining blocks, the final norm and the LM head (Qwen3-VL adds visual features
    after its first blocks, so first_adapted must lie past them; Gemma soft-caps the logits).
    """
    _check_frozen_trunk(model, blocks, first_adapted)
    kwargs = _recompute_kwargs(inputs, _without_last_token(completion_ids))  # (n, P + T - 1)
    if "pixel_values" in kwargs and _accepts_encoder_outputs(model):
        # The G rows of a prompt share its images: encode them once, hand the forward the embeddings.
        del kwargs["pixel_values"]
        kwargs["mm_encoder_outputs"] = {"image": _encode_images_once(model, inputs)}
    return Trunk(*_capture_block_input(model, kwargs, blocks[first_adapted]))


def _run_block(
    block: torch.nn.Module, hidden_states: torch.Tensor, block_kwargs: dict[str, Any], *, checkpointed: bool
) -> torch.Tensor:
    """One decoder block; `checkpointed` keeps only its input and recomputes the rest during backward."""
    if checkpointed:
        # Non-reentrant: gradients reach the LoRA weights although the input (trunk output) has none; the
        # reentrant variant would silently give them none. The RNG state is replayed, so LoRA dropout agrees.
        out = torch.utils.checkpoint.checkpoint(block, hidden_states, use_reentrant=False, **block_kwargs)
    else:
        out = block(hidden_states, **block_kwargs)
    return out[0] if isinstance(out, tuple) else out  # transformers < 5 returned (hidden_states, ...)


def trunk_logprobs(
    trunk: Trunk,
    completion_ids: torch.Tensor,
    *,
    blocks: Sequence[torch.nn.Module],
    first_adapted: int,
    norm: torch.nn.Module,
    lm_head: torch.nn.Module,
    temperature: float,
    return_entropy: bool = False,
    gradient_checkpointing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs` from a captured trunk: blocks[first_adapted:], final norm, LM head, log-softmax.

    Equal to the full forward (tested). Carries gradient into the adapted blocks when grad is enabled (policy);
    call it under no_grad for old_logp, and also inside `adapters_disabled` for ref_logp. No gradient flows into
    the trunk. `gradient_checkpointing` checkpoints each adapted block (only while grad is enabled).
    """
    hidden_states = trunk.hidden_states  # (n, P + T - 1, H)
    checkpointed = gradient_checkpointing and torch.is_grad_enabled()
    for block in blocks[first_adapted:]:
        hidden_states = _run_block(block, hidden_states, trunk.block_kwargs, checkpointed=checkpointed)
    T = completion_ids.shape[1]
    # Off-by-one as in completion_logprobs: positions P - 1 .. P + T - 2, the trunk's last T, predict the T
    # completion tokens. The final norm acts on each position alone, so normalising only them equals the
    # model's norm-then-slice.
    hidden_states = hidden_states[:, -T:]  # (n, T, H)
    logits = lm_head(norm(hidden_states))  # (n, T, V)
    return _logprobs_and_entropy(
        logits, completion_ids, temperature=temperature, return_entropy=return_entropy
    )


# --- speed: sampling with each prompt's prefill run once -----------------------------------------------------
# generate(num_return_sequences=G) copies every prompt G times before its first forward, so the prompt (all L
# blocks over P tokens) is computed G times over. `sample_shared_prefill` runs it once per prompt and copies the
# KV cache instead; it can also record what the frozen trunk hands the adapted blocks at every step, which is
# then the trunk of the update (`trunk_from_recording`) and no trunk forward is left to run at all.


def _draw(
    logits: torch.Tensor, *, temperature: float, top_p: float, suppressed: torch.Tensor
) -> torch.Tensor:
    """Next tokens (N,) from the last position's logits (N, V): generate's sampler, op for op.

    The same steps in the same order as generate's logits processors (suppress -> temperature -> top_p) and its
    sampler, so that for the same seed the same tokens come out (tested): fp32 logits; suppressed tokens get
    -inf; divide by the temperature; top_p drops the least likely tokens whose cumulative probability, counted
    from the bottom, stays <= 1 - top_p (the most likely token always stays); one multinomial draw per row.
    temperature == 0: argmax (greedy).
    """
    scores = logits.float().masked_fill(suppressed, float("-inf"))  # (N, V)
    if temperature == 0:
        return scores.argmax(dim=-1)
    if temperature != 1:
        scores = scores / temperature
    if top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=False)  # (N, V) least likely first
        drop_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop_sorted[:, -1] = False  # NOTE: keep the most likely token even when top_p is tiny
        drop = drop_sorted.scatter(1, order, drop_sorted)  # (N, V) back in vocabulary order
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)  # (N,)


def _first_new_position(model: torch.nn.Module, prompt_mask: torch.Tensor, has_images: bool) -> torch.Tensor:
    """(B, 1) the RoPE position of each prompt's first new token, as generate numbers it.

    Text: positions count real tokens from the row's first one (left padding skipped), so the next one is the
    number of real tokens. Qwen-VL's mRoPE numbers an image's tokens by their grid (t, h, w) instead of one by
    one, so a prompt with images ends at a smaller position: the model stores that shift per prompt as
    `rope_deltas` while it builds the prompt's positions, and new text tokens continue from there.
    """
    position = prompt_mask.long().sum(dim=1, keepdim=True)  # (B, 1)
    if not has_images:
        return position
    deltas = getattr(getattr(model, "model", None), "rope_deltas", None)  # (B, 1), set by the prefill
    if deltas is None or deltas.shape[0] != prompt_mask.shape[0]:
        raise ValueError(
            "sample_shared_prefill needs the Qwen-VL `model.model.rope_deltas` after an image prefill; this"
            " model keeps none: sample with sample_completions (generate) instead"
        )
    return position + deltas.to(position.device)


@contextmanager
def _recording_inputs(block: torch.nn.Module | None) -> Iterator[list[torch.Tensor]]:
    """A list that collects the hidden states entering `block` at each of its calls inside the `with` (None:
    stays empty)."""
    recorded: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        recorded.append(args[0] if args else kwargs["hidden_states"])

    handle = block.register_forward_pre_hook(record, with_kwargs=True) if block is not None else None
    try:
        yield recorded
    finally:
        if handle is not None:
            handle.remove()


def _prefill(model: torch.nn.Module, inputs: dict[str, torch.Tensor], group_size: int) -> tuple[Any, ...]:
    """One forward over the B prompts, then everything decoding needs, repeated for the G rows of each prompt:
    the last position's logits (N, V), the KV cache (N rows) and the position of the first new token (N, 1)."""
    prefill, has_images = dict(inputs), "image_grid_thw" in inputs
    if has_images and hasattr(getattr(model, "model", None), "rope_deltas"):
        model.model.rope_deltas = None  # NOTE: never let a stale shift from an earlier batch be read
    if not has_images:  # positions from each row's first real token, as in _recompute_kwargs
        prefill["position_ids"] = (inputs["attention_mask"].long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
    out = model(**prefill, use_cache=True, logits_to_keep=1)
    position = _first_new_position(model, inputs["attention_mask"], has_images)  # (B, 1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(group_size)  # (B, ...) -> (N, ...): each prompt's keys and values, G times
    logits = out.logits[:, -1]  # (B, V)
    return logits.repeat_interleave(group_size, dim=0), cache, position.repeat_interleave(group_size, dim=0)


@torch.no_grad()
def sample_shared_prefill(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    eos_token_id: int,
    pad_token_id: int,
    suppress_token_ids: Sequence[int] = (),
    record_block: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """G completions for each of the B prompts, each prompt's prefill run once: `sample_completions` made cheaper.

    `inputs` holds the B un-expanded, LEFT-padded prompts (as for `sample_completions(...,
    num_return_sequences=G)`). The prefill (vision tower and all blocks over the P prompt tokens) runs on the B
    prompts; its KV cache and last logits are then repeated G times (`repeat_interleave`: prompt b -> rows
    b*G .. b*G+G-1) and the N = B*G rows are decoded one token per forward, drawn as generate draws them
    (`_draw`), rows that met EOS padded with pad_token_id, until every row has stopped or max_new_tokens.
    Same options, same rows and, for the same seed, the same tokens as `sample_completions` (tested; the
    prefill on B rows instead of N agrees to rounding).

    `record_block` (blocks[first_adapted]) also records the hidden states entering that block at every step:
    the prompt's P positions (copied to its G rows) and one per fed completion token, i.e. (N, P + T - 1, H),
    the input a full forward over prompt + completion would hand it (the last token is drawn, never fed). With
    `trunk_from_recording` that is the frozen trunk of the update, at no extra cost. It agrees with a full
    forward to rounding (a KV-cache step sums its attention in another order): fp32 ~1e-6, tested.
    Returns completion ids (N, T) and the recording (or None).
    """
    _check_inputs(inputs)
    _check_sampling(temperature, top_p, eos_token_id, suppress_token_ids)
    if max_new_tokens < 1 or group_size < 1:
        raise ValueError(
            f"need max_new_tokens >= 1 and group_size >= 1, got {max_new_tokens=}, {group_size=}"
        )
    with _recording_inputs(record_block) as recorded:
        logits, cache, position = _prefill(model, inputs, group_size)  # (N, V), N rows, (N, 1)
        N = logits.shape[0]
        mask = inputs["attention_mask"].repeat_interleave(group_size, dim=0)  # (N, P)
        V = logits.shape[-1]
        if any(not 0 <= t < V for t in suppress_token_ids):  # NOTE: a negative id would index from the end
            raise ValueError(f"suppress_token_ids must lie in [0, {V}), got {sorted(suppress_token_ids)}")
        suppressed = torch.zeros(V, dtype=torch.bool, device=logits.device)  # (V,)
        suppressed[list(suppress_token_ids)] = True
        running = torch.ones(N, dtype=torch.bool, device=logits.device)  # (N,) no EOS yet
        tokens = []
        for t in range(max_new_tokens):
            token = _draw(logits, temperature=temperature, top_p=top_p, suppressed=suppressed)  # (N,)
            # Finished rows get padding; they are still drawn for, so the RNG advances as in generate.
            token = torch.where(running, token, pad_token_id)
            tokens.append(token)
            running &= token != eos_token_id
            if t == max_new_tokens - 1 or not running.any():
                break
            mask = torch.cat([mask, mask.new_ones(N, 1)], dim=1)  # (N, P + t + 1)
            out = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=position + t,  # (N, 1); for Qwen-VL the same on all three mRoPE axes
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]  # (N, V)
    if recorded:
        recorded[0] = recorded[0].repeat_interleave(group_size, dim=0)  # the prompt's (B, P, H) -> (N, P, H)
    completion_ids = torch.stack(tokens, dim=1)  # (N, T)
    return completion_ids, (torch.cat(recorded, dim=1) if recorded else None)


@torch.no_grad()
def trunk_from_recording(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    *,
    blocks: Sequence[torch.nn.Module],
    first_adapted: int,
) -> Trunk:
    """The Trunk of n rows from hidden states recorded while sampling (`sample_shared_prefill(record_block=...)`).

    `inputs` and `completion_ids` as for `capture_trunk`; `hidden_states` (n, P + T - 1, H) those rows' slice
    of the recording. What is left to build is the adapted blocks' keyword arguments over the whole sequence
    (attention mask, (m)RoPE position embeddings): the model builds them before its first block, so a forward
    is run up to blocks[0] only. NOTE: they depend on ids, image grids and the mask, not on pixels, so the
    images are left out and the vision tower does not run (the image tokens' embeddings, wrong without
    pixels, reach nothing but the discarded input of blocks[0]).
    NOTE: blocks[0] must receive the same keyword arguments as the adapted blocks (one attention type; the
    caller checks), on top of the assumptions of `capture_trunk`.
    """
    _check_frozen_trunk(model, blocks, first_adapted)
    # NOTE: a full forward would refuse image placeholders in a completion (no pixels for them); this one has
    # no pixels at all, so it checks itself. Sampling suppresses them (train.suppressed_tokens).
    placeholders = [getattr(model.config, key, None) for key in ("image_token_id", "video_token_id")]
    if any(t is not None and bool((completion_ids == t).any()) for t in placeholders):
        raise ValueError(
            "a completion contains an image/video placeholder token: suppress them when sampling"
        )
    kwargs = _recompute_kwargs(inputs, _without_last_token(completion_ids))  # (n, P + T - 1)
    kwargs.pop("pixel_values", None)
    if hidden_states.shape[:2] != kwargs["input_ids"].shape:
        raise ValueError(
            f"recording {tuple(hidden_states.shape)} does not fit the rows {kwargs['input_ids'].shape}"
        )
    _, block_kwargs = _capture_block_input(model, kwargs, blocks[0])
    return Trunk(hidden_states, block_kwargs)


# --- advantages and loss ------------------------------------------------------------------------------------


def _zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: groups whose G rewards are all equal, tested exactly (a std may round to non-zero)."""
    grouped = rewards.view(-1, group_size)  # (B, G)
    return (grouped == grouped[:, :1]).all(dim=1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
) -> torch.Tensor:
    """Advantages (N,) = (r - mean of the row's group) / (std + eps), optionally clipped to [-clip, clip].

    scale: "group" divides by the group's std, unbiased (divisor G - 1, like TRL; DeepSeekMath does not say);
    "batch" by the unbiased std of all N rewards; "none" does not divide (Dr. GRPO, Liu et al. 2025). eps
    keeps the division finite. Rewards are cast to fp32 (fp64 stays fp64).
    NOTE: a zero-variance group (every completion scored the same) has advantage exactly 0, never NaN, under
    every scale: it carries no learning signal. `rollout_metrics` reports its share as frac_zero_std_groups.
    NOTE: G == 1 is an error (no group to compare against), as are N % G != 0 and non-finite rewards.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to have a group baseline, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be (N,) with N divisible by group_size={group_size}, got {rewards.shape}"
        )
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite: a NaN would spread to the whole group's advantages")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (B, G)
    # The mean of equal floats need not round back to them exactly; force the zero the math promises.
    centered = torch.where(_zero_std_groups(rewards, group_size)[:, None], 0.0, centered)  # (B, G)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # (B, G) / (B, 1)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    adv = centered.reshape(-1)  # (N,) back to row order
    return adv if clip is None else adv.clamp(-clip, clip)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(d) - d - 1 with d = ref_logp - logp.

    Unbiased for tokens sampled from pi, never negative (exp(d) >= 1 + d), exactly 0 where logp == ref_logp.
    Computed as expm1(d) - d, the same quantity without the cancellation of exp(d) - 1 for small d, which in
    fp32 can round to a tiny negative number. NOTE: large d (ref far more likely than pi) grows like exp(d).
    """
    d = ref_logp - logp
    return torch.expm1(d) - d


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    num_rows: int | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token quantity x (N, T) under mask m (N, T) to a scalar; L_i = sum_t m_it.

        "grpo"    (1 / num_rows) * sum_i (sum_t m_it x_it) / L_i       mean per sequence, then over sequences
        "bnpo"    sum_it m_it x_it / num_tokens                         mean over this process's tokens
        "dapo"    sum_it m_it x_it / num_tokens                         mean over the global batch's tokens
        "dr_grpo" sum_it m_it x_it / (num_rows * max_completion_length) a constant: no length bias

    num_rows defaults to N and num_tokens to sum(m) of this call. A caller that splits one batch into
    micro-batches (or ranks) passes the totals of the whole batch, and the sum over chunks then equals the
    unchunked loss and gradient exactly, for every loss_type. bnpo and dapo therefore share one formula here;
    in the literature (and TRL) they differ in the scope of num_tokens: bnpo the tokens of one process's
    batch, dapo those of the global batch across processes. NOTE: train.py passes the global count for both,
    so that R ranks give exactly the one-process update (tested); there the two names are the same loss.
    NOTE: masked positions are excluded with `where`, not by multiplying, so a non-finite value there cannot
    leak in (inf * 0 = NaN). Non-finite values at unmasked positions propagate to the result.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    mask = mask.bool()
    per_token = torch.where(mask, per_token, 0.0)  # (N, T)
    num_rows = mask.shape[0] if num_rows is None else num_rows
    if loss_type == "grpo":
        # clamp: a zero-length row (only when T == 0) would be 0 / 0; real completions have length >= 1.
        lengths = mask.sum(dim=1).clamp(min=1)  # (N,)
        return (per_token.sum(dim=1) / lengths).sum() / num_rows
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the sampler's max_new_tokens)")
        return per_token.sum() / (num_rows * max_completion_length)
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    return per_token.sum() / num_tokens


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    beta: float,
    loss_type: str,
    max_completion_length: int | None = None,
    num_rows: int | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO loss (scalar) and its stats, from logp/old_logp/ref_logp/mask (N, T) and adv (N,).

    Per token: -min(ratio * adv, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * adv) + beta * kl_k3, with
    ratio = exp(logp - old_logp), reduced by `aggregate` (loss_type, max_completion_length, num_rows and
    num_tokens are passed through). ref_logp may be None only when beta == 0; given with beta == 0, the KL is
    only reported. With old_logp = logp.detach() (mu = 1) the loss equals -aggregate(adv) and its gradient is
    the REINFORCE gradient -aggregate(adv * grad logp).
    Stats (python floats, means over this call's unmasked tokens): kl (if ref_logp is given), clip_frac_low
    (ratio < 1 - clip_eps_low with adv < 0: the clip binds), clip_frac_high (ratio > 1 + clip_eps_high with
    adv > 0), ratio_mean.
    NOTE: masked positions get exactly zero gradient, even if they hold inf/NaN. A non-finite value at an
    unmasked position makes the loss non-finite: check `torch.isfinite(loss)` before stepping.
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    mask = mask.bool()
    adv = adv.to(logp.dtype)[:, None]  # (N, 1) one advantage per sequence, shared by its tokens
    # Mask BEFORE exp: at a masked position logp - old_logp may be huge, exp -> inf, and where's zero gradient
    # times inf is NaN. Zeroing the input keeps the gradient there exactly 0.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)  # (N, T)
    ratio = torch.exp(log_ratio)  # (N, T)
    clipped_ratio = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)  # (N, T)
    # The pessimistic bound: the clip only takes effect when it lowers the objective (PPO).
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (N, T)
    kl = None
    if ref_logp is not None:
        # Same masking-before-exp reason; both sides 0 gives k3 = 0 with zero gradient.
        kl = kl_k3(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0))  # (N, T)
        if beta > 0:
            per_token = per_token + beta * kl
    loss = aggregate(
        per_token,
        mask,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        num_rows=num_rows,
        num_tokens=num_tokens,
    )
    with torch.no_grad():
        clip_low = (ratio < 1 - clip_eps_low) & (adv < 0)  # (N, T)
        clip_high = (ratio > 1 + clip_eps_high) & (adv > 0)  # (N, T)
        values = {"clip_frac_low": clip_low.float(), "clip_frac_high": clip_high.float(), "ratio_mean": ratio}
        if kl is not None:
            values["kl"] = kl
        n = mask.sum().clamp(min=1)
        means = torch.stack([torch.where(mask, v, 0).sum() / n for v in values.values()])
        stats = dict(zip(values, means.tolist()))  # one device sync for all of them
    return loss, stats


def rollout_metrics(
    rewards: torch.Tensor,
    components: dict[str, torch.Tensor],
    mask: torch.Tensor,
    truncated: torch.Tensor,
    correct: torch.Tensor | None,
    group_size: int,
) -> dict[str, float]:
    """Scalars to log about one rollout; all tensors are per row (N,) except mask (N, T).

    Keys: reward/mean, reward/std, reward/<name>/mean and reward/<name>/std for each reward component,
    frac_zero_std_groups (groups whose advantage is 0: no signal), completion_length/mean and /max (tokens,
    EOS included), frac_truncated, and if `correct` is given frac_correct, completion_length/correct and
    completion_length/incorrect. Stds are population stds (divisor N), so N = 1 gives 0, not NaN.
    NOTE: completion_length/correct (or /incorrect) is left out when no completion is correct (or incorrect):
    a mean of nothing is not a number, and 0 would read as a real length.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"N={rewards.numel()} rewards do not split into groups of {group_size}")
    lengths = mask.sum(dim=1).float()  # (N,)
    metrics = {"reward/mean": rewards.float().mean(), "reward/std": rewards.float().std(correction=0)}
    for name, values in components.items():
        metrics[f"reward/{name}/mean"] = values.float().mean()
        metrics[f"reward/{name}/std"] = values.float().std(correction=0)
    metrics["frac_zero_std_groups"] = _zero_std_groups(rewards, group_size).float().mean()
    metrics["completion_length/mean"] = lengths.mean()
    metrics["completion_length/max"] = lengths.max()
    metrics["frac_truncated"] = truncated.float().mean()
    if correct is not None:
        correct = correct.bool()
        metrics["frac_correct"] = correct.float().mean()
        for key, rows in (("correct", correct), ("incorrect", ~correct)):
            if bool(rows.any()):
                metrics[f"completion_length/{key}"] = lengths[rows].mean()
    return {key: float(value) for key, value in metrics.items()}


# --- adaptive KL coefficient ---------------------------------------------------------------------------------


def adapt_beta(
    beta: float, kl: float, *, kl_target_low: float, kl_target_high: float, factor: float
) -> float:
    """Keep the measured KL inside [kl_target_low, kl_target_high] by scaling beta after each step.

    A band controller in the spirit of PPO's adaptive KL penalty (Schulman et al. 2017, section 4): KL above
    the band multiplies beta by `factor` (pull the policy back towards the reference), KL below divides it
    (let it move); inside the band beta is unchanged. NOTE: beta = 0 stays 0 (no reference pass at all), so
    start from beta > 0 to use this; a non-finite KL leaves beta unchanged (the step is reported elsewhere).
    """
    if not kl_target_low < kl_target_high or factor <= 1.0:
        raise ValueError("need kl_target_low < kl_target_high and factor > 1")
    if not torch.isfinite(torch.tensor(kl)):
        return beta
    if kl > kl_target_high:
        return beta * factor
    if kl < kl_target_low:
        return beta / factor
    return beta
