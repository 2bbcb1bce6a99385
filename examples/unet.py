"""A small U-Net: an encoder, a bottleneck and a decoder whose every level concatenates the
encoder's output of the same resolution (the skip connections).

The outermost skip goes from the first encoder level to the last decoder level: pipelined
over 4 stages it is made in stage 0 and read in stage 3, so it is the test of sending a
skip value straight from its producer to its consumer (``autopar.passes.split_stages``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.base import Example


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GELU())


class UNet(nn.Module):
    """forward(images (B, C, H, W)) -> per-pixel outputs (B, C_out, H, W)."""

    def __init__(self, in_channels: int = 2, width: int = 4, out_channels: int = 2):
        super().__init__()
        w = width
        self.enc1 = _block(in_channels, w)          # H       -> skip to dec1
        self.enc2 = _block(w, 2 * w)                # H / 2   -> skip to dec2
        self.mid = _block(2 * w, 2 * w)             # H / 4
        self.dec2 = _block(4 * w, w)                # H / 2, after concat with enc2
        self.dec1 = _block(2 * w, w)                # H, after concat with enc1
        self.head = nn.Conv2d(w, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.avg_pool2d(e1, 2))
        m = self.mid(F.avg_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(m, scale_factor=2.0), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1))
        return self.head(d1)


def pixel_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (written out: ``F.mse_loss`` exports through a broadcast that
    makes the model's output depend on the target)."""
    return ((output - target) ** 2).mean()


def unet_factory(batch: int = 8, *, seed: int = 0, image_size: int = 8, in_channels: int = 2,
                 width: int = 4) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UNet(in_channels, width, in_channels)
        images = torch.randn(batch, in_channels, image_size, image_size)
        target = torch.randn(batch, in_channels, image_size, image_size)
    return Example(model, (images,), target, pixel_loss,
                   dict(image_size=image_size, in_channels=in_channels, width=width))
