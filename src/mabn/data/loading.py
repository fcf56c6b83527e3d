"""What the data modules share: their DataLoaders (a training order and augmentations drawn from the run's seed),
and the plan a dry run prints of a data set."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Mapping
from functools import partial
from itertools import islice
from typing import Any, NamedTuple, Protocol, runtime_checkable

import albumentations as A
import numpy as np
import torch
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from ..distributed import rank, world_size


class DataPlan(NamedTuple):
    """What a data module's ``plan(args)`` says of its data set for ``--dry-run``, from one check of it: the
    training samples, the lines to print, the training crop where the data decides it (the memory estimate's), and
    the training pixels per class where the check counts them (a ``mabn.data.masks.ClassPixels``: what
    ``class_weights: counts`` weighs the classes by)."""

    train_samples: int
    lines: list[str]
    crop: int | None = None
    class_pixels: Any = None


@runtime_checkable
class PlannedData(Protocol):
    """The contract between a data module class and the dry run: ``plan`` checks the data set of the init arguments
    ``args`` once and says what it holds (``DataPlan``), reading nothing but file names and its cache. The
    product's data modules fulfil it; a data module of one's own may."""

    @staticmethod
    def plan(args: Mapping[str, Any]) -> DataPlan: ...


MAX_WORKERS = 8  # the recipes' loader workers per device on a node with the cores for them


def cores() -> int:
    """The CPU cores this process may run on (its affinity: a SLURM job's share, not the node's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(devices: int = 1) -> int:
    """Loader workers per device where the run gives none: the cores shared by the ``devices`` of this node, at
    most ``MAX_WORKERS``; 2 cores and one device give 2, where 8 would each wait for a core (torch warns)."""
    return min(MAX_WORKERS, cores() // max(1, devices))


def node_devices(trainer: Any) -> int:
    """The devices of this node that a data module's ``trainer`` (None before a fit attaches it) runs on."""
    return trainer.num_devices if trainer is not None else 1


def workers_line(num_workers: int | None, devices: int) -> str:
    """The plan's line on the loader workers of each of the node's ``devices``."""
    if num_workers is not None:
        return f"loader workers: {num_workers} per device (num_workers as given)"
    return (
        f"loader workers: {default_workers(devices)} per device (num_workers null: {cores()} cores / {devices} "
        f"device(s), at most {MAX_WORKERS}; --data.init_args.num_workers sets them)"
    )


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
    """A seed for an albumentations stream that follows torch's seed and differs per DDP ``rank``: the stream of a
    loader worker (``start_worker``) whose dataset keeps one, for loaders outside the fits (the ablation's)."""
    return int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1)[0])


def start_worker(worker_id: int, rank: int = 0) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM (and SIGHUP and SIGUSR1, which stop a run too) and
    SIGINT, and gets its own albumentations random stream.

    SLURM ends a job (``scancel``, preemption, the time limit) by sending SIGTERM to every process of the job, the
    loader workers included. torch's worker handler dies of a SIGTERM that is not its parent's, and the main
    process's SIGCHLD handler then raises "DataLoader worker ... is killed by signal: Terminated" wherever it is,
    before the run can save. Ignoring it leaves the worker to its parent, which ends it when the run ends (the
    workers also exit when they see their parent gone); the run saves its checkpoint first
    (``mabn.run.LastCheckpoint``). Ctrl-C in a terminal sends SIGINT to the whole foreground process group: a worker
    that took it would end, and the main process, saving its state and shutting the loaders down, would meet
    "DataLoader worker ... exited unexpectedly"; the main process alone acts on it.

    A fit's training samples carry their augmentation's seed (``TrainingSampler``). A dataset read by plain indices
    whose albumentations ``Compose`` keeps its own generator, which every worker would otherwise copy, gets a
    stream per worker: ``torch.initial_seed()`` differs per worker and follows the main process seed. Bind
    ``rank`` with ``functools.partial`` in the main process: a worker need not see the process group.
    """
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT):  # the stops the main process acts on
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


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the augmentation of sample ``index`` in ``epoch`` of a fit seeded ``seed``."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


class TrainingSampler(DistributedSampler):
    """The training order of a fit on one device or many: each epoch a permutation of the dataset drawn from the
    run's seed and the epoch (``set_epoch``, which Lightning calls at each epoch's start), its first whole multiple
    of the ranks split over them as ``DistributedSampler`` splits it (rank r of W takes r, r + W, ...), and each
    sample as the key ``(index, seed)`` of ``SeededSamples``: its augmentation drawn from the fit's seed, the epoch
    and the index alone. So an epoch's samples and crops are the same whatever the loader workers and their
    prefetch, and a resume inside an epoch (``skip``) trains the rest of the epoch as the uninterrupted fit does:
    the same samples, the same crops, on every rank.

    The ranks are the process group's when the order is drawn, not when the loader is made. ``seed`` must be the
    same on every rank (``seed_everything`` gives each the same ``torch.initial_seed()``). Being a
    ``DistributedSampler``, Lightning keeps it under DDP rather than putting its own in its place."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
        self.start = 0  # the samples of this rank's share the next epoch skips

    def skip(self, samples: int) -> None:
        """The next epoch starts at sample ``samples`` of this rank's share (a resume inside an epoch)."""
        self.start = samples

    def _place(self) -> None:
        self.num_replicas, self.rank = world_size(), rank()
        self.num_samples = len(self.dataset) // self.num_replicas
        self.total_size = self.num_samples * self.num_replicas

    def __len__(self) -> int:
        self._place()
        return self.num_samples

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        self._place()
        start, self.start = self.start, 0
        for index in islice(super().__iter__(), start, None):
            yield index, sample_seed(self.seed, self.epoch, index)


class SeededSamples(Dataset):
    """A training dataset read by ``TrainingSampler``'s keys: ``(index, seed)`` seeds the dataset's albumentations
    transform (``transform``, where it is a ``Compose``) with ``seed``, then reads sample ``index``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        transform = getattr(self.dataset, "transform", None)
        if isinstance(transform, A.Compose):
            transform.set_random_seed(seed)
        return self.dataset[index]


class ResumableLoader(DataLoader):
    """A training loader that a resume from inside an epoch continues with the rest of that epoch's batches, as the
    uninterrupted fit trains them: Lightning stores a loader's ``state_dict`` with the fit loop's state in each
    checkpoint and hands it to ``load_state_dict`` when it resumes inside an epoch (before the epoch's iterator is
    made; the epoch comes from Lightning's ``set_epoch``). The state is the batches the fit has trained of the epoch
    (``trained_batches``, which ``mabn.compat.record_trained_batches`` sets from the fit loop's count before each
    save: the loader itself hands out batches ahead of the training, to Lightning's prefetch and to its workers);
    every rank trains as many, each of its own share."""

    trained_batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"trained_batches": self.trained_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.sampler, TrainingSampler):
            self.sampler.skip(state["trained_batches"] * self.batch_size)


def make_loader(
    dataset: Dataset, batch_size: int, train: bool, num_workers: int | None, devices: int = 1
) -> DataLoader:
    """Training loaders (``ResumableLoader``) draw each epoch's order and every sample's augmentation from the
    fit's seed (``TrainingSampler``, ``SeededSamples``) and drop the last partial batch, so every batch splits
    into whole ghost batches; evaluation loaders read every sample once in total over the devices
    (``evaluation_sampler``); every worker ignores the stop signals (``start_worker``). ``num_workers`` None:
    ``default_workers`` of the node's ``devices``."""
    num_workers = default_workers(devices) if num_workers is None else num_workers
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
    return ResumableLoader(
        SeededSamples(dataset),
        batch_size=batch_size,
        sampler=TrainingSampler(dataset, seed=torch.initial_seed()),
        # Each epoch's iterator draws its workers' base seed from this generator, not from torch's: a resume
        # makes its first iterator where the uninterrupted fit drew none, which would shift every later draw.
        generator=torch.Generator().manual_seed(torch.initial_seed()),
        drop_last=True,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        **kwargs,
    )
