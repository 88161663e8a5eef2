"""After any forward the caller's current stream is the one it had before, whatever the layout.

Layouts where hooks of more than one wrapped model meet, or where the root runs inside one
of its own stages: each must leave the stream and the per-thread state as they were, and
count only the calls of the model the stats belong to.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError
from ooo_wrap._runtime.inflight import thread_state
from ooo_wrap._wrapper.lifecycle import WrapState
from ooo_wrap.testing import SimulatedBackend, VirtualStream
from tests.support.models import make_two_towers, two_tower_input

DEFAULT = VirtualStream(0)


class Pair(nn.Module):
    """Two stages, the first of which may be a module shared with another model."""

    def __init__(self, first: nn.Module, dim: int = 4) -> None:
        super().__init__()
        self.first = first
        self.second = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.first(x) + self.second(x)
        return out


def _in_flight() -> tuple[list[object], list[object]]:
    return list(thread_state.frames), list(thread_state.calls)


def test_two_models_sharing_a_stage_module_leave_the_callers_stream() -> None:
    backend = SimulatedBackend()
    shared = nn.Linear(4, 4)
    a, b = Pair(shared), Pair(shared)
    ooo_wrap.OOOModule(a, backend=backend, planner="static")
    ooo_wrap.OOOModule(b, backend=backend, planner="static")
    x = two_tower_input()
    for model in (a, b, a):
        model(x).sum().backward()
        assert backend.current_stream() == DEFAULT, f"leaked after {'a' if model is a else 'b'}"
        assert _in_flight() == ([], [])
    # Stats count only each model's own calls: a ran twice, b once, two stages each.
    assert a.stats.forwards == 2 and a.stats.stage_calls == 4
    assert b.stats.forwards == 1 and b.stats.stage_calls == 2
    assert not [e for m in (a, b) for e in m.events if e.kind is EventKind.STAGE_FAILED]


def test_a_stage_shared_by_two_models_called_on_its_own_forks_once() -> None:
    backend = SimulatedBackend(keep_all=True)
    shared = nn.Linear(4, 4)
    a, b = Pair(shared), Pair(shared)
    ooo_wrap.OOOModule(a, backend=backend, planner="static")
    ooo_wrap.OOOModule(b, backend=backend, planner="static")
    backend.clear_log()
    shared(two_tower_input())  # e.g. a checkpoint recomputing it outside any forward
    assert backend.current_stream() == DEFAULT
    assert [c.op for c in backend.log].count("set_stream") == 2  # one fork, one restore
    assert a.stats.stage_calls + b.stats.stage_calls == 1


def test_wrapping_a_sub_module_of_a_wrapped_model_is_refused() -> None:
    model = make_two_towers()
    ooo_wrap.OOOModule(model, backend=SimulatedBackend(), planner="static")
    inner = model.towers[0]
    with pytest.raises(OOOConfigError, match=r"'towers\.0'"):
        ooo_wrap.OOOModule(inner, backend=SimulatedBackend(), planner="static")
    assert not isinstance(inner, ooo_wrap.OOOModule)


def test_wrapping_the_parent_of_a_wrapped_model_is_refused() -> None:
    inner = make_two_towers()
    ooo_wrap.OOOModule(inner, backend=SimulatedBackend(), planner="static")
    outer = Pair(inner)
    with pytest.raises(OOOConfigError, match="'first'"):
        ooo_wrap.OOOModule(outer, backend=SimulatedBackend(), planner="static")
    assert type(outer) is Pair
    outer(two_tower_input())


class Recursive(nn.Module):
    """A model whose first stage calls the whole model again, ``depth`` levels deep."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.first = _CallsRoot(self, dim)
        self.second = nn.Linear(dim, dim)
        self.depth = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.first(x) + self.second(x)
        return out


class _CallsRoot(nn.Module):
    def __init__(self, root: Recursive, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self._root = [root]  # a plain list: not a sub-module, no module cycle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root = self._root[0]
        out: torch.Tensor = self.lin(x)
        if root.depth < 2:
            root.depth += 1
            out = out + root(x)
        return out


def test_the_root_called_from_inside_one_of_its_stages() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = Recursive()
    plain_out = Recursive()
    plain_out.load_state_dict(model.state_dict())
    expected = plain_out(two_tower_input())
    ooo_wrap.OOOModule(model, backend=backend, planner="static")
    backend.clear_log()
    out = model(two_tower_input())
    log = backend.log
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert backend.current_stream() == DEFAULT
    assert _in_flight() == ([], [])
    assert not [e for e in model.events if e.kind is EventKind.STAGE_FAILED]
    assert model.stats.forwards == 3 and model.stats.stage_calls == 6
    # Every forward, the outer one included, joins both stage streams at its end: the
    # log ends with the outer root's two joins onto the caller's stream.
    tail = [(c.op, c.stream) for c in log[-5:]]
    assert tail[0] == ("current_stream", DEFAULT)
    assert [op for op, _ in tail[1:]] == ["record_event", "wait_event"] * 2
    assert tail[2][1] == DEFAULT and tail[4][1] == DEFAULT


class Router(nn.Module):
    """A stage that runs ``actions`` from inside its forward (an MoE router that replans)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.actions: list[Callable[[], object]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for action in self.actions:
            action()
        out: torch.Tensor = self.lin(x)
        return out


class Routed(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.router = Router(dim)
        self.expert = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.router(x) + self.expert(x)
        return out


CALLS: dict[str, Callable[[nn.Module], object]] = {
    "replan": lambda model: model.replan(),  # type: ignore[operator]
    "unwrap": ooo_wrap.unwrap,
}


def _nothing_in_flight() -> bool:
    return not thread_state.frames and not thread_state.calls


def _routed(backend: SimulatedBackend, planner: str) -> Routed:
    model = Routed()
    ooo_wrap.OOOModule(model, backend=backend, stages=["router", "expert"], planner=planner)
    model(two_tower_input()).sum().backward()  # the dataflow planner learns its plan here
    return model


@pytest.mark.parametrize("name", sorted(CALLS))
def test_replan_or_unwrap_inside_a_stage_is_refused_and_the_forward_goes_on(name: str) -> None:
    backend = SimulatedBackend()
    model = _routed(backend, "dataflow")
    calls = model.stats.stage_calls
    refusals: list[str] = []

    def call() -> None:
        try:
            CALLS[name](model)
        except ooo_wrap.OOOError as error:
            refusals.append(str(error))

    model.router.actions.append(call)
    model(two_tower_input()).sum().backward()
    assert backend.current_stream() == DEFAULT and _nothing_in_flight()
    assert len(refusals) == 1 and f"{name}()" in refusals[0], refusals
    assert isinstance(model, ooo_wrap.OOOModule) and model.stats.stage_calls == calls + 2
    model.router.actions.clear()
    CALLS[name](model)  # between forwards: done
    model(two_tower_input()).sum().backward()
    assert backend.current_stream() == DEFAULT and _nothing_in_flight()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_uncaught_refusal_leaves_the_model_working(name: str) -> None:
    backend = SimulatedBackend()
    model = _routed(backend, "dataflow")
    model.router.actions.append(lambda: CALLS[name](model))
    with pytest.raises(ooo_wrap.OOOError, match=rf"{name}\(\)"):
        model(two_tower_input())
    assert backend.current_stream() == DEFAULT and _nothing_in_flight()
    model.router.actions.clear()
    calls = model.stats.stage_calls
    model(two_tower_input()).sum().backward()
    assert model.stats.stage_calls == calls + 2 and backend.current_stream() == DEFAULT


def test_unwrap_inside_the_learning_forward_is_refused() -> None:
    """The dataflow planner observes its first training forward under a dispatch mode,
    left by the root's post-hook, which unwrap() would remove."""
    model = Routed()
    ooo_wrap.OOOModule(model, backend=SimulatedBackend(), stages=["router", "expert"])
    model.router.actions.append(lambda: ooo_wrap.unwrap(model))
    with pytest.raises(ooo_wrap.OOOError, match=r"unwrap\(\)"):
        model(two_tower_input())
    assert torch._C._len_torch_dispatch_stack() == 0
    model.router.actions.clear()
    model(two_tower_input()).sum().backward()
    assert not model.plan.pending and torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("name", sorted(CALLS))
def test_without_the_refusal_the_side_stream_stays_current(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The refusal is what keeps the stream: with it gone, the call removes the hooks and
    the running stage's post-hook never restores the caller's stream."""
    backend = SimulatedBackend()
    model = _routed(backend, "dataflow")
    model.router.actions.append(lambda: CALLS[name](model))
    monkeypatch.setattr(WrapState, "_refuse_inside_forward", lambda *args: None)
    try:
        model(two_tower_input())
        assert backend.current_stream() != DEFAULT
    finally:  # undo the leak for the tests after this one
        backend.set_stream(DEFAULT)
        thread_state.frames.clear()
        thread_state.calls.clear()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_replan_or_unwrap_after_an_interrupted_forward_restores_the_stream(name: str) -> None:
    """A bare ``BaseException`` skips PyTorch's always-called hooks: the interrupted
    forward is over, so the call is not refused, and it undoes what was left in flight."""
    backend = SimulatedBackend()
    model = _routed(backend, "dataflow")

    def interrupt() -> None:
        raise KeyboardInterrupt

    model.router.actions.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(two_tower_input())
    assert backend.current_stream() != DEFAULT
    model.router.actions.clear()
    CALLS[name](model)
    assert backend.current_stream() == DEFAULT and _nothing_in_flight()
    model(two_tower_input()).sum().backward()
    assert backend.current_stream() == DEFAULT and _nothing_in_flight()
