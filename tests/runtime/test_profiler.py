"""``profile_ranges=True``: each stage call inside ``record_function("ooo/<stage>")``."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import ooo_wrap
from ooo_wrap._runtime.scheduler import Scheduler
from ooo_wrap.testing import SimulatedBackend


class Towers(nn.Module):
    def __init__(self, towers: int = 3) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(towers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(tower(x) for tower in self.towers)  # type: ignore[return-value]


class Boom(nn.Module):
    """A stage that raises while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom")
        return self.linear(x)


class TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = Boom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _profiled(fn: object) -> list[torch.autograd.profiler_util.FunctionEvent]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()  # type: ignore[operator]
    return list(prof.events())


def _ooo_counts(events: list[torch.autograd.profiler_util.FunctionEvent]) -> dict[str, int]:
    return dict(collections.Counter(e.name for e in events if e.name.startswith("ooo/")))


def test_each_stage_call_gets_one_range_named_after_the_stage() -> None:
    model = ooo_wrap.OOOModule(
        Towers(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    x = torch.randn(4, 8)

    def two_steps() -> None:
        for _ in range(2):
            model(x).sum().backward()

    counts = _ooo_counts(_profiled(two_steps))
    assert counts == {"ooo/towers.0": 2, "ooo/towers.1": 2, "ooo/towers.2": 2}


def test_the_range_holds_the_stage_forward() -> None:
    model = ooo_wrap.OOOModule(
        Towers(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    events = _profiled(lambda: model(torch.randn(4, 8)))
    ranges = [e for e in events if e.name.startswith("ooo/")]
    assert len(ranges) == 3
    for stage_range in ranges:
        children = [child.name for child in stage_range.cpu_children]
        assert children.count("aten::linear") == 2
        assert "aten::relu" in children


def test_no_ranges_when_off_and_the_plain_hooks_are_installed() -> None:
    model = ooo_wrap.OOOModule(Towers(), backend=SimulatedBackend(), planner="static")
    assert _ooo_counts(_profiled(lambda: model(torch.randn(4, 8)))) == {}
    # Off means the base scheduler's own hooks, chosen at wrap time: no per-call check.
    hooks = list(model.towers[0]._forward_pre_hooks.values())
    assert [hook.func for hook in hooks] == [Scheduler._stage_pre_hook]
    hooks = list(model.towers[0]._forward_hooks.values())
    assert [hook.func for hook in hooks] == [Scheduler._stage_post_hook]


def test_range_is_closed_when_the_stage_raises() -> None:
    backend = SimulatedBackend()
    model = ooo_wrap.OOOModule(TwoStages(), backend=backend, profile_ranges=True, planner="static")
    model.second.armed = True

    def fail_then_mark() -> None:
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 8))
        with record_function("after"):
            pass

    events = _profiled(fail_then_mark)
    assert _ooo_counts(events) == {"ooo/first": 1, "ooo/second": 1}
    (after,) = [e for e in events if e.name == "after"]
    assert after.cpu_parent is None  # not left inside a dangling stage range
    failed = next(e for e in events if e.name == "ooo/second")
    assert failed.time_range.end <= after.time_range.start
    assert str(backend.current_stream()) == "default"
    model.second.armed = False
    assert _ooo_counts(_profiled(lambda: model(torch.randn(2, 8)))) == {
        "ooo/first": 1,
        "ooo/second": 1,
    }


def test_every_range_opened_is_closed_explicitly_even_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str]] = []

    class Spy(record_function):
        def __enter__(self) -> Spy:
            calls.append(("enter", self.name))
            return super().__enter__()  # type: ignore[no-any-return]

        def __exit__(self, *exc: object) -> None:
            calls.append(("exit", self.name))
            super().__exit__(*exc)

    monkeypatch.setattr(torch.profiler, "record_function", Spy)
    model = ooo_wrap.OOOModule(
        TwoStages(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    model.second.armed = True
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 8))
    # Closed by the post-hook itself, not left to garbage collection of the frame.
    assert calls == [
        ("enter", "ooo/first"),
        ("exit", "ooo/first"),
        ("enter", "ooo/second"),
        ("exit", "ooo/second"),
    ]


def test_bypassed_calls_keep_their_range() -> None:
    model = ooo_wrap.OOOModule(
        Towers(2), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )

    def run_disabled() -> None:
        with ooo_wrap.disabled():
            model(torch.randn(4, 8))

    assert _ooo_counts(_profiled(run_disabled)) == {"ooo/towers.0": 1, "ooo/towers.1": 1}
    assert model.stats.bypasses == 2
    assert model.stats.stage_calls == 0


def test_same_outputs_and_gradients_as_the_plain_model() -> None:
    plain = Towers()
    wrapped = ooo_wrap.OOOModule(
        Towers(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    with profile(activities=[ProfilerActivity.CPU]):
        out = wrapped(x)
        out.sum().backward()
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), q in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert wrapped.stats.stage_calls == 3


def test_ranges_are_harmless_outside_a_profiler() -> None:
    model = ooo_wrap.OOOModule(
        Towers(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    model(torch.randn(4, 8)).sum().backward()  # record_function is a no-op unprofiled
    assert model.stats.stage_calls == 3


@pytest.mark.parametrize("value", [1, "yes", None])
def test_profile_ranges_must_be_a_bool(value: object) -> None:
    with pytest.raises(ooo_wrap.OOOConfigError, match="profile_ranges must be True or False"):
        ooo_wrap.OOOModule(
            Towers(), backend=SimulatedBackend(), profile_ranges=value, planner="static"
        )  # type: ignore[arg-type]


def test_a_jit_trace_keeps_the_ranges() -> None:
    model = ooo_wrap.OOOModule(
        Towers(2), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        # torch.jit.trace is deprecated in recent torch; tracing is still what is tested here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, x)
    assert model.stats.bypasses >= 2  # traced inline (the trace check also runs it eagerly)
    assert _ooo_counts(_profiled(lambda: traced(x))) == {"ooo/towers.0": 1, "ooo/towers.1": 1}


def test_compiled_calls_run_inline_without_ranges() -> None:
    model = ooo_wrap.OOOModule(
        Towers(2), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    counts = _ooo_counts(_profiled(lambda: torch.testing.assert_close(compiled(x), model(x))))
    # The eager call has its ranges; the compiled one bypasses the scheduler entirely.
    assert counts == {"ooo/towers.0": 1, "ooo/towers.1": 1}
    assert model.stats.forwards == 1 and model.stats.stage_calls == 2  # the eager call
    assert [e.reason for e in model.events if e.kind is ooo_wrap.EventKind.BYPASSED] == [
        "compiling"
    ]


@pytest.mark.cuda
def test_ranges_on_a_gpu() -> None:
    model = ooo_wrap.OOOModule(Towers().cuda(), profile_ranges=True, planner="static")
    assert isinstance(model, ooo_wrap.OOOModule)
    x = torch.randn(4, 8, device="cuda")
    events = _profiled(lambda: model(x).sum().backward())
    assert _ooo_counts(events) == {"ooo/towers.0": 1, "ooo/towers.1": 1, "ooo/towers.2": 1}
    torch.cuda.synchronize()


def test_a_range_that_failed_to_open_closes_nothing_on_the_stages_reused_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stage's frame is reused call after call: a range the pre-hook could not open
    must not close the previous call's range a second time."""
    calls: list[tuple[str, str]] = []
    refuse = False

    class Spy(record_function):
        def __enter__(self) -> Spy:
            if refuse:
                raise RuntimeError("profiler refused")
            calls.append(("enter", self.name))
            return super().__enter__()  # type: ignore[no-any-return]

        def __exit__(self, *exc: object) -> None:
            calls.append(("exit", self.name))
            super().__exit__(*exc)

    monkeypatch.setattr(torch.profiler, "record_function", Spy)
    model = ooo_wrap.OOOModule(
        TwoStages(), backend=SimulatedBackend(), profile_ranges=True, planner="static"
    )
    model(torch.randn(2, 8))
    refuse = True
    with pytest.raises(RuntimeError, match="profiler refused"):
        model(torch.randn(2, 8))
    assert calls == [
        ("enter", "ooo/first"),
        ("exit", "ooo/first"),
        ("enter", "ooo/second"),
        ("exit", "ooo/second"),
    ]
