"""Speed-ups of grpo.py: the same tokens, and log-probs and gradients equal to rounding, with less work.

A run chooses them once (`choose`, from `SpeedConfig`: the flags); the training step calls `sample`,
`row_chunks` and `chunk_logprobs` on every path, `--no-shared-prefill --no-trunk-reuse` being grpo.py's own.
Each section re-arranges one grpo.py function:

1. Shared prefill (`sample_completions`). generate(num_return_sequences=G) prefills every prompt G times;
   `sample_shared_prefill` prefills it once, copies the KV cache to the G rows of a pre-allocated one and
   decodes with generate's own sampler, op for op: the same tokens for the same seed. Its decoding step has
   static shapes and reads nothing back to the host but, every few tokens, whether all rows have ended; with
   --cuda-graph it is captured once per prompt length and replayed across calls (`DecodeGraphs`,
   `capture_cuda_graph`). Its mask marks only written slots valid, so every attention kernel (sdpa, eager,
   FlashAttention-2, which reads the mask as the keys to attend) sees no empty slot. Its logits come from the
   log-prob passes' fp32 LM head (`head_logits`): at mu = 1 the tokens are drawn from the distribution whose
   log-probs are trained. LoRA's A and B are cast to the base dtype once per sampling (`weights_cast_once`).
2. The frozen trunk (`completion_logprobs`). With LoRA only in the last K of L blocks, the vision tower and
   the first L - K blocks compute the same activations for the policy, the old policy and the reference:
   `capture_trunk` runs them once without grad, or `trunk_from_recording` takes what sampling recorded on
   the way (`record_block`), and `trunk_logprobs` runs only the K adapted blocks from there.
3. Micro-batches (the loss's backward). `split_rows` cuts the N rows, and their images, into chunks;
   objectives.grpo_loss scales each chunk's loss by its share of the batch, so the chunks' gradients sum
   to the whole one.
4. Log-probs row by row (`logprobs_from_logits`). The reference holds (N, T, V) fp32 logits (the LM head's
   in fp32, log-softmax, the entropy's softmax) for backward; `logprobs_row_by_row` runs the fp32 LM head
   one row at a time both ways (a hand-written backward): no (N, T, V) tensor is ever made.

Letters as in grpo.py, and L decoder blocks, K adapted ones (first_adapted = L - K), H hidden size.
NOTE: the trunk assumes, as holds for Qwen2 / Qwen2.5-VL, that the adapted blocks receive the same keyword
arguments (one attention type) and that only they, the final norm and the LM head follow blocks[first_adapted]
(Qwen3-VL adds visual features in its first blocks; Gemma soft-caps logits). `decoder_parts` refuses the
models it can see break this.
"""

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import StaticCache

import grpo
import lora

# --- 1. sampling with each prompt's prefill run once (grpo.sample_completions) ------------------------------


def _draw(logits: Tensor, *, temperature: float, top_p: float, suppressed: Tensor) -> Tensor:
    """Next tokens (N,) from the last logits (N, V): generate's processors (suppress -> temperature -> top_p)
    and sampler, op for op in its order and dtype (fp32), so the same seed draws the same tokens."""
    scores = logits.float().masked_fill(suppressed, float("-inf")) / (temperature or 1)  # (N, V)
    if temperature == 0:  # greedy; a division by 1 changes no bit
        return scores.argmax(dim=-1)
    if top_p < 1:
        # Drop the least likely tokens whose cumulative probability, counted from the bottom, is <= 1 - top_p.
        sorted_scores, order = torch.sort(scores, descending=False)  # (N, V) least likely first
        drop_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop_sorted[:, -1] = False  # NOTE: keep the most likely token even when top_p is tiny
        drop = drop_sorted.scatter(1, order, drop_sorted)  # (N, V) back in vocabulary order
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)  # (N,)


def _cache_keyword(model: nn.Module) -> str:
    """The KV cache's name in forward and output: `cache` from transformers 5.24, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Steps between two reads of "has every row ended?", by device type. On a GPU a read makes the host wait for
# the device, which then idles while the host queues the next step: every 8 steps, and the up to 7 steps
# drawn past the last EOS are undone. On the CPU a read waits for nothing: every step, none drawn in vain.
FINISHED_CHECK_EVERY = {"cpu": 1, "cuda": 8}


def _prefill(model: nn.Module, inputs: dict[str, Tensor]) -> tuple:
    """One forward over the B prompts, without the LM head: the last position's hidden state (B, H), the
    prompts' KV cache, the RoPE position of the first new token (B, 1)."""
    prefill, has_images = dict(inputs), "image_grid_thw" in inputs
    if has_images and hasattr(getattr(model, "model", None), "rope_deltas"):
        model.model.rope_deltas = None  # NOTE: never let a stale shift from an earlier batch be read
    if not has_images:  # positions from each row's first real token, as in grpo.recompute_inputs
        prefill["position_ids"] = (inputs["attention_mask"].long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
    out = model.base_model(**prefill, use_cache=True)  # as grpo.completion_logprobs: its head is ours
    position = inputs["attention_mask"].long().sum(dim=1, keepdim=True)  # (B, 1) left padding skipped
    if has_images:
        # Qwen-VL's mRoPE numbers an image's tokens by their grid (t, h, w), not one by one, so the prompt
        # ends at a smaller position: the prefill keeps that shift per prompt as `rope_deltas`.
        deltas = getattr(getattr(model, "model", None), "rope_deltas", None)  # (B, 1)
        if deltas is None or deltas.shape[0] != position.shape[0]:
            raise ValueError("the model keeps no Qwen-VL rope_deltas: use grpo.sample_completions (generate)")
        position = position + deltas.to(position.device)
    return out.last_hidden_state[:, -1], out[_cache_keyword(model.base_model)], position  # (B, H), .., (B, 1)


@dataclass
class _Decoder:
    """What the decoding step reads and writes in place, for N rows, P prompt and T completion positions: a
    replayed graph reads it at the addresses it was captured with, so a kept decoder refills these tensors,
    never replaces them."""

    cache: StaticCache  # P + T positions per row
    mask: Tensor  # (N, P + T) 1 on a written, non-padding slot: the only ones any kernel reads
    position: Tensor  # (N, 1) the RoPE position of the token fed next
    written: Tensor  # (1,) the slot the token fed next is written to
    head: Tensor  # (V, H) the LM head's weight as `head_logits` takes it (`head_weight`)


# A capture gets a step (a function of static inputs) and returns (the outputs of one run of it, the static
# outputs a replay refills, the replay): `capture_cuda_graph`, or a stand-in with the same contract.
# NOTE: what a capture relies on in transformers (5.24; Qwen2 / Qwen2.5-VL, sdpa or eager attention):
# StaticCache writes at a device-side index that it advances in place, and for a compileable cache and one
# query token create_causal_mask skips SDPA's is_causal shortcut, whose check reads the padding mask back.
# flash_attention_2 reads its mask, a "dynamic" RoPE its largest position: neither can be captured; a
# sliding-window layer of the cache counts in a Python int, which a replay leaves behind.
Capture = Callable[[Callable[[], tuple]], tuple[tuple, tuple, Callable[[], Any]]]


@dataclass
class DecodeGraphs:
    """The decoding step kept across sampling calls (--cuda-graph): captured once (`capture`) and replayed at
    every later token of every later call of the same shapes, (N rows, P, T, dtype, recording or not):
    training steps and evaluation batches whose prompts have the length it was captured at. A call of other
    shapes first frees the kept one, then captures its own, so at most one is kept: one StaticCache of
    N x (P + T) positions and one graph's memory, held between calls and through the update (memory.py
    counts them). P is never rounded up: a graph computes exactly what the eager loop computes, a capture
    per new prompt length is the price (docs/speed.md). Without `capture` nothing is kept."""

    capture: Capture | None = None
    # (shapes, decoder, its step); the step refers to the decoder, nothing refers back: freed by refcount
    kept: tuple[tuple, _Decoder, Callable[..., tuple]] | None = None
    casts: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)  # `weights_cast_once`'s
    recorded: list[Tensor] = field(default_factory=list)  # what entered record_block, from the hook


def capture_cuda_graph(step: Callable[[], tuple], *, device: torch.device, pool: tuple) -> tuple:
    """A `Capture` on `device`: run `step` once on a side stream there (the warm-up: cuBLAS workspaces and
    lazy allocations are made outside the capture), then capture it into a CUDA graph whose memory comes
    from `pool` (one kept for the run's graphs). The capture launches nothing: the KV cache and the
    positions advance once, in the warm-up, whose outputs are the first step's.
    NOTE: capture_error_mode "thread_local": CUDA then refuses an unsafe call only on this thread. In the
    default "global" mode a page-locked allocation on another thread (`trainer.prompts_ahead` pinning the
    next batch: cudaHostAlloc) fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and breaks the capture.
    `capture_begin` rather than torch.cuda.graph, which synchronizes and empties the allocator's caches
    (device and page-locked) at every capture: a capture per prompt length would pay that every step."""
    with torch.cuda.device(device):  # NOTE: the side stream, the pool and the capture on the model's GPU
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            first = step()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                static = step()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
    return first, static, graph.replay


def _captured(step: Callable[..., tuple], capture: Capture) -> Callable[..., tuple]:
    """`step` replayed as a graph: the first call copies its inputs into static ones and runs and captures
    it (`capture`); later calls copy their inputs there, replay it and return copies of its static outputs
    (the next replay overwrites them; the caller keeps the recorded trunk)."""
    inputs, static, replay = (), (), None

    def run(*args: Tensor) -> tuple:
        nonlocal inputs, static, replay
        if replay is None:
            inputs = tuple(x.clone() for x in args)
            first, static, replay = capture(lambda: step(*inputs))
            return first
        for buffer, x in zip(inputs, args, strict=True):
            buffer.copy_(x)
        replay()
        return tuple(x.clone() for x in static)

    return run


def _decode_step(
    model: nn.Module, decoder: _Decoder, recorded: list[Tensor], capture: Capture | None
) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """One token's forward, tokens (N, 1) -> fp32 logits (N, V) [, what entered record_block: an output, as a
    graph replays no hook]; no host sync or changing shape, all else read in place: a CUDA graph can replay
    it. The logits are the log-prob passes' fp32 head (`head_logits`): the sampler draws from the policy
    whose log-probs are trained."""
    base = model.base_model
    options = {"attention_mask": decoder.mask, "use_cache": True, _cache_keyword(base): decoder.cache}

    def step(fed: Tensor) -> tuple[Tensor, ...]:
        # The fed token's slot becomes valid as it is written: every slot the mask calls valid holds a key.
        # NOTE: sdpa and eager add causality to the mask; FlashAttention-2 attends to every valid slot.
        decoder.mask.index_fill_(1, decoder.written, 1)
        # position_ids (N, 1): for Qwen-VL the same on all three mRoPE axes.
        hidden = base(input_ids=fed, position_ids=decoder.position, **options).last_hidden_state  # (N, 1, H)
        decoder.position.add_(1)  # on the device, as StaticCache advances where it writes: a replay does all
        decoder.written.add_(1)
        logits = head_logits(hidden[:, -1], decoder.head)  # (N, V) fp32
        return (logits, recorded.pop()) if recorded else (logits,)

    return step if capture is None else _captured(step, capture)


def _decoder(
    model: nn.Module, graphs: DecodeGraphs, shapes: tuple, head: Tensor
) -> tuple[_Decoder, Callable]:
    """The decoder and step kept for `shapes` (N, P, T, dtype, recording), else new ones, kept if `graphs`
    capture (the caller has freed any kept for other shapes: never two caches at once)."""
    if graphs.kept is not None and graphs.kept[0] == shapes:
        return graphs.kept[1:]
    (N, P, T, *_), device = shapes, head.device
    decoder = _Decoder(
        cache=StaticCache(config=model.config, max_cache_len=P + T),
        mask=torch.zeros(N, P + T, dtype=torch.long, device=device),
        position=torch.zeros(N, 1, dtype=torch.long, device=device),
        written=torch.zeros(1, dtype=torch.long, device=device),
        head=head_weight(head),
    )
    step = _decode_step(model, decoder, graphs.recorded, graphs.capture)
    if graphs.capture is not None:
        graphs.kept = (shapes, decoder, step)
    return decoder, step


def _load(decoder: _Decoder, prompts: Any, attention_mask: Tensor, position: Tensor, head: Tensor, G: int):
    """A new batch into the decoder, in place: each prompt's KV cache copied to its G rows in the first P
    slots, its padding mask and positions likewise, the head's fp32 copy (if it has one) refreshed."""
    P = attention_mask.shape[1]
    decoder.cache.reset()  # zeros: a slot never written holds no key of an earlier batch
    for layer, prompt in zip(decoder.cache.layers, prompts.layers, strict=True):
        # NOTE: each prompt's keys and values stored G times: once needs an attention over a shared prefix
        layer.update(*(kv.repeat_interleave(G, dim=0) for kv in (prompt.keys, prompt.values)))
    decoder.mask.zero_()  # the T completion slots stay 0 until the step writes them
    decoder.mask[:, :P] = attention_mask.repeat_interleave(G, dim=0)
    decoder.position.copy_(position.repeat_interleave(G, dim=0))
    decoder.written.fill_(P)
    if decoder.head is not head:
        decoder.head.copy_(head)


@contextmanager
def weights_cast_once(model: nn.Module, kept: dict | None = None) -> Iterator[None]:
    """Inside: no grad, and every LoRALinear's A and B replaced by their casts to the base dtype, made once
    for all the forwards inside (its forward's own `.to` is then a no-op; the weights are unchanged, and come
    back on exit). Given `kept` (module -> casts of an earlier call), the casts are refreshed there in place:
    a replayed graph reads them at the addresses it was captured with.
    NOTE: the casts stand in the layers' parameter slots, so nothing inside may train A or B (no grad)."""
    modules, kept = list(lora.lora_modules(model).values()), {} if kept is None else kept
    originals = {m: (m.lora_A.weight, m.lora_B.weight) for m in modules}
    with torch.no_grad():  # the casts are constants: nothing inside trains A or B
        for m, weights in originals.items():
            if m not in kept:
                kept[m] = tuple(w.to(m.weight.dtype) for w in weights)  # an fp32 base: the weights themselves
            for cast, w in zip(kept[m], weights, strict=True):
                if cast is not w:
                    cast.copy_(w)
            for layer, cast in zip((m.lora_A, m.lora_B), kept[m], strict=True):
                layer.weight = nn.Parameter(cast, requires_grad=False)  # the cast's storage, not a copy
        try:
            yield
        finally:
            for m, (a, b) in originals.items():
                m.lora_A.weight = a
                m.lora_B.weight = b


@torch.no_grad()
def sample_shared_prefill(
    model: nn.Module,
    inputs: dict[str, Tensor],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    suppress_token_ids: Sequence[int] = (),
    record_block: nn.Module | None = None,
    capture: Capture | DecodeGraphs | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`grpo.sample_completions(..., num_return_sequences=G)` with each prompt prefilled once: B LEFT-padded
    prompts in, ids (N, T) out (prompt b: rows b*G .. b*G+G-1). Given `record_block` (blocks[first_adapted]),
    also what entered that block, (N, P + T - 1, H) (the last token is drawn, never fed): the frozen trunk,
    equal to a full forward's to rounding (a KV-cache step sums in another order). Given `capture`, the
    decoding step is replayed as a graph after its first run: the same tokens; a `DecodeGraphs` keeps it for
    later calls. Logits from the fp32 LM head, as the log-prob passes: with a bf16 model the tokens differ
    from generate's (bf16 head) where rounding flips a draw."""
    grpo.check_inputs(inputs)
    grpo.check_sampling(temperature, top_p, eos_token_id, suppress_token_ids)
    if max_new_tokens < 1 or group_size < 1:
        raise ValueError(f"need max_new_tokens >= 1, group_size >= 1; got {max_new_tokens=}, {group_size=}")
    graphs = capture if isinstance(capture, DecodeGraphs) else DecodeGraphs(capture)
    graphs.recorded.clear()  # the prompts' (B, P, H), then (N, 1, H) per fed token
    head, (B, P) = model.get_output_embeddings().weight, inputs["input_ids"].shape  # head (V, H)
    shapes = (B * group_size, P, max_new_tokens, head.dtype, record_block is not None)
    if graphs.kept is not None and graphs.kept[0] != shapes:
        graphs.kept = None  # NOTE: the replaced cache and graph are freed now, before the prefill runs

    def record(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        graphs.recorded.append(args[0] if args else kwargs["hidden_states"])

    hook = record_block.register_forward_pre_hook(record, with_kwargs=True) if record_block else nullcontext()
    with hook, weights_cast_once(model, graphs.casts):  # the handle removes the hook on exit; LoRA cast once
        hidden, prompts, position = _prefill(model, inputs)  # (B, H), the prompts' cache, (B, 1)
        recorded = graphs.recorded[:1]  # the prompts' trunk (B, P, H), if recorded
        graphs.recorded.clear()
        decoder, step = _decoder(model, graphs, shapes, head)
        _load(decoder, prompts, inputs["attention_mask"], position, head, group_size)
        logits = head_logits(hidden, decoder.head).repeat_interleave(group_size, dim=0)  # (N, V)
        (N, V), device = logits.shape, logits.device
        if any(not 0 <= t < V for t in suppress_token_ids):  # NOTE: a negative id would index from the end
            raise ValueError(f"suppress_token_ids must lie in [0, {V}), got {sorted(suppress_token_ids)}")
        suppressed = torch.zeros(V, dtype=torch.bool, device=device)  # (V,)
        suppressed[list(suppress_token_ids)] = True
        running = torch.ones(N, dtype=torch.bool, device=device)  # (N,) no EOS yet
        ends = torch.as_tensor(eos_token_id, device=device).reshape(-1)  # one id or several
        tokens = torch.full((N, max_new_tokens), pad_token_id, device=device)  # (N, T)
        every, rng_states, cuda = FINISHED_CHECK_EVERY.get(device.type, 1), [], device.type == "cuda"
        rng = torch.cuda.default_generators[device.index] if cuda else torch.default_generator
        for t in range(max_new_tokens):
            token = _draw(logits, temperature=temperature, top_p=top_p, suppressed=suppressed)  # (N,)
            rng_states.append(rng.get_state())  # the generator multinomial draws from
            # Finished rows get padding; they are still drawn for, so the RNG advances as in generate.
            tokens[:, t] = torch.where(running, token, pad_token_id)
            running &= ~torch.isin(tokens[:, t], ends)  # any end-of-turn id ends the row
            if t == max_new_tokens - 1 or ((t + 1) % every == 0 and not running.any()):
                break
            logits, *fed_hidden = step(tokens[:, t, None])  # (N, V) [and record_block's (N, 1, H)]
            recorded += fed_hidden
    if not running.any():  # generate stops at the step where the last row ended: drop the steps after it
        t = int(torch.isin(tokens, ends).to(torch.int8).argmax(dim=1).max())  # argmax: each row's first EOS
        rng.set_state(rng_states[t])  # and undo their draws
    trunk = [recorded[0].repeat_interleave(group_size, dim=0), *recorded[1 : t + 1]] if recorded else None
    return tokens[:, : t + 1], (torch.cat(trunk, dim=1) if trunk else None)  # prompts G times, tokens fed


# --- 2. the frozen trunk, run once (grpo.completion_logprobs) -----------------------------------------------


@dataclass
class Trunk:
    """What the frozen trunk (vision tower, embeddings, blocks before it) hands to blocks[first_adapted]."""

    hidden_states: Tensor  # (n, P + T - 1, H) detached; the last completion token is left out
    block_kwargs: dict[str, Any]  # as the model passed them: 4D mask or None, (m)RoPE (cos, sin), ...


class _TrunkCaptured(Exception):
    """Raised by a block's forward pre-hook to end the forward there; args: (hidden states, block kwargs)."""


def _trunk_inputs(
    model: nn.Module,
    inputs: dict[str, Tensor],
    completion_ids: Tensor,
    blocks: Sequence[nn.Module],
    first_adapted: int,
) -> dict[str, Tensor]:
    """`grpo.recompute_inputs` but the last completion token (its output would predict a token past the end):
    (n, P + T - 1); the trunk is shared only if nothing before blocks[first_adapted] trains."""
    if not 0 <= first_adapted < len(blocks):
        raise ValueError(f"need 1 <= K <= L adapted blocks, i.e. 0 <= first_adapted < {len(blocks)}")
    adapted = {id(p) for block in blocks[first_adapted:] for p in block.parameters()}
    # NOTE: strict on purpose: a trainable lm_head tied to the input embeddings would change the trunk too.
    outside = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in adapted]
    if outside:
        raise ValueError(
            f"trunk reuse needs every trainable parameter in blocks[{first_adapted}:]: {outside[:3]}"
        )
    if completion_ids.shape[1] == 0:
        raise ValueError("no completion tokens: nothing to compute log-probs for")
    return grpo.recompute_inputs(inputs, completion_ids[:, :-1])


def _encode_images_once(model: nn.Module, inputs: dict[str, Tensor]) -> Any:
    """`get_image_features` for the N rows' images, a row equal to the previous one (a prompt's G rows are
    consecutive; grids and pixels compared exactly) reusing its embeddings: `mm_encoder_outputs["image"]`.
    NOTE: equal to encoding every row up to rounding (the tower's matmuls see fewer patches at once)."""
    images_per_row = _images_per_row(inputs).tolist()  # (N,)
    row_grids = inputs["image_grid_thw"].split(images_per_row)  # N blocks of (images of the row, 3)
    row_pixels = inputs["pixel_values"].split([int(g.prod(-1).sum()) for g in row_grids])  # t * h * w patches
    encoded, source, num_encoded = [], [], 0  # rows to encode; each image's index among the encoded ones
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
    deepstack = getattr(features, "deepstack_features", None)  # Qwen3-VL: per layer, per image
    if deepstack is not None:
        features.deepstack_features = [tuple(layer[i] for i in source) for layer in deepstack]
    return features


def _capture_block_input(
    model: nn.Module, kwargs: dict[str, Any], block: nn.Module
) -> tuple[Tensor, dict[str, Any]]:
    """Run model(**kwargs) up to `block`; return the (hidden states, keyword arguments) it receives. The
    model's own code builds the masks and (m)RoPE; a pre-hook raises there: nothing from `block` on runs."""

    def stop(module: nn.Module, args: tuple, block_kwargs: dict[str, Any]) -> None:
        raise _TrunkCaptured(args[0] if args else block_kwargs.pop("hidden_states"), dict(block_kwargs))

    with block.register_forward_pre_hook(stop, with_kwargs=True):
        try:
            model(**kwargs, logits_to_keep=1, use_cache=False)
        except _TrunkCaptured as captured:
            return captured.args[0].detach(), captured.args[1]
    raise RuntimeError("the block was never called: pass one of the model's own decoder blocks")


@torch.no_grad()
def capture_trunk(
    model: nn.Module,
    inputs: dict[str, Tensor],
    completion_ids: Tensor,
    *,
    blocks: Sequence[nn.Module],
    first_adapted: int,
) -> Trunk:
    """What blocks[first_adapted] receives, without grad, from `grpo.completion_logprobs`'s inputs; a prompt's
    images are encoded once per micro-batch. Adapters on or off alike: none sits in the trunk (checked)."""
    kwargs = _trunk_inputs(model, inputs, completion_ids, blocks, first_adapted)  # (n, P + T - 1)
    # NOTE: a forward without this parameter (transformers < 5) swallows it and leaves image tokens unfilled.
    takes_features = "mm_encoder_outputs" in inspect.signature(model.forward).parameters
    if "pixel_values" in kwargs and hasattr(model, "get_image_features") and takes_features:
        del kwargs["pixel_values"]
        kwargs["mm_encoder_outputs"] = {"image": _encode_images_once(model, inputs)}
    return Trunk(*_capture_block_input(model, kwargs, blocks[first_adapted]))


@torch.no_grad()
def trunk_from_recording(
    model: nn.Module,
    inputs: dict[str, Tensor],
    completion_ids: Tensor,
    hidden_states: Tensor,
    *,
    blocks: Sequence[nn.Module],
    first_adapted: int,
) -> Trunk:
    """The Trunk of n rows from their slice (n, P + T - 1, H) of `sample_shared_prefill`'s recording. The
    blocks' keyword arguments (mask, (m)RoPE) depend on ids, grids and mask, not pixels: a forward without
    images up to blocks[0] builds them (NOTE: the adapted blocks' must equal them: `record_block` checks)."""
    kwargs = _trunk_inputs(model, inputs, completion_ids, blocks, first_adapted)  # (n, P + T - 1)
    kwargs.pop("pixel_values", None)
    # NOTE: no pixels, so no forward refuses a completion's image placeholders; sampling suppresses them.
    placeholders = [getattr(model.config, key, None) for key in ("image_token_id", "video_token_id")]
    if any(t is not None and bool((completion_ids == t).any()) for t in placeholders):
        raise ValueError(
            "a completion contains an image/video placeholder token: suppress them when sampling"
        )
    if hidden_states.shape[:2] != kwargs["input_ids"].shape:
        raise ValueError(
            f"recording {tuple(hidden_states.shape)} does not fit the rows {kwargs['input_ids'].shape}"
        )
    return Trunk(hidden_states, _capture_block_input(model, kwargs, blocks[0])[1])


def fit_recording(hidden_states: Tensor, prompt_length: int, P: int, T: int) -> Tensor:
    """Rows of a recording (n, prompt_length + T' - 1, H) moved into a batch re-padded to prompts of P
    (left) and completions of T >= T' (right): (n, P + T - 1, H). NOTE: the positions added are zeros and
    reach no kept log-prob: left padding is masked out of attention, and the right ones hold the inputs of
    tokens past the row's end (the recording lacks its last token's, which predicts only padding here)."""
    prompt, completion = hidden_states[:, :prompt_length], hidden_states[:, prompt_length:]
    prompt = F.pad(prompt[:, max(prompt_length - P, 0) :], (0, 0, max(P - prompt_length, 0), 0))
    return torch.cat([prompt, F.pad(completion, (0, 0, 0, T - 1 - completion.shape[1]))], dim=1)


def recording_of_groups(
    model: nn.Module,
    inputs: dict[str, Tensor],
    completion_ids: Tensor,
    kept: list[tuple[Tensor, int] | None],
    plan: "Plan",
    group_size: int,
) -> Tensor:
    """The recording (N, P + T - 1, H) of whole groups of G rows, sampled in other batches and re-padded
    together (`inputs`, `completion_ids`): each group's rows of the recording it was sampled with (`kept`:
    (rows, the prompt length then), `fit_recording`), or captured here where that is None."""
    P, T = inputs["input_ids"].shape[1], completion_ids.shape[1]
    frozen = dict(blocks=plan.parts["blocks"], first_adapted=plan.parts["first_adapted"])
    groups = []
    for (rows, group_inputs), recorded in zip(split_rows(inputs, group_size), kept, strict=True):
        if recorded is None:
            groups.append(capture_trunk(model, group_inputs, completion_ids[rows], **frozen).hidden_states)
        else:
            groups.append(fit_recording(*recorded, P, T))
    return torch.cat(groups)


def trunk_logprobs(
    trunk: Trunk,
    completion_ids: Tensor,
    *,
    blocks: Sequence[nn.Module],
    first_adapted: int,
    norm: nn.Module,
    lm_head: nn.Module,
    temperature: float,
    return_entropy: bool = False,
    gradient_checkpointing: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`grpo.completion_logprobs` from a trunk, through blocks[first_adapted:], the norm and the LM head: the
    policy's with grad, old_logp under no_grad, ref_logp inside `lora.adapters_disabled`."""
    hidden_states = trunk.hidden_states  # (n, P + T - 1, H)
    checkpointed = gradient_checkpointing and torch.is_grad_enabled()
    for block in blocks[first_adapted:]:
        if checkpointed:
            # Non-reentrant: gradients reach the LoRA weights although the trunk output has none (reentrant
            # would silently give them none). The RNG state is replayed, so LoRA dropout agrees.
            out = checkpoint(block, hidden_states, use_reentrant=False, **trunk.block_kwargs)
        else:
            out = block(hidden_states, **trunk.block_kwargs)
        hidden_states = out[0] if isinstance(out, tuple) else out  # a few families' blocks return a tuple
    T = completion_ids.shape[1]
    # Off-by-one as in completion_logprobs: positions P - 1 .. P + T - 2, the trunk's last T, predict the T
    # completion tokens. The norm acts on each position alone, so norm-then-slice equals slice-then-norm.
    hidden_states = norm(hidden_states[:, -T:])  # (n, T, H)
    options = dict(temperature=temperature, return_entropy=return_entropy)
    return logprobs_row_by_row(hidden_states, lm_head.weight, completion_ids, **options)


# --- 3. micro-batches (the loss's backward over all N rows at once) -----------------------------------------


def _images_per_row(inputs: dict[str, Tensor]) -> Tensor:
    """(N,) images per row: runs of 1s in mm_token_type_ids (Qwen-VL wraps each image in <|vision_start|> ..
    <|vision_end|>, so two images never merge into one run), checked against the grid count."""
    is_image = inputs["mm_token_type_ids"] == 1  # (N, P)
    images_per_row = (is_image[:, 1:] & ~is_image[:, :-1]).sum(dim=1) + is_image[:, 0]  # (N,) run starts
    num_grids = inputs["image_grid_thw"].shape[0]
    if int(images_per_row.sum()) != num_grids:
        raise ValueError(f"mm_token_type_ids has {int(images_per_row.sum())} image runs, {num_grids} grids")
    return images_per_row


def split_rows(inputs: dict[str, Tensor], chunk_size: int) -> list[tuple[slice, dict[str, Tensor]]]:
    """(rows, inputs) of consecutive chunks of at most `chunk_size` of the N rows, each with only its images:
    (N, P) tensors by rows, the flat `pixel_values` (patches, D) and `image_grid_thw` (images, 3) where the
    chunk's images end. NOTE: a chunk without images drops the image keys (the model cannot encode zero)."""
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


# --- 4. log-probs row by row, the LM head in fp32 (grpo.logprobs_from_logits) ----------------------------


def _fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64; no copy of an fp32 tensor


def _on_cuda(x: Tensor) -> bool:
    return x.device.type == "cuda"


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of two bf16 CUDA matrices as an fp32 matrix (torch >= 2.8; cuBLAS, fp32 accumulation)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def head_weight(weight: Tensor) -> Tensor:
    """The LM head's weight (V, H) as `head_logits` and the backward take it: a bf16 weight on CUDA as it is
    (cuBLAS multiplies it into fp32), an fp32 one as it is, else an fp32 copy, made once per pass by the
    caller (the CPU's bf16: 151,936 x 2048 x 4 B = 1.2 GB at 3B)."""
    return weight if _on_cuda(weight) and weight.dtype == torch.bfloat16 else _fp32(weight)


def head_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """fp32 logits (n, V) of the LM head on `hidden` (n, H), its `weight` from `head_weight`: what the
    sampler draws from and the log-prob passes train (in bf16, logits above 16 are spaced 0.125). For bf16
    operands on CUDA the matmul reads them as they are and writes fp32: a bf16 value has 8 significant bits,
    so each product (16 bits) is exact in fp32 and cuBLAS sums them in fp32: equal to the fp32 head up to
    the summation order, with no fp32 copy of the weight and no TF32 switch (no process-wide setting)."""
    if weight.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16:
        return _mm_fp32(hidden, weight.T)
    return _fp32(hidden) @ _fp32(weight).T


def _times_head(dz: Tensor, weight: Tensor) -> Tensor:
    """dz (T, V) fp32 @ the head's `weight` (V, H) from `head_weight`, in fp32. A bf16 weight on CUDA is
    never copied: dz is split into two bf16 halves, hi = bf16(dz) and lo = bf16(dz - hi), which hold it to
    16 significant bits (|dz - hi - lo| <= 2^-16 |dz|, against 2^-11 for TF32's rounding of dz), and each
    half is multiplied into fp32 as in `head_logits` (exact products, fp32 sums). That error is far below
    the fp32 sum's own over V = 151,936 terms, and the result is rounded to the bf16 hidden states' 8 bits."""
    if weight.dtype != torch.bfloat16:
        return dz @ weight
    hi = dz.to(torch.bfloat16)
    lo = (dz - hi).to(torch.bfloat16)  # dz - hi is exact in fp32: hi is dz rounded to 8 bits
    return _mm_fp32(hi, weight).add_(_mm_fp32(lo, weight))


def _row_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """(T, V) = the LM head on one row's hidden states (T, H), in fp32, over the temperature."""
    logits = head_logits(hidden, weight)
    return logits if temperature == 1 else logits / temperature


class _RowByRowLogprobs(torch.autograd.Function):
    """log softmax(lm_head(hidden) / temperature)[index], and the entropy (no grad), one row at a time both
    ways. A hand-written backward: autograd through a row loop would keep every row's fp32 logits alive;
    this keeps the (N, T) logsumexp and recomputes a row's logits in the backward. A bf16 head on CUDA is
    never copied to fp32 (`head_weight`); elsewhere a pass holds its fp32 copy while it runs."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, index: Tensor, temperature: float, entropy: bool):
        head, lse, picked, entropies = head_weight(weight), [], [], []  # head: (V, H), a copy freed on return
        for row, ids in zip(hidden, index):
            z = _row_logits(row, head, temperature)  # (T, V)
            lse.append(torch.logsumexp(z, dim=-1))
            picked.append(z.gather(-1, ids[:, None]).squeeze(-1))
            if entropy:  # a metric; entr(p) = -p log p, with entr(0) = 0
                entropies.append(torch.special.entr(torch.softmax(z, dim=-1)).sum(dim=-1))
        lse = torch.stack(lse)  # (N, T)
        ctx.save_for_backward(hidden, weight, index, lse)
        ctx.temperature = temperature
        entropy = torch.stack(entropies) if entropy else lse.new_empty(0)  # (N, T) or nothing
        ctx.mark_non_differentiable(entropy)
        return torch.stack(picked) - lse, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, index, lse = ctx.saved_tensors
        head, scale = head_weight(weight), grad / ctx.temperature  # (N, T) chain rule through z / temperature
        grad_hidden = torch.empty_like(hidden)  # (N, T, H): no (N, T, V) tensor, forward or backward
        grad_weight = torch.zeros_like(_fp32(weight)) if ctx.needs_input_grad[1] else None  # a trainable head
        for i in range(hidden.shape[0]):
            # d logp / d z = onehot(index) - softmax(z), times the incoming gradient; then through the head.
            z = _row_logits(hidden[i], head, ctx.temperature)  # (T, V)
            dz = torch.exp(z - lse[i, :, None]).mul_(-scale[i, :, None])  # (T, V)
            dz.scatter_add_(-1, index[i, :, None], scale[i, :, None])  # + scale at index
            grad_hidden[i] = _times_head(dz, head)  # (T, H)
            if grad_weight is not None:
                grad_weight += dz.T @ _fp32(hidden[i])  # (V, H)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def logprobs_row_by_row(
    hidden: Tensor, weight: Tensor, completion_ids: Tensor, *, temperature: float, return_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`grpo.logprobs_from_logits` of the LM head's logits (`weight` (V, H) on hidden states (N, T, H)), one
    row's fp32 logits at a time: logp [and entropy] (N, T), fp32; temperature 0 counts as 1."""
    temperature = float(temperature) if temperature > 0 else 1.0
    logp, entropy = _RowByRowLogprobs.apply(hidden, weight, completion_ids, temperature, return_entropy)
    return logp, entropy if return_entropy else None


# --- the choice, made once per run, and the three calls the step makes through it ---------------------------


@dataclass
class SpeedConfig:
    """Which re-arrangements a run uses; none changes the results. Field names are the flags."""

    shared_prefill: bool = True
    """Prefill each prompt once and copy its KV cache to its G rows (`sample_shared_prefill`), recording the
    trunk (--trunk-reuse). Same tokens as --no-shared-prefill: generate, which prefills a prompt G times."""
    trunk_reuse: bool = True
    """Run the frozen trunk (vision tower, first L - K blocks) once per batch without grad (recorded while
    sampling with --shared-prefill), then only the K adapted blocks per pass; else a full forward each."""
    micro_batch_size: int | Literal["auto"] | None = None
    """Rows per chunk of the log-prob passes and the backward (gradient accumulation, same loss). auto: the
    largest whose memory.py estimate fits the device, with checkpointing if needed. None: auto on CUDA, N on
    the CPU."""
    gradient_checkpointing: bool = False
    """Recompute the adapted blocks' activations in the backward instead of keeping them (non-reentrant).
    --micro-batch-size auto switches it on when the estimate needs it."""
    cuda_graph: bool = False
    """Replay --shared-prefill's one-token decoding step as a CUDA graph (the same tokens, no kernel launched
    one by one); ignored with a note where it cannot act (`decode_capture`). Off: never yet run on a GPU."""

    def check(self) -> None:
        size = self.micro_batch_size
        if size is not None and size != "auto" and size < 1:
            raise ValueError(f"--micro-batch-size: must be >= 1 or auto, got {size}")


@dataclass
class Plan:
    """A run's speed-ups, chosen once (`choose`), read by the step's three calls. All None: the plain path."""

    config: SpeedConfig = field(default_factory=SpeedConfig)
    parts: dict[str, Any] | None = None  # trunk reuse: the adapted blocks, first_adapted, norm, LM head
    record_block: nn.Module | None = None  # shared prefill + trunk reuse: where sampling records
    capture: DecodeGraphs | None = None  # shared prefill + --cuda-graph on CUDA: the kept decoding graphs


def decoder_parts(model: nn.Module, last_k: int) -> dict[str, Any]:
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
    lm_head = model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:  # logprobs_row_by_row applies its weight alone
        raise ValueError("the LM head has a bias; use --no-trunk-reuse")
    return dict(blocks=blocks, first_adapted=first_adapted, norm=norm, lm_head=lm_head)


def record_block(model: nn.Module, parts: dict[str, Any]) -> nn.Module:
    """blocks[first_adapted], whose input `sample_shared_prefill` records as the trunk."""
    # NOTE: trunk_from_recording takes the adapted blocks' mask from blocks[0]: one attention type needed.
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if len(set(types[:1] + types[parts["first_adapted"] :])) > 1:
        raise ValueError("blocks[0] and the adapted blocks differ in attention type; use --no-shared-prefill")
    return parts["blocks"][parts["first_adapted"]]


def decode_capture(model: nn.Module, config: SpeedConfig) -> DecodeGraphs | None:
    """The run's `DecodeGraphs` (`capture_cuda_graph` on the model's GPU, one memory pool) where --cuda-graph
    can act; elsewhere None, and a note says why."""
    device, attention = next(model.parameters()).device, model.config._attn_implementation
    # NOTE: flash_attention_2 reads its mask back to the host; a sliding-window StaticCache layer counts
    # what it holds in a Python int, which a replay would never advance.
    full = set(getattr(model.config.get_text_config(), "layer_types", None) or []) <= {"full_attention"}
    if config.shared_prefill and device.type == "cuda" and attention in ("sdpa", "eager") and full:
        with torch.cuda.device(device):
            pool = torch.cuda.graph_pool_handle()
        return DecodeGraphs(partial(capture_cuda_graph, device=device, pool=pool))
    # A note, not an error: a GPU run's command line also runs on the CPU, as without the flag.
    needs = "--shared-prefill's decoding, on CUDA, with sdpa or eager attention and no sliding window"
    print(f"note: --cuda-graph ignored: it captures {needs} (here {device}, {attention})")
    return None


def choose(model: nn.Module, config: SpeedConfig, *, last_k: int) -> Plan:
    """The run's Plan, made after LoRA is injected; without a trunk, checkpointing is transformers' own."""
    if config.gradient_checkpointing and not config.trunk_reuse:  # the trunk path checkpoints by itself
        enable_plain_checkpointing(model)
    capture = decode_capture(model, config) if config.cuda_graph else None
    if not config.trunk_reuse:
        return Plan(config, capture=capture)
    parts = decoder_parts(model, last_k)
    return Plan(config, parts, record_block(model, parts) if config.shared_prefill else None, capture)


def sample(
    model: nn.Module,
    inputs: dict[str, Tensor],
    plan: Plan,
    *,
    group_size: int,
    record: bool = True,
    **options: Any,
) -> tuple[Tensor, Tensor | None]:
    """G completions of each of the B prompts, (ids (N, T), trunk recording or None if not `record`), from
    `sample_shared_prefill` or (plain) `grpo.sample_completions`, given the samplers' `options`."""
    if plan.config.shared_prefill:
        chosen = dict(record_block=plan.record_block if record else None, capture=plan.capture)
        return sample_shared_prefill(model, inputs, group_size=group_size, **chosen, **options)
    return grpo.sample_completions(model, inputs, num_return_sequences=group_size, **options), None


@dataclass
class RowChunk:
    """One micro-batch of rows: its prompt inputs, completions and (with trunk reuse) its frozen trunk."""

    rows: slice  # which of the N rows
    inputs: dict[str, Tensor]  # input_ids (n, P), ..., and only these rows' images
    completion_ids: Tensor  # (n, T)
    trunk: Trunk | None = None


def row_chunks(
    model: nn.Module, inputs: dict[str, Tensor], completion_ids: Tensor, recording: Tensor | None, plan: Plan
) -> list[RowChunk]:
    """The N rows as the log-prob passes take them: all at once on the plain path, else `micro_batches`."""
    if plan.parts is None and plan.config.micro_batch_size is None:
        return [RowChunk(slice(0, completion_ids.shape[0]), inputs, completion_ids)]
    return micro_batches(model, inputs, completion_ids, recording, plan)


def micro_batches(
    model: nn.Module, inputs: dict[str, Tensor], completion_ids: Tensor, recording: Tensor | None, plan: Plan
) -> list[RowChunk]:
    """The rows in chunks of --micro-batch-size (all N if None), each with its frozen trunk under trunk reuse:
    from the sampler's `recording` (N, P + T - 1, H), or captured here."""
    size, parts, chunks = plan.config.micro_batch_size, plan.parts, []
    for rows, chunk_inputs in split_rows(inputs, size or completion_ids.shape[0]):
        chunk = RowChunk(rows, chunk_inputs, completion_ids[rows])
        if parts is not None:
            frozen = dict(blocks=parts["blocks"], first_adapted=parts["first_adapted"])
            args = (model, chunk.inputs, chunk.completion_ids)
            if recording is not None:
                chunk.trunk = trunk_from_recording(*args, recording[rows], **frozen)
            else:  # adapters on or off does not matter: none sits in the trunk
                chunk.trunk = capture_trunk(*args, **frozen)
            chunk.inputs.pop("pixel_values", None)  # held no longer: only the trunk needed them
        chunks.append(chunk)
    return chunks


def chunk_logprobs(
    model: nn.Module, chunk: RowChunk, plan: Plan, *, temperature: float, return_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Chunk logp (n, T) [and entropy]: a full forward (`grpo.completion_logprobs`), or `trunk_logprobs`."""
    options = dict(temperature=temperature, return_entropy=return_entropy)
    if chunk.trunk is None:
        return grpo.completion_logprobs(model, chunk.inputs, chunk.completion_ids, **options)
    checkpointing = dict(gradient_checkpointing=plan.config.gradient_checkpointing)
    return trunk_logprobs(chunk.trunk, chunk.completion_ids, **options, **plan.parts, **checkpointing)


def enable_plain_checkpointing(model: nn.Module) -> None:
    """transformers' non-reentrant checkpointing of every block, for the plain path (no trunk)."""
    # transformers >= 5.23 renamed gradient_checkpointing_enable (deprecated until v6) to this.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
