"""Tests for grpo.py: independent references, hand-computed numbers, recompute == generation on tiny models.

Expected numbers are written out (with the arithmetic in a comment) rather than recomputed with the code under
test. The model tests use the random Qwen2.5-VL and Qwen2 causal LM from conftest.py, on CPU in fp32.
"""

import math

import pytest
import torch
from conftest import EOS_ID, IMAGE_PAD_ID, PAD_ID, PATCH_DIM, VISION_END_ID, VISION_START_ID, VOCAB
from transformers import GPT2Config, GPT2LMHeadModel

import data
import grpo

IMAGE = [VISION_START_ID] + [IMAGE_PAD_ID] * 4 + [VISION_END_ID]  # grid (1, 4, 4): 16 patches -> 4 tokens
GRID = [1, 4, 4]
# Allow EOS and four ordinary tokens only: P(EOS) ~ 1/5 per step, so sampled rows end at mixed lengths.
ALLOWED = [EOS_ID, 10, 11, 12, 13]
SUPPRESS = [t for t in range(VOCAB) if t not in ALLOWED]
ALL_LOSS_TYPES = ["grpo", "dr_grpo", "dapo"]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts])  # (B, P)
    attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])  # (B, P)
    return input_ids, attention_mask


def vlm_inputs(group_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """B=2 image prompts of different lengths (the first with two images), expanded to N = 2 * G rows."""
    prompts = [[20, *IMAGE, 21, 22, *IMAGE, 23], [30, *IMAGE, 31]]
    images_per_prompt = [2, 1]
    input_ids, attention_mask = left_pad(prompts)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(16 * sum(images_per_prompt), PATCH_DIM, generator=gen)  # (patches, 1176)
    pixel_blocks = pixels.split([16 * k for k in images_per_prompt])  # one block per prompt
    G = group_size
    grids = [GRID for k in images_per_prompt for _ in range(G * k)]  # each row's images, rows in order
    return {
        "input_ids": input_ids.repeat_interleave(G, dim=0),  # (N, P)
        "attention_mask": attention_mask.repeat_interleave(G, dim=0),
        "mm_token_type_ids": (input_ids == IMAGE_PAD_ID).long().repeat_interleave(G, dim=0),
        # Each row carries its own copy of its prompt's images, rows in order.
        "pixel_values": torch.cat([block for block in pixel_blocks for _ in range(G)]),
        "image_grid_thw": torch.tensor(grids),  # (images, 3)
    }


def text_inputs(group_size: int) -> dict[str, torch.Tensor]:
    input_ids, attention_mask = left_pad([[40, 41, 42, 43, 44], [50, 51]])
    G = group_size
    return {
        "input_ids": input_ids.repeat_interleave(G, 0),
        "attention_mask": attention_mask.repeat_interleave(G, 0),
    }


def sample(model, inputs, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.sample_completions' ids (N, T), and their log-probs from the logits generate sampled them from
    (captured by wrapping generate: `output_logits`), at the same temperature."""
    kwargs = {
        "max_new_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "suppress_token_ids": SUPPRESS,
    } | overrides
    generate, seen = model.generate, []

    def with_logits(**generate_kwargs):
        out = generate(**generate_kwargs, output_logits=True)
        seen.append(torch.stack(out.logits, dim=1))  # (N, T, V) raw: before temperature and top_p
        return out

    model.generate = with_logits
    try:
        ids = grpo.sample_completions(model, inputs, **kwargs)
    finally:
        model.generate = generate
    logp, _ = grpo.logprobs_from_logits(seen[0], ids, temperature=kwargs["temperature"], return_entropy=False)
    return ids, logp


def naive_aggregate(x, mask, loss_type, max_len=None, num_tokens=None):
    """Independent reference: python loop over rows, selecting unmasked tokens by boolean indexing."""
    rows = [x[i][mask[i]] for i in range(x.shape[0])]
    if loss_type == "grpo":
        return sum(r.mean() for r in rows) / len(rows)
    if loss_type == "dr_grpo":
        return sum(r.sum() for r in rows) / (len(rows) * max_len)
    return sum(r.sum() for r in rows) / (num_tokens or sum(len(r) for r in rows))


def random_mask(N, T, seed=0):
    lengths = torch.randint(1, T + 1, (N,), generator=torch.Generator().manual_seed(seed))
    return torch.arange(T)[None] < lengths[:, None]


# --- completion_mask ----------------------------------------------------------------------------------------


def test_completion_mask_with_pad_equal_to_eos():
    eos = 1  # padding below is also 1 (pad == eos), or 0 in the last row
    ids = torch.tensor(
        [
            [1, 1, 1, 1],  # EOS first: an empty completion of length 1, the rest is EOS-valued padding
            [7, 8, 1, 1],  # EOS in the middle, followed by EOS-valued padding
            [7, 8, 9, 10],  # no EOS: truncated, all positions count
            [7, 8, 9, 1],  # EOS exactly at the last position: not truncated
            [7, 1, 0, 0],  # pad 0 != eos
        ]
    )
    mask, truncated = grpo.completion_mask(ids, eos)
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert truncated.tolist() == [False, False, True, False, False]


# --- group_advantages ---------------------------------------------------------------------------------------


def test_group_advantages_of_1_0_0_1():
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.5773503; 0.5 / (0.5773503 + 1e-4) = 0.8658754
    torch.testing.assert_close(adv, torch.tensor([0.8658754, -0.8658754, -0.8658754, 0.8658754]))


def test_group_advantages_of_two_groups_are_independent():
    adv = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]), 4)
    # Group 2: mean 0.75, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5: 0.25 / 0.5001, -0.75 / 0.5001.
    expected = [0.8658754, -0.8658754, -0.8658754, 0.8658754, 0.4999000, 0.4999000, 0.4999000, -1.4997001]
    torch.testing.assert_close(adv, torch.tensor(expected))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_gets_exactly_zero_advantage(scale):
    # In fp32 the mean of three 0.9s is 0.9 - 6e-8, not 0.9: an unguarded 6e-8 / (0 + eps) would be 6e-4.
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.5])
    adv = grpo.group_advantages(rewards, 3, scale=scale)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all() and (adv[3:] != 0).any()
    # An all-equal batch: every scale gives zeros, not NaN (the batch std is 0 too).
    assert torch.equal(grpo.group_advantages(torch.ones(4), 2, scale=scale), torch.zeros(4))


def test_group_advantages_scale_none_and_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    none = grpo.group_advantages(rewards, 4, scale="none")  # Dr. GRPO: centred only
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))
    batch = grpo.group_advantages(rewards, 4, scale="batch")
    # Batch std (unbiased) of five 1s and three 0s: sqrt((5 * 0.375**2 + 3 * 0.625**2) / 7) = 0.5175492.
    s = 0.5175492 + 1e-4
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]) / s)


def test_group_advantages_rejects_bad_groups():
    with pytest.raises(ValueError, match="group_size"):
        grpo.group_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="divisible"):
        grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="finite"):
        grpo.group_advantages(torch.tensor([1.0, math.nan]), 2)
    with pytest.raises(ValueError, match="scale"):
        grpo.group_advantages(torch.tensor([1.0, 0.0]), 2, scale="std")


# --- kl_k3 --------------------------------------------------------------------------------------------------


def test_kl_k3_is_nonnegative_and_zero_when_equal():
    torch.manual_seed(0)
    logp = -5 * torch.rand(1000)
    for ref in (logp + torch.randn(1000), logp + 1e-7 * torch.randn(1000), -5 * torch.rand(1000)):
        assert (grpo.kl_k3(logp, ref) >= 0).all()
    assert torch.equal(grpo.kl_k3(logp, logp), torch.zeros(1000))
    # d = ref - logp = ln 2: exp(d) - d - 1 = 2 - ln 2 - 1 = 0.3068528
    torch.testing.assert_close(
        grpo.kl_k3(torch.tensor(0.0), torch.tensor(math.log(2))), torch.tensor(0.3068528)
    )


# --- aggregate and grpo_loss --------------------------------------------------------------------------------


def test_aggregate_formulas_by_hand():
    # Row 0 has length 1, row 1 length 3; the 9s and the inf are masked out.
    per_token = torch.tensor([[1.0, 9.0, math.inf], [2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    agg = lambda loss_type, length=None: grpo.aggregate(per_token, mask, loss_type, length).item()
    assert agg("grpo") == pytest.approx(2.0)  # (1/1 + 9/3) / 2
    assert agg("dapo") == pytest.approx(2.5)  # 10 / 4
    assert agg("dr_grpo", 4) == pytest.approx(1.25)  # 10 / (2 * 4)
    with pytest.raises(ValueError, match="max_completion_length"):
        agg("dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        agg("bnpo")  # the package's (objectives.py), not the reference's


@pytest.mark.parametrize(
    ("loss_type", "length", "expected"),
    [
        ("grpo", None, 0.4333333),  # (-1.1 / 1 + (2.0 + 1.8 + 2.1) / 3) / 2
        ("dapo", None, 1.2),  # (-1.1 + 5.9) / 4
        ("dr_grpo", 4, 0.6),  # 4.8 / (2 * 4)
    ],
)
def test_grpo_loss_hand_computed(loss_type, length, expected):
    # Ratios inside the clip range: row 0 (adv +1) [1.1], row 1 (adv -2) [1.0, 0.9, 1.05].
    # Per token -ratio * adv: row 0 [-1.1], row 1 [2.0, 1.8, 2.1].
    ratio = torch.tensor([[1.1, 1.0, 1.0], [1.0, 0.9, 1.05]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    config = grpo.LossConfig(loss_type=loss_type, beta=0.0, clip_eps_low=0.2, clip_eps_high=0.2)
    loss, stats = grpo.grpo_loss(
        ratio.log(), torch.zeros(2, 3), None, torch.tensor([1.0, -2.0]), mask, config, length
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.0 + 0.9 + 1.05) / 4)
    assert stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0 and "kl" not in stats


def test_grpo_loss_kl_term_by_hand():
    # ratio 1, adv 0: only the KL term; ref - logp = ln 2 on both tokens -> k3 = 1 - ln 2 = 0.3068528.
    logp, adv, mask = torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool)
    config = grpo.LossConfig(loss_type="grpo", beta=0.5, clip_eps_low=0.2, clip_eps_high=0.2)
    loss, stats = grpo.grpo_loss(logp, logp, logp + math.log(2), adv, mask, config)
    assert loss.item() == pytest.approx(0.5 * 0.3068528)
    assert stats["kl"] == pytest.approx(0.3068528)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo.grpo_loss(logp, logp, None, adv, mask, config)


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_mu1_loss_is_minus_aggregated_advantage_and_gradient_is_reinforce(loss_type):
    torch.manual_seed(0)
    N, T = 6, 5
    logp = (-3 * torch.rand(N, T)).requires_grad_()
    adv = torch.randn(N)
    mask = random_mask(N, T)
    config = grpo.LossConfig(loss_type=loss_type, beta=0.0, clip_eps_low=0.2, clip_eps_high=0.28)
    loss, stats = grpo.grpo_loss(logp, logp.detach(), None, adv, mask, config, max_completion_length=T)
    loss.backward()
    expected = naive_aggregate(-adv[:, None].expand(N, T), mask, loss_type, max_len=T)
    torch.testing.assert_close(loss, expected)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0
    # REINFORCE: the gradient of -aggregate(adv * logp), written independently.
    logp_ref = logp.detach().clone().requires_grad_()
    naive_aggregate(-adv[:, None] * logp_ref, mask, loss_type, max_len=T).backward()
    torch.testing.assert_close(logp.grad, logp_ref.grad)


def test_clipping_is_active_exactly_outside_one_plus_minus_eps_and_asymmetric():
    d = 1e-3
    # Row 0 (adv +1): just above 1 + eps_high (clipped), just below it, and far below 1 - eps_low (a positive
    # advantage is never clipped from below). Row 1 (adv -1): the mirror image around 1 - eps_low.
    ratio = torch.tensor([[1.28 + d, 1.28 - d, 0.5], [0.8 - d, 0.8 + d, 1.5]], dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = grpo.LossConfig(loss_type="dapo", beta=0.0, clip_eps_low=0.2, clip_eps_high=0.28)
    loss, stats = grpo.grpo_loss(logp, torch.zeros_like(logp), None, adv, mask, config)
    loss.backward()
    clipped = torch.tensor([[True, False, False], [True, False, False]])
    assert torch.equal(logp.grad[clipped], torch.zeros(2, dtype=torch.float64))
    # Unclipped: d/dlogp of -ratio * adv / 6 tokens = -ratio * adv / 6.
    torch.testing.assert_close(logp.grad[~clipped], (-ratio * adv[:, None] / 6)[~clipped])
    assert stats["clip_frac_high"] == pytest.approx(1 / 6) and stats["clip_frac_low"] == pytest.approx(1 / 6)
    # Clip-higher: ratio 1.25 with a positive advantage passes eps_high = 0.28 but not a symmetric 0.2.
    logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    for eps_high, expected_grad in ((0.28, -1.25), (0.2, 0.0)):
        logp.grad = None
        config = grpo.LossConfig(loss_type="grpo", beta=0.0, clip_eps_low=0.2, clip_eps_high=eps_high)
        loss, _ = grpo.grpo_loss(
            logp, torch.zeros(1, 1), None, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), config
        )
        loss.backward()
        assert logp.grad.item() == pytest.approx(expected_grad)


def test_nonfinite_values_at_masked_positions_do_not_leak():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old_logp = torch.tensor([[-1.5, -math.inf, math.nan]])  # garbage after EOS
    ref_logp = torch.tensor([[-1.2, math.inf, -math.inf]])
    mask = torch.tensor([[True, False, False]])
    for loss_type in ALL_LOSS_TYPES:
        logp.grad = None
        config = grpo.LossConfig(loss_type=loss_type, beta=0.1, clip_eps_low=0.2, clip_eps_high=0.28)
        loss, stats = grpo.grpo_loss(logp, old_logp, ref_logp, torch.ones(1), mask, config, 3)
        loss.backward()
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in stats.values())
        assert torch.equal(logp.grad[0, 1:], torch.zeros(2)) and logp.grad[0, 0] != 0


# --- sampling and the recompute on real (tiny, random) models -----------------------------------------------


def make_random_gpt2() -> GPT2LMHeadModel:
    """A model with learned ABSOLUTE positions, so positions off by the padding length change its log-probs
    (RoPE models are, up to rounding, blind to such a constant shift). It checks the recompute's positions."""
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(std=1.0)  # make positions matter (init std is 0.02)
    return model


@pytest.mark.parametrize("case", ["vlm_images", "vlm_text_only", "causal_lm", "gpt2_absolute_positions"])
def test_recompute_equals_generation_logprobs(case, random_vlm, random_causal_lm):
    model = {"causal_lm": random_causal_lm, "gpt2_absolute_positions": make_random_gpt2()}.get(
        case, random_vlm
    )
    inputs = vlm_inputs(group_size=3) if case == "vlm_images" else text_inputs(group_size=3)
    calls = []
    generate = model.generate
    model.generate = lambda **kw: calls.append(1) or generate(**kw)  # count generate calls
    torch.manual_seed(0)
    completion_ids, gen_logp = sample(model, inputs)
    assert len(calls) == 1  # one batched call for all N rows
    mask, _ = grpo.completion_mask(completion_ids, EOS_ID)
    assert completion_ids.shape[0] == 6 and completion_ids.shape[1] <= 8
    assert (~mask).any() and mask.sum(1).unique().numel() > 1  # mixed lengths, padding after some EOS
    assert not set(completion_ids[mask].tolist()) & set(SUPPRESS)
    with torch.no_grad():
        logp, entropy = grpo.completion_logprobs(
            model, inputs, completion_ids, temperature=0.7, return_entropy=True
        )
    torch.testing.assert_close(logp[mask], gen_logp[mask], atol=1e-4, rtol=0)
    assert entropy.shape == logp.shape and (entropy >= 0).all() and (entropy <= math.log(VOCAB) + 1e-4).all()


def prompts_once() -> data.PromptBatch:
    """vlm_inputs' two image prompts as a PromptBatch of B = 2 rows (each prompt once, its images with it)."""
    rows = vlm_inputs(group_size=1)
    return data.PromptBatch(rows, images_per_row=[2, 1])


def test_generate_repeats_prompt_b_as_rows_b_g_to_b_g_plus_g_minus_1_as_repeat_rows_does(random_vlm):
    # train_step samples G completions of each of B prompts with one generate(num_return_sequences=G) and
    # recomputes on data.repeat_rows' N rows: completion b*G + g must meet prompt b (its text and images).
    G = 3
    batch = prompts_once()
    torch.manual_seed(0)
    ids, gen_logp = sample(random_vlm, batch.inputs, num_return_sequences=G)  # (N, T) from B = 2 prompts
    mask, _ = grpo.completion_mask(ids, EOS_ID)
    with torch.no_grad():
        rows = data.repeat_rows(batch, G).inputs  # (N, P): prompt b at rows b*G .. b*G + G - 1
        logp, _ = grpo.completion_logprobs(random_vlm, rows, ids, temperature=0.7)
        torch.testing.assert_close(logp[mask], gen_logp[mask], atol=1e-4, rtol=0)
        # The test can fail: each completion paired with the other prompt's rows gives other log-probs.
        order = [*range(G, 2 * G), *range(G)]  # prompt 1's completions first, on prompt 0's rows
        wrong, _ = grpo.completion_logprobs(random_vlm, rows, ids[order], temperature=0.7)
    assert (wrong - gen_logp[order])[mask[order]].abs().max() > 1e-2


def test_greedy_sampling_is_deterministic_and_matches_recompute_at_temperature_one(random_vlm):
    inputs = vlm_inputs(group_size=2)
    ids_a, logp_a = sample(random_vlm, inputs, temperature=0.0, top_p=1.0)
    ids_b, _ = sample(random_vlm, inputs, temperature=0.0, top_p=1.0)
    assert torch.equal(ids_a, ids_b)
    mask, _ = grpo.completion_mask(ids_a, EOS_ID)
    with torch.no_grad():
        logp, _ = grpo.completion_logprobs(random_vlm, inputs, ids_a, temperature=0.0)
    torch.testing.assert_close(logp[mask], logp_a[mask], atol=1e-4, rtol=0)


def test_sampling_uses_no_top_k_neither_the_default_50_nor_the_model_generation_config(random_causal_lm):
    random_causal_lm.generation_config.top_k = 1  # if inherited, sampling would be greedy
    random_causal_lm.generation_config.repetition_penalty = 100.0
    input_ids, attention_mask = left_pad([[40, 41, 42]])
    inputs = {"input_ids": input_ids.repeat(32, 1), "attention_mask": attention_mask.repeat(32, 1)}
    torch.manual_seed(0)
    ids, _ = sample(random_causal_lm, inputs, temperature=1.0, top_p=1.0, suppress_token_ids=[])
    # Rank of each row's first sampled token among the next-token logits. The random model is nearly uniform
    # over 128 tokens, so with no top_k about 60% of draws rank below 50; with top_k=50 none would.
    with torch.no_grad():
        logits = random_causal_lm(input_ids=inputs["input_ids"]).logits[:, -1]  # (N, V)
    rank = (logits > logits.gather(1, ids[:, :1])).sum(dim=1)  # (N,)
    assert (rank >= 50).any() and ids[:, 0].unique().numel() > 1


def test_malformed_inputs_are_rejected(random_causal_lm, random_vlm):
    input_ids, attention_mask = left_pad([[40, 41, 42], [50]])
    right = {"input_ids": input_ids.flip(1), "attention_mask": attention_mask.flip(1)}
    with pytest.raises(ValueError, match="LEFT"):
        sample(random_causal_lm, right)
    with pytest.raises(ValueError, match="eos"):
        sample(
            random_causal_lm,
            {"input_ids": input_ids, "attention_mask": attention_mask},
            suppress_token_ids=[EOS_ID],
        )
    inputs = vlm_inputs(group_size=2)
    del inputs["mm_token_type_ids"]
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        grpo.completion_logprobs(random_vlm, inputs, torch.ones(4, 2, dtype=torch.long), temperature=1.0)


def hand_completions() -> torch.Tensor:
    """Six rows with EOS at various places; after EOS, PAD_ID or EOS-valued padding."""
    return torch.tensor(
        [
            [10, 11, EOS_ID, PAD_ID, PAD_ID],
            [EOS_ID, EOS_ID, EOS_ID, EOS_ID, EOS_ID],  # empty completion, EOS-valued padding
            [10, 11, 12, 13, 10],  # truncated
            [12, EOS_ID, PAD_ID, PAD_ID, PAD_ID],
            [13, 12, 11, 10, EOS_ID],
            [11, 11, 11, EOS_ID, EOS_ID],
        ]
    )


def test_tokens_after_eos_get_zero_gradient(random_vlm):
    inputs = vlm_inputs(group_size=3)
    ids = hand_completions()
    mask, truncated = grpo.completion_mask(ids, EOS_ID)
    assert truncated.tolist() == [False, False, True, False, False, False]
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7, 0.2])

    def loss_and_grads(completion_ids):
        random_vlm.zero_grad()
        logp, _ = grpo.completion_logprobs(random_vlm, inputs, completion_ids, temperature=0.7)
        logp.retain_grad()
        with torch.no_grad():
            old_logp = logp + 0.1 * torch.randn(generator=torch.Generator().manual_seed(0), size=logp.shape)
        config = grpo.LossConfig(loss_type="grpo", beta=0.1, clip_eps_low=0.2, clip_eps_high=0.28)
        loss, _ = grpo.grpo_loss(logp, old_logp, old_logp, adv, mask, config)
        loss.backward()
        return (
            loss,
            logp.grad,
            {n: p.grad.clone() for n, p in random_vlm.named_parameters() if p.grad is not None},
        )

    loss, logp_grad, grads = loss_and_grads(ids)
    assert torch.equal(logp_grad[~mask], torch.zeros(int((~mask).sum())))
    assert (logp_grad[mask] != 0).all()
    # Different garbage after EOS changes neither the loss nor any parameter gradient.
    garbage = torch.where(
        mask, ids, torch.randint(10, 14, ids.shape, generator=torch.Generator().manual_seed(1))
    )
    loss2, _, grads2 = loss_and_grads(garbage)
    assert torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys() and all(
        torch.allclose(grads[n], grads2[n], atol=1e-7, rtol=0) for n in grads
    )


def test_recompute_gradient_reaches_language_and_vision_parameters(random_vlm):
    inputs = vlm_inputs(group_size=3)
    ids = hand_completions()
    mask, _ = grpo.completion_mask(ids, EOS_ID)
    logp, _ = grpo.completion_logprobs(random_vlm, inputs, ids, temperature=1.0)
    logp[mask].sum().backward()
    params = dict(random_vlm.named_parameters())
    for name in (
        "lm_head.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.visual.patch_embed.proj.weight",
    ):
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name


def test_recompute_uses_each_rows_own_images(random_vlm):
    inputs = vlm_inputs(group_size=3)
    ids = hand_completions()
    with torch.no_grad():
        before, _ = grpo.completion_logprobs(random_vlm, inputs, ids, temperature=1.0)
        # Replace the image of prompt 1 (rows 3-5; their patches come after rows 0-2's 3 * 32 patches).
        changed = dict(inputs, pixel_values=inputs["pixel_values"].clone())
        changed["pixel_values"][96:] = torch.randn(16, PATCH_DIM).repeat(3, 1)
        after, _ = grpo.completion_logprobs(random_vlm, changed, ids, temperature=1.0)
    torch.testing.assert_close(after[:3], before[:3], atol=1e-6, rtol=0)
    assert (after[3:] - before[3:]).abs().max() > 1e-3


# --- the settings check themselves when built, naming the field (a command line names its flag) -------------

BAD_LOSS_SETTINGS = [
    (dict(beta=-1.0), "beta: must be a number >= 0 (0 drops the KL term), got -1.0"),
    (dict(beta=math.nan), "beta: must be a number >= 0 (0 drops the KL term), got nan"),
    (dict(clip_eps_low=1.5), "clip_eps_low: must be in [0, 1), got 1.5"),
    (dict(clip_eps_high=-0.1), "clip_eps_high: must be a number in [0, 1e38), got -0.1"),
    (dict(clip_eps_high=1e308), "clip_eps_high: must be a number in [0, 1e38), got 1e+308"),
    (dict(clip_eps_high=math.inf), "clip_eps_high: must be a number in [0, 1e38), got inf"),
    (dict(loss_type="cispo"), "loss_type: must be one of ('grpo', 'dapo', 'dr_grpo'), got cispo"),
    (
        dict(importance_sampling_level="row"),
        "importance_sampling_level: must be one of ('token', 'sequence'), got row",
    ),
]


@pytest.mark.parametrize(("settings", "message"), BAD_LOSS_SETTINGS)
def test_a_loss_config_out_of_range_is_refused_when_built_naming_the_field(settings, message):
    with pytest.raises(ValueError) as error:
        grpo.LossConfig(**settings)
    assert str(error.value).startswith(message)


def test_the_widest_clip_a_loss_config_takes_is_one_float32_holds():
    """1 + clip_eps_high becomes a float32 clamp bound: 1e308 would overflow it (torch raises), 9.9e37 not."""
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = grpo.LossConfig(beta=0.0, clip_eps_high=9.9e37)
    loss, _ = grpo.grpo_loss(logp, logp.detach() - 1.0, None, torch.tensor([1.0, -1.0]), mask, config)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# --- the model interface the log-prob half needs ------------------------------------------------------------


def test_a_head_with_a_bias_or_scaled_or_capped_logits_is_refused_naming_the_reason(random_causal_lm):
    ids = torch.tensor([[40, 41, 42, 43]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    completion = torch.tensor([[44, EOS_ID]])
    grpo.completion_logprobs(random_causal_lm, inputs, completion, temperature=1.0)  # a plain head: fine
    for name, value in [("final_logit_softcapping", 30.0), ("logit_scale", 0.0625), ("logits_scaling", 8.0)]:
        setattr(random_causal_lm.config, name, value)
        with pytest.raises(ValueError, match=f": {name}={value}, which completion_logprobs leaves out"):
            grpo.completion_logprobs(random_causal_lm, inputs, completion, temperature=1.0)
        setattr(random_causal_lm.config, name, None)
    head = random_causal_lm.lm_head
    random_causal_lm.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with pytest.raises(ValueError, match="LM head has a bias, which completion_logprobs leaves out"):
        grpo.completion_logprobs(random_causal_lm, inputs, completion, temperature=1.0)
