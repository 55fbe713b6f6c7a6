"""Which backend a run trains on, built by the entry point (`python -m trainer run`) and handed to the loop, so
that trainer/training never imports a concrete backend."""

from __future__ import annotations

from trainer.backends.collectives import rank_info
from trainer.backends.data_parallel import RankZeroBackend, follow
from trainer.backends.local import LocalBackend
from trainer.training.backend import TrainingBackend
from trainer.training.config import RunConfig
from trainer.training.distill import resolve_teacher


def build_backend(cfg: RunConfig) -> TrainingBackend:
    """The backend `launch.backend` names; a data-parallel local trainer's rank 0 gets the announcing wrapper."""
    if cfg.launch.backend == "tinker":
        from trainer.backends.tinker import TinkerBackend  # the local path never imports tinker

        remote = TinkerBackend(cfg)
        if cfg.distill.teacher is not None:
            remote.load_teacher(cfg.distill.teacher)
        return remote
    local = LocalBackend(cfg)
    if cfg.distill.teacher is not None:  # the config keeps a teacher to one rank
        local.load_teacher(resolve_teacher(cfg.distill.teacher))
    return RankZeroBackend(local) if local.ranks.world_size > 1 else local


def follow_rank_zero(cfg: RunConfig) -> None:
    """Ranks > 0 of a data-parallel trainer: no I/O, only the collective calls rank 0 makes."""
    follow(LocalBackend(cfg))


def is_main_rank() -> bool:
    return rank_info().is_main


def release(backend: TrainingBackend) -> None:
    """After a finished or stopped loop: let the other ranks of a data-parallel job go. Not after an exception:
    rank 0 exits instead and torchrun stops the other ranks (a stop message could land in the middle of a
    collective they are waiting in)."""
    if isinstance(backend, RankZeroBackend):
        backend.close()
