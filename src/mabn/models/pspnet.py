"""PSPNet-101 as in the paper: dilated ResNet-101 (output stride 8), pyramid pooling, auxiliary head.

smp's own ``PSPNet`` is a different network (encoder depth 3, no auxiliary segmentation head), so this
composes smp's ResNet-101 encoder with the heads of Zhao et al. (2017) / hszhao/semseg. ``arch`` picks another
smp encoder (``check_encoder``: a ResNet of ``mabn.models.ARCHS``, ResNeXt, EfficientNet, ``tu-`` timm models...)
that smp can dilate to output stride 8; the heads follow its channel counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..norm import convert_norm, norm_entry
from .resnet import DEFAULT_ARCH, check_encoder, norm_kwargs_for


def undilatable(arch: str, output_stride: int, error: Exception) -> ConfigError:
    """The one error for an encoder that smp cannot run at ``output_stride`` (``error``: smp's or timm's reason): a
    choice of the user's, one line naming the way out."""
    reason = str(error) or type(error).__name__
    return ConfigError(
        f"encoder {arch!r} does not run at output stride {output_stride} ({reason}): pick a decoder at output "
        "stride 32 or another encoder (docs/models.md, Encoders)"
    )


def convert_network_norms(
    net: nn.Module,
    norm: str,
    norm_batch_size: int | None = None,
    norm_options: dict[str, dict[str, Any]] | None = None,
    head_norm: str | None = None,
    centre_encoder: bool | None = None,
) -> None:
    """Every BatchNorm of a segmentation network (its ``encoder`` and ``heads()``) converted: the encoder's to
    ``norm``, its convs centred as the preset says unless ``centre_encoder`` says otherwise (False: a BN backbone's
    convs keep BN's function, ``mabn.models.backbone.keep_bn_function``), the decoder's and heads' to ``head_norm``
    (None: the norm entry's ``head_norm`` where its layers learn nothing, frozenbn's; else ``norm``)."""
    heads = head_norm or norm_entry(norm).head_norm or norm
    if heads == norm and centre_encoder is None:
        convert_norm(net, norm, **norm_kwargs_for(norm, norm_batch_size, norm_options))
        return
    convert_norm(net.encoder, norm, centre_encoder, **norm_kwargs_for(norm, norm_batch_size, norm_options))
    convert_norm(net.heads(), heads, **norm_kwargs_for(heads, norm_batch_size, norm_options))


def head_conv(cin: int, cout: int, kernel: int, classifier: bool = False) -> nn.Conv2d:
    """A conv of a head, drawn once as ``init_head`` starts it (not first by the constructor as well): a hidden one
    without bias, or the ``classifier``, with one."""
    conv = nn.utils.skip_init(
        nn.Conv2d, cin, cout, kernel, padding=kernel // 2, bias=classifier, device=torch.get_default_device()
    )
    init_head(conv, conv if classifier else None)
    return conv


def conv_norm_relu(cin: int, cout: int, kernel: int) -> nn.Sequential:
    """conv (no bias) -> norm -> ReLU; the norm becomes the requested one through ``convert_norm``."""
    return nn.Sequential(head_conv(cin, cout, kernel), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class PyramidPooling(nn.Module):
    """Average-pool to each bin size, reduce channels, upsample back and concatenate with the input."""

    def __init__(self, channels: int, bins: Sequence[int]) -> None:
        super().__init__()
        reduced = channels // len(bins)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(b), conv_norm_relu(channels, reduced, 1)) for b in bins
        )

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        pooled = [F.interpolate(stage(x), size, mode="bilinear", align_corners=True) for stage in self.stages]
        return torch.cat([x, *pooled], dim=1)


def seg_head(cin: int, mid: int, num_classes: int, dropout: float) -> nn.Sequential:
    """3x3 conv-norm-ReLU, dropout, 1x1 classifier; initialized as ``init_head`` does."""
    return nn.Sequential(conv_norm_relu(cin, mid, 3), nn.Dropout2d(dropout), head_conv(mid, num_classes, 1, True))


CLASSIFIER_STD = 0.01


def init_head(module: nn.Module, classifier: nn.Conv2d | None = None) -> None:
    """He initialization (fan-out) for ``module``'s convs and ``classifier``, the conv that yields the logits, drawn
    near zero (normal, std ``CLASSIFIER_STD``), as mmsegmentation starts its heads: He's fan-out of a classifier is
    its class count, whose logits would start at a std of 4 to 10 and the loss far above ln K; biases zero."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            if m is classifier:
                nn.init.normal_(m.weight, std=CLASSIFIER_STD)
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class PSPNet(nn.Module):
    """PSPNet on a dilated ResNet-101 (or the encoder ``arch``) with every norm (encoder and heads) set to ``norm``
    (``head_norm`` and ``centre_encoder``: ``convert_network_norms``).

    Training returns (main logits, auxiliary logits from layer3), both at input resolution; eval
    returns the main logits only, so the auxiliary head costs nothing at inference.
    """

    def __init__(
        self,
        num_classes: int = 19,
        norm: str = "mabn",
        norm_batch_size: int | None = None,
        norm_options: dict[str, dict[str, Any]] | None = None,
        bins: Sequence[int] = (1, 2, 3, 6),
        dropout: float = 0.1,
        arch: str = DEFAULT_ARCH,
        head_norm: str | None = None,
        centre_encoder: bool | None = None,
    ) -> None:
        super().__init__()
        # weights=None: never download; the stage-1 backbone is loaded separately.
        check_encoder(arch)
        try:
            self.encoder = smp.encoders.get_encoder(arch, weights=None, output_stride=8)
        except (ValueError, AssertionError) as error:  # timm asserts its output strides
            raise undilatable(arch, 8, error) from None
        channels = self.encoder.out_channels
        self.ppm = PyramidPooling(channels[-1], bins)
        self.classifier = seg_head(channels[-1] * 2, 512, num_classes, dropout)
        self.aux = seg_head(channels[-2], 256, num_classes, dropout)
        convert_network_norms(self, norm, norm_batch_size, norm_options, head_norm, centre_encoder)

    def heads(self) -> nn.ModuleList:
        """The newly initialized parts, trained at the higher learning rate."""
        return nn.ModuleList([self.ppm, self.classifier, self.aux])

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        features = self.encoder(x)
        return self.decode(features[-1], features[-2], size=x.shape[-2:])

    def decode(self, last: Tensor, before: Tensor, size: torch.Size) -> Tensor | tuple[Tensor, Tensor]:
        """The heads on the encoder's last feature map and the one before it (layer4's and layer3's), their logits
        at the input's spatial ``size``: the forward after the encoder, which a segmented CUDA-graph capture
        (``mabn.tasks.cudagraph``) runs as a segment of its own."""
        out = F.interpolate(self.classifier(self.ppm(last)), size, mode="bilinear", align_corners=False)
        if not self.training:
            return out
        aux = F.interpolate(self.aux(before), size, mode="bilinear", align_corners=False)
        return out, aux
