"""The full trainer's test helpers: `trainer.Args` from flat flag names, a `trainer.Run` around a model, a
random checkpoint saved as `from_pretrained` reads it, the embedded model with LoRA that has gradients.

They need the package, so they live beside its tests; the random models and token ids come from the
reference's tests/conftest.py (`from conftest import ...`). A module, not a second conftest.py: a test file
that torchrun runs as a script has tests/full first on its path, where a conftest.py would shadow the
reference's."""

import dataclasses
from pathlib import Path

import torch
from conftest import TINY_CHECKPOINT, VLM_FAMILIES, make_random_model
from transformers import AutoImageProcessor, AutoTokenizer

import grpo
import lora
import model_io
from grpo_vlm import files


def save_random_checkpoint(family: str, directory: Path, **text_config) -> Path:
    """A tiny random model of `family` saved as `from_pretrained` reads it (files.save_model), with the
    embedded tiny model's tokenizer and, for a VLM, its image processor: what `train.Args(model=...)` takes.
    """

    tokenizer = AutoTokenizer.from_pretrained(TINY_CHECKPOINT)
    model = make_random_model(
        family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **text_config
    )
    image_processor = AutoImageProcessor.from_pretrained(TINY_CHECKPOINT) if family in VLM_FAMILIES else None
    files.save_model(model, tokenizer, image_processor, directory)
    return Path(directory)


def make_run(model, args, **fields):
    """A trainer.Run around `model` with the speed-up parts `args` asks for, as trainer.build_run makes it."""
    from grpo_vlm import speedups, trainer

    tokenizer = fields.get("tokenizer")
    sampling = trainer.sampling_options(args, tokenizer) if tokenizer is not None else {}
    plan = speedups.choose(model, args.speed, last_k=args.lora.lora_last_k)
    options = dict(sampling=sampling, speed=plan)
    return trainer.Run(model=model, **options, **fields)


def train_args(**flags):
    """trainer.Args from flat flag names (`beta=0.1`, `micro_batch_size=4`), each handed to the settings group
    that owns it, as the command line does (`--beta 0.1`)."""
    from grpo_vlm import trainer

    groups = {
        f.name: f.default_factory
        for f in dataclasses.fields(trainer.Args)
        if f.default_factory is not dataclasses.MISSING
    }
    owner = {g.name: name for name, cls in groups.items() for g in dataclasses.fields(cls)}
    nested = {
        name: cls(**{k: v for k, v in flags.items() if owner.get(k) == name}) for name, cls in groups.items()
    }
    return trainer.Args(**{k: v for k, v in flags.items() if k not in owner}, **nested)


def lora_model_with_gradients(checkpoint: Path = TINY_CHECKPOINT):
    """A checkpoint with LoRA as `main` injects it, and B != 0 so that every A gets a gradient too:
    (model, tokenizer, image_processor)."""
    model, tokenizer, image_processor = model_io.load_model(
        str(checkpoint), device="cpu", dtype=torch.float32
    )
    torch.manual_seed(0)
    lora.inject_lora(model, r=8, alpha=16.0, last_k=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            if torch.count_nonzero(p) == 0:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model, tokenizer, image_processor


def sample_with_logprobs(model, inputs: dict, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo.sample_completions' ids (N, T), and their log-probs from the very logits generate drew them from
    (multiturn.generation_logits), at the sampling temperature (0: as 1)."""
    from grpo_vlm import multiturn

    with multiturn.generation_logits(model) as seen:
        ids = grpo.sample_completions(model, inputs, **options)
    logp, _ = grpo.logprobs_from_logits(
        seen[0], ids, temperature=options["temperature"], return_entropy=False
    )
    return ids, logp
