"""What the data modules share: their DataLoaders, with per-worker and per-rank augmentation streams, and the
plan a dry run prints of a data set."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from functools import partial
from typing import Any, NamedTuple

import albumentations as A
import numpy as np
import torch
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from ..distributed import rank, world_size


class DataPlan(NamedTuple):
    """What a data module's ``plan(args)`` says of its data set for ``--dry-run``, from one check of it: the
    training samples, the lines to print, the training crop where the data decides it (the memory estimate's), and
    the training pixels per class where the check counts them (a ``mabn.data.folder.ClassPixels``: what
    ``class_weights: counts`` weighs the classes by)."""

    train_samples: int
    lines: list[str]
    crop: int | None = None
    class_pixels: Any = None


class DataLayout(NamedTuple):
    """What makes a folder a data module's dataset, for the stage launch (``mabn.cli.launch``): the folders and files
    below its root, the lines it says when no folder is given (``missing``), the module of ``mabn.data.synthetic``
    whose demo set then stands in for it, and the dataset's name in a run's wandb tags (None: the folder's name)."""

    folders: tuple[str, ...]
    missing: str
    demo: str
    files: tuple[str, ...] = ()
    name: str | None = None


def augmentation_seed(rank: int) -> int:
    """A seed for an albumentations stream that follows torch's seed and differs per DDP ``rank``.

    Under ``seed_everything`` every rank has the same torch seed; without the rank all ranks would draw
    the same scale/crop/flip sequence, making the crops of one global batch alike.
    """
    return int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1)[0])


def start_worker(worker_id: int, rank: int = 0) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM (and SIGHUP and SIGUSR1, which stop a run too) and
    gets its own albumentations random stream.

    SLURM ends a job (``scancel``, preemption, the time limit) by sending SIGTERM to every process of the job, the
    loader workers included. torch's worker handler dies of a SIGTERM that is not its parent's, and the main
    process's SIGCHLD handler then raises "DataLoader worker ... is killed by signal: Terminated" wherever it is,
    before the run can save. Ignoring it leaves the worker to its parent, which ends it when the run ends (the
    workers also exit when they see their parent gone); the run saves its checkpoint first
    (``mabn.run.LastCheckpoint``).

    An albumentations ``Compose`` keeps its own generator, which every worker would otherwise copy, so all
    workers would draw the same augmentations. ``torch.initial_seed()`` differs per worker and follows the
    main process seed, so runs stay reproducible under ``seed_everything``. Bind ``rank`` with
    ``functools.partial`` in the main process: a worker need not see the process group.
    """
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):  # the stops LastCheckpoint acts on, also SLURM's
        signal.signal(stop, signal.SIG_IGN)
    transform = getattr(get_worker_info().dataset, "transform", None)
    if isinstance(transform, A.Compose):
        transform.set_random_seed(augmentation_seed(rank))


def evaluation_sampler(dataset: Dataset) -> Sampler | None:
    """Under DDP, rank r of W evaluates samples r, r + W, r + 2W, ...: every sample exactly once.

    Lightning's own ``DistributedSampler`` pads the split to a multiple of W by repeating samples (500
    Cityscapes val images count as 504 on 8 devices), so metrics summed over the devices would not be those
    of the split. Being a ``DistributedSampler``, this one is kept by Lightning. Ranks then run up to one
    batch fewer than others, which is safe as long as validation does no collective per batch (metrics sync
    at epoch end) and each rank has a sample (DDP syncs buffers on the first forward after training).
    None without a process group: the loader reads in order.
    """
    if world_size() == 1:
        return None
    return UnrepeatedDistributedSampler(dataset, shuffle=False)


class ResumableSampler(Sampler[int]):
    """The training order of a single-process fit: each epoch a permutation of the ``size`` samples, drawn as
    torch's ``RandomSampler`` draws it (a seed from torch's generator at the epoch's start, which the checkpoints'
    random states restore at an epoch's end), and able to go on inside an epoch (``resume``): the same permutation,
    from a given sample on."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seed: int | None = None  # this epoch's, once its order is drawn
        self._resumed: tuple[int, int] | None = None

    def resume(self, seed: int, start: int) -> None:
        """The next epoch's order is the one of ``seed``, from its sample ``start`` on."""
        self._resumed = (seed, start)

    def __iter__(self) -> Iterator[int]:
        if self._resumed is not None:
            (self.seed, start), self._resumed = self._resumed, None
        else:
            self.seed, start = int(torch.empty((), dtype=torch.int64).random_().item()), 0
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed))
        yield from order[start:].tolist()

    def __len__(self) -> int:
        return self.size


class ResumableLoader(DataLoader):
    """A training loader that a resume from inside an epoch continues with the rest of that epoch's batches, as the
    uninterrupted fit draws them: Lightning stores a loader's ``state_dict`` with the fit loop's state in each
    checkpoint and hands it to ``load_state_dict`` when it resumes inside an epoch (before the epoch's iterator is
    made). The state is the epoch's seed and the batches the fit has trained of it (``trained_batches``, which
    ``mabn.compat.record_trained_batches`` sets from the fit loop's count before each save: the loader itself hands
    out batches ahead of the training, to Lightning's prefetch and to its workers)."""

    trained_batches = 0

    def state_dict(self) -> dict[str, int | None]:
        return {"seed": getattr(self.sampler, "seed", None), "trained_batches": self.trained_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") is not None and isinstance(self.sampler, ResumableSampler):
            self.sampler.resume(state["seed"], state["trained_batches"] * self.batch_size)


def make_loader(dataset: Dataset, batch_size: int, train: bool, num_workers: int) -> DataLoader:
    """Training loaders shuffle and drop the last partial batch, so every batch splits into whole ghost
    batches (Lightning shards them over the devices); evaluation loaders read every sample once in total over
    the devices (``evaluation_sampler``); every worker ignores SIGTERM and gets its own augmentation stream."""
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs = {"persistent_workers": True, "worker_init_fn": partial(start_worker, rank=rank())}
    if not train:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=evaluation_sampler(dataset),
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )
    # Under DDP Lightning gives the loader its DistributedSampler in place of the shuffling one (seeded by the
    # epoch, with no place in an epoch); on one process the ResumableSampler goes on inside an epoch. Both are a
    # ResumableLoader, so that a checkpoint of either has the loader state the other's resume expects.
    one = world_size() == 1
    return ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableSampler(len(dataset)) if one else None,
        shuffle=not one,
        # Each epoch's iterator draws its workers' base seed from this generator, not from torch's: a resume
        # makes its first iterator where the uninterrupted fit drew none, which would shift every later draw.
        generator=torch.Generator().manual_seed(torch.initial_seed()),
        drop_last=True,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        **kwargs,
    )
