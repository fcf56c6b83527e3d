"""The one training loop every row runs: same network, data, optimizer and schedule; only the norm differs.

SGD (momentum 0.9, weight decay 1e-4 on every parameter, gamma and beta included, as in the paper), a
linear lr warm-up then cosine decay to 0 over a fixed number of steps, gradient batch 32. A run is
deterministic per seed, and the seed is paired across rows: every row with the same seed starts the layers
they share from the same weights and sees the same batches with the same augmentations, whatever its norm
(the norm conversion draws from the global generator for some rows and not others, so the data order has
its own generator). The CPU kernels run on a fixed number of threads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ...data.errors import DatasetError
from ...data.imagenet import ImageFolderDataModule
from ...data.loading import start_worker
from ...models.backbone import BN_EPS, seed_from_bn
from ...norm import convert_norm
from .model import SmallResNet
from .probes import make_probe
from .rows import GRADIENT_BATCH, Row, layer_options


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on besides its row and seed."""

    data: Path
    steps: int
    image_size: int = 32
    # Peak lr: 4x the paper's 0.1 per 256 samples at gradient batch 32, so that the runs level off within
    # the default steps (at 0.0125 BN(32)'s error still falls from 4.5 % to 0.2 % between 800 and 1600).
    lr: float = 0.05
    warmup_fraction: float = 0.05  # linear lr warm-up over this share of the steps
    momentum: float = 0.9
    weight_decay: float = 1e-4
    crop_scale: tuple[float, float] = (0.6, 1.0)  # RandomResizedCrop area range (ImageNet recipes: 0.08-1)
    threads: int = 1  # torch CPU threads per run
    loader_workers: int = 0  # DataLoader processes per run (0: load in the training process)
    device: str = "cpu"
    probe_layer: str = "layer1.0.bn1"  # the layer of the paper's statistics figures
    progress_every: int = 50  # print a progress line every this many steps (0: never)


@dataclass
class RunResult:
    """What a run gives back: its final validation error, or ``diverged`` with the reason."""

    row: str
    seed: int
    val_error: float  # top-1 error in %, NaN when the run diverged
    seconds: float
    final_loss: float
    diverged: str | None = None
    losses: list[float] = field(default_factory=list)  # training loss of every step
    stats: list[dict[str, float]] = field(default_factory=list)  # per-step probe records (empty: not probed)
    state: dict[str, torch.Tensor] | None = None  # the trained network's weights, where asked (a warm start's source)


def lr_factor(step: int, steps: int, warmup_fraction: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warm-up, then cosine to 0."""
    warmup = max(1, round(warmup_fraction * steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def build_model(row: Row, num_classes: int, steps: int) -> nn.Module:
    """The network with every norm replaced as the row says."""
    return convert_norm(SmallResNet(num_classes), row.preset, **layer_options(row, steps))


def open_data(config: TrainConfig) -> ImageFolderDataModule:
    """The train/val folders of ``config.data`` with the ImageNet-style augmentation at ``image_size``;
    raises DatasetError naming the path when the layout is wrong."""
    data = ImageFolderDataModule(
        str(config.data),
        batch_size=GRADIENT_BATCH,
        num_workers=config.loader_workers,
        image_size=config.image_size,
        val_resize=round(config.image_size * 9 / 8),  # 36 px for 32 px crops, 252 for 224 (ImageNet: 256)
        crop_scale=config.crop_scale,
    )
    data.setup("fit")  # seeds the augmentations from torch's seed
    if len(data.train_set) < GRADIENT_BATCH:
        raise DatasetError(
            f"{config.data / 'train'} holds {len(data.train_set)} images; one gradient batch needs {GRADIENT_BATCH}"
        )
    return data


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageFolderDataModule, device: torch.device) -> float:
    """Top-1 error (%) on the validation split, with the norms in inference mode."""
    model.eval()
    wrong = total = 0
    for images, labels in data.val_dataloader():
        logits = model(images.to(device))
        wrong += int((logits.argmax(1).cpu() != labels).sum())
        total += labels.numel()
    return 100.0 * wrong / total


def training_batches(
    data: ImageFolderDataModule, seed: int, loader_workers: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Training batches epoch after epoch, each epoch reshuffled; the order and the augmentations follow
    ``seed`` alone (own generators), so they are the same for every row."""
    data.train_transform.set_random_seed(seed)  # the in-process augmentation stream
    loader = DataLoader(
        data.train_set,
        batch_size=GRADIENT_BATCH,
        shuffle=True,
        drop_last=True,  # every batch splits into whole normalization batches
        num_workers=loader_workers,
        generator=torch.Generator().manual_seed(seed),  # also seeds the loader processes' streams
        worker_init_fn=start_worker if loader_workers else None,
        persistent_workers=loader_workers > 0,
    )
    while True:
        yield from loader


def initial_model(
    row: Row, num_classes: int, seed: int, steps: int, init: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """The row's network at its start: the plain network is drawn first from ``seed``, so the layers
    every row shares (convs, linear, norm affine) start equal across rows. A warm-start row then takes the
    weights and statistics of the BN network ``init`` (``mabn.models.backbone.seed_from_bn``)."""
    torch.manual_seed(seed)
    model = build_model(row, num_classes, steps)
    if row.warm_from:
        if init is None:
            raise ValueError(f"row {row.key} starts from {row.warm_from}'s network: pass its weights")
        seed_from_bn(model, init, BN_EPS)
    return model


def run_steps(row: Row, config: TrainConfig) -> int:
    """The optimizer steps of ``row``'s runs: its own, or the run's."""
    return config.steps if row.steps is None else row.steps


def train_run(
    row: Row,
    seed: int,
    config: TrainConfig,
    probe: bool = False,
    init: dict[str, torch.Tensor] | None = None,
    keep_state: bool = False,
) -> RunResult:
    """Train ``row`` with ``seed`` for its steps (``run_steps``); ``probe`` records the statistics of
    ``config.probe_layer`` at every step; ``init``: a warm-start row's BN network; ``keep_state``: return the
    trained weights. A non-finite loss or norm statistic ends the run as diverged."""
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    start = time.perf_counter()
    data = open_data(config)
    steps = run_steps(row, config)
    model = initial_model(row, data.num_classes, seed, steps, init).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    recorder = make_probe(model.get_submodule(config.probe_layer)) if probe else None
    tag = f"[{row.key} seed {seed}]"
    loss_value, diverged, losses = math.nan, None, []
    model.train()
    for step, (images, labels) in zip(range(steps), training_batches(data, seed, config.loader_workers)):
        for group in optimizer.param_groups:
            group["lr"] = config.lr * lr_factor(step, steps, config.warmup_fraction)
        try:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        except FloatingPointError as err:  # a diverged run is a result (the paper's "-"), not a crash
            diverged = f"step {step}: {err}"
            break
        optimizer.step()
        if recorder is not None:
            recorder.end_step(step)
        loss_value = loss.item()
        losses.append(loss_value)
        done = step + 1
        if config.progress_every and (done % config.progress_every == 0 or done == steps):
            elapsed = time.perf_counter() - start
            print(f"{tag} step {done}/{steps} loss {loss_value:.3f} ({elapsed / done:.2f} s/step, "
                  f"ETA {elapsed / done * (steps - done):.0f} s)", flush=True)  # fmt: skip
    if recorder is not None:
        recorder.close()
    error = math.nan if diverged else evaluate(model, data, device)
    seconds = time.perf_counter() - start
    outcome = f"diverged at {diverged}" if diverged else f"val error {error:.2f}%"
    print(f"{tag} done in {seconds:.0f} s: {outcome}", flush=True)
    records = recorder.records if recorder is not None else []
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if keep_state else None
    return RunResult(row.key, seed, error, seconds, loss_value, diverged, losses, records, state)
