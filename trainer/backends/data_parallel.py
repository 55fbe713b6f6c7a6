"""The data-parallel trainer's control flow: rank 0 runs the loop and announces each collective call (forward_backward,
optim_step, load_state) to the other ranks, which make the same call (`follow`). Rank 0 alone writes files."""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from trainer.backends.collectives import broadcast
from trainer.backends.local import LocalBackend
from trainer.training.backend import AdamParams, ForwardBackwardResult
from trainer.training.batch import TrainingExample
from trainer.training.loss_params import LossParams, Reduction
from trainer.training.losses import BatchScale


class RankZeroBackend:
    """The TrainingBackend the loop sees on rank 0 of a data-parallel job: collective calls are announced to the
    other ranks (which run `follow`) before rank 0 makes them; file writes happen on rank 0 only."""

    def __init__(self, local: LocalBackend):
        self.local = local

    @property
    def step(self) -> int:
        return self.local.step

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    def forward_backward(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction = "sum",
        scale: BatchScale | None = None,
    ) -> ForwardBackwardResult:
        broadcast(("forward_backward", (list(examples), loss, reduction, scale)))
        return self.local.forward_backward(examples, loss, reduction, scale)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        broadcast(("optim_step", (adam,)))
        return self.local.optim_step(adam)

    def train_step(
        self,
        examples: Sequence[TrainingExample],
        loss: LossParams,
        reduction: Reduction,
        adam: AdamParams,
        scale: BatchScale | None = None,
    ) -> tuple[ForwardBackwardResult, dict[str, float]]:
        return self.forward_backward(examples, loss, reduction, scale), self.optim_step(adam)

    def load_state(self, path: str) -> None:
        broadcast(("load_state", (path,)))
        self.local.load_state(path)

    def save_for_sampler(self, version: int) -> str:
        return self.local.save_for_sampler(version)

    def probe(self, prompts: list[list[int]], top_k: int) -> list[dict[int, float]]:
        return self.local.probe(prompts, top_k)  # rank 0's replica alone: no collective

    def probe_logits(self, prompts: list[list[int]], adapter: bool = True) -> torch.Tensor:
        return self.local.probe_logits(prompts, adapter)  # rank 0's replica alone: no collective

    def save_state(self, name: str) -> str:
        return self.local.save_state(name)

    def close(self) -> None:
        broadcast(("stop", ()))
        leave_together()


def leave_together() -> None:
    """After the stop: every rank passes a barrier before it tears its process group down. Rank 0's broadcast
    returns once it has sent; torn down at once, its connections could close while a follower was still reading the
    stop, and that follower exited non-zero at the run's clean end."""
    dist.barrier()
    dist.destroy_process_group()


FOLLOWER_CALLS = frozenset({"forward_backward", "optim_step", "load_state"})


def follow(local: LocalBackend) -> None:
    """Ranks > 0: make the collective calls rank 0 announces, until it says stop."""
    while True:
        name, args = broadcast()
        if name == "stop":
            leave_together()
            return
        if name not in FOLLOWER_CALLS:
            raise RuntimeError(f"rank {dist.get_rank()}: rank 0 announced unknown call {name!r}")
        getattr(local, name)(*args)
