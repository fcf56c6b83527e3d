"""Training-step benchmark: forward, backward and SGD step per norm, time and peak memory vs BN.

Three models: PSPNet-101 as the segmentation stage trains it (2 images per device), ResNet-101 as stage 1 trains it
(``mabn.models.resnet``, the network ClassificationTask builds: 32 images of 224 px per device, BRN and MABN over
ghost batches, BN over the device's whole batch as the ``bn32`` backbone), and torchvision's ResNet-50 at small
inputs (e.g. batch 8 at 160 px), where the norms and the per-layer host work weigh more; for ResNet-50 also a
user's plain loop (``convert_norm(model, "mabn")``, ``torch.optim.SGD``), with and without ``mabn.keep_centred``.
Compiled rows (``torch.compile``, fullgraph) run beside the eager ones and are compared with compiled BN. ``rows``
picks a subset of the rows (``make gpu-check`` measures bn and mabn alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from ...callbacks import MABNCallback, NormPolicy
from ...data.classes import IGNORE_INDEX
from ...models import PSPNet, resnet
from ...norm import NORMS, convert_norm, norm_entry
from ...norm.cenconv import keep_centred
from ...norm.factory import norms_where
from ...tasks.cudagraph import training_call
from .measure import median_times, peak_memory
from .workloads import BASELINE, BF16, MODELS, NORM_BATCH_SIZE

LOGGED = "mabn + stats logging"  # MABN with MABNCallback's statistics logging at every step
# ResNet-50 only: a user's loop, convert_norm(model, "mabn") with its defaults (the whole batch; past its warm-ups,
# as every row) and torch.optim.SGD, with mabn.keep_centred(model, optimizer), and without it (centring in forward).
PLAIN = "mabn plain loop"
PLAIN_FORWARD = "mabn plain loop, no keep_centred"
COMPILED = ("bn", "mabn")  # the norms of the compiled rows, named "<norm> compiled" (compiling takes minutes)
# SegmentationTask's defaults: auxiliary loss weight and SGD settings.
AUX_WEIGHT = 0.4
SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}


def benched() -> tuple[str, ...]:
    """The norms measured: every norm the benchmarks build (its entry's ``steady_state``), in registration order."""
    return norms_where(lambda entry: entry.steady_state is not None)


def steady_state() -> dict[str, dict[str, Any]]:
    """The ``norm_options`` of steady state from the first step, per norm: e.g. BRN's clipping and MABN's
    renormalization already active (the warm-ups only pick between tensors computed either way, so the cost is the
    same)."""
    return {name: dict(NORMS[name].steady_state) for name in benched()}


@dataclass(frozen=True)
class StepRow:
    """One row's median step time and peak memory, and both as ratios to BN's (compiled BN's for a compiled
    row); for a compiled row also the time of its first step, which compiled it."""

    norm: str
    seconds: float
    peak_bytes: int
    time_ratio: float
    mem_ratio: float
    first_step_s: float | None = None


def build(norm: str, num_classes: int = 19, model: str = "pspnet101", norm_batch_size: int | None = 2) -> nn.Module:
    """``model`` with ``norm``, BRN and MABN normalizing groups of ``norm_batch_size`` (None: the whole batch).
    BN is plain ``nn.BatchNorm2d`` over the batch: at PSPNet's batch of 2 that is the ghost batch of 2 without
    the ghost-batch machinery, so it is the fastest BN baseline; at stage 1's 32 images it is the ``bn32``
    backbone's BN. GN has no batch dimension to split."""
    entry = norm_entry(norm)
    groups = norm_batch_size if entry.batch and norm != BASELINE else None
    if model == "pspnet101":
        return PSPNet(num_classes, norm, groups, steady_state())
    if model == "resnet101":  # stage 1's network, built as ClassificationTask.build_model builds it
        return resnet(norm, num_classes, groups, steady_state(), arch="resnet101")
    net = torchvision.models.resnet50(num_classes=num_classes)  # weights=None: never downloads
    options = {**(entry.steady_state or {}), **({"norm_batch_size": groups} if groups else {})}
    return convert_norm(net, norm, **options)


def _loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """SegmentationTask's loss for PSPNet's (main, auxiliary) logits, cross-entropy for a classifier's."""
    if isinstance(out, tuple):
        main, aux = out
        loss = F.cross_entropy(main, labels, ignore_index=IGNORE_INDEX)
        return loss + AUX_WEIGHT * F.cross_entropy(aux, labels, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(out, labels)


class _Trainer:
    """A model and its optimizer; ``step`` is one training iteration as the tasks run it (once ``cuda_graph`` is
    set, the next step captures the forward and backward for its shape, later ones replay; with ``compile_mode``
    the forward and backward run through ``torch.compile``, compiled at the first step)."""

    def __init__(
        self, model: nn.Module, compile_mode: str | None = None, precision: str | None = None, centred: bool = True
    ) -> None:
        self.model = model
        self.cuda_graph = False
        self.graph_segments = "whole"  # how a capture splits the model: training_call's ``segments``
        self.precision = precision
        self.optimizer = torch.optim.SGD(model.parameters(), **SGD)
        if centred:  # as the tasks train: centred convs kept centred by SGD
            keep_centred(model, self.optimizer)
        self.compiled = None if compile_mode is None else torch.compile(model, fullgraph=True, mode=compile_mode)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        # bf16-mixed as Lightning runs it: the forward and the loss under autocast, the backward outside.
        with torch.autocast(images.device.type, torch.bfloat16, enabled=self.precision == BF16):
            if self.compiled is not None:
                out = self.compiled(images)
            else:
                out = training_call(self.model, images, self.cuda_graph, self.graph_segments)
            loss = _loss(out, labels)
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

    def __init__(self, model: PSPNet, precision: str | None = None) -> None:
        super().__init__(model, precision=precision)
        self.callback = MABNCallback(NormPolicy(log_every_n_steps=1))
        self.logged: dict[str, float] = {}
        self.trainer = SimpleNamespace(global_step=0, loggers=[SimpleNamespace(log_metrics=self._keep)])
        self.callback.setup(self.trainer, model, "fit")

    def _keep(self, metrics: dict[str, float], step: int) -> None:
        self.logged = metrics

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        # The batch hooks read only ``cuda_graph`` of the LightningModule: this object stands in for it.
        self.callback.on_train_batch_start(self.trainer, self, (images, labels), 0)
        super().step(images, labels)
        self.callback.on_train_batch_end(self.trainer, self, None, (images, labels), 0)
        self.trainer.global_step += 1


def _batch(
    batch: int, crop: int, num_classes: int, device: torch.device, dense: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, crop, crop, generator=gen)
    labels = torch.randint(0, num_classes, (batch, crop, crop) if dense else (batch,), generator=gen)
    return images.to(device), labels.to(device)


def training_step(
    norm: str, device: torch.device, model: str = "pspnet101", batch: int = 2, crop: int = 512
) -> Callable[[], None]:
    """One eager training iteration of ``build(norm, model=model)`` on fixed images, as a function; its first call
    made (momentum buffers created, kernels compiled)."""
    dense = model == "pspnet101"
    num_classes = 19 if dense else 1000
    torch.manual_seed(0)
    trainer = _Trainer(build(norm, num_classes, model).to(device).train())
    step = partial(trainer.step, *_batch(batch, crop, num_classes, device, dense))
    step()
    return step


def _say(line: str) -> None:
    print(line, flush=True)


def row_names(compile_mode: str | None, model: str = "pspnet101") -> tuple[str, ...]:
    """The rows a run measures: every norm eager, for ResNet-50 the plain loops, and with ``compile_mode`` the
    compiled ones."""
    plain = (PLAIN, PLAIN_FORWARD) if model == "resnet50" else ()
    return (*benched(), LOGGED) + plain + (tuple(f"{norm} compiled" for norm in COMPILED) if compile_mode else ())


def run(
    device: torch.device,
    repeats: int = 5,
    crop: int = 512,
    batch: int = 2,
    num_classes: int | None = None,
    cuda_graph: bool = False,
    model: str = "pspnet101",
    norm_batch_size: int | None = NORM_BATCH_SIZE,
    compile_mode: str | None = None,
    precision: str | None = None,
    rows: Sequence[str] | None = None,
    graph_segments: str = "whole",
    say: Callable[[str], None] = _say,
) -> list[StepRow]:
    """Time and peak memory of one training step per norm, all on the same images and labels.

    A first step creates the optimizer's momentum buffers (so the measured steps do not allocate them), at a
    small crop for the eager rows and at the measured one for the compiled rows (it compiles them, and its time
    is reported); then one step per row is measured for peak memory, then ``repeats`` interleaved rounds are
    timed (median reported). With ``cuda_graph`` (CUDA) every eager model's training forward and backward are
    CUDA graphs: the memory step is the one that captures them, so its peak includes the capture's;
    ``graph_segments`` is how each capture splits the model (``training_call``'s ``segments``).
    ``num_classes``: 19 (Cityscapes) for PSPNet-101, 1000 for the ResNets when not given. ``precision``:
    ``bf16-mixed`` runs each forward and loss under bfloat16 autocast, as Lightning's precision of that name.
    ``rows``: the rows to measure, in ``row_names``' order (default: all of them), with the row each is compared
    with (``bn``, ``bn compiled``). ``say``: where the progress lines go (default: printed).
    """
    if precision not in (None, BF16):
        raise ValueError(f"precision must be {BF16!r} or None (float32), got {precision!r}")
    names = row_names(compile_mode, model)
    chosen = names if rows is None else tuple(n for n in names if n in rows)
    unknown = sorted(set(rows or ()) - set(names))
    bases = {"bn compiled" if n.endswith(" compiled") else "bn" for n in chosen}
    if unknown or not chosen or not bases <= set(chosen):
        raise ValueError(f"rows must be some of {', '.join(names)} with the bn row each is compared with, got {rows}")
    if norm_batch_size and batch % norm_batch_size:
        raise ValueError(f"batch must be a multiple of the normalization batch {norm_batch_size}, got {batch}")
    dense = model == "pspnet101"
    num_classes = num_classes or (19 if dense else 1000)
    warmup = _batch(batch, min(crop, 64), num_classes, device, dense)
    images, labels = _batch(batch, crop, num_classes, device, dense)
    trainers: dict[str, Any] = {}
    first_step: dict[str, float] = {}
    for name in chosen:
        torch.manual_seed(0)
        if name in (PLAIN, PLAIN_FORWARD):  # convert_norm's defaults: no ghost batches
            net = build("mabn", num_classes, model, None).to(device).train()
            trainers[name] = _Trainer(net, precision=precision, centred=name == PLAIN)
            trainers[name].step(*warmup)
            trainers[name].cuda_graph = cuda_graph
            trainers[name].graph_segments = graph_segments
            continue
        norm = "mabn" if name == LOGGED else name.removesuffix(" compiled")
        net = build(norm, num_classes, model, norm_batch_size).to(device).train()
        if name == LOGGED:
            trainers[name] = _LoggingTrainer(net, precision)
        elif name.endswith(" compiled"):
            trainers[name] = _Trainer(net, compile_mode, precision)
            started = time.perf_counter()
            trainers[name].step(images, labels)
            first_step[name] = time.perf_counter() - started
            say(f"training step {name}: first step (compiling) {first_step[name]:.1f} s")
            continue
        else:
            trainers[name] = _Trainer(net, precision=precision)
        trainers[name].step(*warmup)
        trainers[name].cuda_graph = cuda_graph  # captured at the measured shape, by the memory step below
        trainers[name].graph_segments = graph_segments
    if LOGGED in trainers and not trainers[LOGGED].logged:
        raise RuntimeError("MABNCallback logged no statistics: the logging row would measure nothing")
    steps = {name: partial(t.step, images, labels) for name, t in trainers.items()}
    peaks = {}
    for name, step in steps.items():
        peaks[name] = peak_memory(step, device)
        say(f"training step {name}: peak memory {peaks[name] / 2**30:.3f} GiB")
    times = median_times(steps, device, repeats, warmup=0)
    results = []
    for name in steps:
        base = "bn compiled" if name in first_step else "bn"
        ratios = (times[name] / times[base], peaks[name] / peaks[base])
        results.append(StepRow(name, times[name], peaks[name], *ratios, first_step.get(name)))
        say(f"training step {name}: {times[name]:.3f} s, {ratios[0]:.3f} x {base}")
    return results


def table(
    rows: list[StepRow],
    repeats: int,
    crop: int,
    batch: int,
    cuda_graph: bool = False,
    model: str = "pspnet101",
    norm_batch_size: int | None = NORM_BATCH_SIZE,
    compile_mode: str | None = None,
    precision: str | None = None,
    graph_segments: str = "whole",
) -> str:
    """The markdown section for ``rows``."""
    graphs = ", forward and backward as CUDA graphs" if cuda_graph else ""
    graphs += f", {precision}" if precision else ""
    size = f"crop {crop}x{crop}" if model == "pspnet101" else f"{crop}x{crop} px"
    groups = f"ghost batches of {norm_batch_size}" if norm_batch_size else "the whole batch"
    lines = [
        f"### {MODELS[model]} training step: batch {batch}, {size}, forward + backward + SGD step{graphs}",
        "",
        f"Median of {repeats} interleaved repeats; peak memory above what was allocated before the step (so weights "
        "and momentum buffers are not counted, gradients are). "
        f"BRN and MABN normalize {groups}; BN is `nn.BatchNorm2d` over the batch.",
        "",
        "| norm | s / step | time / BN | peak memory (GiB) | memory / BN |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.norm} | {r.seconds:.3f} | {r.time_ratio:.3f} | {r.peak_bytes / 2**30:.3f} | {r.mem_ratio:.3f} |"
        )
    lines.append("")
    if any(r.norm == LOGGED for r in rows):
        lines.append(
            f"`{LOGGED}`: MABN with `MABNCallback(NormPolicy(log_every_n_steps=1))` computing its statistics summary "
            "at every step (the default logs every 50 steps)."
        )
    if any(r.norm == PLAIN for r in rows):
        lines.append(
            f'`{PLAIN}`: a user\'s loop, `convert_norm(model, "mabn")` (the whole batch) and `torch.optim.SGD` with '
            f"`mabn.keep_centred(model, optimizer)`; `{PLAIN_FORWARD}`: the same without it, the convs centring "
            "their weights in every forward."
        )
    if cuda_graph:
        lines.append(
            "Every eager model's training forward and backward replay CUDA graphs (`mabn.tasks.cudagraph`). "
            "Peak memory is that of the step which captured the graphs."
            + (" The graphs are captured per stage (`graph_segments: stages`)." if graph_segments == "stages" else "")
        )
    compiled = [r for r in rows if r.first_step_s is not None]
    if compiled:
        firsts = ", ".join(f"{r.norm.removesuffix(' compiled')} {r.first_step_s:.0f} s" for r in compiled)
        lines.append(
            f"`compiled` rows: `torch.compile(model, fullgraph=True, mode={compile_mode!r})` of the forward and "
            f"backward, their ratios to `bn compiled`; the first step, which compiles, took {firsts}."
        )
    return "\n".join(lines).rstrip()
