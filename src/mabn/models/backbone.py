"""The stage 1 -> stage 2 hand-off: where a PSPNet encoder's weights come from, checked before they load.

A backbone file is one of (see docs/backbones.md):
- a stage-1 file in ``pretrain/`` (format in pretrain/README.md) of the encoder's own norm;
- a stage-1 file of plain BatchNorm (``bn`` or ``syncbn``, any normalization batch: the norms whose entry holds
  ``bn_statistics``) for a ``bn``, ``brn`` or ``syncbn`` encoder (``takes_bn_statistics``): the paper's Cityscapes
  baselines BN, BRN and SyncBN all start from one BN ResNet-101;
- torchvision's ResNet-101 ``state_dict()`` saved with ``torch.save`` (a BN network), for the same encoders; timm's
  ``resnet50``/``resnet101`` state dicts have torchvision's keys and shapes, and read as one;
- any of these BN networks for a MABN encoder (``mabn`` and its ablation presets), converted so that the encoder
  computes BN's function (``keep_bn_function``): its convs uncentred, BN's mean and scale folded into MABN's affine,
  MABN's statistics seeded from BN's second moment (``converts``). Stage 1's warm start converts a BN network for
  a centring MABN norm (``warm_norm``) with centred convs instead (``seed_from_bn``), since it re-pretrains.
Any other pairing is refused with the reason, before training (``check_backbone``) and at loading. So is a file
of another ResNet depth than the encoder's (the ``arch`` model option, default resnet101), and any file for an
encoder that is not a ResNet (stage 2 takes any smp encoder; stage 1 trains ResNets only).
"""

from __future__ import annotations

import copy
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..norm import NORM_PRESETS, CenConv2d, MABN2d, check_norm, norm_entry
from ..norm.factory import entry_of, norms_where
from ..run import file_identity, load_weights_file, write_atomic
from .resnet import ARCHS, DEFAULT_ARCH, check_arch

FORMAT = "mabn-backbone"
VERSION = 1
STAGE1, TORCHVISION = "stage-1", "torchvision"  # the two sources: a file of stage 1, a torchvision state dict
LAYERS = ("layer1", "layer2", "layer3", "layer4")
# Blocks per layer of each ``arch``, and the archs of basic blocks (two convs) rather than bottlenecks (three).
ARCH_BLOCKS = dict(zip(ARCHS, [(2, 2, 2, 2), (3, 4, 6, 3), (3, 4, 6, 3), (3, 4, 23, 3), (3, 8, 36, 3)]))
BASIC_BLOCKS = ("resnet18", "resnet34")
BN_EPS = 1e-5  # torch's BatchNorm2d default: torchvision's and this project's unless norm_options set eps
CONVERTED = (
    "converted to MABN keeping BN's function: the encoder's convs uncentred (centring changes what a conv computes), "
    "BN's mean and scale folded into MABN's affine, MABN's statistics seeded from BN's second moment (var + mean^2); "
    "a stage-1 MABN backbone (make pretrain NORM=mabn) starts centred convs"
)


class BackboneError(ConfigError):
    """A backbone file that is missing, malformed, or does not fit the requested model."""


def arch_title(arch: str) -> str:
    """How the docs and messages name a ResNet: resnet101 -> ResNet-101."""
    return f"ResNet-{arch.removeprefix('resnet')}"


@dataclass(frozen=True)
class Backbone:
    """A backbone file as read: its weights, the norm it was trained with and how its convs compute."""

    path: Path
    source: str  # STAGE1 or TORCHVISION
    norm: str
    centralized: bool
    eps: float  # the eps of its BatchNorm layers (where the source has them)
    state_dict: dict[str, torch.Tensor]
    info: dict[str, Any]  # the stage-1 payload without weights (empty for torchvision)
    arch: str = DEFAULT_ARCH  # the ResNet the weights belong to
    # The classifier (``fc.*``) of a torchvision state dict, which an encoder does not load and a stage-1 warm start
    # (``mabn.models.warm_start``) does; empty for a stage-1 file, which holds none.
    head: dict[str, torch.Tensor] = field(default_factory=dict)

    def describe(self) -> str:
        """What the file is, for the line stage 2 logs and for errors."""
        if self.source == TORCHVISION:
            return f"torchvision {arch_title(self.arch)} state dict (BN)"
        top1 = self.info.get("val_top1")
        batch = (self.info.get("config") or {}).get("model", {}).get("norm_batch_size", "n/a")
        shown = "n/a" if top1 is None else f"{top1:.3f}"
        return f"stage-1 backbone, norm {self.norm} at normalization batch {batch or 'per device'}, val top-1 {shown}"


def backbone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A ResNet's weights under torchvision's keys, without the classifier (``fc``)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if not k.startswith("fc.")}


def save_backbone(
    path: str | Path,
    model: nn.Module,
    norm: str,
    config: dict[str, Any],
    val_top1: float | None,
    arch: str = DEFAULT_ARCH,
) -> Path:
    """Write ``model``'s backbone (a ResNet ``arch``) with what stage 2 needs to trust it."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "arch": check_arch(arch),
        "norm": norm,
        "centralized": check_norm(norm).centre_weights,
        "state_dict": backbone_state(model),
        "config": config,
        "val_top1": val_top1,
    }
    return write_atomic(path, lambda tmp: torch.save(payload, tmp))


# The payloads of the last files read, by (device, inode, size, modification time): a file written anew (an atomic
# write gives a new inode) or rewritten in place is read again; another name of the file (a link) is not.
_PAYLOADS: dict[tuple[int, ...], Any] = {}
_KEPT_PAYLOADS = 4


def _payload(path: Path) -> Any:
    """``torch.load`` of the backbone file at ``path``, once per unchanged file (``read_backbone``)."""
    if not path.is_file():
        return load_weights_file(path, "backbone file", BackboneError)  # the error that names the missing file
    stamp = file_identity(path)
    if stamp not in _PAYLOADS:
        mapped = zipfile.is_zipfile(path)  # torch.load maps zip archives only
        payload = load_weights_file(path, "backbone file", BackboneError, mmap=mapped)
        while len(_PAYLOADS) >= _KEPT_PAYLOADS:
            _PAYLOADS.pop(next(iter(_PAYLOADS)))
        _PAYLOADS[stamp] = payload
    return _PAYLOADS[stamp]


def _is_torchvision(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and "format" not in payload
        and "conv1.weight" in payload
        and all(isinstance(v, torch.Tensor) for v in payload.values())
    )


def _check_blocks(path: Path, state: dict[str, torch.Tensor], arch: str) -> None:
    """torchvision ResNets share their keys up to the block counts and kinds: refuse another depth by name, with
    both ways out: the weights of ``arch``, or the depth of the file's weights where it is one of ``ARCHS``."""
    counts = tuple(len({k.split(".")[1] for k in state if k.startswith(f"{layer}.")}) for layer in LAYERS)
    bottleneck = "layer1.0.conv3.weight" in state
    depth = [a for a, b in ARCH_BLOCKS.items() if b == counts and (a not in BASIC_BLOCKS) == bottleneck]
    save = f"save torchvision.models.{arch}'s state_dict()"
    if depth:
        save += f", or train the file's {arch_title(depth[0])}: --model.init_args.arch {depth[0]}"
    for layer, blocks in zip(LAYERS, ARCH_BLOCKS[arch]):
        found = len({k.split(".")[1] for k in state if k.startswith(f"{layer}.")})
        if found != blocks:
            raise BackboneError(
                f"{path} is a torchvision ResNet state dict with {found} blocks in {layer}, {arch_title(arch)} has "
                f"{blocks}: {save}"
            )
    kind = {True: "bottleneck", False: "basic"}
    if bottleneck != (arch not in BASIC_BLOCKS):
        raise BackboneError(
            f"{path} is a torchvision ResNet state dict of {kind[bottleneck]} blocks, {arch_title(arch)} has "
            f"{kind[not bottleneck]} blocks: {save}"
        )


def _stage1_eps(payload: dict[str, Any]) -> float:
    options = ((payload.get("config") or {}).get("model") or {}).get("norm_options") or {}
    return float(options.get(check_norm(payload["norm"]).kind, {}).get("eps", BN_EPS))


def read_backbone(path: str | Path, arch: str = DEFAULT_ARCH) -> Backbone:
    """Read a stage-1 file or a torchvision state dict of the ResNet ``arch``; ``BackboneError`` for anything else.
    (A stage-1 file records its own ``arch``, which ``check_backbone`` compares.)

    A run checks its backbone before it plans and loads it after: a file read before in this process and unchanged
    since (the same device, inode, size and modification time, under any of its names) is not read again. Its
    weights are mapped from the file, not copied into memory, where it is a zip archive (every ``torch.save`` since
    torch 1.6); callers only read them."""
    path = Path(path)
    payload = _payload(path)
    if _is_torchvision(payload):
        state = {k: v for k, v in payload.items() if not k.startswith("fc.")}
        _check_blocks(path, state, check_arch(arch))
        head = {k: v for k, v in payload.items() if k.startswith("fc.")}
        return Backbone(path, TORCHVISION, "bn", False, BN_EPS, state, {}, arch, head)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise BackboneError(
            f"{path} is neither a {FORMAT} file (pretrain/README.md) nor a torchvision or timm ResNet state dict"
        )
    if payload.get("version") != VERSION:
        raise BackboneError(f"{path} has format version {payload.get('version')}, this code reads {VERSION}")
    try:
        check_norm(payload.get("norm"))
    except ValueError as err:
        raise BackboneError(f"{path} names an {err}") from None
    if payload.get("arch") not in ARCH_BLOCKS:
        raise BackboneError(f"{path} names an unknown arch {payload.get('arch')!r}")
    info = {k: v for k, v in payload.items() if k != "state_dict"}
    norm, centralized, state = payload["norm"], bool(payload["centralized"]), payload["state_dict"]
    return Backbone(path, STAGE1, norm, centralized, _stage1_eps(payload), state, info, payload["arch"])


def warm_norm(norm: str) -> bool:
    """Whether ``norm`` is a centring MABN preset, the norms a BN network is converted to (``mabn``, ``mbn``, ...)."""
    preset = NORM_PRESETS.get(norm)
    return preset is not None and preset.kind == "mabn" and preset.centre_weights


def mabn_norm(norm: str) -> bool:
    """Whether ``norm`` is a preset of MABN2d layers (``mabn``, ``mabn_nowc``, ``mbn``, ...)."""
    preset = NORM_PRESETS.get(norm)
    return preset is not None and preset.kind == "mabn"


def converts(backbone: Backbone, norm: str) -> bool:
    """Whether ``backbone`` starts an encoder of ``norm`` converted rather than as it is: a BN network (torchvision's,
    or a stage-1 file of a norm that holds BN statistics) for a MABN norm (``keep_bn_function``), whose encoder is
    then built with uncentred convs (``centre_encoder``)."""
    return backbone.norm != norm and norm_entry(backbone.norm).bn_statistics and mabn_norm(norm)


def conversion_line(backbone: Backbone) -> str:
    """The line a run and its dry run say when ``backbone`` is converted to MABN."""
    return f"backbone: {backbone.path} ({backbone.describe()}), {CONVERTED}"


def _refusal(backbone: Backbone, norm: str) -> str | None:
    """Why ``backbone`` cannot start an encoder built with ``norm`` and what would, or None when it can."""
    target, source = norm_entry(norm), norm_entry(backbone.norm)
    if backbone.norm == norm or converts(backbone, norm):
        return None
    if check_norm(norm).centre_weights and not backbone.centralized:
        return (
            f"{norm} centres each conv's weights, which changes what every conv computes, so uncentred weights do "
            f"not carry over; pre-train with make pretrain NORM={norm}, or give BN weights (converted to {norm})"
        )
    if source.bn_statistics and target.takes_bn_statistics:
        return None
    if source.bn_statistics and not target.batch:
        return (
            f"{target.layers[0].__name__} normalizes each sample by its own statistics, so BN's running statistics "
            f"and affine do not give the same function; pre-train with make pretrain NORM={norm}"
        )
    fits = ", ".join(norms_where(lambda entry: entry.takes_bn_statistics))
    converted = ", ".join(name for name in NORM_PRESETS if mabn_norm(name))
    return (
        f"pre-train with that norm or pick a matching backbone (a BN backbone fits {fits}, and is converted for "
        f"{converted})"
    )


def check_fits(backbone: Backbone, norm: str) -> None:
    """Refuse a backbone that cannot start an encoder built with ``norm``, naming both norms and why."""
    reason = _refusal(backbone, norm)
    if reason:
        raise BackboneError(
            f"norm mismatch: backbone {backbone.path} was pre-trained with norm {backbone.norm!r} "
            f"({'a torchvision state dict' if backbone.source == TORCHVISION else 'a stage-1 file'}), "
            f"but the model asks for norm {norm!r}: {reason}"
        )


def check_backbone(path: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> Backbone:
    """The backbone at ``path``, checked to fit an encoder of the ResNet ``arch`` built with ``norm`` (weights not
    yet loaded). Backbone files hold ResNets only: an encoder of another ``arch`` is refused before reading."""
    if arch not in ARCHS:
        raise BackboneError(
            f"backbone {path} cannot start encoder {arch!r}: backbone files hold ResNets ({', '.join(ARCHS)}); "
            "train this encoder from random weights (--backbone none) or pick a ResNet arch"
        )
    backbone = read_backbone(path, arch)
    if backbone.arch != arch:
        raise BackboneError(
            f"arch mismatch: backbone {backbone.path} is a stage-1 {backbone.arch} file, but the model's encoder is "
            f"{arch}: set the model's arch to {backbone.arch} or pre-train with arch {arch}"
        )
    check_fits(backbone, norm)
    return backbone


def load_backbone(path: str | Path, norm: str) -> dict[str, Any]:
    """Read a stage-1 file trained with exactly ``norm``; returns its payload (weights under ``state_dict``)."""
    backbone = read_backbone(path)
    if backbone.source != STAGE1 or backbone.norm != norm:
        raise BackboneError(f"{backbone.path} is not a stage-1 backbone of norm {norm!r}: {backbone.describe()}")
    return {**backbone.info, "state_dict": dict(backbone.state_dict)}  # a dict of its own: the read is shared


_STATISTICS = ("running_mean", "running_var", "running_std", "num_batches_tracked")  # a norm layer's buffers of them


def adapt_statistics(state: dict[str, torch.Tensor], encoder: nn.Module, eps: float) -> dict[str, torch.Tensor]:
    """``state`` with each norm's running statistics in the form ``encoder``'s layer keeps them, as the layer's norm
    takes BN's (``NormEntry.from_bn``): the source layer's mean and variance (``bn_variance``: a source that keeps the
    std with its ``eps`` inside gives std^2 - eps) go through a BatchNorm2d of the source's ``eps`` into the layer,
    whose buffers replace the source's, so the eval output is the source's. BatchNorm keeps ``running_var``;
    BatchRenorm2d and ghost-batch BN keep sqrt(running_var + eps); FrozenBatchNorm2d keeps BatchNorm's buffers
    without ``num_batches_tracked``; a registered norm keeps what its ``from_bn`` writes. A source already in the
    layer's form loads as it is; every converted layer's ``num_batches_tracked`` starts at 0 (BRN's clipping ramps
    have not begun; BN with a momentum does not read it).
    """
    out = dict(state)
    for name, layer in encoder.named_modules():
        entry = entry_of(layer)
        prefix = f"{name}." if name else ""
        has = {key for key in _STATISTICS if f"{prefix}{key}" in out}
        keeps = {key for key, _ in layer.named_buffers(recurse=False)} & set(_STATISTICS)
        spread = has & {"running_var", "running_std"}
        if entry is None or entry.from_bn is None or "running_mean" not in has or not spread or has == keeps:
            continue  # a norm that takes no BN statistics, a source in its form or without them (the key check)
        bn = nn.BatchNorm2d(layer.num_features, eps=eps)
        target = copy.deepcopy(layer)  # the encoder itself is loaded only once every key fits
        with torch.no_grad():
            bn.running_mean.copy_(_take(out, f"{prefix}running_mean", bn.running_mean))
            bn.running_var.copy_(bn_variance(out, prefix, eps, bn.running_var.double()))
            entry.from_bn(bn, target)
        for key in _STATISTICS:
            out.pop(f"{prefix}{key}", None)
        # The layer's statistics as it keeps them; its other buffers (FrozenBatchNorm2d's affine) stay the source's.
        for key, buffer in target.named_buffers(recurse=False):
            if f"{prefix}{key}" not in out:
                out[f"{prefix}{key}"] = (
                    torch.zeros_like(buffer) if key == "num_batches_tracked" else buffer.detach().clone()
                )
    return out


def key_differences(
    expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]
) -> tuple[list[str], list[str], list[str]]:
    """How a state dict ``given`` fails to fit ``expected``: its missing, unexpected and mis-shaped keys, sorted."""
    missing, unexpected = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    shaped = sorted(k for k in expected.keys() & given.keys() if expected[k].shape != given[k].shape)
    return missing, unexpected, shaped


def _key_mismatch(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """The first missing, unexpected or mis-shaped key with the counts, or None when the two fit."""
    missing, unexpected, shaped = key_differences(expected, given)
    if missing:
        return f"{len(missing)} encoder key(s) missing from the file, e.g. {missing[0]}"
    if unexpected:
        return f"{len(unexpected)} key(s) the encoder does not have, e.g. {unexpected[0]}"
    if shaped:
        k = shaped[0]
        shapes = f"{tuple(given[k].shape)} for {tuple(expected[k].shape)}"
        return f"{len(shaped)} key(s) of another shape, e.g. {k}: {shapes}"
    return None


def _take(state: Mapping[str, Tensor], key: str, like: Tensor) -> Tensor:
    """``state[key]`` in ``like``'s dtype; ``BackboneError`` when it is missing or of another shape."""
    if key not in state:
        raise BackboneError(f"the BN network has no {key}: it is not the network being warm-started")
    value = state[key]
    if value.shape != like.shape:
        raise BackboneError(f"the BN network's {key} is {tuple(value.shape)}, the network's {tuple(like.shape)}")
    return value.to(like.dtype)


def bn_variance(state: Mapping[str, Tensor], prefix: str, eps: float, like: Tensor) -> Tensor:
    """The BN layer ``prefix``'s running variance in ``like``'s dtype: ``running_var`` (BatchNorm), or
    ``running_std`` ** 2 - ``eps`` (BatchRenorm2d and ghost-batch BN keep the std with the source's eps inside)."""
    if f"{prefix}running_var" not in state and f"{prefix}running_std" in state:
        std = _take(state, f"{prefix}running_std", like).double()
        return (std.square() - eps).clamp_min(0.0).to(like.dtype)  # clamp: a std rounded below sqrt(eps)
    return _take(state, f"{prefix}running_var", like)


def _bn_layer(state: Mapping[str, Tensor], prefix: str, eps: float, like: Tensor) -> tuple[Tensor, ...]:
    """The BN layer ``prefix``'s (weight, bias, running mean, running variance) in float64."""
    var = bn_variance(state, prefix, eps, like).double()
    weight, bias = (_take(state, f"{prefix}{k}", like).double() for k in ("weight", "bias"))
    return weight, bias, _take(state, f"{prefix}running_mean", like).double(), var


def _seed_stream(module: MABN2d, second_moment: Tensor) -> None:
    """MABN's EMA and chi^2 stream from a BN layer's statistics; psi's streams start empty."""
    module.reset_stream(reset_ema=True)
    module.running_var.copy_(second_moment)
    module.buffer_x2.copy_(second_moment.expand_as(module.buffer_x2))
    module.count_x2.fill_(module.buffer_size)  # the SMA counts as full: moving statistics from step 1


def _seeded_variance(module: MABN2d, state: Mapping[str, Tensor], prefix: str, eps: float) -> None:
    """``seed_from_bn``'s MABN layer: BN's affine as it is, BN's running variance as the second moment."""
    weight, bias, _, var = _bn_layer(state, prefix, eps, module.running_var)
    module.weight.copy_(weight)
    module.bias.copy_(bias)
    _seed_stream(module, var.to(module.running_var.dtype))


def _kept_function(module: MABN2d, state: Mapping[str, Tensor], prefix: str, eps: float) -> None:
    """``keep_bn_function``'s MABN layer. BN computes g (x - mu) / s + b with s = sqrt(var + eps); MABN in eval
    w x / sqrt(m + eps') + b'. With m = var + mu^2, the second moment E[x^2] of BN's input that MABN's statistics
    measure (so its EMA does not drift off the seed when training starts), w = g sqrt(m + eps') / s and
    b' = b - g mu / s the two are one function."""
    weight, bias, mean, var = _bn_layer(state, prefix, eps, module.running_var)
    second = var + mean.square()
    scale = weight / (var + eps).sqrt()
    module.weight.copy_(scale * (second + module.eps).sqrt())
    module.bias.copy_(bias - scale * mean)
    _seed_stream(module, second.to(module.running_var.dtype))


@torch.no_grad()
def _seed(model: nn.Module, state: Mapping[str, Tensor], eps: float, norm: Callable[..., None]) -> list[str]:
    """Copy the BN network ``state`` into ``model``, each MABN2d by ``norm``, the convs and the classifier as they
    are (a CenConv2d's weights centred: the filter it convolves with)."""
    notes = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, MABN2d):
            norm(module, state, prefix, eps)
        elif isinstance(module, nn.Conv2d):
            weight = _take(state, f"{prefix}weight", module.weight)
            if isinstance(module, CenConv2d):
                weight = weight - weight.mean(dim=(1, 2, 3), keepdim=True)
            module.weight.copy_(weight)
            if module.bias is not None:
                module.bias.copy_(_take(state, f"{prefix}bias", module.bias))
        elif isinstance(module, nn.Linear):
            key = f"{prefix}weight"
            if key in state and state[key].shape == module.weight.shape:
                module.weight.copy_(state[key])
                module.bias.copy_(_take(state, f"{prefix}bias", module.bias))
            else:
                found = f"of shape {tuple(state[key].shape)}" if key in state else "none"
                notes.append(
                    f"classifier {name or 'fc'}: the file's is {found}, the network's {tuple(module.weight.shape)}; "
                    "it starts from random weights"
                )
    return notes


def seed_from_bn(model: nn.Module, state: Mapping[str, Tensor], eps: float) -> list[str]:
    """Copy the BN network ``state`` (its layers' keys as ``model``'s; BN's ``eps``) into ``model``, whose norms are
    MABN2d and whose convs feeding them are centred: stage 1's warm start (``mabn.models.warm_start``), which
    re-pretrains the network, so the function it starts from need not be BN's. Returns what was not copied, as
    lines to report (a classifier of another shape)."""
    return _seed(model, state, eps, _seeded_variance)


def keep_bn_function(model: nn.Module, state: Mapping[str, Tensor], eps: float) -> list[str]:
    """Copy the BN network ``state`` into ``model``, whose norms are MABN2d after plain (uncentred) convs, so that
    ``model`` in eval computes what the BN network computes: each BN's running mean folded into MABN's bias, its
    scale into MABN's weight, MABN's statistics seeded from BN's second moment, var + mean^2 (``_kept_function``).
    Stage 2's start from BN weights. A centred conv changes what it computes by its filter's mean times the input's
    window sum, which no per-channel affine undoes, so centred convs are refused."""
    centred = next((name for name, m in model.named_modules() if isinstance(m, CenConv2d)), None)
    if centred is not None:
        raise BackboneError(f"{centred} is a centred conv: BN's function needs the convs as BN trained them")
    return _seed(model, state, eps, _kept_function)


def load_backbone_into(encoder: nn.Module, path: str | Path, norm: str, arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """Load a backbone file into a ResNet encoder (``arch``, default ResNet-101) built with ``norm``, with strict
    key checking; a BN network for a MABN ``norm`` is converted (``converts``), into an encoder of uncentred convs.

    Returns what to report: ``norm`` and ``source`` of the file, ``description``, ``converted`` (with the line that
    says so, ``conversion``), and for stage-1 files the payload without weights (``val_top1``, ``config``, ...).
    """
    backbone = check_backbone(path, norm, arch)
    info = {**backbone.info, "norm": backbone.norm, "source": backbone.source, "description": backbone.describe()}
    if converts(backbone, norm):
        try:
            keep_bn_function(encoder, backbone.state_dict, backbone.eps)
        except BackboneError as err:
            raise BackboneError(f"{backbone.path} does not fit the {norm} {arch_title(arch)} encoder: {err}") from err
        return {**info, "converted": True, "conversion": conversion_line(backbone)}
    state = adapt_statistics(backbone.state_dict, encoder, backbone.eps)
    mismatch = _key_mismatch(encoder.state_dict(), state)
    if mismatch:
        raise BackboneError(f"{backbone.path} does not fit the {norm} {arch_title(arch)} encoder: {mismatch}")
    encoder.load_state_dict(state, strict=True)
    return {**info, "converted": False}
