"""PSPNet-101 training-step benchmark: forward, backward and SGD step per norm, time and peak memory vs BN."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ..callbacks import MABNCallback
from ..cudagraph import training_call
from ..data.cityscapes import IGNORE_INDEX
from ..models import PSPNet
from .measure import median_times, peak_memory

NORMS = ("bn", "gn", "brn", "mabn")
LOGGED = "mabn + stats logging"  # MABN with MABNCallback's statistics logging at every step
ROWS = (*NORMS, LOGGED)
# The recipe's per-device batch is one ghost batch of 2: BRN and MABN normalize groups of this size.
NORM_BATCH_SIZE = 2
# SegmentationTask's defaults: auxiliary loss weight and SGD settings.
AUX_WEIGHT = 0.4
SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
# Steady state from the first step: BRN's clipping and MABN's renormalization already active (the
# warm-ups only pick between tensors computed either way, so the cost is the same).
STEADY_STATE = {"brn": {"r_ramp": (0, 1), "d_ramp": (0, 1)}, "mabn": {"warmup_iters": 1, "renorm_warmup_iters": 1}}


@dataclass(frozen=True)
class StepRow:
    """One norm's median step time and peak memory, and both as ratios to BN's."""

    norm: str
    seconds: float
    peak_bytes: int
    time_ratio: float
    mem_ratio: float


def build(norm: str, num_classes: int = 19) -> PSPNet:
    """PSPNet-101 with ``norm`` as trained here. BN is plain ``nn.BatchNorm2d``: at a batch of 2 its
    normalization batch is the ghost batch of 2 that ``norm_batch_size`` would give, without the ghost-batch
    machinery, so it is the fastest BN baseline. GN has no batch dimension to split."""
    norm_batch_size = NORM_BATCH_SIZE if norm in ("brn", "mabn") else None
    return PSPNet(num_classes, norm, norm_batch_size, STEADY_STATE)


class _Trainer:
    """A model and its optimizer; ``step`` is one training iteration as SegmentationTask runs it (once
    ``cuda_graph`` is set, the next step captures the forward and backward for its shape, later ones replay)."""

    def __init__(self, model: PSPNet) -> None:
        self.model = model
        self.cuda_graph = False
        self.optimizer = torch.optim.SGD(model.parameters(), **SGD)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        out, aux = training_call(self.model, images, self.cuda_graph)
        loss = F.cross_entropy(out, labels, ignore_index=IGNORE_INDEX)
        loss = loss + AUX_WEIGHT * F.cross_entropy(aux, labels, ignore_index=IGNORE_INDEX)
        loss.backward()
        self.optimizer.step()
        # Gradients are freed after every step, so models waiting their turn hold none and each step
        # allocates its own: every measured step then counts the same things.
        self.optimizer.zero_grad(set_to_none=True)


class _LoggingTrainer(_Trainer):
    """MABN with MABNCallback's statistics logging at every step (log_every_n_steps=1, its costliest setting).

    The callback's own hooks run around each step. Outside a Trainer they get a stand-in that supplies what
    they read: the step number and the loggers, here one that keeps the last metrics in memory.
    """

    def __init__(self, model: PSPNet) -> None:
        super().__init__(model)
        self.callback = MABNCallback(log_every_n_steps=1)
        self.logged: dict[str, float] = {}
        self.trainer = SimpleNamespace(
            global_step=0, loggers=[SimpleNamespace(log_metrics=self._keep)], strategy=None
        )  # one process: no distributed strategy to configure
        self.callback.setup(self.trainer, model, "fit")

    def _keep(self, metrics: dict[str, float], step: int) -> None:
        self.logged = metrics

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        # The batch hooks read only ``cuda_graph`` of the LightningModule: this object stands in for it.
        self.callback.on_train_batch_start(self.trainer, self, (images, labels), 0)
        super().step(images, labels)
        self.callback.on_train_batch_end(self.trainer, self, None, (images, labels), 0)
        self.trainer.global_step += 1


def _batch(batch: int, crop: int, num_classes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, crop, crop, generator=gen)
    labels = torch.randint(0, num_classes, (batch, crop, crop), generator=gen)
    return images.to(device), labels.to(device)


def run(
    device: torch.device,
    repeats: int = 5,
    crop: int = 512,
    batch: int = 2,
    num_classes: int = 19,
    cuda_graph: bool = False,
) -> list[StepRow]:
    """Time and peak memory of one training step per norm, all on the same images and labels.

    A first step at a small crop creates the optimizer's momentum buffers (so the measured steps do not
    allocate them), then one step per norm is measured for peak memory, then ``repeats`` interleaved
    rounds are timed (median reported). With ``cuda_graph`` (CUDA) every model's training forward and
    backward are CUDA graphs: the memory step is the one that captures them, so its peak includes the
    capture's.
    """
    if batch % NORM_BATCH_SIZE:
        raise ValueError(f"batch must be a multiple of the normalization batch {NORM_BATCH_SIZE}, got {batch}")
    warmup = _batch(batch, min(crop, 64), num_classes, device)
    images, labels = _batch(batch, crop, num_classes, device)
    trainers: dict[str, Any] = {}
    for name in ROWS:
        torch.manual_seed(0)
        trainer_cls, norm = (_LoggingTrainer, "mabn") if name == LOGGED else (_Trainer, name)
        trainers[name] = trainer_cls(build(norm, num_classes).to(device).train())
        trainers[name].step(*warmup)
        trainers[name].cuda_graph = cuda_graph  # captured at the measured shape, by the memory step below
    if not trainers[LOGGED].logged:
        raise RuntimeError("MABNCallback logged no statistics: the logging row would measure nothing")
    steps = {norm: partial(t.step, images, labels) for norm, t in trainers.items()}
    peaks = {}
    for norm, step in steps.items():
        peaks[norm] = peak_memory(step, device)
        print(f"training step {norm}: peak memory {peaks[norm] / 2**30:.3f} GiB", flush=True)
    times = median_times(steps, device, repeats, warmup=0)
    results = [StepRow(n, times[n], peaks[n], times[n] / times["bn"], peaks[n] / peaks["bn"]) for n in ROWS]
    for row in results:
        print(f"training step {row.norm}: {row.seconds:.3f} s, {row.time_ratio:.3f} x BN", flush=True)
    return results


def table(rows: list[StepRow], repeats: int, crop: int, batch: int, cuda_graph: bool = False) -> str:
    """The markdown section for ``rows``."""
    graphs = ", forward and backward as CUDA graphs" if cuda_graph else ""
    lines = [
        f"### PSPNet-101 training step: batch {batch}, crop {crop}x{crop}, forward + backward + SGD step{graphs}",
        "",
        f"Median of {repeats} interleaved repeats; peak memory above what was allocated before the step (so weights "
        "and momentum buffers are not counted, gradients are). "
        f"BRN and MABN normalize ghost batches of {NORM_BATCH_SIZE}; BN is `nn.BatchNorm2d` over the batch.",
        "",
        "| norm | s / step | time / BN | peak memory (GiB) | memory / BN |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.norm} | {r.seconds:.3f} | {r.time_ratio:.3f} | {r.peak_bytes / 2**30:.3f} | {r.mem_ratio:.3f} |"
        )
    lines += [
        "",
        f"`{LOGGED}`: MABN with `MABNCallback(log_every_n_steps=1)` computing its statistics summary at every step "
        "(the default logs every 50 steps).",
    ]
    if cuda_graph:
        lines.append(
            "Every model's training forward and backward replay CUDA graphs (`mabn.cudagraph`). Peak memory is "
            "that of the step which captured the graphs."
        )
    return "\n".join(lines)
