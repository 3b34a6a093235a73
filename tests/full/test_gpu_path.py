"""The sampler on a GPU's terms, checked on the CPU with stand-ins.

- Every attention kernel: a stand-in that, like FlashAttention-2, attends to every slot the 2D mask calls
  valid (transformers hands FA2 the padding mask, not a causal one) draws generate's tokens.
- The policy it trains: on the bf16 tiny model the sampler's logits are the fp32 head's, the one the
  log-prob passes apply, on the same hidden states.
- A graph capture beside the thread that pins the next batch: CUDA's capture modes, in a stand-in.
- Graphs kept across calls for their exact prompt length, at most one, a replaced one freed at once.
- The bf16 head on CUDA: no fp32 copy of its weight, no TF32 switch, the fp32 head's numbers.
"""

import gc
import threading
import weakref
from contextlib import contextmanager, nullcontext

import pytest
import torch
from conftest import make_random_causal_lm
from test_grpo import SUPPRESS, left_pad, text_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    flash_attention_mask,
)

import grpo
import lora
import model_io
from full.helpers import train_args
from full.test_speed import K, lora_model
from grpo_vlm import speedups, trainer

SAMPLING = dict(eos_token_id=1, pad_token_id=0, suppress_token_ids=SUPPRESS)
FA2_LIKE = "fa2_like_stand_in"


def fa2_like_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """FlashAttention-2's semantics in plain torch: the 2D mask (from `flash_attention_mask`) names the
    valid keys (keys past its length trimmed, as transformers' `_upad_input` does), queries are the last
    ones, causality is bottom-right among the valid keys; None: every key. Output (N, q, heads, d)."""
    N, heads, q, d = query.shape
    valid = torch.ones(N, key.shape[2], dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    key, value = key[:, :, : valid.shape[1]], value[:, :, : valid.shape[1]]
    key = key.repeat_interleave(heads // key.shape[1], dim=1)  # grouped-query heads
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    queries_valid = torch.ones(N, 1, dtype=torch.bool) if q == 1 else valid[:, -q:]
    out = torch.zeros(N, q, heads, d, dtype=query.dtype)
    for r in range(N):
        k, v = key[r][:, valid[r]], value[r][:, valid[r]]  # (heads, n_k, d) the valid keys only
        rows = queries_valid[r].nonzero().squeeze(1)
        n_q, n_k = len(rows), k.shape[1]
        allowed = torch.arange(n_k)[None] <= torch.arange(n_q)[:, None] + n_k - n_q  # (n_q, n_k)
        scores = (query[r][:, rows] @ k.transpose(1, 2)) * (scaling or d**-0.5)  # (heads, n_q, n_k)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[r, rows] = (weights @ v).transpose(0, 1)  # (n_q, heads, d)
    return out, None


@pytest.fixture
def fa2_like():
    """The stand-in registered under its own name for attention and mask creation, removed after."""
    AttentionInterface.register(FA2_LIKE, fa2_like_attention)
    AttentionMaskInterface.register(FA2_LIKE, flash_attention_mask)
    yield FA2_LIKE
    AttentionInterface._global_mapping.pop(FA2_LIKE)
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(FA2_LIKE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_under_a_kernel_that_attends_to_every_valid_slot_the_sampler_draws_generates_tokens(
    fa2_like, temperature
):
    model, G = make_random_causal_lm(), 3
    model.config._attn_implementation = fa2_like
    options = dict(max_new_tokens=8, temperature=temperature, **SAMPLING)
    torch.manual_seed(0)
    reference = grpo.sample_completions(model, text_inputs(G), **options)
    torch.manual_seed(0)
    ours, _ = speedups.sample_shared_prefill(model, text_inputs(1), group_size=G, **options)
    assert torch.equal(ours, reference)


def test_the_sampler_draws_from_the_fp32_head_the_log_prob_passes_apply_on_the_bf16_tiny_model(monkeypatch):
    """The logits each token is drawn from against `logprobs_row_by_row` on the hidden states entering the LM
    head at that step. Measured (torch 2.13, CPU, one thread): at most 4.8e-7, the summation order of
    (N, H) @ (H, V) against (T, H) @ (H, V); the sampler's bf16 head gave 0.0102 (mean 0.0020)."""
    model, _, _ = model_io.load_model(model_io.DEFAULT_MODEL, device="cpu", dtype=torch.bfloat16)
    parts, G = speedups.decoder_parts(model, 2), 2
    drawn_from, normed = [], []
    draw = speedups._draw
    monkeypatch.setattr(
        speedups, "_draw", lambda logits, **kw: drawn_from.append(logits) or draw(logits, **kw)
    )
    parts["norm"].register_forward_hook(lambda _m, _a, out: normed.append(out))
    inputs = {
        "input_ids": torch.tensor([[0, 40, 41, 42], [50, 51, 52, 53]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1], [1] * 4]),
    }
    torch.manual_seed(0)
    ids, _ = speedups.sample_shared_prefill(
        model, inputs, group_size=G, max_new_tokens=6, temperature=1.0, eos_token_id=1, pad_token_id=0
    )
    T = ids.shape[1]
    logp_sampler = (
        torch.stack(drawn_from[:T], dim=1).float().log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    )
    hidden = torch.cat([normed[0][:, -1:].repeat_interleave(G, dim=0), *normed[1:T]], dim=1)  # (N, T, H)
    head = parts["lm_head"].weight
    logp_head, _ = speedups.logprobs_row_by_row(hidden, head, ids, temperature=1.0, return_entropy=False)
    assert (logp_sampler - logp_head).abs().max() <= 1e-5, (logp_sampler - logp_head).abs().max()


# --- a capture beside the thread that pins the next batch -------------------------------------------------


class CaptureModes:
    """CUDA's stream-capture modes as a stand-in CUDA keeps them: while a capture is underway in "global"
    mode, an unsafe call (cudaHostAlloc, which `pin_memory` makes) from ANY thread fails the call and breaks
    the capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); in "thread_local" mode only from the capturing
    thread. It records every pin made while a capture was underway, and from which thread."""

    def __init__(self):
        self.capture = None  # (capturing thread, mode) while a capture is underway
        self.begun = threading.Event()
        self.pins_during_capture = []

    def pin_memory(self, tensor):
        if threading.current_thread() is not threading.main_thread() and not self.begun.wait(timeout=10):
            self.begun.set()  # the thread ahead pins once the capture is underway (or none ever begins)
        if self.capture is not None:
            thread, mode = self.capture
            self.pins_during_capture.append(threading.current_thread())
            if mode == "global" or thread is threading.current_thread():
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return tensor

    def graph(self):
        modes = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                modes.capture = (threading.current_thread(), capture_error_mode)
                modes.begun.set()

            def capture_end(self):
                modes.capture = None

            def replay(self):
                pass

        return Graph()

    @contextmanager
    def graph_context(self, graph, pool=None, stream=None, capture_error_mode="global"):
        """torch.cuda.graph's capture: begun and ended around the block, in the mode it is given."""
        graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            yield
        finally:
            graph.capture_end()


class Stream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


def test_a_decode_graph_captures_while_the_thread_ahead_pins_the_next_batch(tmp_path, monkeypatch):
    """The training loop makes step s + 1's batch on a thread (`trainer.prompts_ahead`), pinned on CUDA,
    while step s samples, and step s's sampling may capture its decoding step: the capture must let that
    thread allocate page-locked memory. Here the thread pins exactly while the capture is underway."""
    flags = dict(device="cpu", train_size=8, eval_size=0, batch_size=2, group_size=2, max_new_tokens=4)
    args = train_args(output_dir=str(tmp_path / "run"), **flags)
    run = trainer.build_run(args, torch.device("cpu"), torch.float32, 0, 1)
    run.device = torch.device("cuda")  # a stand-in: host_batch pins for CUDA
    modes = CaptureModes()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: modes.pin_memory(tensor))
    monkeypatch.setattr(torch.cuda, "device", lambda device: nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", modes.graph)
    monkeypatch.setattr(torch.cuda, "graph", modes.graph_context)
    with trainer.prompts_ahead(run, args, range(2, 4)) as prepared:  # step 2's batch: on the thread now

        def step():
            if modes.capture is not None:  # captured: meanwhile the thread pins step 2's batch
                return (prepared(2).inputs["input_ids"],)
            return (torch.zeros(1),)

        speedups.capture_cuda_graph(step, device=torch.device("cuda"), pool=(0, 0))
    assert modes.pins_during_capture and threading.main_thread() not in modes.pins_during_capture


# --- graphs kept across calls -------------------------------------------------------------------------------


def text_prompts(length: int) -> dict[str, torch.Tensor]:
    """Two left-padded text prompts, the longer of `length` tokens."""
    input_ids, attention_mask = left_pad([[40 + i % 20 for i in range(length)], [50, 51]])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class StandInGraph:
    """A captured graph's stand-in (the contract of `test_speed.graph_stand_in`), weakly referenced by the
    test: a replay reruns the step on its static inputs and refills the static outputs in place."""

    def __init__(self, step, static):
        self.step, self.static = step, static

    def replay(self):
        for buffer, x in zip(self.static, self.step(), strict=True):
            buffer.copy_(x)


def stand_in_capture(made: list):
    def capture(step):
        first = step()
        graph = StandInGraph(step, tuple(torch.full_like(x, float("nan")) for x in first))
        made.append(weakref.ref(graph))
        return first, graph.static, graph.replay

    return capture


def test_a_kept_decode_graph_replays_only_at_its_prompt_length_with_the_eager_loops_exact_numbers():
    """Slots past P would be masked, yet they change the attention's summation order (in bf16 a token may
    then differ): a graph is replayed only for prompts of the length it was captured at, so its tokens and
    recorded trunk are the eager loop's bit for bit, and a resumed run computes what the original did."""
    model, made = lora_model("text"), []
    block = speedups.record_block(model, speedups.decoder_parts(model, K))
    graphs = speedups.DecodeGraphs(stand_in_capture(made))
    options = dict(group_size=3, max_new_tokens=10, temperature=1.0, record_block=block, **SAMPLING)
    for step, length in enumerate([9, 9, 9, 5, 9]):  # training steps; then shorter prompts, then longer again
        with torch.no_grad():
            for p in lora.lora_parameters(model):
                p.add_(0.01)  # each step's new LoRA weights, read by the kept graph
        torch.manual_seed(step)
        eager = speedups.sample_shared_prefill(model, text_prompts(length), **options)
        torch.manual_seed(step)
        kept = speedups.sample_shared_prefill(model, text_prompts(length), capture=graphs, **options)
        assert torch.equal(kept[0], eager[0]) and torch.equal(kept[1], eager[1]), step
    assert len(made) == 3  # captured at P = 9, again at 5, again at 9: never replayed at another length


def test_a_replaced_decode_graph_and_its_cache_are_freed_at_once_and_one_at_most_is_kept():
    """A training step's graph, then an evaluation batch's (other rows), then a longer prompt's: each call
    frees the graph and the StaticCache kept before it, by reference count, with the garbage collector off."""
    model, made = lora_model("text"), []
    block = speedups.record_block(model, speedups.decoder_parts(model, K))
    graphs = speedups.DecodeGraphs(stand_in_capture(made))
    training = dict(group_size=3, max_new_tokens=6, temperature=1.0, record_block=block, **SAMPLING)
    evaluation = dict(group_size=1, max_new_tokens=6, temperature=0.0, **SAMPLING)
    caches = []
    gc.disable()
    try:
        for options, length in ((training, 5), (evaluation, 5), (training, 80)):
            speedups.sample_shared_prefill(model, text_prompts(length), capture=graphs, **options)
            caches.append(weakref.ref(graphs.kept[1].cache.layers[0].keys))
            assert [ref() is not None for ref in made] == [False] * (len(made) - 1) + [True]
            assert [ref() is not None for ref in caches] == [False] * (len(caches) - 1) + [True]
    finally:
        gc.enable()
    assert len(made) == 3


# --- the bf16 head on CUDA ---------------------------------------------------------------------------------


def mm_fp32_stand_in(a, b):
    """`torch.mm(a, b, out_dtype=torch.float32)` of two bf16 matrices as cuBLAS computes it: exact products,
    sums in at least fp32 (here fp64), one rounding to fp32; no fp32 copy of either operand."""
    assert a.dtype == b.dtype == torch.bfloat16
    return (a.double() @ b.double()).float()


class Fp32Copies(TorchDispatchMode):
    """Counts the fp32 tensors made with as many elements as the head's weight: its fp32 copies."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.copies = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == self.numel:
                self.copies += 1
        return out


@pytest.fixture
def on_cuda(monkeypatch):
    """The CPU's tensors taken for CUDA's by speedups, with cuBLAS's bf16 -> fp32 matmul stood in for."""
    monkeypatch.setattr(speedups, "_on_cuda", lambda x: True)
    monkeypatch.setattr(speedups, "_mm_fp32", mm_fp32_stand_in, raising=False)


def head_pass(hidden, weight, ids):
    """logp (N, T) and the gradient of sum(logp * w) by the hidden states, through `logprobs_row_by_row`."""
    hidden = hidden.detach().requires_grad_()
    logp, _ = speedups.logprobs_row_by_row(hidden, weight, ids, temperature=0.7, return_entropy=False)
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), hidden.grad


def test_the_bf16_head_on_cuda_makes_no_fp32_copy_of_its_weight_and_gives_the_fp32_heads_numbers(on_cuda):
    gen = torch.Generator().manual_seed(0)
    V, H = 1000, 48
    weight = torch.randn(V, H, generator=gen).to(torch.bfloat16)
    hidden = (3 * torch.randn(3, 7, H, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, V, (3, 7), generator=gen)
    with Fp32Copies(V * H) as seen:
        logp, grad = head_pass(hidden, weight, ids)
    assert seen.copies == 0  # neither the forward nor the backward copies the head's weight to fp32
    fp32_logp, fp32_grad = head_pass(hidden.float(), weight.float(), ids)  # the fp32 head, plain fp32
    torch.testing.assert_close(logp, fp32_logp, atol=1e-6, rtol=1e-6)  # fp32 sums in another order
    # The gradient is stored in the hidden states' bf16: within half a bf16 spacing of the fp32 one.
    torch.testing.assert_close(grad.float(), fp32_grad, atol=1e-9, rtol=2**-8)
    assert grad.dtype == torch.bfloat16


def test_the_sampler_on_a_bf16_model_on_cuda_keeps_no_fp32_copy_of_the_head(on_cuda):
    model = make_random_causal_lm().to(torch.bfloat16)
    head = model.get_output_embeddings().weight
    with Fp32Copies(head.numel()) as seen:
        speedups.sample_shared_prefill(
            model, text_prompts(5), group_size=3, max_new_tokens=6, temperature=1.0, **SAMPLING
        )
    assert seen.copies == 0


@pytest.fixture
def new_precision_api():
    """TF32 set through torch's new per-backend API (torch >= 2.9), as a user's script or a library may:
    from then on reading the legacy `allow_tf32` flag raises. Put back after."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    yield
    torch.backends.cuda.matmul.fp32_precision = "none"


def test_the_bf16_head_on_cuda_touches_no_tf32_setting_once_the_new_precision_api_is_used(
    on_cuda, new_precision_api
):
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 (the read itself raises)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(2, 3, 8, generator=gen).to(torch.bfloat16)
    head_pass(hidden, weight, torch.tensor([[0, 1, 2], [3, 4, 0]]))  # forward and backward
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # as the user set it
