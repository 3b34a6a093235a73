"""Shared fixtures: tiny randomly initialised models built from a config (no files, no downloads).

`random_vlm` is a Qwen2.5-VL with 6 decoder blocks and a 2-block vision tower; `random_causal_lm` is a
Qwen2 text-only causal LM with 4 blocks. Both are fp32, eval mode, seeded, and small enough that a
forward pass takes milliseconds on a CPU. Token ids 0-6 (the constants below) are reserved for the vision
markers so that tests can build image prompts by hand.

Tests run torch on one thread: the models are tiny, and on a 2-core machine the per-op thread start-up of a
multi-threaded matmul costs more than the matmul (the suite is several times faster this way).
"""

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)

# Token ids of the random VLM (it has no tokenizer; tests write ids directly).
PAD_ID = 0
EOS_ID = 1
VISION_START_ID = 3
VISION_END_ID = 4
IMAGE_PAD_ID = 5
VIDEO_PAD_ID = 6
VOCAB = 128
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size**2


def make_random_vlm(seed: int = 0, num_layers: int = 6) -> Qwen2_5_VLForConditionalGeneration:
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            tie_word_embeddings=False,
            bos_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        bos_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def make_random_causal_lm(seed: int = 0, num_layers: int = 4) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def random_vlm() -> Qwen2_5_VLForConditionalGeneration:
    return make_random_vlm()


@pytest.fixture
def random_causal_lm() -> Qwen2ForCausalLM:
    return make_random_causal_lm()


def make_run(model, args, **fields):
    """A train.Run around `model` with the speed-up parts `args` asks for, as train.build_run makes it."""
    import train

    parts, record_block = train.speedup_parts(model, args)
    tokenizer = fields.get("tokenizer")
    sampling = train.sampler_options(args, tokenizer) if tokenizer is not None else {}
    options = dict(sampling=sampling, loss=train.loss_options(args), parts=parts, record_block=record_block)
    return train.Run(model=model, **options, **fields)
