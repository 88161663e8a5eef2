"""The stage hooks' fast paths do exactly what their general paths do.

The hooks take shortcuts for the common case (one tensor in, one tensor out; a flat tuple
of tensors); each test here runs the same calls through the shortcut and through the
general path (a search of the inputs and outputs) and compares every backend call and
counter.
"""

from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import OOOStats
from ooo_wrap._runtime import inflight
from ooo_wrap._tensors import _OBJECT_DEPTH, _collect, tensors_in
from ooo_wrap.testing import SimulatedBackend, VirtualStream


class Echo(nn.Module):
    """Returns its input unchanged: as a bare tensor, or in a tuple when ``boxed`` is given
    (a keyword argument, so the pre-hook searches, and a tuple, so the post-hook does)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))  # puts the stage on the CPU

    def forward(
        self, x: torch.Tensor, boxed: int | None = None
    ) -> torch.Tensor | tuple[torch.Tensor]:
        return x if boxed is None else (x,)


class EchoChain(nn.Module):
    def __init__(self, searched: bool) -> None:
        super().__init__()
        self.searched = searched
        self.a = Echo()
        self.b = Echo()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.searched:
            y = self.a(x, boxed=0)[0]
            return self.b(y, boxed=0)[0]
        return self.b(self.a(x))


def _run(
    searched: bool, x: torch.Tensor
) -> tuple[list[tuple[str, VirtualStream, str | None]], OOOStats]:
    backend = SimulatedBackend(keep_all=True)
    model = ooo_wrap.OOOModule(
        EchoChain(searched), backend=backend, planner="static", stages=["a", "b"]
    )
    backend.clear_log()
    for _ in range(3):  # the first call makes the events, later ones re-record them
        model(x)
    return [(c.op, c.stream, c.tensor) for c in backend.log], model.stats


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_one_tensor_in_and_out_does_what_the_search_does(device: str) -> None:
    # On "meta" the tensors are not on the stage's device (the CPU): neither path may
    # give them a record_stream, nor count one.
    x = torch.ones(3, 2, device=device)
    fast_log, fast_stats = _run(False, x)
    slow_log, slow_stats = _run(True, x)
    assert fast_log == slow_log
    assert fast_stats == slow_stats
    records = [entry for entry in fast_log if entry[0] == "record_stream"]
    assert len(records) == (0 if device == "meta" else 12)  # 2 stages, in and out, 3 calls
    assert fast_stats.record_streams == len(records)
    assert fast_stats.stage_calls == fast_stats.waits == 6


Pair = namedtuple("Pair", ["first", "second"])


@pytest.mark.parametrize(
    "value",
    [
        (),
        ("t0",),
        ("t0", "t1", "t2"),
        ("t0", None, "t1"),
        (None, "t0"),
        ("t0", ("t1", "t2")),
        ("t0", ["t1"], {"k": "t2"}),
        (1, 2.0, "text"),
        Pair("t0", "t1"),
    ],
    ids=repr,
)
def test_the_flat_tuple_shortcut_finds_what_the_search_finds(value: tuple[object, ...]) -> None:
    tensors = {f"t{i}": torch.full((1,), float(i)) for i in range(3)}

    def build(item: object) -> object:
        if isinstance(item, str) and item in tensors:
            return tensors[item]
        if isinstance(item, Pair):
            return Pair(*(build(x) for x in item))
        if isinstance(item, (tuple, list)):
            return type(item)(build(x) for x in item)
        if isinstance(item, dict):
            return {k: build(x) for k, x in item.items()}
        return item

    built = build(value)
    searched: list[torch.Tensor] = []
    _collect(built, searched, [], _OBJECT_DEPTH, set())
    found = tensors_in(built, [])
    assert [id(t) for t in found] == [id(t) for t in searched]
    assert type(found) is list  # a fresh list: the scheduler may extend it
    found.append(torch.zeros(1))
    assert [id(t) for t in tensors_in(built)] == [id(t) for t in searched]


class ListsProbe(nn.Module):
    """Records, inside its forward, whether the innermost root call's ``frames`` is the
    thread's own (the stage hooks read it there instead of from the thread state)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = inflight.thread_state
        call = local.calls[-1]
        self.seen.append(call.frames is local.frames)
        return x * self.weight


class ProbeChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ListsProbe()
        self.b = ListsProbe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_root_call_holds_its_own_threads_frames() -> None:
    model = ProbeChain()
    ooo_wrap.OOOModule(model, backend=SimulatedBackend(), planner="static", stages=["a", "b"])
    x = torch.ones(2)
    model(x)
    thread = threading.Thread(target=model, args=(x,))
    thread.start()
    thread.join()
    model(x)
    assert model.a.seen == model.b.seen == [True] * 3
    assert model.stats.stage_calls == 6
    assert inflight.thread_state.frames == [] and inflight.thread_state.calls == []
