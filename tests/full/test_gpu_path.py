"""The sampler on a GPU's terms, checked on the CPU with stand-ins (issue #30).

- Every attention kernel: a stand-in that, like FlashAttention-2, attends to every slot the 2D mask calls
  valid (transformers hands FA2 the padding mask, not a causal one) draws generate's tokens.
- The policy it trains: on the bf16 tiny model the sampler's logits are the fp32 head's, the one the
  log-prob passes apply, on the same hidden states.
- Graphs captured once: kept across calls (training steps, evaluation) per prompt bucket.
- The fp32 head in TF32 only around its own matmul, only for bf16 operands on CUDA.
"""

import pytest
import torch
from conftest import make_random_causal_lm
from test_grpo import SUPPRESS, text_inputs, vlm_inputs
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
from full.test_speed import K, graph_stand_in, lora_model
from grpo_vlm import speedups

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


def test_a_kept_decode_graph_is_captured_once_per_bucket_and_replays_the_eager_loops_tokens():
    model, counts = lora_model("vlm"), {"captures": 0, "replays": 0}
    block = speedups.record_block(model, speedups.decoder_parts(model, K))
    graphs = speedups.DecodeGraphs(graph_stand_in(counts, 2), bucket=speedups.PROMPT_BUCKET)
    options = dict(group_size=3, max_new_tokens=10, temperature=1.0, record_block=block, **SAMPLING)
    decoders = []
    for step in range(3):  # three training steps: new LoRA weights, new prompts, all in one bucket (P < 64)
        with torch.no_grad():
            for p in lora.lora_parameters(model):
                p.add_(0.01)
        inputs = vlm_inputs(1, seed=step)
        torch.manual_seed(step)
        eager = speedups.sample_shared_prefill(model, inputs, **options)
        torch.manual_seed(step)
        kept = speedups.sample_shared_prefill(model, inputs, capture=graphs, **options)
        assert torch.equal(kept[0], eager[0]), step
        # A prompt shorter than its slots: the same keys behind more masked ones, equal to rounding.
        torch.testing.assert_close(kept[1], eager[1], atol=1e-5, rtol=0)
        decoders += graphs.decoders.values()
    assert counts["captures"] == 1 and len({id(d) for d in decoders}) == 1  # one graph, its buffers kept
    assert counts["replays"] > 10
    greedy = dict(group_size=1, max_new_tokens=10, temperature=0.0, **SAMPLING)  # evaluation: N, no trunk
    graphs.capture = graph_stand_in(counts, 1)  # its step has one output: the logits
    for seed in range(2):
        speedups.sample_shared_prefill(model, vlm_inputs(1, seed=seed), capture=graphs, **greedy)
    assert counts["captures"] == 2 and len(graphs.decoders) == 2


class MatmulPrecision(TorchDispatchMode):
    """Records, for each matmul, whether TF32 was allowed when it ran."""

    def __init__(self):
        super().__init__()
        self.tf32 = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.tf32.append(torch.backends.cuda.matmul.allow_tf32)
        return func(*args, **(kwargs or {}))


def head_matmuls(dtype: torch.dtype) -> list[bool]:
    """TF32 or not for each matmul of logprobs_row_by_row's forward and backward, 2 rows."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 8, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(5, 8, generator=gen).to(dtype).requires_grad_()
    with MatmulPrecision() as seen:
        logp, _ = speedups.logprobs_row_by_row(
            hidden, weight, torch.tensor([[0, 1, 2], [3, 4, 0]]), temperature=1.0, return_entropy=False
        )
        logp.sum().backward()
    return seen.tf32


def test_the_fp32_head_runs_in_tf32_only_around_its_logits_for_bf16_operands_on_cuda(monkeypatch):
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert head_matmuls(torch.bfloat16) == [False] * 8  # the CPU: nothing changes
    monkeypatch.setattr(speedups, "_on_cuda", lambda x: True)  # a stand-in CUDA device
    # Forward: each row's logits. Backward, per row: the logits again (TF32), then dz @ W and dz^T @ h, whose
    # dz is no bf16 value: plain fp32.
    assert head_matmuls(torch.bfloat16) == [True, True] + [True, False, False] * 2
    assert head_matmuls(torch.float32) == [False] * 8  # an fp32 model's head stays fp32
    assert torch.backends.cuda.matmul.allow_tf32 is False  # restored after each
    with pytest.raises(RuntimeError, match="inside"), speedups.tf32_matmuls(True):
        assert torch.backends.cuda.matmul.allow_tf32 is True
        raise RuntimeError("inside")
    assert torch.backends.cuda.matmul.allow_tf32 is False  # restored on error too
