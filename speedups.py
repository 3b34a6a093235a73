"""Speed-ups of grpo.py: the same tokens, and log-probs and gradients equal to rounding, with less work.

Each section re-arranges one grpo.py function and names it; tests compare each with the grpo.py function it
re-arranges (tokens identical, log-probs and gradients to fp32 rounding). A run chooses its speed-ups once
(`choose`, from `SpeedConfig`: the flags) and the training step calls `sample`, `row_chunks` and
`chunk_logprobs` on every path; `--no-shared-prefill --no-trunk-reuse` is the plain path of grpo.py.

1. Shared prefill (re-arranges `grpo.sample_completions`). generate(num_return_sequences=G) copies every
   prompt G times before its first forward, so the prompt (all L blocks over P tokens) is computed G times.
   `sample_shared_prefill` runs it once per prompt, copies the KV cache to the G rows and decodes with
   generate's own sampler, op for op: the same tokens for the same seed.
2. The frozen trunk (re-arranges `grpo.completion_logprobs`). With LoRA only in the last K of L blocks, the
   vision tower and the first L - K blocks compute the same activations for the policy, the old policy and the
   reference. `capture_trunk` runs them once, without grad, and keeps what block L - K receives;
   `trunk_logprobs` runs only the K adapted blocks from there. Sampling has already computed those
   activations, one token at a time: `sample_shared_prefill(record_block=...)` records them and
   `trunk_from_recording` turns the recording into the trunk, so no trunk forward is left at all.
3. Micro-batches (re-arranges the loss's backward). `split_rows` cuts the N rows, and their images, into
   chunks; `grpo.aggregate` takes the whole batch's totals, so the chunks' gradients sum to the whole one.
4. Log-probs row by row (re-arranges `grpo.logprobs_from_logits`). The reference holds (N, T, V) fp32 copies
   of the logits (the upcast, the log-softmax, the entropy's softmax) and autograd keeps them for backward;
   `logprobs_row_by_row` upcasts one row at a time both ways (`selective_log_softmax`, a hand-written
   backward), equal to the reference to rounding. `trunk_logprobs` uses it.

Letters as in grpo.py, and L decoder blocks, K adapted ones (first_adapted = L - K), H hidden size.
NOTE: the trunk assumes, as holds for Qwen2 / Qwen2.5-VL: every adapted block receives the same keyword
arguments (one attention type), and after blocks[first_adapted] the model runs only the remaining blocks,
the final norm and the LM head (Qwen3-VL adds visual features in its first blocks, so first_adapted must lie
past them; Gemma soft-caps logits). `decoder_parts` refuses the models it can see break this.
"""

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

import grpo
import lora

# --- 1. sampling with each prompt's prefill run once (grpo.sample_completions) ------------------------------


def _draw(
    logits: torch.Tensor, *, temperature: float, top_p: float, suppressed: torch.Tensor
) -> torch.Tensor:
    """Next tokens (N,) from the last position's logits (N, V): generate's processors and sampler, op for op.

    suppress -> temperature -> top_p, in generate's order and dtype (fp32), then one multinomial draw per row,
    so the same seed draws the same tokens. top_p drops the least likely tokens whose cumulative probability,
    counted from the bottom, stays <= 1 - top_p. temperature == 0: argmax (greedy).
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

    Text counts real tokens (left padding skipped). Qwen-VL's mRoPE numbers an image's tokens by their grid
    (t, h, w), not one by one, so a prompt with images ends at a smaller position: the model keeps that shift
    per prompt as `rope_deltas` after the prefill, and new text tokens continue from there.
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
    """A list of the hidden states entering `block` at each of its calls inside the `with` (None: empty)."""
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
    """One forward over the B prompts, then what decoding needs, repeated for the G rows of each prompt: the
    last position's logits (N, V), the KV cache (N rows) and the position of the first new token (N, 1)."""
    prefill, has_images = dict(inputs), "image_grid_thw" in inputs
    if has_images and hasattr(getattr(model, "model", None), "rope_deltas"):
        model.model.rope_deltas = None  # NOTE: never let a stale shift from an earlier batch be read
    if not has_images:  # positions from each row's first real token, as in grpo.recompute_inputs
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
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    suppress_token_ids: Sequence[int] = (),
    record_block: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`grpo.sample_completions(model, inputs, num_return_sequences=G, ...)` with each prompt prefilled once.

    `inputs` holds the B un-expanded, LEFT-padded prompts. The prefill runs on them; its KV cache and last
    logits are repeated G times (prompt b -> rows b*G .. b*G+G-1) and the N rows are decoded one token per
    forward until every row has met EOS (then padded with pad_token_id) or max_new_tokens.
    `record_block` (blocks[first_adapted]) also records the hidden states entering that block: the prompt's
    P positions (copied to its G rows) and one per fed token, (N, P + T - 1, H), the last token being drawn
    but never fed. With `trunk_from_recording` that is the update's frozen trunk, at no extra cost (equal to
    a full forward to rounding: a KV-cache step sums its attention in another order).
    Returns completion ids (N, T) and the recording (or None).
    """
    grpo.check_inputs(inputs)
    grpo.check_sampling(temperature, top_p, eos_token_id, suppress_token_ids)
    if max_new_tokens < 1 or group_size < 1:
        raise ValueError(
            f"need max_new_tokens >= 1 and group_size >= 1, got {max_new_tokens=}, {group_size=}"
        )
    with _recording_inputs(record_block) as recorded:
        logits, cache, position = _prefill(model, inputs, group_size)  # (N, V), N rows, (N, 1)
        N, V = logits.shape
        mask = inputs["attention_mask"].repeat_interleave(group_size, dim=0)  # (N, P)
        if any(not 0 <= t < V for t in suppress_token_ids):  # NOTE: a negative id would index from the end
            raise ValueError(f"suppress_token_ids must lie in [0, {V}), got {sorted(suppress_token_ids)}")
        suppressed = torch.zeros(V, dtype=torch.bool, device=logits.device)  # (V,)
        suppressed[list(suppress_token_ids)] = True
        running = torch.ones(N, dtype=torch.bool, device=logits.device)  # (N,) no EOS yet
        ends = torch.as_tensor(eos_token_id, device=logits.device).reshape(-1)  # one id or several
        tokens = []
        for t in range(max_new_tokens):
            token = _draw(logits, temperature=temperature, top_p=top_p, suppressed=suppressed)  # (N,)
            # Finished rows get padding; they are still drawn for, so the RNG advances as in generate.
            token = torch.where(running, token, pad_token_id)
            tokens.append(token)
            running &= ~torch.isin(token, ends)  # any end-of-turn id ends the row
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


# --- 2. the frozen trunk, run once (grpo.completion_logprobs) -----------------------------------------------


@dataclass
class Trunk:
    """What the frozen trunk (vision tower, embeddings, blocks before it) hands to blocks[first_adapted]."""

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
    """The trunk is shared only if nothing before blocks[first_adapted] trains (K <= L, tower frozen)."""
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

    The N rows hold each prompt's images G times, in consecutive rows. A row whose grids and pixels equal the
    previous row's (compared exactly) reuses its embeddings. Returns `get_image_features`'s output with its
    per-image tuples (`pooler_output`, Qwen3-VL's `deepstack_features`) re-indexed to one entry per image of
    the N rows: what the forward takes as `mm_encoder_outputs["image"]` instead of `pixel_values`.
    NOTE: equal to encoding every row up to rounding (the tower's matmuls see fewer patches at once).
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
    """Run model(**kwargs) up to `block`; return the (hidden states, keyword arguments) the block receives.

    A forward pre-hook records them and raises to end the forward there: the model's own code builds the masks
    and (m)RoPE, none of it is re-implemented here, and nothing from `block` on is computed.
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
    """(n, T - 1): the last completion token's output would predict a token past the end, so the trunk stops
    before it: P + T - 1 positions."""
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

    Same inputs as `grpo.completion_logprobs`. The G rows of a prompt share its images, so each is encoded
    once (`_encode_images_once`); a prompt whose rows fall into several micro-batches is encoded once per
    chunk. The adapters may be on or off: none sits in the trunk (checked).
    """
    _check_frozen_trunk(model, blocks, first_adapted)
    kwargs = grpo.recompute_inputs(inputs, _without_last_token(completion_ids))  # (n, P + T - 1)
    if "pixel_values" in kwargs and _accepts_encoder_outputs(model):
        del kwargs["pixel_values"]
        kwargs["mm_encoder_outputs"] = {"image": _encode_images_once(model, inputs)}
    return Trunk(*_capture_block_input(model, kwargs, blocks[first_adapted]))


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
    """The Trunk of n rows from the hidden states `sample_shared_prefill(record_block=...)` recorded.

    `hidden_states` (n, P + T - 1, H) is those rows' slice of the recording. What is left to build is the
    adapted blocks' keyword arguments (attention mask, (m)RoPE): the model builds them before blocks[0], so a
    forward runs up to there only, without the images (masks and positions depend on ids, grids and the mask,
    not on pixels, so the vision tower does not run).
    NOTE: blocks[0] must receive the same keyword arguments as the adapted blocks (`record_block` checks).
    """
    _check_frozen_trunk(model, blocks, first_adapted)
    # NOTE: a full forward would refuse image placeholders in a completion (no pixels for them); this one has
    # no pixels at all, so it checks itself. Sampling suppresses them.
    placeholders = [getattr(model.config, key, None) for key in ("image_token_id", "video_token_id")]
    if any(t is not None and bool((completion_ids == t).any()) for t in placeholders):
        raise ValueError(
            "a completion contains an image/video placeholder token: suppress them when sampling"
        )
    kwargs = grpo.recompute_inputs(inputs, _without_last_token(completion_ids))  # (n, P + T - 1)
    kwargs.pop("pixel_values", None)
    if hidden_states.shape[:2] != kwargs["input_ids"].shape:
        raise ValueError(
            f"recording {tuple(hidden_states.shape)} does not fit the rows {kwargs['input_ids'].shape}"
        )
    _, block_kwargs = _capture_block_input(model, kwargs, blocks[0])
    return Trunk(hidden_states, block_kwargs)


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
    return out[0] if isinstance(out, tuple) else out  # a tuple from a few families' blocks (Chameleon, TrOCR)


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
    """`grpo.completion_logprobs` from a trunk: blocks[first_adapted:], the final norm, the LM head.

    Carries gradient into the adapted blocks when grad is enabled (the policy); under no_grad it gives
    old_logp, and inside `lora.adapters_disabled` ref_logp. `gradient_checkpointing` checkpoints each adapted
    block (only while grad is enabled).
    """
    hidden_states = trunk.hidden_states  # (n, P + T - 1, H)
    checkpointed = gradient_checkpointing and torch.is_grad_enabled()
    for block in blocks[first_adapted:]:
        hidden_states = _run_block(block, hidden_states, trunk.block_kwargs, checkpointed=checkpointed)
    T = completion_ids.shape[1]
    # Off-by-one as in completion_logprobs: positions P - 1 .. P + T - 2, the trunk's last T, predict the T
    # completion tokens. The norm acts on each position alone, so norm-then-slice equals slice-then-norm.
    logits = lm_head(norm(hidden_states[:, -T:]))  # (n, T, V)
    return logprobs_row_by_row(logits, completion_ids, temperature=temperature, return_entropy=return_entropy)


# --- 3. micro-batches (the loss's backward over all N rows at once) -----------------------------------------


def _images_per_row(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) images in each row, counted as runs of 1s in mm_token_type_ids (checked against the grid count).
    Qwen-VL wraps each image in <|vision_start|> .. <|vision_end|>, so two images never merge into one run."""
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

    Returns (rows, chunk inputs) pairs. (N, P) tensors are sliced by rows; the flat `pixel_values` (patches,
    D) and `image_grid_thw` (images, 3) are cut where the chunk's images end.
    NOTE: a chunk whose rows carry no image drops the image keys (the model cannot encode zero images).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    grpo.check_inputs(inputs)
    N = inputs["input_ids"].shape[0]
    bounds = [(start, min(start + chunk_size, N)) for start in range(0, N, chunk_size)]
    row_keys = [k for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in inputs]
    if "image_grid_thw" not in inputs:
        return [(slice(a, b), {k: inputs[k][a:b] for k in row_keys}) for a, b in bounds]
    grid = inputs["image_grid_thw"]  # (images, 3)
    first_image = [0, *_images_per_row(inputs).cumsum(0).tolist()]  # (N + 1,) index of each row's first image
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


# --- 4. log-probs row by row (grpo.logprobs_from_logits) ---------------------------------------------------


def _upcast(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in at least fp32 (a bf16 logsumexp of ~10-20 is off by up to ~0.06, a 6% error in
    the ratio); no copy when there is nothing to do (fp32 logits, temperature 1)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1 else logits / temperature


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(logits / temperature)[index], one row at a time both ways. A hand-written backward, since
    autograd through a row loop would keep every row's fp32 upcast alive; this saves an (N, T) logsumexp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
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
    """log_softmax(logits / temperature, -1).gather(-1, index) for logits (N, T, V), index (N, T) -> (N, T),
    in fp32, holding one row's (T, V) temporaries at a time, never an (N, T, V) log-softmax or upcast copy."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _SelectiveLogSoftmax.apply(logits, index, float(temperature))


def logprobs_row_by_row(
    logits: torch.Tensor, completion_ids: torch.Tensor, *, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`grpo.logprobs_from_logits`, one row's fp32 copy at a time: logp [and entropy] (N, T) from shifted
    logits (N, T, V); temperature 0 counts as 1."""
    temperature = temperature if temperature > 0 else 1.0
    logp = selective_log_softmax(logits, completion_ids, temperature)  # (N, T)
    if not return_entropy:
        return logp, None
    with torch.no_grad():  # the entropy is a metric
        # entr(p) = -p log p with entr(0) = 0, so -inf logits (probability 0) give 0, not 0 * -inf = NaN.
        entropy = [torch.special.entr(torch.softmax(_upcast(row, temperature), -1)).sum(-1) for row in logits]
    return logp, torch.stack(entropy)  # (N, T)


# --- the choice, made once per run, and the three calls the step makes through it ---------------------------


@dataclass
class SpeedConfig:
    """Which re-arrangements a run uses; none changes the results. Field names are train.py's flags."""

    shared_prefill: bool = True
    """Our decoding loop (speedups.sample_shared_prefill): each prompt prefilled once, its KV cache copied to
    its G rows, the frozen trunk recorded on the way (--trunk-reuse). Same tokens as --no-shared-prefill:
    transformers' generate, which prefills every prompt G times."""
    trunk_reuse: bool = True
    """Compute the frozen trunk (vision tower and the first L - K blocks) once per batch, without grad (with
    --shared-prefill: recorded while sampling, no extra forward), and run only the K adapted blocks for the
    policy, the reference and the old policy. --no-trunk-reuse: a full forward for each."""
    micro_batch_size: int | None = None
    """Rows per chunk of the log-prob recomputes and of the backward (gradient accumulation, same loss).
    None: all N = B*G rows at once."""
    gradient_checkpointing: bool = False
    """Recompute the adapted blocks' activations in the backward instead of keeping them (non-reentrant)."""

    def check(self) -> None:
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size: must be >= 1, got {self.micro_batch_size}")


@dataclass
class Plan:
    """The speed-ups of one run, chosen once (`choose`); `sample`, `row_chunks` and `chunk_logprobs` read it,
    so the training step has one text for every path. All None / False: the plain path of grpo.py."""

    config: SpeedConfig
    parts: dict[str, Any] | None = None  # trunk reuse: the adapted blocks, first_adapted, norm, LM head
    record_block: torch.nn.Module | None = None  # shared prefill + trunk reuse: where sampling records


def decoder_parts(model: torch.nn.Module, last_k: int) -> dict[str, Any]:
    """blocks, first_adapted, the final norm and the LM head: the trunk functions' keyword arguments."""
    path, blocks = lora.find_decoder_blocks(model)
    first_adapted = len(blocks) - last_k  # 1 <= K <= L is checked by inject_lora and the trunk functions
    config = model.config.get_text_config()
    # NOTE: the trunk hands every adapted block the mask of blocks[first_adapted]; one attention type only.
    if len(set((getattr(config, "layer_types", None) or [])[first_adapted:])) > 1:
        raise ValueError("the adapted blocks mix attention types; use --no-trunk-reuse")
    # NOTE: Qwen3-VL adds visual features to the hidden states after its first blocks ("deepstack").
    vision_config = getattr(model.config, "vision_config", None)
    if first_adapted < len(getattr(vision_config, "deepstack_visual_indexes", None) or []):
        raise ValueError("LoRA reaches the blocks that receive deepstack features; use --no-trunk-reuse")
    norm = model.get_submodule(path.rpartition(".")[0]).norm  # applied to the last block's output
    return {
        "blocks": blocks,
        "first_adapted": first_adapted,
        "norm": norm,
        "lm_head": model.get_output_embeddings(),
    }


def record_block(model: torch.nn.Module, parts: dict[str, Any]) -> torch.nn.Module:
    """blocks[first_adapted], whose input `sample_shared_prefill` records as the trunk."""
    # NOTE: trunk_from_recording takes the adapted blocks' mask from blocks[0]: one attention type needed.
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if len(set(types[:1] + types[parts["first_adapted"] :])) > 1:
        raise ValueError("blocks[0] and the adapted blocks differ in attention type; use --no-shared-prefill")
    return parts["blocks"][parts["first_adapted"]]


def choose(model: torch.nn.Module, config: SpeedConfig, *, last_k: int) -> Plan:
    """The run's Plan, once, after LoRA is injected: the decoder parts trunk reuse runs, the block shared
    prefill records at; for checkpointing without a trunk, transformers' own checkpointing switched on."""
    if config.gradient_checkpointing and not config.trunk_reuse:  # the trunk path checkpoints by itself
        enable_plain_checkpointing(model)
    if not config.trunk_reuse:
        return Plan(config)
    parts = decoder_parts(model, last_k)
    return Plan(config, parts, record_block(model, parts) if config.shared_prefill else None)


def sample(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    plan: Plan,
    *,
    group_size: int,
    record: bool = True,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """G completions of each of the B prompts, (ids (N, T), trunk recording or None): `sample_shared_prefill`
    or, on the plain path, `grpo.sample_completions`. `options` are the samplers' (max_new_tokens,
    temperature, top_p, eos_token_id, pad_token_id, suppress_token_ids); `record` False: no recording."""
    if plan.config.shared_prefill:
        block = plan.record_block if record else None
        return sample_shared_prefill(model, inputs, group_size=group_size, record_block=block, **options)
    return grpo.sample_completions(model, inputs, num_return_sequences=group_size, **options)[0], None


@dataclass
class RowChunk:
    """One micro-batch of rows: its prompt inputs, completions and (with trunk reuse) its frozen trunk."""

    rows: slice  # which of the N rows
    inputs: dict[str, torch.Tensor]  # input_ids (n, P), ..., and only these rows' images
    completion_ids: torch.Tensor  # (n, T)
    trunk: Trunk | None = None


def row_chunks(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    completion_ids: torch.Tensor,
    recording: torch.Tensor | None,
    plan: Plan,
) -> list[RowChunk]:
    """The N rows as the log-prob passes take them: all at once (the plain path), or micro-batches, each with
    its frozen trunk under trunk reuse, from the sampler's `recording` (N, P + T - 1, H) or captured here."""
    size, parts = plan.config.micro_batch_size, plan.parts
    if parts is None and size is None:
        return [RowChunk(slice(0, completion_ids.shape[0]), inputs, completion_ids)]
    chunks = []
    for rows, chunk_inputs in split_rows(inputs, size or completion_ids.shape[0]):
        chunk = RowChunk(rows, chunk_inputs, completion_ids[rows])
        if parts is not None:
            frozen = dict(blocks=parts["blocks"], first_adapted=parts["first_adapted"])
            if recording is not None:
                chunk.trunk = trunk_from_recording(
                    model, chunk.inputs, chunk.completion_ids, recording[rows], **frozen
                )
            else:  # adapters on or off does not matter: none sits in the trunk
                chunk.trunk = capture_trunk(model, chunk.inputs, chunk.completion_ids, **frozen)
        chunks.append(chunk)
    return chunks


def chunk_logprobs(
    model: torch.nn.Module, chunk: RowChunk, plan: Plan, *, temperature: float, return_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp (n, T) [and entropy] of a chunk: `grpo.completion_logprobs` (a full forward), or the adapted
    blocks on the chunk's frozen trunk (`trunk_logprobs`)."""
    options = dict(temperature=temperature, return_entropy=return_entropy)
    if chunk.trunk is None:
        return grpo.completion_logprobs(model, chunk.inputs, chunk.completion_ids, **options)
    checkpointing = plan.config.gradient_checkpointing
    return trunk_logprobs(
        chunk.trunk, chunk.completion_ids, **options, **plan.parts, gradient_checkpointing=checkpointing
    )


def enable_plain_checkpointing(model: torch.nn.Module) -> None:
    """transformers' non-reentrant checkpointing of every block, for the plain path (no trunk)."""
    # transformers >= 5.23 renamed gradient_checkpointing_enable (deprecated until v6) to this.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
