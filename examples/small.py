"""Two small non-transformer examples: a ResNet (conv stem, two BasicBlocks with
BatchNorm2d, avg pool, linear head; cross entropy) and an MLP (three Linear layers with
GELU; MSE loss)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.base import Example, classification_loss, mse_loss

__all__ = ["ResNet", "resnet_factory", "MLP", "mlp_factory"]


# ---------------------------------------------------------------------------- ResNet

class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """forward(images (B, in_ch, H, W)) -> logits (B, num_classes)."""

    def __init__(self, in_channels: int = 3, width: int = 16, num_classes: int = 8):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, stride=1)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet_factory(batch: int = 8, *, seed: int = 0, image_size: int = 16,
                   in_channels: int = 3, width: int = 16, num_classes: int = 8) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet(in_channels, width, num_classes)
        images = torch.randn(batch, in_channels, image_size, image_size)
        target = torch.randint(0, num_classes, (batch,))
    config = dict(image_size=image_size, in_channels=in_channels, width=width,
                  num_classes=num_classes)
    return Example(model, (images,), target, classification_loss, config)


# ------------------------------------------------------------------------------- MLP

class MLP(nn.Module):
    """Three Linear layers with GELU between them."""

    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def mlp_factory(batch: int = 8, *, seed: int = 0, in_features: int = 32, hidden: int = 64,
                out_features: int = 16) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(in_features, hidden, out_features)
        x = torch.randn(batch, in_features)
        target = torch.randn(batch, out_features)
    config = dict(in_features=in_features, hidden=hidden, out_features=out_features)
    return Example(model, (x,), target, mse_loss, config)
