"""An Inception-style model: a conv stem, then independent branches (towers) of unequal
cost all fed the stem's output, joined by concatenating their channels, then a head.

The branches share no parameters and no values until the join, so they can run on disjoint
groups of devices (branch parallelism: ``autopar.analysis.branches`` finds them, the pin
``branch=N`` places them). Tower ``k`` is ``k + 1`` 3x3 convolutions deep (tower 0 is a
single 1x1 convolution), so the towers cost more the later they come.

    from examples.inception import inception_factory
    ex = inception_factory(batch=8, branches=4)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.base import Example, classification_loss


def _tower(k: int, cin: int, width: int) -> nn.Sequential:
    """Tower ``k``: a 1x1 convolution, then ``k`` 3x3 ones, GELU after each."""
    layers: list[nn.Module] = [nn.Conv2d(cin, width, 1), nn.GELU()]
    for _ in range(k):
        layers += [nn.Conv2d(width, width, 3, padding=1), nn.GELU()]
    return nn.Sequential(*layers)


class Inception(nn.Module):
    """forward(images (B, C, H, W)) -> class logits (B, num_classes)."""

    def __init__(self, in_channels: int = 3, width: int = 8, branches: int = 2,
                 num_classes: int = 8):
        super().__init__()
        if branches < 2:
            raise ValueError(f"Inception(branches={branches}): an Inception block has at least "
                             "2 branches")
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1)
        self.towers = nn.ModuleList(_tower(k, width, width) for k in range(branches))
        self.head = nn.Linear(branches * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.gelu(self.stem(x))
        joined = torch.cat([tower(s) for tower in self.towers], dim=1)
        return self.head(joined.mean(dim=(2, 3)))


def inception_factory(batch: int = 8, *, seed: int = 0, image_size: int = 8,
                      in_channels: int = 3, width: int = 8, branches: int = 2,
                      num_classes: int = 8) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Inception(in_channels, width, branches, num_classes)
        images = torch.randn(batch, in_channels, image_size, image_size)
        target = torch.randint(0, num_classes, (batch,))
    config = dict(image_size=image_size, in_channels=in_channels, width=width,
                  branches=branches, num_classes=num_classes)
    return Example(model, (images,), target, classification_loss, config)
