"""The model both examples train: a small ResNet in plain torch (no torchvision), kept in channels-last memory
format, and the loss of one batch of uint8 images as the loader hands them over.

Imports torch: the scripts import this module only after parsing their options.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Two 3x3 convolutions with batch norm, plus a shortcut (a strided 1x1 convolution where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        same = stride == 1 and cin == cout
        self.shortcut = nn.Identity() if same else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                                 nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x), inplace=True)


class ResNet(nn.Module):
    """A strided 3x3 stem, then stages of residual blocks (each stage after the first halves the resolution and
    doubles the width), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        cin = width
        for stage, n in enumerate(blocks):
            cout = width << stage
            for i in range(n):
                layers.append(Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_model(num_classes: int, device: torch.device | None = None) -> ResNet:
    """The ResNet in channels-last memory format (what tensor cores want for convolutions), on ``device``."""
    model = ResNet(num_classes) if device is None else ResNet(num_classes).to(device)
    return model.to(memory_format=torch.channels_last)


def forward_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, nhwc: bool) -> torch.Tensor:
    """Cross-entropy of ``model`` on a batch of uint8 images (on the GPU). N x H x W x 3 images are already
    channels-last in memory, so the permute to N x 3 x H x W copies nothing; N x 3 x H x W ones are converted.
    Pixels are scaled to about [-2, 2]. Run it under ``torch.autocast`` for bf16."""
    x = images.permute(0, 3, 1, 2) if nhwc else images.contiguous(memory_format=torch.channels_last)
    x = x.float().sub_(127.5).div_(64.0)  # keeps the channels-last strides
    return F.cross_entropy(model(x), labels)
