"""The ablation's network: a narrow ResNet built from torchvision's BasicBlock, for 32 px inputs.

A CIFAR-style stem (one 3x3 conv, no max-pool) keeps enough resolution for small images, and three stages
of widths 32, 64, 128 (strides 1, 2, 2) make one step cheap enough on a CPU. Every conv is registered right
before its norm, with torchvision's names (``layer1.0.bn1`` is the layer of the paper's Figures 2, 5, 6),
so ``convert_norm`` swaps the norms and centres the convs exactly as it does on ResNet-101.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, conv1x1

WIDTHS = (32, 64, 128)
BLOCKS = (1, 1, 1)


class SmallResNet(nn.Module):
    """stem conv3x3-BN-ReLU, ``blocks[i]`` BasicBlocks of ``widths[i]`` channels per stage, pool, linear.

    Initialization as torchvision's ResNet and the paper (appendix B.2): Kaiming normal (fan_out) convs,
    norms with gamma 1 and beta 0.
    """

    def __init__(self, num_classes: int, widths: tuple[int, ...] = WIDTHS, blocks: tuple[int, ...] = BLOCKS) -> None:
        super().__init__()
        if len(widths) != len(blocks):
            raise ValueError(f"SmallResNet: one block count per width, got widths {widths} and blocks {blocks}")
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        inplanes = widths[0]
        for i, (planes, count) in enumerate(zip(widths, blocks), start=1):
            stride = 1 if i == 1 else 2
            layers = []
            for k in range(count):
                downsample = None
                if k == 0 and (stride != 1 or inplanes != planes):
                    downsample = nn.Sequential(conv1x1(inplanes, planes, stride), nn.BatchNorm2d(planes))
                layers.append(BasicBlock(inplanes, planes, stride if k == 0 else 1, downsample))
                inplanes = planes
            self.add_module(f"layer{i}", nn.Sequential(*layers))
        self.num_stages = len(widths)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def features(self, x: Tensor) -> Tensor:
        """The last stage's feature map (stride 4 with the default three stages): what a segmentation head reads."""
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.avgpool(self.features(x)).flatten(1))
