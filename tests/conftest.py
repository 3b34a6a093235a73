"""Shared fixtures: tiny randomly initialised models built from a config (no files, no downloads).

`random_vlm` is a Qwen2.5-VL with 6 decoder blocks and a 2-block vision tower; `random_causal_lm` is a
Qwen2 text-only causal LM with 4 blocks. Both are fp32, eval mode, seeded, and small enough that a
forward pass takes milliseconds on a CPU. Token ids 0-6 (the constants below) are reserved for the vision
markers so that tests can build image prompts by hand.

`make_random_model(family)` builds the same kind of tiny model for every family the README names (FAMILIES:
Qwen2.5-VL, Qwen2-VL, Qwen3-VL with deepstack, Qwen2, Qwen3, Llama); the package's tests save them as
checkpoints (full/helpers.py). Nothing here imports the package: the reference's tests run without it.

Tests run torch on one thread: the models are tiny, and on a 2-core machine the per-op thread start-up of a
multi-threaded matmul costs more than the matmul (the suite is several times faster this way).
"""

import os
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

torch.set_num_threads(1)
# Child processes (`python -m grpo_vlm`, the scripts, test files run by torchrun) find the reference
# modules, the package and these helpers wherever their working folder is.
ROOT = Path(__file__).resolve().parent.parent
TESTS = [str(ROOT), str(ROOT / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*TESTS, os.environ.get("PYTHONPATH")]))

# Token ids of the random VLM (it has no tokenizer; tests write ids directly).
PAD_ID = 0
EOS_ID = 1
VISION_START_ID = 3
VISION_END_ID = 4
IMAGE_PAD_ID = 5
VIDEO_PAD_ID = 6
VOCAB = 128
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size**2


def _text_config(num_layers: int, vocab_size: int, eos_token_id: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=PAD_ID,
        eos_token_id=eos_token_id,
        pad_token_id=PAD_ID,
    )


# --- every family the README names ---------------------------------------------------------------------

FAMILIES = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen2", "qwen3", "llama")
VLM_FAMILIES = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl")
# Qwen3-VL adds its vision tower's deepstack features to the output of these many first decoder blocks.
DEEPSTACK_BLOCKS = 2
# The embedded tiny model's tokenizer (and image processor), for checkpoints that train.main can load.
TINY_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen2.5-vl"


# Vision towers with 14-pixel patches (PATCH_DIM, and the embedded image processor's patch size) and the
# 2 x 2 merger, 2 blocks each; Qwen3-VL's deepstack taps both blocks.
_VISION = {
    "qwen2.5-vl": dict(
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
    "qwen2-vl": dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        mlp_ratio=2,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    ),
    "qwen3-vl": dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=list(range(DEEPSTACK_BLOCKS)),
    ),
}
_VLM_CLASSES = {
    "qwen2.5-vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    "qwen2-vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    "qwen3-vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
}
_LM_CLASSES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


def make_random_model(
    family: str,
    *,
    seed: int = 0,
    num_layers: int = 4,
    vocab_size: int = VOCAB,
    eos_token_id: int = EOS_ID,
    **text_config,
) -> PreTrainedModel:
    """A tiny random model of `family` (one of FAMILIES), fp32, eval mode, seeded: hidden size 64, 4 heads
    of 16, the token ids above. `vocab_size` / `eos_token_id` fit it to a tokenizer; `text_config` goes into
    the (text) config, e.g. use_sliding_window=True, sliding_window=4, max_window_layers=2."""
    text = _text_config(num_layers, vocab_size, eos_token_id) | text_config
    if family in _LM_CLASSES:
        config_class, model_class = _LM_CLASSES[family]
        config = config_class(**text)
    else:
        config_class, model_class = _VLM_CLASSES[family]
        # head_dim 16: 8 rotary frequencies split over the (temporal, height, width) mRoPE axes
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        if family == "qwen3-vl":
            rope["mrope_interleaved"] = True
        config = config_class(
            text_config=text | {"rope_parameters": rope},
            vision_config=_VISION[family],
            image_token_id=IMAGE_PAD_ID,
            video_token_id=VIDEO_PAD_ID,
            vision_start_token_id=VISION_START_ID,
            vision_end_token_id=VISION_END_ID,
            tie_word_embeddings=False,
            bos_token_id=PAD_ID,
            eos_token_id=eos_token_id,
            pad_token_id=PAD_ID,
        )
    torch.manual_seed(seed)
    return model_class(config).eval()


def make_random_vlm(seed: int = 0, num_layers: int = 6) -> Qwen2_5_VLForConditionalGeneration:
    return make_random_model("qwen2.5-vl", seed=seed, num_layers=num_layers)


def make_random_causal_lm(seed: int = 0, num_layers: int = 4) -> Qwen2ForCausalLM:
    return make_random_model("qwen2", seed=seed, num_layers=num_layers)


@pytest.fixture
def random_vlm() -> Qwen2_5_VLForConditionalGeneration:
    return make_random_vlm()


@pytest.fixture
def random_causal_lm() -> Qwen2ForCausalLM:
    return make_random_causal_lm()
