"""The norms by name, in one registry: ``NORMS`` holds one ``NormEntry`` per norm with every fact the code asks
about it (its layers, whether it takes ghost batches, folds at inference, holds or takes BatchNorm statistics,
synchronizes across devices, and its rows in the cost tables); ``NORM_PRESETS`` names the paper's comparisons and
ablations, each a norm's entry with fixed layer arguments; ``create_norm`` builds one layer of a preset (in the
manner of timm's ``create_norm_layer``), and ``convert_norm`` builds every norm it swaps in through it.
``register_norm`` adds a norm: its layer module and one entry (docs/design.md, "Adding a norm, a decoder, a
dataset")."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .batchrenorm import BatchRenorm2d, GhostBatchNorm2d
from .frozen import FrozenBatchNorm2d
from .mabn import MABN2d


@dataclass(frozen=True)
class NormEntry:
    """Every fact about one norm: how to build its layer and what the conversion, the folding, the backbone
    hand-off, the launch checks and the cost benchmarks ask of it. A preset's ``kind`` names its entry."""

    name: str
    description: str  # of the preset of the same name, which ``register_norm`` adds
    # build(channels, eps=, momentum=, norm_batch_size=, **options): one layer; momentum in the paper's convention
    # (the weight of the old value) or None for the layer's default; an option it does not take is a TypeError
    build: Callable[..., nn.Module]
    # the classes of the layers it builds, each with ``num_features`` channels as BatchNorm2d (or ``num_channels``
    # as GroupNorm): the conversion pairs convs with them, the folding finds them
    layers: tuple[type[nn.Module], ...]
    centre_weights: bool = False  # its preset centres the weights of the convs that feed it (CenConv2d)
    batch: bool = False  # normalizes over the batch, so it takes ghost batches (norm_batch_size)
    # (scale, shift) per channel of a layer in eval mode: a norm linear at inference, which fold_norms folds into
    # the conv before it; None: it keeps per-sample statistics and stays
    inference_affine: Callable[[nn.Module], tuple[Tensor, Tensor]] | None = None
    bn_statistics: bool = False  # its layers hold BatchNorm's running statistics: a stage-1 file of it is a BN one
    # from_bn(bn, layer): set ``layer``'s running statistics from a BatchNorm layer's (``convert_norm`` has copied the
    # affine), where it computes w * (x - mean) / std + b at inference and so takes a BN backbone over exactly;
    # None: it takes BN's affine alone
    from_bn: Callable[[nn.Module, nn.Module], None] | None = None
    sync: bool = False  # normalizes over every device's batch: two or more processes, on GPUs (sync_batchnorm)
    cost_family: str | None = None  # the cost tables' row it is measured under; None: its own name
    # layer options that put it past its warm-ups from the first step, for the cost benchmarks; None: not benched
    steady_state: Mapping[str, Any] | None = None
    # Its layers learn nothing from the data (frozenbn): it starts from BN weights, stage 1 cannot train it, and a
    # segmentation network's decoder and heads are built with this norm instead (their BN layers start untrained).
    head_norm: str | None = None

    @property
    def takes_bn_statistics(self) -> bool:
        """Whether a BN network's running statistics carry over into its layers (``from_bn``)."""
        return self.from_bn is not None

    @property
    def frozen(self) -> bool:
        """Whether its layers take no statistics from the data and train nothing of their own by default."""
        return self.head_norm is not None

    @property
    def linear(self) -> bool:
        """Whether it is linear at inference: ``fold_norms`` folds it into the conv before it."""
        return self.inference_affine is not None

    @property
    def family(self) -> str:
        """The name the cost tables measure it under."""
        return self.cost_family or self.name


@dataclass(frozen=True)
class NormPreset:
    """A named norm: the layer kind (a key of ``NORMS``), fixed layer arguments, and whether convs get centred
    weights."""

    kind: str
    description: str
    layer_kwargs: dict[str, Any] = field(default_factory=dict)
    centre_weights: bool = False


def _no_options(name: str, options: Mapping[str, Any]) -> None:
    if options:
        raise TypeError(f"create_norm: arguments {sorted(options)} do not apply to norm {name!r}")


def _torch_momentum(momentum: float | None) -> float:
    """torch's BatchNorm momentum (the weight of the new value) from the paper's (that of the old)."""
    return 0.1 if momentum is None else 1.0 - momentum


def _managed(cls: type[nn.Module]) -> Callable[..., nn.Module]:
    """The builder of a layer class taking ``eps``, ``norm_batch_size`` and its own options (MABN2d, BRN)."""

    def build(channels: int, *, eps: float, momentum: float | None, norm_batch_size: int | None, **options: Any):
        if momentum is not None:
            options["momentum"] = momentum
        return cls(channels, eps=eps, norm_batch_size=norm_batch_size, **options)

    return build


_ghost_batch_norm = _managed(GhostBatchNorm2d)


def _batch_norm(channels: int, *, eps: float, momentum: float | None, norm_batch_size: int | None, **options: Any):
    """torch's BatchNorm2d over the whole batch; GhostBatchNorm2d over ghost batches."""
    if norm_batch_size:
        return _ghost_batch_norm(channels, eps=eps, momentum=momentum, norm_batch_size=norm_batch_size, **options)
    _no_options("bn", options)
    return nn.BatchNorm2d(channels, eps=eps, momentum=_torch_momentum(momentum))


def _sync_batch_norm(
    channels: int, *, eps: float, momentum: float | None, norm_batch_size: int | None, **options: Any
) -> nn.Module:
    _no_options("syncbn", options)
    if norm_batch_size:
        raise ValueError("create_norm: syncbn normalizes over all devices; norm_batch_size does not apply")
    return nn.SyncBatchNorm(channels, eps=eps, momentum=_torch_momentum(momentum))


def _group_norm(channels: int, *, eps: float, momentum: float | None, norm_batch_size: int | None, **options: Any):
    """32 groups (fewer where they do not divide the channels); no batch, so momentum and ghost batches are moot."""
    _no_options("gn", options)
    return nn.GroupNorm(math.gcd(32, channels), channels, eps=eps)


def _frozen_batch_norm(
    channels: int, *, eps: float, momentum: float | None, norm_batch_size: int | None, **options: Any
) -> nn.Module:
    """Fixed statistics: a momentum or a normalization batch has nothing to act on; ``train_affine`` is its option."""
    train_affine = options.pop("train_affine", False)
    _no_options("frozenbn", options)
    if momentum is not None:
        raise TypeError("create_norm: frozenbn keeps BN's statistics fixed; momentum does not apply")
    return FrozenBatchNorm2d(channels, eps=eps, train_affine=train_affine)


def batch_norm_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """(scale, shift) per channel of torch's BatchNorm in eval mode, in float64."""
    if norm.running_var is None:
        raise ValueError(f"fold_norms: {norm} tracks no running statistics, so it is not linear at inference")
    scale = (norm.running_var.double() + norm.eps).rsqrt()
    weight = norm.weight.double() if norm.weight is not None else torch.ones_like(scale)
    bias = norm.bias.double() if norm.bias is not None else torch.zeros_like(scale)
    return weight * scale, bias - norm.running_mean.double() * weight * scale


def _own_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """A managed norm's own (scale, shift) (``ManagedNorm.inference_affine``)."""
    return norm.inference_affine()


def _bn_affine(norm: nn.Module) -> tuple[Tensor, Tensor]:
    """bn's layers: GhostBatchNorm2d keeps its statistics as BatchRenorm2d does, torch's BatchNorm2d its own way."""
    return _own_affine(norm) if isinstance(norm, GhostBatchNorm2d) else batch_norm_affine(norm)


def copy_bn_statistics(bn: nn.Module, layer: nn.Module) -> None:
    """``from_bn`` of the norms that compute w * (x - mean) / std + b at inference: BN's running mean, and its running
    variance, or where the layer keeps the standard deviation with eps inside (BatchRenorm2d, ghost-batch BN)
    sqrt(var + BN's eps), so that the layer in eval mode computes what the BN layer did."""
    layer.running_mean.copy_(bn.running_mean)
    if hasattr(layer, "running_std"):
        layer.running_std.copy_((bn.running_var.double() + bn.eps).sqrt())
    else:
        layer.running_var.copy_(bn.running_var)


_BRN_STEADY = {"r_ramp": (0, 1), "d_ramp": (0, 1)}  # clipping active from the first step
NORMS: dict[str, NormEntry] = {
    e.name: e
    for e in (
        NormEntry(
            "bn",
            "BatchNorm; GhostBatchNorm2d when norm_batch_size is set",
            _batch_norm,
            (nn.BatchNorm2d, GhostBatchNorm2d),
            batch=True,
            inference_affine=_bn_affine,
            bn_statistics=True,
            from_bn=copy_bn_statistics,
            steady_state={},
        ),
        NormEntry(
            "syncbn",
            "BatchNorm synchronized across devices",
            _sync_batch_norm,
            (nn.SyncBatchNorm,),
            inference_affine=batch_norm_affine,
            bn_statistics=True,
            from_bn=copy_bn_statistics,
            sync=True,
            cost_family="bn",  # BatchNorm's activations; the synchronization costs no memory
        ),
        NormEntry("gn", "GroupNorm, 32 groups", _group_norm, (nn.GroupNorm,), steady_state={}),
        NormEntry(
            "brn",
            "Batch Renormalization",
            _managed(BatchRenorm2d),
            (BatchRenorm2d,),
            batch=True,
            inference_affine=_own_affine,
            from_bn=copy_bn_statistics,
            steady_state=_BRN_STEADY,
        ),
        NormEntry(
            "frozenbn",
            "BatchNorm with BN's statistics and affine fixed (detectron2's FrozenBatchNorm2d); heads with bn",
            _frozen_batch_norm,
            (FrozenBatchNorm2d,),
            inference_affine=batch_norm_affine,
            bn_statistics=True,
            from_bn=copy_bn_statistics,
            cost_family="bn",  # at most BatchNorm's activations: the same layers, one fewer saved statistic
            head_norm="bn",
        ),
        NormEntry(
            "mabn",
            "MABN: SMA statistics in BP, EMA in FP, centred conv weights",
            _managed(MABN2d),
            (MABN2d,),
            centre_weights=True,
            batch=True,
            inference_affine=_own_affine,
            steady_state={"warmup_iters": 1, "renorm_warmup_iters": 1},  # SMA and renormalization from step 1
        ),
    )
}

# The paper's comparisons (Tables 1, 2, 6 and the Cityscapes table) by name: one per norm, as its entry says, and
# the ablations of MABN.
NORM_PRESETS: dict[str, NormPreset] = {
    **{e.name: NormPreset(e.name, e.description, {}, e.centre_weights) for e in NORMS.values()},
    "mabn_nowc": NormPreset("mabn", "MABN without centred conv weights", {}, False),
    "mbn": NormPreset("mabn", "modified BN (x / chi_B, batch statistics)", {"stats": "batch", "renorm": False}, True),
    "mbn_emas": NormPreset("mabn", "modified BN with EMAS in FP", {"stats": "batch", "renorm": True}, True),
    "mabn_smas": NormPreset("mabn", "modified BN, SMAS in FP and BP", {"stats": "sma", "renorm": False}, True),
    "mabn_emas": NormPreset("mabn", "modified BN, EMAS in FP and BP", {"stats": "ema", "renorm": True}, True),
}


def register_norm(entry: NormEntry) -> None:
    """Add the norm ``entry`` and its preset of the same name: from here on every part of the code that takes a
    norm by name takes it. A name already taken is a ValueError naming it."""
    if entry.name in NORMS or entry.name in NORM_PRESETS:
        raise ValueError(f"register_norm: norm {entry.name!r} exists already")
    NORMS[entry.name] = entry
    NORM_PRESETS[entry.name] = NormPreset(entry.name, entry.description, {}, entry.centre_weights)


def unregister_norm(name: str) -> None:
    """Remove the norm ``name`` and every preset of it (the inverse of ``register_norm``)."""
    norm_entry(name)
    del NORMS[name]
    for preset in [p for p, v in NORM_PRESETS.items() if v.kind == name]:
        del NORM_PRESETS[preset]


def check_norm(name: str, also: Iterable[str] = ()) -> NormPreset:
    """The preset ``name``; a ValueError in one line naming the known norms (and the caller's other names
    ``also``) when there is none."""
    if name not in NORM_PRESETS:
        known = ", ".join(sorted({*NORM_PRESETS, *also}))
        raise ValueError(f"unknown norm {name!r}; choose one of {known}")
    return NORM_PRESETS[name]


def norm_entry(name: str) -> NormEntry:
    """The entry of the preset (or norm) ``name``: ``check_norm``'s error when there is none."""
    return NORMS[check_norm(name).kind]


def norms_where(fact: Callable[[NormEntry], Any]) -> tuple[str, ...]:
    """The names of the norms whose entry has ``fact``, in registration order (for checks and messages)."""
    return tuple(name for name, entry in NORMS.items() if fact(entry))


def layer_classes(fact: Callable[[NormEntry], Any] = lambda entry: True) -> tuple[type[nn.Module], ...]:
    """The layer classes of the norms whose entry has ``fact`` (of every norm by default)."""
    return tuple(cls for entry in NORMS.values() if fact(entry) for cls in entry.layers)


def entry_of(layer: nn.Module) -> NormEntry | None:
    """The entry of the norm ``layer`` is a layer of (the first registered whose classes it is an instance of:
    bn's GhostBatchNorm2d before brn's BatchRenorm2d, its base); None for a layer of no norm."""
    return next((entry for entry in NORMS.values() if isinstance(layer, entry.layers)), None)


def create_norm(name: str, channels: int, **options: Any) -> nn.Module:
    """One layer of the norm ``name`` (a key of ``NORM_PRESETS``) over ``channels`` channels.

    ``options`` are the layer's arguments over the preset's; ``momentum`` always in the paper's convention (the
    weight of the old value, converted for torch's BatchNorm), ``eps`` and ``norm_batch_size`` for every batch
    norm. ``bn`` with ``norm_batch_size`` is a ``GhostBatchNorm2d``; ``syncbn`` refuses one (it normalizes over
    all devices). An option that the layer does not take is a TypeError naming it.
    """
    preset = check_norm(name)
    kw = {**preset.layer_kwargs, **options}
    momentum = kw.pop("momentum", None)
    eps = kw.pop("eps", 1e-5)
    norm_batch_size = kw.pop("norm_batch_size", None)
    return NORMS[preset.kind].build(channels, eps=eps, momentum=momentum, norm_batch_size=norm_batch_size, **kw)
