"""Benchmark one GRPO step phase by phase: ours (speed-ups on) against the plain path, and TRL if present.

    python scripts/bench.py --config tiny             # embedded tiny VLM
    python scripts/bench.py --config small --steps 2  # random Qwen2.5-VL: 12 blocks, K = 2, 224-pixel photos
    python scripts/bench.py --quick                   # 1 step of tiny: checks that every path runs
    python scripts/bench.py --config small --device cuda  # on a GPU: synchronized timings, allocator peaks
    python scripts/bench.py --config small --device cuda --cuda-graph  # ours decodes by CUDA-graph replays
    python scripts/bench.py --memory                  # peak memory of completion log-probs, 151k vocabulary
    python scripts/bench.py --trl-python /tmp/venv-trl/bin/python   # also TRL's GRPOTrainer + PEFT LoRA

How it measures (fp32, one run, one machine; CPU unless --device cuda):
- Both paths live in this one process, each with its own copy of the model and optimizer from the same
  initialisation, and take turns step by step on the same prompts, seeds and rewards, so that a load spike
  from other processes hits both alike. Each path's first step is a warm-up and is not counted.
- "ours" is trainer.py's default: sampling with each prompt's prefill run once
  (speedups.sample_shared_prefill), the frozen trunk recorded on the way, and only the K adapted blocks run
  for reference, old policy and policy.
- "plain" is trainer.py with every speed-up off (--no-shared-prefill --no-trunk-reuse, no micro-batches, no
  checkpointing) and transformers' generate on the G-times repeated rows (as before `num_return_sequences`),
  which prefills every prompt and encodes every image G times. Both draw the same tokens (same seed).
- Phases, in ms per step (mean over the timed steps): sampling, trunk (ours: the recorded trunk's masks and
  positions, a forward up to the first block; plain: 0), reference/old (no-grad log-probs), policy fwd+bwd,
  optimizer (clip + AdamW). Rewards are seeded random numbers: scoring is not model compute.
- tokens/s: completion tokens (up to EOS) per second of a whole step.
- peak memory: how far the process's resident set (VmHWM, reset before each step through
  /proc/self/clear_refs) rises above its size at the start of the step. CPU torch keeps no allocator
  statistics; RSS sees every tensor that touches memory, plus allocator slack. On CUDA: the allocator's
  peak (torch.cuda.max_memory_allocated, reset before each step) above what was allocated at its start.
- On CUDA the host only queues kernels: each phase's clock starts and stops after torch.cuda.synchronize(),
  so a phase is charged with its own kernels, not with the ones queued before it.
- encodings: images through the vision tower per step (a forward hook on model.model.visual).
- TRL (in the interpreter given by --trl-python, or this one if it has trl and peft): GRPOTrainer with a
  PEFT LoRA on the same blocks, same model, prompts, B, G, T, beta and loss; its step time is the time
  between the trainer's on_step_begin and on_step_end callbacks, again without the first step.

A bad flag (an unknown --config, a count below 1, a --trl-python that is not there) prints one line
`error: ...` naming it and exits with status 2 before any model is built (cli.py).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data
import grpo
import lora
import model_io
from grpo_vlm import cli, lora_config, objectives, sampling_config, speedups, tasks, trainer

PHASES = ("sampling", "trunk", "reference/old", "policy fwd+bwd", "optimizer")


@dataclass(frozen=True)
class Config:
    """A named setting. model: 'asset' (the embedded tiny VLM) or 'random' (a Qwen2.5-VL of given size)."""

    model: str
    B: int
    G: int
    T: int  # max_new_tokens
    K: int  # adapted (last) blocks
    r: int
    image_size: int  # photo side in pixels; the task draws 56 (4 visual tokens), 224 gives 64
    hidden: int = 0
    layers: int = 0


CONFIGS = {
    "tiny": Config("asset", B=4, G=4, T=24, K=2, r=8, image_size=56),
    "small": Config("random", B=4, G=4, T=24, K=2, r=8, image_size=224, hidden=256, layers=12),
}


@dataclass
class BenchArgs:
    config: str = "tiny"
    """A name from CONFIGS: tiny (embedded asset, 6 blocks) or small (random, 12 blocks, bigger photos)."""
    steps: int = 3
    """Timed steps per path, after one warm-up step each."""
    quick: bool = False
    """One timed step of tiny, no TRL: checks that everything runs."""
    memory: bool = False
    """Instead: peak memory of completion log-probs (V = 151,936) against log_softmax + gather."""
    num_iterations: int = 1
    """mu; > 1 adds the old-policy pass."""
    micro_batch_size: int | None = None
    """Ours only: rows per micro-batch."""
    gradient_checkpointing: bool = False
    """Ours only: checkpoint the adapted blocks."""
    cuda_graph: bool = False
    """Ours only, --device cuda: replay the one-token decoding step as a CUDA graph (captured per step)."""
    device: str = "cpu"
    """cpu or cuda (both paths; TRL and --memory stay on the CPU)."""
    threads: int = 1
    """torch CPU threads, for every path and TRL alike. 1 by default: with a core busy elsewhere, OpenMP's
    second thread spin-waits and a small matmul can take 100x longer, which would swamp every ratio."""
    trl_python: str | None = None
    """Interpreter with trl and peft installed. Default: this one, if it has them."""
    trl_only: bool = False
    """Internal: run TRL's GRPOTrainer in this process and print its step times as JSON."""
    memory_variant: str | None = None
    """Internal: one --memory measurement in this process (ours|naive, with :grad for forward+backward)."""


# --- measuring ----------------------------------------------------------------------------------------------


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@contextmanager
def peak_rss_mb(out: dict, key: str, device: str = "cpu"):
    """out[key] = how far the resident set (CUDA: allocated memory) rose above its start in the block, MB."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield
        out[key] = (torch.cuda.max_memory_allocated() - start) / 2**20
        return
    start = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM (the peak) to the current RSS
    yield
    out[key] = max(_status_kb("VmHWM") - start, 0) / 1024  # RSS may also shrink: then the rise is 0


@dataclass
class StepRecord:
    """Milliseconds and vision-tower image encodings per phase of one step."""

    ms: dict[str, float] = field(default_factory=dict)
    encodings: dict[str, int] = field(default_factory=dict)
    phase: str | None = None
    cuda: bool = False  # synchronize around each phase: time the kernels, not their queueing

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        self.phase, start = name, time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.ms[name] = self.ms.get(name, 0.0) + 1000 * (time.perf_counter() - start)
        self.phase = None

    def count_encodings(self, module, args, kwargs, output) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)  # (images, 3)
        self.encodings[self.phase] = self.encodings.get(self.phase, 0) + grid.shape[0]


# --- models and data ----------------------------------------------------------------------------------------


def random_vlm(asset_config, hidden: int, layers: int) -> torch.nn.Module:
    """A randomly initialised Qwen2.5-VL with the asset's token ids, a bigger text model and vision tower."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = copy.deepcopy(asset_config)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, 3 * hidden, layers
    text.num_attention_heads, text.num_key_value_heads = hidden // 64, max(hidden // 128, 1)
    text.layer_types = ["full_attention"] * layers
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[8, 12, 12])  # sums to head_dim / 2 = 32
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.depth = 128, 256, 2, 4
    vision.out_hidden_size, vision.fullatt_block_indexes = hidden, [3]
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval().requires_grad_(False)


def build_model(config: Config, device: str = "cpu"):
    """(model, tokenizer, image_processor) for a config; the image processor lets image_size photos in."""
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device=device, dtype=torch.float32
    )
    if config.model == "random":
        model = random_vlm(model.config, config.hidden, config.layers).to(device)
    image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": config.image_size**2}
    return model, tokenizer, image_processor


def task_samples(config: Config, n: int) -> list[dict]:
    """n inspection samples (1-4 photos each), photos resized to config.image_size."""
    samples = tasks.make_task("inspection", n, seed=0)
    for sample in samples:
        sample["images"] = [im.resize((config.image_size,) * 2) for im in sample["images"]]
    return samples


def add_lora(model, config: Config) -> None:
    """LoRA in the last K blocks, with B != 0 (as after the first update) so the adapters change outputs."""
    lora.inject_lora(model, r=config.r, alpha=2.0 * config.r, last_k=config.K)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))


# --- one step, timed ----------------------------------------------------------------------------------------


def accumulate_policy_gradient(
    model,
    chunks: list[speedups.RowChunk],
    plan: speedups.Plan,
    args: trainer.Args,
    *,
    adv: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
) -> tuple[float, dict[str, float], torch.Tensor]:
    """trainer.py's policy gradient in one process: logp with grad and the GRPO loss's backward, chunk by
    chunk, each normalised by the whole batch's rows and tokens; returns loss, stats and entropy (N, T)."""
    num_rows, num_tokens = mask.shape[0], mask.sum().clamp(min=1)
    totals = objectives.BatchTotals(num_rows=num_rows, num_tokens=num_tokens)
    loss_sum, stats_sum, entropies = 0.0, {}, []
    for chunk in chunks:
        rows = chunk.rows
        options = dict(temperature=args.sampling.temperature, return_entropy=True)
        logp, entropy = speedups.chunk_logprobs(model, chunk, plan, **options)  # (n, T) with grad
        loss, stats = objectives.grpo_loss(
            logp,
            old_logp[rows] if old_logp is not None else logp.detach(),
            ref_logp[rows] if ref_logp is not None else None,
            adv[rows],
            mask[rows],
            args.loss,
            totals=totals,
            max_completion_length=args.sampling.max_new_tokens,
        )
        loss.backward()  # frees this chunk's activations before the next chunk's forward
        loss_sum += loss.item()
        share = mask[rows].sum().item() / num_tokens.item()
        stats_sum = {key: stats_sum.get(key, 0.0) + share * value for key, value in stats.items()}
        entropies.append(entropy)
    return loss_sum, stats_sum, torch.cat(entropies)


def run_step(
    model, optimizer, batch, tokenizer, args: trainer.Args, seed: int, record: StepRecord, *, plain: bool
) -> int:
    """One GRPO step of trainer.py, phase by phase; returns the number of completion tokens."""
    plan = speedups.choose(model, args.speed, last_k=args.lora.lora_last_k)
    torch.manual_seed(seed)  # the same completions on both paths
    model.eval()
    with record("sampling"):
        # trainer.py's sampling (ids, mask, texts). plain: generate on the G-times repeated rows, every prompt
        # prefilled and every image encoded G times; ours: each prompt prefilled once, the trunk recorded.
        ids, recording = speedups.sample(
            model,
            data.repeat_rows(batch, args.group_size).inputs if plain else batch.inputs,
            plan,
            group_size=1 if plain else args.group_size,
            max_new_tokens=args.sampling.max_new_tokens,
            temperature=args.sampling.temperature,
            top_p=args.sampling.top_p,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            suppress_token_ids=data.suppressed_tokens(tokenizer),
        )
        mask, _ = grpo.completion_mask(ids, tokenizer.eos_token_id)  # (N, T)
        data.decode_completions(tokenizer, ids, mask)  # the texts trainer.py scores; here rewards are random
    reward = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(seed)).to(ids.device)  # scoring
    adv = grpo.group_advantages(reward, args.group_size)
    with record("trunk"):  # ours: the masks and positions of the recorded trunk; plain: all rows in one chunk
        inputs = data.repeat_rows(batch, args.group_size).inputs  # (N, P) rows
        chunks = speedups.row_chunks(model, inputs, ids, recording, plan)
        del inputs  # as in trainer.rollout: the rows' pixels stay only in chunks whose passes read them
    old_logp = None
    options = dict(temperature=args.sampling.temperature)
    with record("reference/old"), torch.no_grad():
        if args.num_iterations > 1:
            old_logp = torch.cat([speedups.chunk_logprobs(model, c, plan, **options)[0] for c in chunks])
        with lora.adapters_disabled(model):
            ref_logp = torch.cat([speedups.chunk_logprobs(model, c, plan, **options)[0] for c in chunks])
    model.train()
    for _ in range(args.num_iterations):
        with record("policy fwd+bwd"):
            optimizer.zero_grad(set_to_none=True)
            accumulate_policy_gradient(
                model, chunks, plan, args, adv=adv, mask=mask, old_logp=old_logp, ref_logp=ref_logp
            )
        with record("optimizer"):
            torch.nn.utils.clip_grad_norm_(lora.lora_parameters(model), args.max_grad_norm)
            optimizer.step()
    model.eval()
    return int(mask.sum())


def path_args(config: Config, bench: BenchArgs, *, plain: bool) -> trainer.Args:
    if plain:
        speed = speedups.SpeedConfig(shared_prefill=False, trunk_reuse=False)
    else:
        checkpointing = bench.gradient_checkpointing
        speed = speedups.SpeedConfig(
            micro_batch_size=bench.micro_batch_size,
            gradient_checkpointing=checkpointing,
            cuda_graph=bench.cuda_graph,
        )
    return trainer.Args(
        batch_size=config.B,
        group_size=config.G,
        num_iterations=bench.num_iterations,
        sampling=sampling_config.SamplingConfig(max_new_tokens=config.T),
        lora=lora_config.LoRAConfig(lora_last_k=config.K, lora_r=config.r),
        speed=speed,
    )


def bench_ours_and_plain(config: Config, bench: BenchArgs) -> dict[str, list[dict]]:
    """Per path, a list of timed steps: {'ms': {phase: ms}, 'encodings': {...}, 'tokens', 'peak_mb'}."""
    model, tokenizer, image_processor = build_model(config, bench.device)
    add_lora(model, config)
    paths = {}
    for name in ("ours", "plain"):
        path_model = model if name == "ours" else copy.deepcopy(model)
        args = path_args(config, bench, plain=name == "plain")
        optimizer = torch.optim.AdamW(lora.lora_parameters(path_model), lr=args.lr)
        paths[name] = (path_model, optimizer, args)
    samples = task_samples(config, config.B * (bench.steps + 1))
    results = {name: [] for name in paths}
    for step in range(bench.steps + 1):  # step 0 is the warm-up
        prompts = samples[step * config.B : (step + 1) * config.B]
        batch = data.prepare_prompts(prompts, tokenizer, image_processor, device=bench.device)
        order = list(paths) if step % 2 else list(paths)[::-1]  # alternate who goes first
        for name in order:
            path_model, optimizer, args = paths[name]
            record, out = StepRecord(cuda=bench.device == "cuda"), {}
            hook = path_model.model.visual.register_forward_hook(record.count_encodings, with_kwargs=True)
            with peak_rss_mb(out, "peak_mb", bench.device):
                tokens = run_step(
                    path_model, optimizer, batch, tokenizer, args, step, record, plain=name == "plain"
                )
            hook.remove()
            if step > 0:
                results[name].append(
                    {"ms": record.ms, "encodings": record.encodings, "tokens": tokens, **out}
                )
    return results


# --- report -------------------------------------------------------------------------------------------------


def summarise(steps: list[dict]) -> dict:
    """Means over the timed steps (peak memory: the largest)."""
    n = len(steps)
    ms = {phase: sum(s["ms"].get(phase, 0.0) for s in steps) / n for phase in PHASES}
    ms["step"] = sum(ms.values())
    encodings = {phase: sum(s["encodings"].get(phase, 0) for s in steps) / n for phase in PHASES}
    return {
        "ms": ms,
        "tokens_per_s": sum(s["tokens"] for s in steps) / n / (ms["step"] / 1000),
        "peak_mb": max(s["peak_mb"] for s in steps),
        "encodings": {phase: count for phase, count in encodings.items() if count},
    }


def print_report(
    name: str, config: Config, bench: BenchArgs, ours: dict, plain: dict, trl: dict | str
) -> None:
    L = config.layers or 6
    print(
        f"config {name}: {config.model} Qwen2.5-VL, L={L} blocks, K={config.K}, r={config.r}, B={config.B}, "
        f"G={config.G} (N={config.B * config.G}), T={config.T}, photos {config.image_size}px, beta=0.04, "
        f"mu={bench.num_iterations}; mean of {bench.steps} timed step(s) after 1 warm-up; fp32, "
        + (
            torch.cuda.get_device_name()
            if bench.device == "cuda"
            else f"CPU, {torch.get_num_threads()} threads"
        )
    )
    print(f"{'':22}{'ours':>12}{'plain':>12}{'ours/plain':>12}")
    rows = [(f"{phase} ms", ours["ms"][phase], plain["ms"][phase]) for phase in (*PHASES, "step")]
    rows += [("tokens/s", ours["tokens_per_s"], plain["tokens_per_s"])]
    rows += [("peak memory MB", ours["peak_mb"], plain["peak_mb"])]
    for label, a, b in rows:
        ratio = f"{a / b:12.2f}" if b >= 1 else f"{'-':>12}"  # no ratio to a base of ~0 (plain's trunk)
        print(f"{label:22}{a:12.1f}{b:12.1f}{ratio}")
    for path, result in (("ours", ours), ("plain", plain)):
        parts = " + ".join(f"{phase} {count:g}" for phase, count in result["encodings"].items())
        print(f"encodings/step {path:6} {sum(result['encodings'].values()):g} = {parts}")
    if isinstance(trl, str):
        print(f"TRL: {trl}")
    else:
        ratio = ours["ms"]["step"] / trl["step_ms"]
        print(
            f"TRL GRPOTrainer + PEFT LoRA: step {trl['step_ms']:.1f} ms ({trl['steps']} timed steps); "
            f"ours/TRL {ratio:.2f}"
        )


# --- --memory: log-probs with a Qwen-sized vocabulary -------------------------------------------------------

MEMORY_SHAPE = {"N": 16, "P": 16, "T": 64, "V": 151_936}
MEMORY_VARIANTS = ("naive", "ours", "trunk", "naive:grad", "ours:grad", "trunk:grad", "trunk:grad:micro4")


def _memory_model():
    """A Qwen2 causal LM with Qwen's vocabulary and a tiny hidden size, LoRA in its single block."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=MEMORY_SHAPE["V"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    # something to differentiate, as in training
    lora.inject_lora(model, r=4, alpha=8.0, last_k=1)
    return model


def _logprobs_for_memory(model, inputs, ids, name: str) -> torch.Tensor:
    """logp (n, T) by one of the three paths: naive, ours (completion_logprobs), trunk (trunk_logprobs)."""
    if name == "naive":  # the textbook version: a full (N, T, V) log-softmax, then gather
        T = ids.shape[1]
        full = model(
            input_ids=torch.cat([inputs["input_ids"], ids], 1), logits_to_keep=T + 1, use_cache=False
        )
        return torch.log_softmax(full.logits[:, :-1] / 0.7, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    if name == "ours":
        return grpo.completion_logprobs(model, inputs, ids, temperature=0.7)[0]
    parts = speedups.decoder_parts(model, 1)
    trunk = speedups.capture_trunk(
        model, inputs, ids, blocks=parts["blocks"], first_adapted=parts["first_adapted"]
    )
    return speedups.trunk_logprobs(trunk, ids, temperature=0.7, **parts)[0]


def memory_variant(variant: str) -> dict:
    """Peak RSS rise while computing completion log-probs ('grad': and their backward; 'micro4': 4 chunks)."""
    N, P, T, V = MEMORY_SHAPE.values()
    model = _memory_model()
    inputs = {"input_ids": torch.randint(V, (N, P)), "attention_mask": torch.ones(N, P, dtype=torch.long)}
    ids = torch.randint(V, (N, T))  # (N, T)
    name, *options = variant.split(":")
    chunk_size = N // 4 if "micro4" in options else N
    out = {}
    with torch.set_grad_enabled("grad" in options), peak_rss_mb(out, "peak_mb"):
        for rows, chunk in speedups.split_rows(inputs, chunk_size):
            logp = _logprobs_for_memory(model, chunk, ids[rows], name)
            if "grad" in options:
                logp.sum().backward()
            del logp
    logits_mb = N * T * V * 4 / 2**20  # the fp32 completion logits (N, T, V)
    return {"variant": variant, "peak_mb": out["peak_mb"], "logits_mb": logits_mb}


def memory_report() -> None:
    """Each variant in a fresh interpreter, so that none inherits another's allocations or peak."""
    N, P, T, V = MEMORY_SHAPE.values()
    print(f"completion log-probs, Qwen2 with V={V:,}, hidden 64, 1 block; N={N}, P={P}, T={T}; fp32 CPU")
    print("peak extra memory = rise of VmHWM above VmRSS at the call, in a fresh process per variant")
    for variant in MEMORY_VARIANTS:
        command = [sys.executable, __file__, "--memory-variant", variant]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.splitlines()[-1])
        ratio = result["peak_mb"] / result["logits_mb"]
        print(f"  {variant:18} peak extra {result['peak_mb']:6.0f} MB = {ratio:.2f} x the completion logits")
    print(f"  (completion logits (N, T, V) fp32 = {result['logits_mb']:.0f} MB; 'grad' adds the backward)")


# --- TRL ----------------------------------------------------------------------------------------------------


def trl_step_times(config: Config, steps: int) -> dict:
    """TRL's GRPOTrainer with a PEFT LoRA on the same last K blocks (needs trl and peft; not dependencies)."""
    import random
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import Qwen2_5_VLProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """NOTE: transformers insists on a video processor, which needs torchvision, even for images only."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    model, tokenizer, image_processor = build_model(config)
    processor = ImageOnlyProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    samples = task_samples(config, config.B * (steps + 1))
    dataset = Dataset.from_list([{"prompt": data.sample_messages(s), "images": s["images"]} for s in samples])
    L = len(lora.find_decoder_blocks(model)[1])
    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=2 * config.r,
        target_modules=list(lora.DEFAULT_TARGETS),
        layers_to_transform=list(range(L - config.K, L)),
        layers_pattern="layers",  # the language model's blocks, not the vision tower's
    )
    rng = random.Random(0)
    step_ms = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            step_ms.append(1000 * (time.perf_counter() - self.start))

    with tempfile.TemporaryDirectory() as output_dir:
        trl_args = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=config.B * config.G,  # TRL counts completions: N per step
            num_generations=config.G,
            max_completion_length=config.T,
            beta=0.04,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            learning_rate=2e-3,
            gradient_checkpointing=False,  # TRL's default is on; ours is off in this comparison too
            max_steps=steps + 1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [rng.random() for _ in completions],
            args=trl_args,
            train_dataset=dataset,
            processing_class=processor,
            peft_config=peft_config,
            callbacks=[StepTimer()],
        )
        trainer.train()
    timed = step_ms[1:]  # without the warm-up step
    return {"step_ms": sum(timed) / len(timed), "steps": len(timed)}


def run_trl(name: str, steps: int, trl_python: str | None) -> dict | str:
    """TRL's step time from a separate interpreter, or why it was not measured."""
    if trl_python is None:
        if not (importlib.util.find_spec("trl") and importlib.util.find_spec("peft")):
            return "not run: trl and peft are not installed here (see --trl-python)"
        trl_python = sys.executable
    command = [trl_python, __file__, "--trl-only", "--config", name, "--steps", str(steps)]
    command += ["--threads", str(torch.get_num_threads())]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return f"failed ({trl_python}):\n" + result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def check_args(bench: BenchArgs) -> None:
    """Every flag's range before any model is built (cli.UsageError)."""
    cli.check(bench.config in CONFIGS, "--config", f"unknown {bench.config!r}; known: {', '.join(CONFIGS)}")
    for flag, value in (
        ("--steps", bench.steps),
        ("--num-iterations", bench.num_iterations),
        ("--threads", bench.threads),
    ):
        cli.check(value >= 1, flag, f"must be >= 1, got {value}")
    micro = bench.micro_batch_size
    cli.check(micro is None or micro >= 1, "--micro-batch-size", f"must be >= 1, got {micro}")
    cli.check(bench.device in ("cpu", "cuda"), "--device", f"must be cpu or cuda, got {bench.device!r}")
    cuda_ok = bench.device != "cuda" or torch.cuda.is_available()
    cli.check(cuda_ok, "--device", "cuda asked for, but torch sees no CUDA device here")
    cli.check(not bench.cuda_graph or bench.device == "cuda", "--cuda-graph", "needs --device cuda")
    variant = bench.memory_variant
    known = ", ".join(MEMORY_VARIANTS)
    cli.check(variant in (None, *MEMORY_VARIANTS), "--memory-variant", f"unknown {variant!r}; known: {known}")
    python = bench.trl_python
    found = python is None or shutil.which(python) is not None
    cli.check(found, "--trl-python", f"{python} is neither an executable file nor a command on PATH")


def main(bench: BenchArgs) -> None:
    check_args(bench)
    torch.set_num_threads(bench.threads)
    if bench.memory_variant:
        print(json.dumps(memory_variant(bench.memory_variant)))
        return
    if bench.memory:
        memory_report()
        return
    name = "tiny" if bench.quick else bench.config
    steps = 1 if bench.quick else bench.steps
    config = CONFIGS[name]
    if bench.trl_only:
        print(json.dumps(trl_step_times(config, steps)))
        return
    bench.steps = steps
    results = bench_ours_and_plain(config, bench)
    if bench.quick or bench.device != "cpu":
        trl = f"not run ({'--quick' if bench.quick else 'TRL is timed on the CPU only'})"
    else:
        trl = run_trl(name, steps, bench.trl_python)
    print_report(name, config, bench, summarise(results["ours"]), summarise(results["plain"]), trl)


if __name__ == "__main__":
    cli.run(main, tyro.cli(BenchArgs))
