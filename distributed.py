"""Several processes under torchrun: one rank per device, each on B whole prompt groups, one global update.

    torchrun --nproc-per-node 8 train.py --device cuda ...

Each of the R ranks samples and scores B prompts of one global batch of B*R (train.batch_for_step gives each
rank its slice; a prompt's G completions stay on one rank, so group advantages need no communication). Every
rank normalises its loss by the global batch's rows and tokens (`batch_counts`), so that the SUM of the
ranks' gradients (`all_reduce_gradients`) is the gradient of the one-process loss on B*R prompts: the update
equals one process's. DistributedDataParallel is not used: its wrapper would hide the model's `generate` and
the adapters-off switch of the reference pass, and only the LoRA gradients need reducing.
With R = 1 no process group exists and every collective here returns its argument (or does nothing): the
training step calls them unconditionally and one process runs exactly as without them.
NCCL on CUDA, gloo on the CPU (2 gloo ranks = 1 process is a test). Imports torch and the stdlib only.
"""

import math
import os

import torch
import torch.distributed as dist


def resolve_device(name: str) -> torch.device:
    """'auto' is cuda if available, else cpu; under torchrun (R > 1) a bare 'cuda' becomes cuda:LOCAL_RANK.
    A malformed name or a CUDA device on a machine without one is a ValueError naming --device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    try:
        device = torch.device(name)
    except RuntimeError as e:  # torch's message lists the device types it knows
        raise ValueError(f"--device: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {name}: no CUDA device here; use --device cpu")
    return device


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, R) from torchrun's environment; NCCL on CUDA, else gloo. R = 1 creates no process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL communicates through the current device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world


def finish_distributed() -> None:
    if initialized():
        dist.destroy_process_group()


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device() -> torch.device:
    """Where tensors must live to be communicated: the current CUDA device for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_rank_stream(seed: int, step: int, rank: int) -> None:
    """Reseed this rank's sampling (and LoRA dropout) for `step` from (seed, step, rank): ranks draw different
    completions, and a resumed run draws the same ones again from rank 0's checkpoint alone. One process keeps
    its single stream (saved in each checkpoint)."""
    if not initialized():
        return
    torch.manual_seed((seed * 1_000_003 + step) * 10_007 + rank)


def batch_counts(mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(num_rows, num_tokens) of the global batch: this rank's rows and unmasked tokens, summed over ranks.

    int64, so that dividing a bf16 loss by num_tokens does not promote it; num_tokens is clamped to >= 1.
    """
    if not initialized():
        return mask.shape[0], mask.sum().clamp(min=1)
    counts = torch.stack([torch.tensor(mask.shape[0]), mask.sum().cpu()]).to(torch.int64)
    counts = counts.to(_collective_device())
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return int(counts[0]), counts[1].to(mask.device).clamp(min=1)


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the LoRA gradients over ranks in place, through one flat buffer (one collective, not one a tensor).

    Each rank's loss is already normalised by the global counts, so the SUM is the gradient of the global
    loss (DDP would average, which equals this only with each rank's loss multiplied by R).
    """
    if not initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.float().reshape(-1) for g in grads]).to(_collective_device())
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, g, summed in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = g.copy_(summed.view_as(g))


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over ranks, in float64 (one process: the values themselves, untouched)."""
    if not initialized():
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()


def mean_across_ranks(record: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks that logged it, NaN ignored; a value equal on every rank stays exact.

    An object all-gather, not a tensor all-reduce: ranks can log different keys (completion_length/correct
    is missing on a rank where nothing was correct).
    """
    if not initialized():
        return record
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, record)
    merged = {}
    for key in dict.fromkeys(k for rank_record in gathered for k in rank_record):  # first-seen order
        values = [r[key] for r in gathered if key in r and not math.isnan(r[key])]
        if not values:
            merged[key] = float("nan")
        else:
            merged[key] = values[0] if len(set(values)) == 1 else sum(values) / len(values)
    return merged


def gather_lists(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (an object all-gather: small data)."""
    if not initialized():
        return list(items)
    gathered: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, items)
    return [item for rank_items in gathered for item in rank_items]


def gather_tensor(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, concatenated in rank order, on every rank (one process: `values` itself)."""
    if not initialized():
        return values
    return torch.tensor(gather_lists(values.tolist()), dtype=values.dtype, device=values.device)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on one (all-reduce MAX): a decision all ranks take together."""
    if not initialized():
        return bool(flag)
    value = torch.tensor([int(bool(flag))], device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def barrier() -> None:
    if initialized():
        on_cuda = dist.get_backend() == "nccl"
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_cuda else None)
