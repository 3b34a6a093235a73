"""The memory a training step needs, estimated from shapes, and the micro-batch that makes it fit a device.

`estimate` adds up, per phase of trainer.py's step, the bytes alive together:
- sampling: the base weights, the pre-allocated KV cache of N rows x (P + T) positions in all L blocks, the
  recorded trunk (N, P + T - 1, H), twice while its pieces are concatenated, and the LM head's fp32 weight
  where the device makes a copy of it (the CPU; CUDA multiplies a bf16 head into fp32 as it is);
- with --cuda-graph (`cuda_graph`): the decoding step kept between calls (`decode_graph_bytes`: its
  StaticCache of N x (P + T) positions, its mask and the graph's memory), held through every later phase;
- trunk: the recording kept through the update, each chunk's 4D mask and (m)RoPE tables, the pixels (the B
  prompts' once with trunk reuse; the N rows' on the plain path, whose every pass reads them);
- logprob_pass: a no-grad pass (reference, old policy): one adapted block's intermediates for a micro-batch,
  and the fp32 LM head run row by row (`speedups.logprobs_row_by_row`: a few (T, V) fp32 tensors, never an
  (N, T, V) one, and the head's fp32 copy where the device makes one);
- update: what the K adapted blocks save for the backward of one micro-batch (`activations`: counted below
  from their ops, the attention's additive mask included; with checkpointing only each block's input, plus
  one block recomputed), then the larger of the LM head's and a block's backward working set.
- with tools (`tool_image_tokens` > 0, multiturn.py): sampling is generate's, turn by turn, whatever
  --shared-prefill says: its cache of N rows x (P + T) grown by concatenation, each turn's prefill over the
  whole sequence so far, the N rows' fp32 pixels (the prompt's images and the tools', G copies of each
  prompt's) and one vision block's working set over them, as each turn re-encodes every image; nothing is
  recorded, the trunk is captured after sampling. Through the update the rows' pixels stay on the plain path
  only (trainer.tool_rollout drops them under trunk reuse). T is the completion with the tool turns' tokens.
`peak` is the largest phase. Every count is per token of n micro-batch rows x S = P + T - 1 positions, and
assumes, as trainer.py's default path does, LoRA on q/k/v/o/gate/up/down of the last K blocks of a Qwen2-style
decoder, trunk reuse, fused attention (SDPA's flash / memory-efficient kernels, which save q, k, v, the output
and the log-sum-exp, never the (S, S) scores) and padded prompts (so keys and values are repeated to every
head for SDPA; eager attention would keep the (S, S) scores too). The plain path (no shared prefill, no trunk
reuse) is counted with generate's cache and the (n, T, V) logits it makes. Letters as in grpo.py: B prompts,
G group size, N = B*G rows, P prompt, T completion length, V vocab, K adapted of L blocks, H hidden, I MLP
width, r LoRA rank, d the activation dtype's bytes.

`track_peak` measures the same thing on any device: the bytes of the tensors that ops make while it is on.
"""

import math
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Qwen2.5-VL's public config.json numbers (Qwen/Qwen2.5-VL-{3B,7B}-Instruct), for tables without a download.
QWEN25_VL = {
    "3b": dict(
        text_config=dict(
            hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2
        ),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=2048),
    ),
    "7b": dict(
        text_config=dict(
            hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
        ),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584),
    ),
}
QWEN25_VL["3b"]["text_config"].update(intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)
QWEN25_VL["7b"]["text_config"].update(intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)

GIB = 2**30
# The share of the device's memory (free + what torch already holds) an estimate may fill: the caching
# allocator's fragmentation and the estimate's error (within 25% at small shapes) need the rest.
SAFETY_FRACTION = 0.8


def parameter_count(config: Any) -> int:
    """Base parameters from a Qwen2-style config: embeddings, L blocks, the LM head if untied, and the vision
    tower (Qwen2.5-VL's layout: SwiGLU blocks, a 2x2 patch merger) when the config has one."""
    text = config.get_text_config()
    H, I, L, V = text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.vocab_size
    kv = text.num_key_value_heads * H // text.num_attention_heads
    block = H * (2 * H + 2 * kv) + (H + 2 * kv) + 3 * H * I + 2 * H  # q, o, k, v + their biases, MLP, norms
    tied = getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
    count = V * H * (1 if tied else 2) + L * block + H
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        h, i, out = vision.hidden_size, vision.intermediate_size, vision.out_hidden_size
        patch = 3 * 2 * 14 * 14 * h  # channels x temporal x 14 x 14 pixels per patch
        merger = 4 * h * 4 * h + 4 * h + 4 * h * out + out + h
        count += patch + vision.depth * (4 * h * h + 4 * h + 3 * h * i + 2 * i + 3 * h) + merger
    return count


def estimate(
    config: Any,
    *,
    rows: int,
    prompt_len: int,
    completion_len: int,
    last_k: int,
    lora_r: int,
    dtype_bytes: int,
    micro_batch_size: int | None,
    gradient_checkpointing: bool,
    trunk_reuse: bool = True,
    shared_prefill: bool = True,
    lora_modules: int = 7,
    group_size: int = 8,
    num_params: int | None = None,
    image_tokens: int | None = None,
    tool_image_tokens: int = 0,
    cuda_graph: bool = False,
    device_type: str = "cuda",
) -> dict[str, int]:
    """Bytes per phase of one step (see the module docstring) and their `peak`; `num_params` defaults to
    `parameter_count(config)`, `image_tokens` (visual tokens per prompt) to all P with a vision tower;
    `tool_image_tokens`: the visual tokens a row's tool turns may add (0: no tools); `cuda_graph`: the
    decoding step kept as a CUDA graph; `device_type`: where the step runs ("cuda": a 16-bit head is
    multiplied into fp32 without a copy; elsewhere an fp32 copy of it is made per sampling call and pass)."""
    text = config.get_text_config()
    H, I, L, V = text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.vocab_size
    heads, d, f32 = text.num_attention_heads, dtype_bytes, 4
    hd, kv = H // heads, text.num_key_value_heads * H // heads
    N, P, T, K, r, n = rows, prompt_len, completion_len, last_k, lora_r, micro_batch_size or rows
    S = P + T - 1  # the trunk's positions: the last completion token is never fed
    if image_tokens is None:
        image_tokens = P if getattr(config, "vision_config", None) is not None else 0
    weights = (num_params or parameter_count(config)) * d
    # LoRA's A (r, d_in) and B (d_out, r) on q, o, k, v, gate, up, down (scaled to `lora_modules` of them),
    # fp32: weights, gradients, AdamW's two moments.
    lora = K * r * (2 * H + 2 * H + 2 * (H + kv) + 3 * (H + I)) * lora_modules // 7 * f32 * 4
    recording = N * S * H * d if trunk_reuse else 0
    rows_cache = N * (P + T) * L * 2 * kv * d
    kv_cache = rows_cache + (N // group_size) * P * L * 2 * kv * d  # + the prompts' own
    draw = 3 * N * V * f32  # the last logits, their softmax, the sampler's scores
    # The LM head's weight in fp32, once per sampling call or pass; none for speedups' head on CUDA
    # (`speedups.head_weight`: cuBLAS multiplies a bf16 head into fp32), one for grpo.py's.
    weight32 = V * H * f32 if d < f32 else 0
    cuda16 = device_type == "cuda" and d < f32
    sampling = kv_cache + 2 * recording + draw + (0 if cuda16 else weight32)  # drawn from the fp32 head
    if not shared_prefill:  # generate: all N rows prefilled, a cache grown by concatenation (old and new)
        sampling = 2 * kv_cache + N * P * 3 * I * d + draw
    if tool_image_tokens:  # generate turn by turn: each turn prefills every row's whole sequence, images too
        visual = N * (image_tokens + tool_image_tokens)  # the rows' visual tokens, re-encoded each turn
        h, i = config.vision_config.hidden_size, config.vision_config.intermediate_size
        encoder = 4 * visual * (3 * i + 4 * h) * d  # one vision block over 4 patches a token: MLP, attention
        rows_cache = N * (P + T) * L * 2 * kv * d  # no prompt cache shared by a group's rows
        sampling = 2 * rows_cache + N * (P + T) * 3 * I * d + draw + pixel_bytes(visual) + encoder
    # Each chunk's 4D boolean mask (n, 1, S, S) and mRoPE cos, sin (3, n, S, hd); pixels: each prompt's once
    # when the chunks drop theirs after the trunk (trainer.Rollout.prompts), else every row's.
    pixels = pixel_bytes(
        N // group_size * image_tokens if trunk_reuse else N * (image_tokens + tool_image_tokens)
    )
    trunk = recording + (N * S * S + 2 * 3 * N * S * hd * d if trunk_reuse else 0) + pixels
    # Saved per token by one adapted block: the normed input (q/k/v's LoRA A keep it), q and k after RoPE and
    # v, both repeated to all heads, SDPA's output and its transposed copy (o_proj's input), cos and sin,
    # the log-sum-exp; the second norm's fp32 copy and output; gate, silu(gate), up and their product (down's
    # input); each LoRA A's (r) output; SDPA's additive mask, (n, 1, S, S) in the activations' dtype, made
    # from the boolean one by each block's call (the memory-efficient kernel takes and saves a float bias).
    # Blocks after the first also keep their input norm's fp32 copy.
    block = d * (7 * H + 2 * hd + 4 * I + lora_modules * r + S) + f32 * (heads + H)
    later = f32 * H  # the first block's input comes from the trunk, without grad: its norm keeps nothing
    head_saved = n * T * (f32 * H + d * H + f32)  # final norm (fp32 copy, output), the LM head's lse
    if gradient_checkpointing:  # each block's input, and one block recomputed in the backward
        activations = n * S * ((K - 1) * d * H + block + later) + head_saved
    else:
        activations = n * S * (K * block + (K - 1) * later) + head_saved
    # Logits, softmax, entropy or their gradient: one row's (T, V) at a time; without trunk reuse
    # grpo.completion_logprobs makes all n rows' at once, and keeps two such tensors for the backward.
    logits = 3 * (1 if trunk_reuse else n) * T * V * f32
    activations += 0 if trunk_reuse else 2 * n * T * V * f32
    ours = cuda16 and trunk_reuse  # speedups' row-by-row head: no copy; dz in two bf16 halves backward
    head_pass = (2 * T * V * d if ours else weight32) + logits + n * T * H * d
    block_pass = n * S * (d * (3 * I + 6 * H) + f32 * H)  # one block's forward: MLP, attention, norm
    backward = n * S * d * (I + 3 * H)  # one block's gradients in flight
    kept = decode_graph_bytes(config, N, P, T, d) if cuda_graph and shared_prefill else 0
    base = weights + lora
    phases = {
        "weights": weights,
        "lora+adam": lora,
        "sampling": base + sampling + kept - rows_cache * bool(kept),  # the kept cache is the one sampled in
        "trunk": base + kept + trunk,
        "logprob_pass": base + kept + trunk + max(head_pass, block_pass),
        "activations": activations,
        "update": base + kept + trunk + activations + max(head_pass, backward),
    }
    phases["peak"] = max(phases[k] for k in ("sampling", "logprob_pass", "update"))
    return phases


def decode_graph_bytes(config: Any, rows: int, prompt_len: int, completion_len: int, dtype_bytes: int) -> int:
    """What a decoding step kept as a CUDA graph (speedups.DecodeGraphs) holds between sampling calls: its
    StaticCache of N rows x (P + T) positions in all L blocks (keys and values), its (N, P + T) int64 mask,
    and the graph's memory: the step's fp32 logits (N, V) and their static copy, one block's intermediates
    for N tokens (MLP and attention), the attention's (N, 1, 1, P + T) masks (boolean and additive)."""
    text = config.get_text_config()
    H, I, L, V = text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.vocab_size
    N, S, d = rows, prompt_len + completion_len, dtype_bytes
    kv = text.num_key_value_heads * H // text.num_attention_heads
    cache = N * S * L * 2 * kv * d
    pool = 2 * N * V * 4 + N * (3 * I + 6 * H) * d + N * S * (1 + d)
    return cache + N * S * 8 + pool


def pixel_bytes(image_tokens: int) -> int:
    """The fp32 `pixel_values` of `image_tokens` visual tokens: 4 patches each (Qwen-VL's 2x2 merge) of 3
    channels x 2 frames x 14 x 14 pixels."""
    return image_tokens * 4 * 3 * 2 * 14 * 14 * 4


def choose_micro_batch(config: Any, *, budget_bytes: int, **shapes: Any) -> tuple[int, bool]:
    """(micro_batch_size, gradient_checkpointing): the largest micro-batch (N, then powers of two below) whose
    `estimate(config, **shapes)` peak fits the budget without checkpointing, else with it (only with it when
    `shapes` asks for it); else 1 row with checkpointing, which does not fit: the caller says so."""
    N = shapes["rows"]
    sizes = [N] + [2**k for k in range(math.ceil(math.log2(N)) - 1, -1, -1)]
    for checkpointing in (False, True) if not shapes.get("gradient_checkpointing") else (True,):
        for size in sizes:
            options = dict(shapes, micro_batch_size=size, gradient_checkpointing=checkpointing)
            if estimate(config, **options)["peak"] <= budget_bytes:
                return size, checkpointing
    return 1, True


def fit(
    config: Any, budget: int, micro_batch_size: int | None, gradient_checkpointing: bool, **shapes: Any
) -> tuple[int, bool, list[str]]:
    """(micro-batch, checkpointing, the lines to print): `choose_micro_batch`'s choice when `micro_batch_size`
    is None, else the size given; then the estimate of that choice, and a warning if it exceeds `budget`."""
    lines = []
    if micro_batch_size is None:
        micro_batch_size, gradient_checkpointing = choose_micro_batch(
            config, budget_bytes=budget, gradient_checkpointing=gradient_checkpointing, **shapes
        )
        on = "on" if gradient_checkpointing else "off"
        lines.append(f"--micro-batch-size auto: {micro_batch_size} rows, gradient checkpointing {on}")
    phases = estimate(
        config, micro_batch_size=micro_batch_size, gradient_checkpointing=gradient_checkpointing, **shapes
    )
    N, P, T = shapes["rows"], shapes["prompt_len"], shapes["completion_len"]
    head = f"memory estimate (memory.py) for N={N} rows, P={P}, T={T}, budget {budget / GIB:.1f} GiB:"
    if phases["peak"] > budget:
        lines.append(
            f"warning: the estimated peak, {phases['peak'] / GIB:.1f} GiB, exceeds the budget: lower "
            "--micro-batch-size, --batch-size, --group-size, --max-new-tokens or the images' size"
        )
    return micro_batch_size, gradient_checkpointing, [head, *format_table(phases), *lines]


def format_table(phases: dict[str, int]) -> list[str]:
    """`estimate`'s phases as lines: name, GiB (MiB when the peak is below 1 GiB)."""
    unit, size = ("GiB", GIB) if phases["peak"] >= GIB else ("MiB", 2**20)
    return [f"  {name:<13} {value / size:8.2f} {unit}" for name, value in phases.items()]


def device_budget(device: torch.device) -> int:
    """SAFETY_FRACTION of what this process can use: on CUDA the free memory plus torch's own reserve (the
    weights already loaded), on the CPU the physical memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(SAFETY_FRACTION * (free + torch.cuda.memory_reserved(device)))
    return int(SAFETY_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class _StorageCounter(TorchDispatchMode):
    """Counts each storage an op returns (not views, in-place results) until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.seen and storage.nbytes():
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


@contextmanager
def track_peak() -> Iterator[_StorageCounter]:
    """Inside: `.live` bytes of the tensors made since entering and their `.peak` (set `.peak = .live` to
    start a phase). Tensors made before are not counted; slow (every op passes through Python)."""
    with _StorageCounter() as counter:
        yield counter
