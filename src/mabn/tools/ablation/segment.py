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
from ...errors import ConfigError
from ...models.backbone import BN_EPS, keep_bn_function, seed_from_bn
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

# How each row's encoder starts from BN(32)'s trained weights: loaded into the BN network and converted by
# ``convert_norm`` (which carries the affine, and BN's statistics where the norm takes them), converted for MABN by
# stage 2's code (``keep_bn_function``: BN's function kept, convs uncentred), by the same with BN's mean folded into
# beta and its variance as MABN's statistics, or by stage 1's warm start (``seed_from_bn``: convs centred).
AS_IS, KEPT, FOLDED, CENTRED = "as is", "kept", "folded", "centred"
SOURCE = "bn32"  # the ablation row whose trained network the fine-tunes start from
REFERENCE = "mabn2-kept"  # the row the paired differences are taken against: stage 2's conversion


@dataclass(frozen=True)
class Start:
    """How a fine-tune starts: its encoder from BN(32)'s weights (``how``), its head's norm (a row of rows.py)."""

    how: str
    head: str | None = None  # None: the row's own norm


def _row(base: str, key: str, label: str, preset: str | None = None) -> Row:
    row = replace(ROWS_BY_KEY[base], key=key, label=label, paper_error=None, paper_ref="beyond the paper")
    return row if preset is None else replace(row, preset=preset, norm_batch_size=None)


SEGMENT_ROWS: tuple[Row, ...] = (
    _row("mabn2", REFERENCE, "MABN(2), BN's function kept (stage 2's conversion)"),
    _row("bn32", "bn32-from-bn", "BN(32)"),
    _row("bn32", "frozenbn-head-bn2", "frozen BN, head BN(2)", "frozenbn"),
    _row("bn32", "frozenbn-head-gn", "frozen BN, head GN", "frozenbn"),
    _row("mabn2", "mabn2-mean-folded", "MABN(2), uncentred, BN's mean folded into beta, its variance as statistics"),
    _row("mabn2", "mabn2-centred", "MABN(2), centred convs (stage 1's warm-start conversion)"),
    _row("bn2", "bn2-from-bn", "BN(2)"),
    _row("gn2", "gn-from-bn", "GN, BN's affine kept"),
)
SEGMENT_ROWS_BY_KEY = {row.key: row for row in SEGMENT_ROWS}
STARTS = {
    REFERENCE: Start(KEPT),
    "bn32-from-bn": Start(AS_IS),
    "frozenbn-head-bn2": Start(AS_IS, "bn2"),
    "frozenbn-head-gn": Start(AS_IS, "gn2"),
    "mabn2-mean-folded": Start(FOLDED),
    "mabn2-centred": Start(CENTRED),
    "bn2-from-bn": Start(AS_IS),
    "gn-from-bn": Start(AS_IS),
}
# The domain shift (--domain-shift): the fine-tune's images in other colours, contrast and texture than the
# pre-training's, as Cityscapes' street scenes differ from ImageNet's photographs.
SHIFT_CHANNELS = (2, 0, 1)  # RGB -> BRG
SHIFT_INVERTED = 1  # the channel shown inverted after the permutation
SHIFT_CONTRAST = 0.75
SHIFT_TEXTURE = 0.05  # amplitude of a sinusoidal grating of random orientation and frequency per image


def select_segment_rows(keys: list[str] | None) -> list[Row]:
    """The fine-tunes named by ``keys`` in table order (every one for None); unknown keys: a ConfigError."""
    if keys is None:
        return list(SEGMENT_ROWS)
    unknown = [k for k in keys if k not in SEGMENT_ROWS_BY_KEY]
    if unknown:
        raise ConfigError(f"unknown --segment-start rows {unknown}; choose from {', '.join(SEGMENT_ROWS_BY_KEY)}")
    return [row for row in SEGMENT_ROWS if row.key in keys]


def shifted(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``images`` (N, H, W, 3) in [0, 1] with the domain shift: channels permuted and one inverted, the contrast
    lowered, a grating added; clipped to [0, 1]."""
    x = images[..., list(SHIFT_CHANNELS)].copy()
    x[..., SHIFT_INVERTED] = 1.0 - x[..., SHIFT_INVERTED]
    x = 0.5 + SHIFT_CONTRAST * (x - 0.5)
    n, h, w = x.shape[:3]
    v, u = np.meshgrid(np.arange(h) / h, np.arange(w) / w, indexing="ij")
    angle, frequency = rng.uniform(0, np.pi, n), rng.uniform(2, 6, n)
    phase = (np.cos(angle)[:, None, None] * u + np.sin(angle)[:, None, None] * v) * frequency[:, None, None]
    x = x + SHIFT_TEXTURE * np.sin(2 * np.pi * phase)[..., None]
    return np.clip(x, 0.0, 1.0)


@cache
def segment_set(split: str, size: int, shift: bool = False) -> tuple[Tensor, Tensor]:
    """(images (N, 3, size, size) normalized as the classification set's loader does, labels (N, size, size)
    int64) of ``split`` (train or val): one shape per image, of the classification set's shapes, degradation and
    size, the classes in turn, resized to ``size`` (the run's --image-size: the masks by nearest neighbour), with
    the domain shift where ``shift`` (``shifted``); deterministic, the same in every run."""
    count = {"train": TRAIN_IMAGES, "val": VAL_IMAGES}[split]
    rng = np.random.default_rng([DATA_SEED, ("train", "val").index(split)])
    images, labels = [], []
    for i in range(count):
        shape = i % len(CLASSES)
        image, mask = render_with_mask(shape, shapes.SIZE, rng)
        images.append(shapes.degrade(image, shapes.FADE, shapes.NOISE, rng))
        labels.append(np.where(mask, shape + 1, BACKGROUND))
    pixels = np.stack(images).astype(np.float64) / 255.0
    if shift:
        pixels = shifted(pixels, np.random.default_rng([DATA_SEED, ("train", "val").index(split), 1]))
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float()
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


def _fold_mean_only(encoder: nn.Module, state: dict[str, Tensor]) -> None:
    """After ``keep_bn_function``: MABN's affine and statistics with BN's mean folded into beta alone, BN's variance
    (not the second moment) as the statistics: BN's function in eval with MABN's eps = BN's, which the EMA then
    leaves as it measures the second moment."""
    with torch.no_grad():
        for name, layer in encoder.named_modules():
            if isinstance(layer, MABN2d):
                var, gamma = state[f"{name}.running_var"], state[f"{name}.weight"]
                layer.weight.copy_(gamma)
                layer.running_var.copy_(var)
                layer.buffer_x2.copy_(var.expand_as(layer.buffer_x2))


def initial_model(row: Row, seed: int, steps: int, bn_state: dict[str, Tensor]) -> nn.Module:
    """The row's network at its start: drawn from ``seed`` (so every row's head starts from the same weights), its
    encoder started from the BN(32) network ``bn_state`` as ``STARTS`` says, then its head's norms swapped; a MABN
    encoder's streams reset as stage 2's norm policy resets them at the start of a fit."""
    torch.manual_seed(seed)
    model = SegmentNet()
    start, state = STARTS[row.key], encoder_state(bn_state)
    options = layer_options(row, steps)
    if start.how == AS_IS:
        model.encoder.load_state_dict(state, strict=True)
        convert_norm(model.encoder, row.preset, **options)
    elif start.how == CENTRED:
        seed_from_bn(convert_norm(model.encoder, row.preset, True, **options), state, BN_EPS)
    else:
        keep_bn_function(convert_norm(model.encoder, row.preset, False, **options), state, BN_EPS)
        if start.how == FOLDED:
            _fold_mean_only(model.encoder, state)
    head = row if start.head is None else ROWS_BY_KEY[start.head]
    convert_norm(model.head, head.preset, **layer_options(head, steps))
    for layer in model.encoder.modules():
        if isinstance(layer, MABN2d):
            layer.reset_stream(reset_ema=False)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, size: int, device: torch.device, shift: bool = False, batch: int = 100) -> float:
    """The validation mIoU (%) at ``size`` px (``shift``: of the shifted set) with the norms in inference mode."""
    model.eval()
    images, labels = segment_set("val", size, shift)
    metric = SegmentationMetric(NUM_CLASSES, ignore_index=255)
    for start in range(0, len(images), batch):
        logits = model(images[start : start + batch].to(device))
        metric.update(logits.argmax(1).cpu(), labels[start : start + batch])
    return 100.0 * float(metric.compute()["miou"])


def _batches(count: int, generator: torch.Generator) -> list[Tensor]:
    """One epoch's index batches of ``GRADIENT_BATCH``, shuffled by ``generator``, the last partial batch dropped."""
    order = torch.randperm(count, generator=generator)
    return list(order[: count - count % GRADIENT_BATCH].split(GRADIENT_BATCH))


def finetune_run(
    row: Row, seed: int, config: TrainConfig, steps: int, bn_state: dict[str, Tensor], shift: bool = False
) -> RunResult:
    """Fine-tune ``row`` with ``seed`` for ``steps`` optimizer steps; its ``val_error`` is the validation mIoU (%).
    A non-finite loss ends the run as diverged."""
    torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    start = time.perf_counter()
    images, labels = segment_set("train", config.image_size, shift)
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
    miou = math.nan if diverged else evaluate(model, config.image_size, device, shift)
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
    bn_state: dict[str, Tensor]
    shift: bool = False

    def run(self, config: TrainConfig) -> RunResult:
        return finetune_run(self.row, self.seed, config, self.steps, self.bn_state, self.shift)
