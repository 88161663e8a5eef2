"""The benchmark model families, sized by arguments: towers, branches, transformer, fanout.

Each family is described by a :class:`ModelSpec` (family name plus size), which builds the
model, makes a batch of inputs and targets, and computes the loss. Building is seeded, so
two builds of one spec are identical; the suite still deep-copies one build for both
sides, so that plain and wrapped start from the very same parameters.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the transformer family is the reference model in examples/
    sys.path.insert(0, str(ROOT))

from examples.transformer import SEQ, VOCAB, TinyTransformer  # noqa: E402

__all__ = ["FAMILIES", "Branches", "Family", "FanOut", "ModelSpec", "Towers"]

Family = Literal["towers", "branches", "transformer", "fanout"]
FAMILIES: tuple[Family, ...] = ("towers", "branches", "transformer", "fanout")
_NO_EXTENT: tuple[Family, ...] = ("towers", "fanout")  # families sized without an extent

BRANCH_CLASSES = 10
# Inception's branch shapes, in turn: 1x1, 3x3 and 5x5 convolutions, and a pooling branch.
_BRANCH_KINDS: tuple[int | str, ...] = (1, 3, 5, "pool")


def _mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


class Towers(nn.Module):
    """``num_towers`` independent MLPs (``depth`` layers of ``width x width``) of one input, summed.

    Every tower is a stage; their backward passes are independent, so they can overlap.
    """

    def __init__(self, num_towers: int = 8, width: int = 2048, depth: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_mlp(width, depth) for _ in range(num_towers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x)
        for tower in self.towers[1:]:
            out = out + tower(x)
        return out


def _conv(c_in: int, c_out: int, kernel: int) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    ]


def _branch(kind: int | str, channels: int, depth: int) -> nn.Sequential:
    if kind == "pool":
        # Average rather than max pooling: its backward is a gather, deterministic on
        # CUDA, so the parity tests can compare gradients tightly.
        layers: list[nn.Module] = [nn.AvgPool2d(3, stride=1, padding=1)]
        layers += _conv(channels, channels, 1)
        return nn.Sequential(*layers)
    assert isinstance(kind, int)
    layers = _conv(channels, channels, 1)  # the 1x1 reduction Inception puts first
    for _ in range(depth - 1):
        layers += _conv(channels, channels, kind)
    return nn.Sequential(*layers)


class Branches(nn.Module):
    """Inception-style: a stem, ``num_branches`` convolution branches concatenated, a head.

    With automatic stage expansion the stem, every branch and the head are stages; the
    branches are independent of each other, so their backward passes can overlap.
    """

    def __init__(self, num_branches: int = 4, channels: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv(3, channels, 3))
        self.branches = nn.ModuleList(
            _branch(_BRANCH_KINDS[i % len(_BRANCH_KINDS)], channels, depth)
            for i in range(num_branches)
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(num_branches * channels, BRANCH_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out: torch.Tensor = self.head(torch.cat([branch(h) for branch in self.branches], dim=1))
        return out


def _small_branch(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.LayerNorm(width)]
    for i in range(depth):
        if i:
            layers.append(nn.GELU())
        layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


class FanOut(nn.Module):
    """Launch-bound fan-out: a stem, ``num_branches`` small MLP branches concatenated, a head.

    Each branch is a LayerNorm and ``depth`` ``width x width`` Linear layers (GELU between).
    With automatic stage expansion the stem, every branch and the head are stages; the
    branches are independent of each other, so their forward and backward can overlap.

    Why the default sizes (16 branches, width 128, depth 2, batch 32 to 256) are
    launch-bound, as estimates from public H200 figures, not measurements: one branch
    Linear at batch 256 is 2 x 256 x 128 x 128 = 8.4 MFLOP (about 0.13 us at 67 TFLOPS of
    float32) and moves about 0.3 MB (about 0.07 us at 4.8 TB/s), both far below a
    kernel's launch floor of a few us. The cost model (``ooo_wrap/_planner/cost.py``: 5 us of
    host time per eager op, 2 us least per kernel) puts a training step at about 225
    launched ops, 1.1 ms, the same at batch 32 and 256: the host's launches set the step
    time, and the GPU waits on them. A CUDA graph removes those launches; side streams
    inside it can then overlap the branches.
    """

    def __init__(self, num_branches: int = 16, width: int = 128, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.branches = nn.ModuleList(_small_branch(width, depth) for _ in range(num_branches))
        self.head = nn.Linear(num_branches * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out: torch.Tensor = self.head(torch.cat([branch(h) for branch in self.branches], dim=1))
        return out


@dataclass(frozen=True)
class ModelSpec:
    """One model family at one size.

    Attributes:
        family: ``towers``, ``branches``, ``transformer`` or ``fanout``.
        count: towers: number of towers (K); branches and fanout: number of branches;
            transformer: number of blocks.
        width: towers and fanout: layer width; branches: channels per branch;
            transformer: model dim.
        depth: towers: layers per tower; branches: convolutions per branch; fanout: Linear
            layers per branch; transformer: attention heads.
        extent: branches: image side in pixels; transformer: sequence length; towers and
            fanout: unused.
    """

    family: Family
    count: int
    width: int
    depth: int
    extent: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; expected one of {FAMILIES}")
        for name in ("count", "width", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be >= 1 for {self.family}, got {getattr(self, name)}"
                )
        if self.family not in _NO_EXTENT and self.extent < 1:
            raise ValueError(f"extent must be >= 1 for {self.family}, got {self.extent}")

    @classmethod
    def towers(cls, num_towers: int = 8, width: int = 2048, depth: int = 4) -> ModelSpec:
        """K towers of ``depth`` ``width x width`` layers (the towers target point by default)."""
        return cls("towers", num_towers, width, depth)

    @classmethod
    def branches(
        cls, num_branches: int = 4, channels: int = 64, depth: int = 2, image: int = 32
    ) -> ModelSpec:
        """Inception-style branches on ``image x image`` inputs."""
        return cls("branches", num_branches, channels, depth, image)

    @classmethod
    def transformer(
        cls, depth: int = 4, dim: int = 64, heads: int = 4, seq: int = SEQ
    ) -> ModelSpec:
        """The reference model of ``examples/transformer.py`` (its own size by default)."""
        return cls("transformer", depth, dim, heads, seq)

    @classmethod
    def fanout(cls, num_branches: int = 16, width: int = 128, depth: int = 2) -> ModelSpec:
        """The launch-bound fan-out of :class:`FanOut` (its default sizes by default)."""
        return cls("fanout", num_branches, width, depth)

    @property
    def size(self) -> dict[str, int]:
        """The size parameters under their family's names, for reports."""
        if self.family == "towers":
            return {"towers": self.count, "width": self.width, "depth": self.depth}
        if self.family == "fanout":
            return {"branches": self.count, "width": self.width, "depth": self.depth}
        if self.family == "branches":
            return {
                "branches": self.count,
                "channels": self.width,
                "depth": self.depth,
                "image": self.extent,
            }
        return {"blocks": self.count, "dim": self.width, "heads": self.depth, "seq": self.extent}

    @property
    def label(self) -> str:
        """A short human name, e.g. ``towers K=8 W=2048 D=4``."""
        if self.family == "towers":
            return f"towers K={self.count} W={self.width} D={self.depth}"
        if self.family == "branches":
            return f"branches N={self.count} C={self.width} D={self.depth} {self.extent}px"
        if self.family == "fanout":
            return f"fanout N={self.count} W={self.width} D={self.depth}"
        return f"transformer L={self.count} d={self.width} h={self.depth} T={self.extent}"

    def build(self, seed: int = 0) -> nn.Module:
        """The model, initialised from ``seed`` on the current default device."""
        torch.manual_seed(seed)
        if self.family == "towers":
            return Towers(self.count, self.width, self.depth)
        if self.family == "branches":
            return Branches(self.count, self.width, self.depth)
        if self.family == "fanout":
            return FanOut(self.count, self.width, self.depth)
        return TinyTransformer(
            vocab=VOCAB,
            dim=self.width,
            heads=self.depth,
            depth=self.count,
            seq=self.extent,
        )

    def make_batch(
        self, batch: int, device: torch.device | str = "cpu", seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` for one step, drawn from ``seed`` on the CPU, then moved."""
        gen = torch.Generator().manual_seed(seed)
        if self.family in _NO_EXTENT:  # towers and fanout: regression on width features
            x = torch.randn(batch, self.width, generator=gen)
            y = torch.randn(batch, self.width, generator=gen)
        elif self.family == "branches":
            x = torch.randn(batch, 3, self.extent, self.extent, generator=gen)
            y = torch.randint(0, BRANCH_CLASSES, (batch,), generator=gen)
        else:
            tokens = torch.randint(0, VOCAB, (batch, self.extent + 1), generator=gen)
            x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        return x.to(device), y.to(device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss, computed in float32 whatever precision the model ran in."""
        if self.family in _NO_EXTENT:
            return F.mse_loss(output.float(), target)
        if self.family == "branches":
            return F.cross_entropy(output.float(), target)
        return F.cross_entropy(output.float().flatten(0, 1), target.flatten())
