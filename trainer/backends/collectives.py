"""Collective primitives for data-parallel training over ranks that torchrun starts (`distributed.nproc_per_node`, `distributed.nnodes`).

Every rank holds the whole model; rank 0 alone talks to run-api and the gateway and writes adapters and
checkpoints. For each step rank 0 broadcasts the full example list; each rank trains its token-balanced shard
through torch's DistributedDataParallel, whose communication hook SUMS the LoRA gradients (the loss already
weights every token by whole-batch counts, so the sum over shards is the one-big-batch gradient, not a mean).
The optimizer then takes the same step on every rank from the same gradients. DDP syncs only the LoRA weights at
construction: the frozen base comes from the same files on every rank (checked by a fingerprint, not a broadcast).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations as live objects.
import datetime
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    """This process's place in the torchrun job (rank 0 of 1 when not started by torchrun)."""
    return RankInfo(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_process_group(backend: str, device: torch.device, timeout_s: float = 1800.0) -> None:
    """Join the torchrun job (rendezvous from torchrun's env vars). A no-op for a single rank."""
    info = rank_info()
    if info.world_size == 1 or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Generous timeout: rank 0 may spend minutes waiting for run-api batches between collectives.
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def shard_indices(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Contiguous shard of example indices for `rank`, balanced by tokens, at least one example per rank when
    there are enough. Deterministic: every rank computes every shard the same way."""
    n = len(lengths)
    if n < world_size:
        return [rank] if rank < n else []
    total = float(sum(lengths))
    midpoints, running = [], 0.0
    for length in lengths:
        midpoints.append(running + length / 2)
        running += length
    bounds = [0]
    for r in range(1, world_size):
        # An example goes to the rank whose share of the token total holds its midpoint.
        cut = sum(1 for m in midpoints if m < total * r / world_size)
        bounds.append(min(max(cut, bounds[-1] + 1), n - (world_size - r)))
    bounds.append(n)
    return list(range(bounds[rank], bounds[rank + 1]))


def sum_gradients_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce SUM (DDP's default hook divides by the world size)."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    return work.get_future().then(lambda f: f.value()[0])


FINGERPRINT_SAMPLES = 256  # elements read from each frozen tensor: enough to tell two checkpoints apart


def frozen_state_names(module: torch.nn.Module) -> list[str]:
    """Parameters that are not trained, and buffers: every rank loads them from the same model folder, so DDP need
    not broadcast them. For an 8B base that broadcast is 16 GB from rank 0 at start-up, for nothing."""
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    return frozen + [name for name, _ in module.named_buffers()]


def _fingerprint(module: torch.nn.Module, names: Sequence[str]) -> list[tuple[str, str]]:
    """(name, digest of shape, dtype and a strided sample of values) per tensor: a few hundred small reads, not a
    pass over the whole model."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    out = []
    for name in names:
        flat = tensors[name].detach().flatten()
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
        digest = hashlib.blake2b(f"{tuple(flat.shape)}{tensors[name].dtype}".encode(), digest_size=8)
        digest.update(sample.float().cpu().numpy().tobytes())
        out.append((f"{name} {tuple(tensors[name].shape)}", digest.hexdigest()))
    return out


def check_same_frozen_state(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Refuse to train when a rank's frozen base differs from rank 0's (another model folder or revision on some
    node): DDP no longer overwrites it with rank 0's, and gradients from different bases would be averaged."""
    prints = gather_objects(_fingerprint(module, names))
    for rank, other in enumerate(prints[1:], start=1):
        if other != prints[0]:
            first = next(
                (a[0] if a[0] == b[0] else f"{a[0]} vs {b[0]}" for a, b in zip(prints[0], other) if a != b),
                f"{len(prints[0])} vs {len(other)} tensors",
            )
            raise RuntimeError(
                f"rank {rank}'s frozen base model differs from rank 0's (first difference: {first}): every rank "
                "must load the same model.path; check that the model folder holds the same files on every node"
            )


def wrap_data_parallel(
    module: torch.nn.Module, device: torch.device
) -> torch.nn.parallel.DistributedDataParallel:
    """`module` under DDP, summing gradients over ranks. Construction broadcasts rank 0's trainable (LoRA) weights
    only, so every rank starts from the same adapter whatever its seed; the frozen base and the buffers are left
    out of every sync (checked equal across ranks instead), and the per-forward buffer broadcast goes with them."""
    ignored = frozen_state_names(module)
    check_same_frozen_state(module, ignored)
    # torch's (private, still in 2.13) way to keep named parameters and buffers out of DDP's syncs and reducer.
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
    ddp = torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None
    )
    ddp.register_comm_hook(None, sum_gradients_hook)
    return ddp


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (one element on a single rank)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
