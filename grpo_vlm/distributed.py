"""torchrun: R processes, one per device, each on B whole prompt groups of a global batch of B*R; one update.

Rank r samples and scores its slice (trainer.step_prompts); a group stays on one rank, so advantages need no
communication. Each rank divides its loss by the global batch's rows and tokens (`batch_counts`), so the SUM
of the ranks' gradients (`all_reduce_gradients`) is one process's gradient on B*R prompts. No DDP: it would
hide `generate` and the reference pass's adapters-off switch. With R = 1 there is no process group and each
function returns its argument or does nothing, so the step calls them unconditionally. NCCL, or gloo on CPU.
"""

import datetime
import math
import os

import torch
import torch.distributed as dist


def resolve_device(name: str) -> torch.device:
    """'auto': cuda if there is one, else cpu; torchrun makes 'cuda' cuda:LOCAL_RANK; errors name --device."""
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


def use_deterministic_algorithms() -> None:
    """Deterministic kernels only; an op that has none raises. Call before CUDA starts: cuBLAS reads its
    workspace setting once. SDPA's backward then takes its deterministic path; flash-attn's reads
    FLASH_ATTENTION_DETERMINISTIC (transformers)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("FLASH_ATTENTION_DETERMINISTIC", "1")
    torch.use_deterministic_algorithms(True)


def init_distributed(device: torch.device, *, timeout_minutes: float = 10.0) -> tuple[int, int]:
    """(rank, R) from torchrun's environment. R = 1 creates no process group. A collective that waits longer
    than `timeout_minutes` for a rank (rank 0 saving alone) fails the run."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL communicates through the current device
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return (dist.get_rank() if world > 1 else 0), world


def finish_distributed() -> None:
    if initialized():
        dist.destroy_process_group()


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _summed(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over ranks, on the device its backend communicates through (NCCL: CUDA, gloo: the CPU)."""
    t = t.to(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def seed_rank_stream(seed: int, step: int, rank: int) -> None:
    """Under torchrun, reseed from (seed, step, rank): ranks differ, a resume draws the same again."""
    if initialized():
        torch.manual_seed((seed * 1_000_003 + step) * 10_007 + rank)


def batch_counts(mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(num_rows, num_tokens >= 1) summed over ranks; int64, so a bf16 loss divided by it stays bf16."""
    if not initialized():
        return mask.shape[0], mask.sum().clamp(min=1)
    counts = _summed(torch.tensor([mask.shape[0], int(mask.sum())], dtype=torch.int64))
    return int(counts[0]), counts[1].to(mask.device).clamp(min=1)


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """SUM (not DDP's mean: losses are divided by global counts) of the gradients over ranks, in place."""
    if not initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _summed(torch.cat([g.float().reshape(-1) for g in grads]))
    for p, g, summed in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = g.copy_(summed.view_as(g))


def sum_across_ranks(values: list[float]) -> list[float]:
    """Element-wise sum over ranks, in float64."""
    if not initialized():
        return list(values)
    return _summed(torch.tensor(values, dtype=torch.float64)).tolist()


def mean_across_ranks(record: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks that logged it (keys differ), NaN ignored; equal values stay exact."""
    if not initialized():
        return record
    records = gather_lists([record])
    keys = dict.fromkeys(k for r in records for k in r)  # first-seen order
    values = {k: [r[k] for r in records if k in r and not math.isnan(r[k])] or [math.nan] for k in keys}
    return {k: v[0] if len(set(v)) == 1 else sum(v) / len(v) for k, v in values.items()}


def gather_lists(items: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (an object all-gather: small data)."""
    if not initialized():
        return list(items)
    gathered: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, items)
    return [item for rank_items in gathered for item in rank_items]


def gather_to_writer(items: list) -> list:
    """Every rank's list, concatenated in rank order, on rank 0, the one that writes files; the others get
    []: what only the writer needs (rollouts.jsonl's rows, their thumbnails) is not sent R times."""
    if not initialized():
        return list(items)
    gathered: list[list] | None = [[] for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(items, gathered, dst=0)
    return [item for rank_items in gathered for item in rank_items] if gathered is not None else []


def gather_tensor(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `values`, concatenated in rank order, on every rank."""
    if not initialized():
        return values
    return torch.tensor(gather_lists(values.tolist()), dtype=values.dtype, device=values.device)


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on one: a decision all ranks take together."""
    return sum_across_ranks([float(bool(flag))])[0] > 0


def barrier() -> None:
    if initialized():
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)
