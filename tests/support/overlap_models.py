"""Models for ``overlap_forward``: each touches a stage's output in a different way."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

DIM = 8


def pending_joins() -> int:
    """Joins pending on this thread."""
    from ooo_wrap._runtime.inflight import thread_state

    return len(thread_state.pending)


class TowersSum(nn.Module):
    """Independent towers, all called before the parent sums their outputs."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [tower(x) for tower in self.towers]
        return functools.reduce(torch.add, outs)


class TowersCat(nn.Module):
    """Independent towers concatenated."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tower(x) for tower in self.towers], dim=-1)


class ParentOpBetween(nn.Module):
    """A parent op reads one stage's output before the next stage is called."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out: torch.Tensor = self.b(h * 2)
        return out


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean()


class HostRead(nn.Module):
    """The host reads a stage's output (``.item()``, the first touch) between stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Scalar()
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.a(x)
        scale = 2.0 if s.item() > 0 else 3.0
        out: torch.Tensor = self.b(x) * scale + s
        return out


class Split(nn.Module):
    """Returns its output and a view of it, made inside the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, 2 * DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        return h, h[:, DIM:]


class DirectFeed(nn.Module):
    """A stage's outputs feed the next stages directly: a tensor, and a view in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.split = Split()
        self.c = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = self.b(self.a(x))
        whole, half = self.split(x)
        return y, self.c(half), whole


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.training:
            raise ValueError("tower refuses in training")
        return h


class FailingSecondTower(nn.Module):
    """The second of three towers raises; the parent catches it and carries on."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.second = Raises()
        self.third = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        try:
            b = self.second(x)
        except ValueError:
            b = None
        c = self.third(x)
        return a + c if b is None else a + b + c


class ResidualChain(nn.Module):
    """Stages in a chain with a residual add between each pair."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            h = h + block(h)
        return h


class AttributeEscape(nn.Module):
    """Stage ``b`` reads stage ``a``'s output through an attribute, not an argument: the
    hooks cannot see it, so with deferred joins ``b`` may read it unordered."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = Reader(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stash = self.a(x)
        out: torch.Tensor = self.b(x)
        return out


class Reader(nn.Module):
    def __init__(self, parent: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        object.__setattr__(self, "parent", parent)  # not a sub-module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash: torch.Tensor = self.parent.stash  # type: ignore[attr-defined]
        return self.linear(x) + stash


def inputs() -> torch.Tensor:
    return torch.randn(4, DIM)


ACCEPTANCE = {
    "towers_sum": TowersSum,
    "towers_cat": TowersCat,
    "parent_op_between": ParentOpBetween,
    "host_read": HostRead,
    "direct_feed": DirectFeed,
    "failing_second_tower": FailingSecondTower,
    "residual_chain": ResidualChain,
}


class Outer(nn.Module):
    """A stage whose forward calls another stage (held outside its sub-modules) and
    returns that stage's output as its own."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Linear(DIM, DIM)
        object.__setattr__(self, "inner", inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(self.scale(x))  # type: ignore[operator]
        return out


class NestedCall(nn.Module):
    """Stage ``outer`` calls stage ``inner`` inside its forward; the parent reads the result."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM, DIM)
        self.outer = Outer(self.inner)
        self.other = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.outer(x)
        return torch.tanh(h) + self.other(x)


class TowersReturned(nn.Module):
    """Towers whose outputs the model returns untouched: only the root's join orders them."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(DIM, DIM)
        self.right = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.left(x), self.right(x)


class Fill(nn.Module):
    """Writes its result into ``out`` in place and returns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.linear(x))


class InPlaceFill(nn.Module):
    """Stage ``fill`` writes into a view of a buffer; stage ``c`` then reads the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = Fill()
        self.c = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = x.new_zeros(x.shape[0], 2 * DIM)
        left = buf[:, :DIM]
        self.fill(x, left)
        out: torch.Tensor = self.c(buf)
        return out


class Counting(TorchFunctionMode):
    """A user's own mode: counts the torch calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class UserModeAround(nn.Module):
    """The parent calls stage ``a`` inside a mode of its own and reads the output right
    after leaving it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.modes: list[Counting] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = Counting()
        self.modes.append(mode)
        with mode:
            h = self.a(x)
        y = h * 2
        out: torch.Tensor = self.b(x) + y
        return out


class Box:
    """A plain object holding one value: nested, it hides a tensor from the hooks' search."""

    def __init__(self, value: object) -> None:
        self.value = value


def boxed(value: object, depth: int) -> object:
    for _ in range(depth):
        value = Box(value)
    return value


def unboxed(value: object) -> torch.Tensor:
    while isinstance(value, Box):
        value = value.value
    assert isinstance(value, torch.Tensor)
    return value


class BoxReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, box: object) -> torch.Tensor:
        out: torch.Tensor = self.linear(unboxed(box))
        return out


class DeepFeed(nn.Module):
    """Stage ``a``'s output reaches stage ``b`` nested deeper than the hooks search."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = BoxReader()
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(boxed(self.a(x), self.depth))
        return out


class BoxWriter(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> object:
        return boxed(self.linear(x), self.depth)


class DeepReturn(nn.Module):
    """Stage ``a`` returns its output nested deeper than the hooks search; the parent
    takes it out (attribute reads only, no torch call) and hands it to stage ``b``."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.a = BoxWriter(depth)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(unboxed(self.a(x)))
        return out


class ThreadRead(nn.Module):
    """The parent hands stage ``a``'s pending output to a thread of its own, which reads
    it: the join-on-touch mode and the pending joins belong to the parent's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        found: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: found.append(h * 2))
        worker.start()
        worker.join()
        out: torch.Tensor = self.b(x) + found[0]
        return out


class DisabledRead(nn.Module):
    """The parent reads stage ``a``'s pending output with torch functions disabled, modes
    included: the join-on-touch mode never sees the read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch._C.DisableTorchFunction():
            y = h * 2
        out: torch.Tensor = self.b(x) + y
        return out


class SharedNorm(nn.Module):
    """Sibling stages ``a`` and ``b`` normalise with one batch norm: in training each call
    updates its running statistics in place, a write neither stage's inputs nor outputs
    show. Stage ``c`` has a batch norm of its own."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(DIM)
        self.a = nn.Sequential(nn.Linear(DIM, DIM), norm)
        self.b = nn.Sequential(nn.Linear(DIM, DIM), norm)
        self.c = nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a(x), self.b(x), self.c(x)
        out: torch.Tensor = a + b + c
        return out


class Total(nn.Module):
    """Holds the buffer two stages share."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.ones(DIM))


class Tally(nn.Module):
    """Adds a shared buffer to its result; with ``update``, first adds its batch to it."""

    def __init__(self, shared: Total, update: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.shared = shared
        self.update = update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.linear(x)
        total: torch.Tensor = self.shared.total
        if self.update:
            with torch.no_grad():
                total.add_(h.sum(0))
        return h + total


class SharedBuffer(nn.Module):
    """Sibling stages ``a`` and ``b`` read one buffer; each may write it in place first
    (``writes``: whether ``a``, then ``b``, does)."""

    def __init__(self, writes: tuple[bool, bool]) -> None:
        super().__init__()
        shared = Total()
        self.a, self.b = Tally(shared, writes[0]), Tally(shared, writes[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class TiedTallies(nn.Module):
    """``n`` sibling stages that each add their batch to one shared buffer, then read it."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        shared = Total()
        self.tallies = nn.ModuleList(Tally(shared, True) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [tally(x) for tally in self.tallies]
        return functools.reduce(torch.add, outs)


class TiedUnderAutocast(nn.Module):
    """Under autocast, stage ``b`` runs on stage ``a``'s stream (they share a weight); it
    also shares a buffer with stage ``c``, called first, on a stream of its own."""

    def __init__(self) -> None:
        super().__init__()
        shared = Total()
        self.c = Tally(shared, True)
        self.a = nn.Sequential(nn.Linear(DIM, DIM))
        self.b = Tally(shared, True)
        self.b.linear = self.a[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            c, a, b = self.c(x), self.a(x), self.b(x)
            return (c + a + b).float()
