"""``--segment-start`` (beyond the paper, docs/ablation/segment-start.md): stage 2's start from BN weights at small
scale.

Per seed the ablation's BN(32) row trains on the ablation's classification set, then three segmentation networks
fine-tune on a generated segmentation set of the same shapes: MABN(2) with the BN(32) encoder converted as stage 2
converts a BN backbone (``mabn.models.backbone.seed_from_bn``, then the streams reset as the norm policy's
``reset_from_pretrained`` does: warm-up again, BN's variance kept as the EMA), BN(32) with the same encoder loaded
as it is, and MABN(2) from random weights. The segmentation network is the ablation's SmallResNet (its classifier
dropped) under a head of one 3x3 conv, its norm and a 1x1 classifier, upsampled to the input, its norms those of
the row as stage 2 converts PSPNet's head. The fine-tune follows stage 2's recipe: SGD with momentum and weight
decay, the head at ``HEAD_LR_MULT`` times the encoder's lr (``SEGMENT_LR`` at gradient batch 32, the recipe's 0.01
per 16 scaled linearly), linear warm-up over the recipe's share of the run then poly 0.9, cross-entropy; the
metric is the validation mIoU (``mabn.tasks.metrics.SegmentationMetric``). Seeds are paired: with the same seed
every row starts its head from the same weights and sees the same batches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...data.images import IMAGENET_MEAN, IMAGENET_STD
from ...data.synthetic.imagenet import CLASSES, render_with_mask
from ...models.backbone import BN_EPS, seed_from_bn
from ...norm import MABN2d, convert_norm
from ...tasks.metrics import SegmentationMetric
from ...tasks.schedules import warmup_poly
from . import shapes
from .model import WIDTHS, SmallResNet
from .rows import GRADIENT_BATCH, ROWS_BY_KEY, Row, layer_options
from .train import RunResult, TrainConfig

BACKGROUND = 0  # the label of every pixel outside the shape; shape k is label k + 1
NUM_CLASSES = 1 + len(CLASSES)
# A small training split, the setting where a pre-trained start matters; a large validation split (about 90,000
# shape pixels per class) so that the mIoU resolves tenths of a point.
TRAIN_IMAGES, VAL_IMAGES = 500, 1000
DATA_SEED = 30  # the set's own generator, apart from the runs' seeds and the classification set's
HEAD_WIDTH = 64
HEAD_LR_MULT = 10.0  # stage 2's head_lr_mult
SEGMENT_LR = 0.02  # stage 2's base_lr 0.01 per global batch 16, at the gradient batch of 32
WARMUP_SHARE = 3 / 200  # stage 2's 3 warm-up epochs of 200
POLY_POWER = 0.9
DEFAULT_SEGMENT_STEPS = 150  # the measured run of docs/ablation/segment-start.md

# How each row's encoder starts: BN(32)'s trained weights converted to MABN, loaded as they are, or random.
CONVERTED, AS_IS, RANDOM = "converted", "as is", "random"
SOURCE = "bn32"  # the ablation row whose trained network the fine-tunes start from
REFERENCE = "mabn2-from-bn"  # the row the paired differences are taken against


def _row(base: str, key: str, label: str) -> Row:
    return replace(ROWS_BY_KEY[base], key=key, label=label, paper_error=None, paper_ref="beyond the paper")


SEGMENT_ROWS: tuple[Row, ...] = (
    _row("mabn2", REFERENCE, "MABN(2), converted from BN(32)"),
    _row("bn32", "bn32-from-bn", "BN(32), from BN(32)"),
    _row("mabn2", "mabn2-random", "MABN(2), random"),
)
STARTS = {REFERENCE: CONVERTED, "bn32-from-bn": AS_IS, "mabn2-random": RANDOM}


@cache
def segment_set(split: str, size: int) -> tuple[Tensor, Tensor]:
    """(images (N, 3, size, size) normalized as the classification set's loader does, labels (N, size, size)
    int64) of ``split`` (train or val): one shape per image, of the classification set's shapes, degradation and
    size, the classes in turn, resized to ``size`` (the run's --image-size: the masks by nearest neighbour);
    deterministic, the same in every run."""
    count = {"train": TRAIN_IMAGES, "val": VAL_IMAGES}[split]
    rng = np.random.default_rng([DATA_SEED, ("train", "val").index(split)])
    images, labels = [], []
    for i in range(count):
        shape = i % len(CLASSES)
        image, mask = render_with_mask(shape, shapes.SIZE, rng)
        images.append(shapes.degrade(image, shapes.FADE, shapes.NOISE, rng))
        labels.append(np.where(mask, shape + 1, BACKGROUND))
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0
    y = torch.from_numpy(np.stack(labels))[:, None].float()
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    y = F.interpolate(y, size=(size, size), mode="nearest-exact")[:, 0].long()
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std, y


class SegmentNet(nn.Module):
    """The ablation's SmallResNet as the encoder (torchvision's names, its classifier dropped as smp's encoders drop
    it), a head of conv3x3-BN-ReLU and a 1x1 classifier, and bilinear upsampling to the input."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.encoder = SmallResNet(len(CLASSES))
        self.encoder.fc = nn.Identity()
        self.head = nn.Sequential(
            nn.Conv2d(WIDTHS[-1], HEAD_WIDTH, 3, padding=1, bias=False),
            nn.BatchNorm2d(HEAD_WIDTH),
            nn.ReLU(inplace=True),
            nn.Conv2d(HEAD_WIDTH, num_classes, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        logits = self.head(self.encoder.features(x))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def encoder_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The classification network's weights an encoder takes: all but the classifier."""
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def initial_model(row: Row, seed: int, steps: int, bn_state: dict[str, Tensor] | None) -> nn.Module:
    """The row's network at its start: drawn from ``seed`` before its norms are swapped (so every row's head starts
    from the same weights), then its encoder started as ``STARTS`` says from the BN(32) network ``bn_state``."""
    torch.manual_seed(seed)
    model = convert_norm(SegmentNet(), row.preset, **layer_options(row, steps))
    start = STARTS[row.key]
    if start == RANDOM:
        return model
    if bn_state is None:
        raise ValueError(f"row {row.key} starts from {SOURCE}'s network: pass its weights")
    if start == AS_IS:
        model.encoder.load_state_dict(encoder_state(bn_state), strict=True)
        return model
    seed_from_bn(model.encoder, encoder_state(bn_state), BN_EPS)
    for layer in model.encoder.modules():
        if isinstance(layer, MABN2d):
            layer.reset_stream(reset_ema=False)  # as stage 2's norm policy does at the start of a fit (the default)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, size: int, device: torch.device, batch: int = 100) -> float:
    """The validation mIoU (%) at ``size`` px with the norms in inference mode."""
    model.eval()
    images, labels = segment_set("val", size)
    metric = SegmentationMetric(NUM_CLASSES, ignore_index=255)
    for start in range(0, len(images), batch):
        logits = model(images[start : start + batch].to(device))
        metric.update(logits.argmax(1).cpu(), labels[start : start + batch])
    return 100.0 * float(metric.compute()["miou"])


def _batches(count: int, generator: torch.Generator) -> list[Tensor]:
    """One epoch's index batches of ``GRADIENT_BATCH``, shuffled by ``generator``, the last partial batch dropped."""
    order = torch.randperm(count, generator=generator)
    return list(order[: count - count % GRADIENT_BATCH].split(GRADIENT_BATCH))


def finetune_run(row: Row, seed: int, config: TrainConfig, steps: int, bn_state: dict[str, Tensor] | None) -> RunResult:
    """Fine-tune ``row`` with ``seed`` for ``steps`` optimizer steps; its ``val_error`` is the validation mIoU (%).
    A non-finite loss ends the run as diverged."""
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    start = time.perf_counter()
    images, labels = segment_set("train", config.image_size)
    model = initial_model(row, seed, steps, bn_state).to(device)
    optimizer = torch.optim.SGD(
        [
            {"params": model.encoder.parameters(), "mult": 1.0},
            {"params": model.head.parameters(), "mult": HEAD_LR_MULT},
        ],
        lr=SEGMENT_LR,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    warmup = max(1, round(WARMUP_SHARE * steps))
    tag = f"[{row.key} seed {seed}]"
    loss_value, diverged, losses, batches = math.nan, None, [], []
    order = torch.Generator().manual_seed(seed)  # the data order's own generator: the same batches in every row
    model.train()
    for step in range(steps):
        if not batches:
            batches = _batches(len(images), order)
        index = batches.pop(0)
        for group in optimizer.param_groups:
            group["lr"] = SEGMENT_LR * group["mult"] * warmup_poly(step, steps, warmup, POLY_POWER)
        loss = F.cross_entropy(model(images[index].to(device)), labels[index].to(device))
        if not torch.isfinite(loss):  # a diverged run is a result, not a crash
            diverged = f"step {step}: loss is {loss.item()}"
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        losses.append(loss_value)
        done = step + 1
        if config.progress_every and (done % config.progress_every == 0 or done == steps):
            elapsed = time.perf_counter() - start
            print(f"{tag} step {done}/{steps} loss {loss_value:.3f} ({elapsed / done:.2f} s/step)", flush=True)
    miou = math.nan if diverged else evaluate(model, config.image_size, device)
    seconds = time.perf_counter() - start
    outcome = f"diverged at {diverged}" if diverged else f"mIoU {miou:.2f}%"
    print(f"{tag} done in {seconds:.0f} s: {outcome}", flush=True)
    return RunResult(row.key, seed, miou, seconds, loss_value, diverged, losses)


@dataclass(frozen=True)
class FinetuneTask:
    """One fine-tune for ``runner.run_all``."""

    row: Row
    seed: int
    steps: int
    bn_state: dict[str, Tensor] | None

    def run(self, config: TrainConfig) -> RunResult:
        return finetune_run(self.row, self.seed, config, self.steps, self.bn_state)
