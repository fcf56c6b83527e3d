"""Stage 2 on any decoder: the paper's PSPNet, or a decoder of segmentation_models_pytorch (smp) on the same ResNet
encoder, with one norm everywhere (``build_segmentation_model``; the list, strides and choices: docs/models.md).

Every network has the parts PSPNet has, under the names the stage-2 config, the norm policy's groups and the
optimizer's head group already use:

- ``encoder``: smp's encoder ``arch``, a ResNet by default (random weights, never downloaded; the stage-1 backbone
  is loaded separately, into this module, as for PSPNet), dilated to the decoder's output stride;
- ``classifier``: everything newly initialized that produces the main logits; for an smp decoder its
  ``decoder`` and its ``head`` (smp's segmentation head: the last conv and the upsampling to the input size);
- ``aux``: the auxiliary head on layer3 (PSPNet's: 3x3 conv-norm-ReLU 256, dropout, 1x1), for the decoders that
  take one (``Decoder.aux``); absent otherwise.

So ``heads()`` (the parameters at ``head_lr_mult`` x the lr) is ``classifier`` and ``aux``, and the config's heads
group ``[model.ppm, model.classifier, model.aux]`` covers every decoder's norms (``model.ppm`` is PSPNet's only).
PSPNet itself is built unchanged (``mabn.models.PSPNet``), so its checkpoints keep their keys.

Every BatchNorm2d that smp builds becomes the requested norm through the same ``convert_norm`` as the encoder's,
after two rewrites that make smp's layers fit the conversion and the folding: FPN's GroupNorm layers become
BatchNorm2d first (so FPN's decoder follows the chosen norm too; ``gn`` gives back smp's 32 groups), and
DeepLabV3+'s separable convs (a depthwise and a pointwise conv in a Sequential of their own) are spliced into the
Sequential that holds their norm, so the pointwise conv sits right before the norm: MABN centres it, and
``fold_norms`` folds the norm into it. UPerNet's LayerNorm2d on the encoder's features stays as smp builds it: it
normalizes each pixel over its channels, has no batch statistics and no conv right before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from segmentation_models_pytorch.decoders.deeplabv3.decoder import SeparableConv2d
from torch import Tensor, nn

from ..errors import ConfigError
from .pspnet import PSPNet, convert_network_norms, init_head, seg_head, undilatable
from .resnet import DEFAULT_ARCH, check_encoder


@dataclass(frozen=True)
class Decoder:
    """A stage-2 decoder: the smp model it comes from, its output strides, aux head and dropout argument."""

    smp_model: str | None  # the smp class whose decoder and segmentation head are taken; None: this project's PSPNet
    output_strides: tuple[int, ...]  # the encoder's output strides it takes, the default first
    aux: bool  # whether an auxiliary head on layer3 is trained with it
    dropout_arg: str | None = None  # the smp argument that takes the ``dropout`` option, if smp has one
    title: str = ""


DECODERS: dict[str, Decoder] = {
    "pspnet": Decoder(None, (8,), True, title="PSPNet (the paper's; this project's heads)"),
    "deeplabv3": Decoder("DeepLabV3", (8, 16), True, "decoder_aspp_dropout", "DeepLabV3"),
    "deeplabv3plus": Decoder("DeepLabV3Plus", (16, 8), True, "decoder_aspp_dropout", "DeepLabV3+"),
    "upernet": Decoder("UPerNet", (32,), True, title="UPerNet"),
    "fpn": Decoder("FPN", (32,), False, "decoder_dropout", "FPN"),
    "unet": Decoder("Unet", (32,), False, title="U-Net"),
    "unetplusplus": Decoder("UnetPlusPlus", (32,), False, title="U-Net++"),
    "manet": Decoder("MAnet", (32,), False, title="MA-Net"),
    "segformer": Decoder("Segformer", (32,), False, title="SegFormer's MLP"),
}
DEFAULT_DECODER = "pspnet"


def resolve_decoder(decoder: str, output_stride: int | None = None) -> tuple[Decoder, int]:
    """The decoder named ``decoder`` and the output stride it runs at (``output_stride``, or its default); a
    ValueError naming the choices for an unknown decoder or a stride it does not take."""
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    spec = DECODERS[decoder]
    if output_stride is None:
        return spec, spec.output_strides[0]
    if output_stride not in spec.output_strides:
        allowed = " or ".join(map(str, sorted(spec.output_strides)))
        raise ValueError(f"decoder {decoder} takes output stride {allowed}, not {output_stride}")
    return spec, output_stride


def _splice_separable_convs(model: nn.Module) -> None:
    """Replace each smp SeparableConv2d in a Sequential by its depthwise and pointwise convs, in place, so the
    pointwise conv is registered right before the norm it feeds. The same computation: a Sequential applies its
    children in order either way."""
    for parent in list(model.modules()):
        if not isinstance(parent, nn.Sequential) or not any(isinstance(c, SeparableConv2d) for c in parent):
            continue
        if type(parent).forward is not nn.Sequential.forward:
            raise TypeError(f"{type(parent).__name__} has its own forward: its separable convs cannot be spliced")
        children = [m for child in parent for m in (child if isinstance(child, SeparableConv2d) else [child])]
        for name, _ in list(parent.named_children()):
            delattr(parent, name)
        for i, child in enumerate(children):
            parent.add_module(str(i), child)


def _group_norms_to_batch_norms(model: nn.Module) -> None:
    """Replace every GroupNorm by a BatchNorm2d of its channels (gamma and beta kept), for ``convert_norm``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.GroupNorm):
                bn = nn.BatchNorm2d(child.num_channels, eps=child.eps)
                with torch.no_grad():
                    bn.weight.copy_(child.weight)
                    bn.bias.copy_(child.bias)
                setattr(parent, name, bn)


class DecoderHead(nn.Module):
    """An smp decoder and its segmentation head: encoder features -> logits at the (padded) input size."""

    def __init__(self, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = head

    def forward(self, features: list[Tensor]) -> Tensor:
        return self.head(self.decoder(features))


class DecoderNet(nn.Module):
    """An smp decoder on the smp encoder ``arch`` at ``output_stride``, every norm set to ``norm``.

    Training returns (main logits, auxiliary logits) for a decoder with an auxiliary head and the main logits
    alone otherwise; eval returns the main logits. Logits are at the input's size: an input whose sides are not
    multiples of the output stride is zero-padded at the bottom and right, and the logits are cropped back.
    """

    def __init__(
        self,
        decoder: str,
        num_classes: int = 19,
        norm: str = "mabn",
        norm_batch_size: int | None = None,
        norm_options: dict[str, dict[str, Any]] | None = None,
        dropout: float = 0.1,
        arch: str = DEFAULT_ARCH,
        output_stride: int | None = None,
        head_norm: str | None = None,
        centre_encoder: bool | None = None,
    ) -> None:
        super().__init__()
        spec, stride = resolve_decoder(decoder, output_stride)
        if spec.smp_model is None:
            raise ValueError(f"decoder {decoder} is not an smp decoder: build it with build_segmentation_model")
        kwargs: dict[str, Any] = {"encoder_name": check_encoder(arch), "encoder_weights": None, "classes": num_classes}
        if len(spec.output_strides) > 1:
            kwargs["encoder_output_stride"] = stride
        if spec.dropout_arg is not None:
            kwargs[spec.dropout_arg] = dropout
        # smp builds, and initializes, the encoder, the decoder and the head; weights=None: nothing is downloaded.
        try:
            built = getattr(smp, spec.smp_model)(**kwargs)
        except (ValueError, AssertionError) as error:  # timm asserts its output strides
            if stride == 32:  # no dilation asked: smp refused the pair (UnetPlusPlus takes no mit_b* encoder)
                raise ConfigError(
                    f"decoder {decoder} does not take encoder {arch!r} (smp: {error or type(error).__name__}): pick "
                    "another decoder or another encoder (docs/models.md, Encoders)"
                ) from None
            raise undilatable(arch, stride, error) from None
        self.decoder_name, self.output_stride = decoder, stride
        self.size_divisor = stride  # the smp decoders' upsamplings by 2, 4, 8 meet the skips' sizes then
        self.encoder = built.encoder
        head = built.segmentation_head
        init_head(head, next(m for m in head.modules() if isinstance(m, nn.Conv2d)))  # smp's xavier start is ~10x
        self.classifier = DecoderHead(built.decoder, head)
        if spec.aux:
            self.aux = seg_head(self.encoder.out_channels[-2], 256, num_classes, dropout)
        else:
            self.aux = None
        _splice_separable_convs(self.classifier)
        _group_norms_to_batch_norms(self.classifier)
        convert_network_norms(self, norm, norm_batch_size, norm_options, head_norm, centre_encoder)

    def heads(self) -> nn.ModuleList:
        """The newly initialized parts, trained at the higher learning rate: the decoder, its head, the aux head."""
        return nn.ModuleList([m for m in (self.classifier, self.aux) if m is not None])

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        height, width = x.shape[-2:]
        d = self.size_divisor
        x = F.pad(x, (0, (d - width % d) % d, 0, (d - height % d) % d))
        features = self.encoder(x)
        out = self.classifier(features)[..., :height, :width]
        if not self.training or self.aux is None:
            return out
        aux = F.interpolate(self.aux(features[-2]), x.shape[-2:], mode="bilinear", align_corners=False)
        return out, aux[..., :height, :width]


def build_segmentation_model(
    decoder: str = DEFAULT_DECODER,
    num_classes: int = 19,
    norm: str = "mabn",
    norm_batch_size: int | None = None,
    norm_options: dict[str, dict[str, Any]] | None = None,
    arch: str = DEFAULT_ARCH,
    dropout: float = 0.1,
    output_stride: int | None = None,
    head_norm: str | None = None,
    centre_encoder: bool | None = None,
) -> nn.Module:
    """The stage-2 network: ``decoder`` (one of ``DECODERS``) on the smp encoder ``arch`` at ``output_stride`` (default:
    the decoder's), with every norm, encoder and decoder alike, set to ``norm``, but for ``head_norm`` and
    ``centre_encoder`` (``convert_network_norms``). ``pspnet`` is ``PSPNet`` unchanged; the others are
    ``DecoderNet``."""
    spec, stride = resolve_decoder(decoder, output_stride)
    norms = {"head_norm": head_norm, "centre_encoder": centre_encoder}
    if spec.smp_model is None:
        return PSPNet(num_classes, norm, norm_batch_size, norm_options, dropout=dropout, arch=arch, **norms)
    return DecoderNet(decoder, num_classes, norm, norm_batch_size, norm_options, dropout, arch, stride, **norms)
