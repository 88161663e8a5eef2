"""Model factories for the command-line tests: ``tests.support.cli_factories:<name>``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NOT_CALLABLE = 42


def returns_tensor() -> torch.Tensor:
    return torch.zeros(1)


def raises() -> nn.Module:
    raise ValueError("factory failed\non purpose")


def single_stage() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def chain() -> nn.Module:
    """Two stages in a chain: the dataflow planner learns ``no_parallelism``."""
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def graph_towers() -> nn.Module:
    """Four towers of two Linear(256, 256): at batch 16 their kernels are shorter than their
    launches, so eager pricing rejects the region (host-bound) and graph pricing keeps it."""
    from benchmarks.models import Towers

    torch.manual_seed(0)
    return Towers(4, 256, 2)


def on_meta() -> nn.Module:
    """Parameters without data, as a model built under ``torch.device("meta")`` has."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def already_wrapped() -> nn.Module:
    from ooo_wrap import OOOModule
    from ooo_wrap.testing import SimulatedBackend

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    return OOOModule(model, streams=1, backend=SimulatedBackend())  # type: ignore[no-any-return]


class TokensAndFeatures(nn.Module):
    """Two inputs of different dtypes: token ids (int64) and features (float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.small = nn.Embedding(20, 16)
        self.proj = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.small(tokens) + self.proj(features).unsqueeze(1)


class _Slot:
    def __init__(self, value: Any) -> None:
        self.value = value


class Box:
    """A tensor held four objects deep: the scheduler opens objects' attributes only three
    deep, so it cannot protect the tensor's memory for the caller's stream."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.slot = _Slot(_Slot(_Slot(tensor)))

    @property
    def tensor(self) -> torch.Tensor:
        value: torch.Tensor = self.slot.value.value.value
        return value


class BoxedStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Box:
        return Box(self.linear(x))


class Leaky(nn.Module):
    """Two stages whose outputs reach the caller inside a :class:`Box`: a race finding."""

    def __init__(self) -> None:
        super().__init__()
        self.left = BoxedStage()
        self.right = BoxedStage()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x).tensor * self.right(x).tensor


class SharedEmbeddingTowers(nn.Module):
    """Two towers over one ``nn.Embedding``, registered in both (and at the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.left = nn.Sequential(self.embedding, nn.Linear(8, 8), nn.Tanh())
        self.right = nn.Sequential(self.embedding, nn.Linear(8, 8), nn.ReLU())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.left(tokens) * self.right(tokens)


class _Stack(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layer = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.embed_tokens(tokens)))


class T5Style(nn.Module):
    """T5/BART's layout: a root-level ``shared`` embedding that is also the encoder's and
    the decoder's ``embed_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(16, 8)
        self.encoder = _Stack(self.shared)
        self.decoder = _Stack(self.shared)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens) + self.decoder(tokens.flip(-1))


class HostRead(nn.Module):
    """Two stages; the host reads the first one's output (``.item()``): fine eagerly, but
    a CUDA graph capture refuses a host read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.a(x).mean()
        scale = 2.0 if s.item() > 0 else 3.0
        out: torch.Tensor = self.b(x) * scale + s
        return out
