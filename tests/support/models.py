"""Small deterministic models for the tests, each with a factory and an input factory.

Not a test file: the test modules import it (``from models import ...``). Every factory
seeds its own generator, so two calls build bitwise-identical models and inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ooo_wrap._tensors import tensors_in

DIM = 6

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def _mlp(d_in: int, d_out: int, hidden: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


# --- the six parity shapes ------------------------------------------------------------


class Towers(nn.Module):
    """Independent towers in a ``ModuleList`` whose outputs are combined by a head."""

    def __init__(self, n: int = 3, dim: int = DIM) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_mlp(dim, dim) for _ in range(n))
        self.act = nn.ReLU()  # parameter-free: never a stage
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.stack([tower(x) for tower in self.towers]).sum(0)
        out: torch.Tensor = self.head(self.act(h))
        return out


class Heads(nn.Module):
    """A trunk feeding heads in a ``ModuleDict``; returns a tuple."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.trunk = nn.Linear(dim, dim)
        self.heads = nn.ModuleDict({"cls": nn.Linear(dim, 3), "reg": _mlp(dim, 1)})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.heads["cls"](h), self.heads["reg"](h)


class SharedTwice(nn.Module):
    """One stage called twice in a forward (shared weights)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.block = _mlp(dim, dim)
        self.other = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        out: torch.Tensor = self.block(torch.relu(h) + self.other(x))
        return out


class GatedStage(nn.Module):
    """A stage taking keyword tensors (one optional) and returning a dict."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, *, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.lin(x) * scale
        if bias is not None:
            h = h + bias
        return {"h": h, "gate": torch.sigmoid(self.gate(x))}


class KwargsDict(nn.Module):
    """Keyword arguments in (to the model and to its stages) and a dict out."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.enc = GatedStage(dim)
        self.dec = GatedStage(dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.enc(x, scale=scale)
        b = self.dec(a["h"], scale=scale, bias=a["gate"])
        return {"out": self.out(b["h"]), "gate": b["gate"]}


class Residual(nn.Module):
    """The stem's output feeds two later stages, with a residual add between them."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.left = _mlp(dim, dim)
        self.right = _mlp(dim, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        h = a + self.left(a)  # residual add between the two consumers of ``a``
        c = self.right(a)
        out: torch.Tensor = self.head(h * c)
        return out


class TokenModel(nn.Module):
    """Integer token ids into an embedding stage, then towers and a head."""

    VOCAB = 11

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, dim)
        self.towers = nn.ModuleList([_mlp(dim, dim), _mlp(dim, dim)])
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        h = self.towers[0](e) * self.towers[1](e)
        out: torch.Tensor = self.head(h.mean(1))
        return out


@dataclass(frozen=True)
class Shape:
    """A parity shape: how to build it, its inputs, and its stage calls per forward."""

    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], Inputs]
    stage_calls_per_forward: int


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(1234)
        return factory()

    return make


def _x(batch: int = 5, dim: int = DIM) -> Inputs:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(batch, dim, generator=gen),), {}


def _kwargs_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, DIM, generator=gen)
    return (x,), {"scale": torch.rand(DIM, generator=gen) + 0.5}


def _token_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(9)
    return (torch.randint(0, TokenModel.VOCAB, (4, 7), generator=gen),), {}


SHAPES: tuple[Shape, ...] = (
    Shape("towers_modulelist", _seeded(Towers), _x, 4),
    Shape("heads_moduledict", _seeded(Heads), _x, 3),
    Shape("shared_stage_called_twice", _seeded(SharedTwice), _x, 3),
    Shape("kwargs_in_dict_out", _seeded(KwargsDict), _kwargs_inputs, 3),
    Shape("residual_fan_out", _seeded(Residual), _x, 4),
    Shape("token_ids_embedding", _seeded(TokenModel), _token_inputs, 4),
)


def loss_of(output: Any) -> torch.Tensor:
    """A scalar loss touching every output tensor."""
    return torch.stack([(t.float() ** 2).mean() for t in tensors_in(output)]).sum()


# --- models for the scheduler, wrapper and fallback tests --------------------------------


class TwoTowers(nn.Module):
    """The smallest interesting model: two independent linear towers, summed."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return out


def make_two_towers(dim: int = 4) -> TwoTowers:
    torch.manual_seed(99)
    return TwoTowers(dim)


def two_tower_input(batch: int = 3, dim: int = 4) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(3))


class MaybeFailing(nn.Module):
    """A linear stage that raises ``fail_with`` (any ``BaseException``) when it is set."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.fail_with: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_with is not None:
            raise self.fail_with
        out: torch.Tensor = self.lin(x)
        return out


class FailingTowers(nn.Module):
    """Two towers, either of which can be told to raise."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList([MaybeFailing(dim), MaybeFailing(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return out


class CalledInExcept(nn.Module):
    """Calls its stages while handling an exception it caught itself."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            raise LookupError("handled inside forward")
        except LookupError:
            out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return out


class StreamProbe(nn.Module):
    """A linear stage that records ``probe()`` (the current stream) on every call."""

    def __init__(self, probe: Callable[[], object], dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.probe = probe
        self.seen: list[object] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.probe())
        out: torch.Tensor = self.lin(x)
        return out


class ProbeTowers(nn.Module):
    """Two :class:`StreamProbe` towers."""

    def __init__(self, probe: Callable[[], object], dim: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList([StreamProbe(probe, dim), StreamProbe(probe, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return out


class Scriptable(nn.Module):
    """Two linear stages and a forward TorchScript can compile."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_snapshot(model: nn.Module) -> dict[str, dict[str, dict[Any, Any]]]:
    """A copy of every submodule's hook dicts, keyed by module name then dict name."""
    return {
        name: {attr: dict(getattr(module, attr)) for attr in HOOK_DICTS}
        for name, module in model.named_modules(remove_duplicate=False)
    }


def hook_count(model: nn.Module) -> int:
    """How many forward hooks and pre-hooks the model and its submodules hold in all."""
    return sum(
        len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules()
    )
