"""Tensors in stage inputs and outputs held by containers other than tuple/list/dict.

Each tensor a stage passes on needs ``record_stream``; one the hooks cannot find is an
allocator hazard on a GPU, which the race checker reports.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap._runtime import scheduler as scheduler_module
from ooo_wrap._tensors import map_leaves, named_tensors
from ooo_wrap.testing import SimulatedBackend, check


class Holder:
    """A plain object with tensor attributes."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a = a
        self.b = b


class Deep:
    """An object holding an object; three of them nested are deeper than the hooks look."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class Cache:
    """A list of objects holding tensors, as a Hugging Face ``DynamicCache`` holds layers."""

    def __init__(self, layers: list[Holder]) -> None:
        self.layers = layers


def _pack(kind: str, a: torch.Tensor, b: torch.Tensor) -> Any:
    if kind == "namespace":
        return types.SimpleNamespace(a=a, b=b, note="text")
    if kind == "object":
        return Holder(a, b)
    if kind == "deque":
        return collections.deque([a, b])
    if kind == "cache":
        return Cache([Holder(a, b)])
    return Deep(Deep(Deep(Holder(a, b))))


def _unpack(kind: str, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "deque":
        return value[0], value[1]
    if kind == "cache":
        value = value.layers[0]
    if kind == "deep":
        value = value.inner.inner.inner
    return value.a, value.b


class Split(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return _pack(self.kind, h.relu(), h.sigmoid())


class Merge(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, packed: Any) -> torch.Tensor:
        a, b = _unpack(self.kind, packed)
        out: torch.Tensor = self.lin(a * b)
        return out


class Packed(nn.Module):
    """Stage ``split`` returns a container; stage ``merge`` takes it as its input."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.split = Split(kind)
        self.merge = Merge(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.merge(self.split(x))
        return out


@pytest.mark.parametrize("kind", ["namespace", "object", "deque", "cache"])
def test_tensors_in_other_containers_get_record_stream(kind: str) -> None:
    backend = SimulatedBackend(keep_all=True)
    model = ooo_wrap.OOOModule(Packed(kind), backend=backend, planner="static")
    model(torch.randn(4, 8))
    # split: x in, two tensors out; merge: the two in, one out.
    assert model.stats.record_streams == 1 + 2 + 2 + 1
    assert not [e for e in model.events if e.kind is EventKind.UNTRACKED]


@pytest.mark.parametrize("kind", ["namespace", "object", "deque", "cache"])
def test_check_is_clean_on_tensors_in_other_containers(kind: str) -> None:
    report = check(Packed(kind), torch.randn(4, 8), planner="static")
    assert report.ok, str(report)


def test_an_output_the_hooks_cannot_see_into_is_reported_once() -> None:
    model = ooo_wrap.OOOModule(Packed("deep"), backend=SimulatedBackend(), planner="static")
    for _ in range(3):
        model(torch.randn(4, 8))
    untracked = [e for e in model.events if e.kind is EventKind.UNTRACKED]
    assert [(e.stage, e.reason, e.count) for e in untracked] == [
        ("split", "Holder", 1),
        ("merge", "Holder", 1),
    ]
    assert "record_stream" in untracked[0].message


def test_named_tensors_spells_each_path() -> None:
    t = torch.ones(1)
    pair = collections.namedtuple("pair", "a b")
    value = (t, {"sum": types.MappingProxyType({"x": [t]})}, pair(t, 1), _Holder(t))
    names = [name for name, _ in named_tensors(value, "output")]
    assert names == [
        "output[0]",
        "output[1]['sum']['x'][0]",
        "output[2].a",
        "output[3].tensor",
    ]


def test_map_leaves_rebuilds_the_containers() -> None:
    pair = collections.namedtuple("pair", "a b")
    value = {"k": [1, pair(2, (3,))]}
    assert map_leaves(lambda x: x * 10, value) == {"k": [10, pair(20, (30,))]}


@dataclasses.dataclass
class _Holder:
    tensor: torch.Tensor


class NamespaceOut(nn.Module):
    """Two towers whose model returns its result in a plain object."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.left(x) + self.right(x), step=1)


def test_the_checker_sees_the_tensors_the_hooks_see() -> None:
    # One walker: check() (its default loss, its parity) finds an output the stage hooks
    # find, in a plain object too. With a walker of its own it found no tensor there and
    # refused the model ("no floating-point tensor that requires grad").
    value = (
        types.SimpleNamespace(logits=torch.ones(1), lr=0.1),
        collections.deque([torch.ones(1)]),
    )
    assert [name for name, _ in named_tensors(value, "output")] == [
        "output[0].logits",
        "output[1][0]",
    ]
    report = check(NamespaceOut(), torch.randn(4, 8), planner="static")
    assert report.ok, str(report)
    assert "output.logits" in {entry.name for entry in report.parity}


def test_map_leaves_rebuilds_registered_containers_and_keeps_dict_kinds() -> None:
    value = {"q": collections.deque([1, 2]), "d": collections.defaultdict(list, {"k": 3})}
    mapped = map_leaves(lambda x: x * 10, value)
    assert mapped["q"] == collections.deque([10, 20])
    assert isinstance(mapped["d"], collections.defaultdict) and mapped["d"]["k"] == 30
    assert mapped["d"]["missing"] == []  # the factory kept


class Stash(nn.Module):
    """A stage that keeps its result in an attribute, its own or (``sink``) another
    object's, and returns None."""

    def __init__(self, sink: types.SimpleNamespace | None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.last: torch.Tensor | None = None
        self.sink = sink

    def forward(self, x: torch.Tensor) -> None:
        result = self.lin(x).tanh()
        if self.sink is not None:
            self.sink.last = result
        else:
            self.last = result


class Escape(nn.Module):
    """Reads the left stage's result from where it kept it."""

    def __init__(self, elsewhere: bool = False) -> None:
        super().__init__()
        self.sink = types.SimpleNamespace(last=None) if elsewhere else None
        self.left = Stash(self.sink)
        self.right = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.left(x)
        kept = self.left.last if self.sink is None else self.sink.last
        assert kept is not None
        out: torch.Tensor = kept + self.right(x)
        return out


@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_a_result_kept_in_the_stages_attribute_is_recorded_for_the_caller(planner: str) -> None:
    torch.manual_seed(0)
    report = check(Escape(), torch.randn(4, 8), stages=["left", "right"], planner=planner, steps=3)
    assert report.ok, str(report)
    kept = [note for note in report.notes if "untracked/attribute [left]" in note]
    assert len(kept) == 1 and "self.last" in kept[0], report.notes


def test_the_attribute_is_recorded_once_per_call_and_reported_once() -> None:
    backend = SimulatedBackend()
    model = ooo_wrap.OOOModule(
        Escape(), streams=2, backend=backend, stages=["left", "right"], planner="static"
    )
    before = model.stats.record_streams
    for _ in range(2):
        model(torch.randn(4, 8))
    # Per call: x to left and to right, right's output, and left's kept result.
    assert model.stats.record_streams - before == 2 * 4
    events = [e for e in model.events if e.kind is EventKind.UNTRACKED]
    assert [(e.reason, e.stage, e.count) for e in events] == [("attribute", "left", 1)]


def test_without_recording_the_kept_result_the_check_finds_the_hazard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The mutation: the stage's attributes are never looked at.
    def nothing(stage: Any, attributes: dict[str, Any]) -> None:
        stage.attributes, stage.attributes_seen = (), len(attributes)

    monkeypatch.setattr(scheduler_module, "_list_attributes", nothing)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    report = check(Escape(), x, stages=["left", "right"], planner="static", tune_arm="static")
    assert [str(h.access) for h in report.allocator_hazards] == [
        "read by aten.add.Tensor on default (forward) of float32[4, 8]"
    ], str(report)
    assert "hint: code outside the stages used a tensor a stage made" in str(report)


def test_a_result_kept_elsewhere_is_reported_with_what_to_do() -> None:
    # Kept in another object's attribute: no hook sees it.
    torch.manual_seed(0)
    report = check(
        Escape(elsewhere=True), torch.randn(4, 8), stages=["left", "right"], planner="static"
    )
    assert not report.ok
    assert "return it from the stage's forward()" in str(report)
