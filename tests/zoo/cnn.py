"""Small hand-written replicas of the block structure of torchvision/timm CNNs.

torchvision's wheel on this project's package index is a CUDA build that breaks the CPU
torch, and timm depends on torchvision, so neither is installed. Each class below is a
replica written here (not the library's code) with the same dataflow shape as the named
architecture's blocks: the branches, joins, concatenations and residual adds that decide
what the checker and the wrapper see. Tiny widths, random weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def conv_bn(c_in: int, c_out: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """Conv, batch norm, ReLU: torchvision's ``BasicConv2d`` / ``Conv2dNormActivation``."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class BasicBlock(nn.Module):
    """ResNet-18's block: two 3x3 convs plus the identity (or a 1x1 strided downsample)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv_bn(c_in, c_out, stride=stride)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(self.conv1(x))) + identity)


class ResNet(nn.Module):
    """Replica of torchvision ``resnet18``'s structure: stem, BasicBlocks, pool, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 8, 3, 2), nn.MaxPool2d(3, 2, 1))
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Inception(nn.Module):
    """Inception-v1 block: four unequal branches, one a pool without parameters, concat."""

    def __init__(self, c_in: int, c: int) -> None:
        super().__init__()
        self.branch1 = conv_bn(c_in, c, 1)
        self.branch2 = nn.Sequential(conv_bn(c_in, c, 1), conv_bn(c, c))
        self.branch3 = nn.Sequential(conv_bn(c_in, c, 1), conv_bn(c, c), conv_bn(c, c))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn(c_in, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = (self.branch1, self.branch2, self.branch3, self.branch4)
        return torch.cat([branch(x) for branch in branches], 1)


class InceptionAux(nn.Module):
    """GoogLeNet's training-only auxiliary classifier."""

    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.conv = conv_bn(c_in, 8, 1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.conv(x), 1), 1))


class GoogLeNet(nn.Module):
    """Replica of torchvision ``googlenet``: Inception blocks, aux heads only in training."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2)
        self.inception3a = Inception(16, 4)
        self.inception3b = Inception(16, 4)
        self.aux1 = InceptionAux(16)
        self.inception4a = Inception(16, 8)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.inception3b(self.inception3a(self.stem(x)))
        aux = self.aux1(x) if self.training else None
        x = self.inception4a(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)), aux


class HRFuse(nn.Module):
    """HRNet's two-resolution stage: a branch per resolution, then fuse layers that add
    each branch (upsampled or strided down) into the other."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [nn.Sequential(BasicBlock(c, c)), nn.Sequential(BasicBlock(2 * c, 2 * c))]
        )
        self.up = nn.Sequential(nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, 2, 1, bias=False), nn.BatchNorm2d(2 * c))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        hi, lo = self.branches[0](xs[0]), self.branches[1](xs[1])
        up = F.interpolate(self.up(lo), scale_factor=2.0, mode="nearest")
        return [F.relu(hi + up), F.relu(self.down(hi) + lo)]


class HRNet(nn.Module):
    """Replica of timm ``hrnet_w18_small``'s shape: a stem, a transition to two
    resolutions, two fusing stages, and a head over both."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2)
        self.transition = nn.ModuleList([conv_bn(8, 8), conv_bn(8, 16, 3, 2)])
        self.stage2 = HRFuse()
        self.stage3 = HRFuse()
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        xs = [self.transition[0](x), self.transition[1](x)]
        xs = self.stage3(self.stage2(xs))
        pooled = [torch.flatten(F.adaptive_avg_pool2d(t, 1), 1) for t in xs]
        return self.head(torch.cat(pooled, 1))


class Fire(nn.Module):
    """SqueezeNet's Fire module: a 1x1 squeeze, then 1x1 and 3x3 expands concatenated."""

    def __init__(self, c_in: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Sequential(nn.Conv2d(c_in, squeeze, 1), nn.ReLU(inplace=True))
        self.expand1x1 = nn.Sequential(nn.Conv2d(squeeze, expand, 1), nn.ReLU(inplace=True))
        self.expand3x3 = nn.Sequential(nn.Conv2d(squeeze, expand, 3, padding=1), nn.ReLU(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze(x)
        return torch.cat([self.expand1x1(x), self.expand3x3(x)], 1)


class SqueezeNet(nn.Module):
    """Replica of torchvision ``squeezenet1_1``: Fire modules, dropout, conv classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2),
            nn.ReLU(inplace=True),
            Fire(16, 4, 8),
            Fire(16, 4, 8),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Fire(16, 8, 16),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(32, 10, 1), nn.ReLU(True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(self.classifier(self.features(x)), 1), 1)


class DenseLayer(nn.Module):
    """DenseNet's layer: BN-ReLU-1x1-BN-ReLU-3x3 over the concatenation of all before it."""

    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseNet(nn.Module):
    """Replica of torchvision ``densenet121``'s dense block (each layer reads every
    earlier layer's output) and transition."""

    def __init__(self, growth: int = 4) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2)
        self.layers = nn.ModuleList(DenseLayer(8 + i * growth, growth) for i in range(3))
        self.transition = nn.Sequential(nn.BatchNorm2d(20), nn.ReLU(), nn.Conv2d(20, 8, 1))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        x = self.transition(torch.cat(features, 1))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1, residual if same shape."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        self.conv = nn.Sequential(
            conv_bn(c_in, hidden, 1),
            conv_bn(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """Replica of torchvision ``mobilenet_v2``'s structure."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 8, 3, 2),
            InvertedResidual(8, 8, 1),
            InvertedResidual(8, 16, 2),
            InvertedResidual(16, 16, 1),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class SqueezeExcite(nn.Module):
    """EfficientNet's squeeze-and-excitation: pool, two 1x1 convs, sigmoid, scale."""

    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return x * torch.sigmoid(scale)


class MBConv(nn.Module):
    """EfficientNet's MBConv: expand, depthwise, squeeze-excite, project, residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.expand = conv_bn(c, 4 * c, 1)
        self.depthwise = conv_bn(4 * c, 4 * c, 3, groups=4 * c)
        self.se = SqueezeExcite(4 * c, c // 2)
        self.project = nn.Sequential(nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class EfficientNet(nn.Module):
    """Replica of torchvision ``efficientnet_b0``'s MBConv-with-SE structure."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2)
        self.blocks = nn.Sequential(MBConv(8), MBConv(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LinearFuse(nn.Module):
    """HRNet's fuse pattern in linear layers: one gradient reaches two consumers."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.branches[0](x), self.branches[1](x)
        return ((a + self.up(b)).relu() + (self.down(a) + b).relu()).sum()
