"""``overlap_forward=True``: stage joins deferred until first touch, checked and logged."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap.testing import SimulatedBackend, VirtualStream, check
from tests.support import overlap_models as om

DEFAULT = VirtualStream(0)


def _wrap(model: nn.Module) -> SimulatedBackend:
    backend = SimulatedBackend(keep_all=True)
    ooo_wrap.OOOModule(model, backend=backend, overlap_forward=True, planner="static")
    return backend


def _idle() -> bool:
    """Nothing pending and the join mode off the stack, on this thread."""
    return om.pending_joins() == 0 and torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("name", sorted(om.ACCEPTANCE))
def test_acceptance_models_are_clean_with_bitwise_parity(name: str) -> None:
    torch.manual_seed(0)
    report = check(om.ACCEPTANCE[name](), om.inputs(), overlap_forward=True, planner="static")
    assert report.ok, str(report)
    assert all(entry.max_abs_diff == 0.0 for entry in report.parity)
    assert _idle()


@pytest.mark.parametrize("factory", [om.NestedCall, om.InPlaceFill, om.TowersReturned])
def test_more_models_are_clean(factory: type[nn.Module]) -> None:
    """A stage called inside another's forward, a stage writing into a view of a buffer
    the next stage reads, and towers returned untouched."""
    torch.manual_seed(0)
    report = check(factory(), om.inputs(), overlap_forward=True, planner="static")
    assert report.ok, str(report)
    assert _idle()


def _join_of(log: list[ooo_wrap.testing.StreamCall], stream: VirtualStream) -> tuple[int, int]:
    """(index of the stage's join-event record, index of the caller's wait on it)."""
    record = next(i for i, c in enumerate(log) if c.op == "record_event" and c.stream == stream)
    event = log[record].event
    wait = next(
        i
        for i, c in enumerate(log)
        if c.op == "wait_event" and c.stream == DEFAULT and c.event == event
    )
    return record, wait


@pytest.mark.parametrize("factory", [om.TowersSum, om.TowersCat])
def test_the_second_tower_forks_before_the_first_is_joined(factory: type[nn.Module]) -> None:
    model = factory()
    backend = _wrap(model)
    start = len(backend.log)
    model(om.inputs())
    log = list(backend.log)[start:]
    side1, side2 = VirtualStream(1), VirtualStream(2)
    _, first_joined = _join_of(log, side1)
    second_forked = next(i for i, c in enumerate(log) if c.op == "wait_event" and c.stream == side2)
    assert second_forked < first_joined
    assert _idle()


def test_without_overlap_the_first_tower_is_joined_before_the_second_forks() -> None:
    model = om.TowersSum()
    backend = SimulatedBackend(keep_all=True)
    ooo_wrap.OOOModule(model, backend=backend, planner="static")
    start = len(backend.log)
    model(om.inputs())
    log = list(backend.log)[start:]
    _, first_joined = _join_of(log, VirtualStream(1))
    second_forked = next(
        i for i, c in enumerate(log) if c.op == "wait_event" and c.stream == VirtualStream(2)
    )
    assert first_joined < second_forked


def test_the_trace_shows_the_towers_forward_concurrent() -> None:
    report = check(
        om.TowersSum(),
        om.inputs(),
        overlap_forward=True,
        steps=1,
        planner="static",
        tune_arm="static+overlap",
    )
    forward = [r for r in report.trace if r.phase == "forward" and r.stage is not None]
    by_stage = {r.stage: dict(r.clock) for r in forward if r.op == "aten.addmm.default"}
    first, second = by_stage["towers.0"], by_stage["towers.1"]
    # Neither op happens before the other: each saw only part of the other's stream.
    assert first.get(2, 0) < second[2] and second.get(1, 0) < first[1]
    plain = check(om.TowersSum(), om.inputs(), steps=1, planner="static", tune_arm="static")
    rows = [r for r in plain.trace if r.op == "aten.addmm.default" and r.phase == "forward"]
    plain_clocks = {r.stage: dict(r.clock) for r in rows}
    assert plain_clocks["towers.1"].get(1, 0) >= plain_clocks["towers.0"][1]


def test_a_stage_reading_a_pending_output_through_an_attribute_is_reported() -> None:
    """The hooks see arguments only: a documented limit that check() catches."""
    report = check(om.AttributeEscape(), om.inputs(), overlap_forward=True, planner="static")
    assert any(
        r.earlier.stage == "a" and r.later.stage == "b" and r.later.stream != r.earlier.stream
        for r in report.races
    ), str(report)
    # With eager joins the read is ordered (its missing record_stream is reported either way).
    assert check(om.AttributeEscape(), om.inputs(), planner="static").races == ()


@pytest.mark.parametrize("factory", [om.ThreadRead, om.DisabledRead])
def test_a_read_the_join_mode_cannot_see_is_reported(factory: type[nn.Module]) -> None:
    """Documented limits that check() catches: a pending output read on another thread,
    or under ``torch._C.DisableTorchFunction()``."""
    report = check(factory(), om.inputs(), overlap_forward=True, planner="static")
    assert any(
        r.earlier.stage == "a" and (r.later.stream, r.later.op) == ("default", "aten.mul.Tensor")
        for r in report.races
    ), str(report)
    assert check(factory(), om.inputs(), planner="static").ok  # eager joins order it
    assert _idle()


@pytest.mark.parametrize(
    "touch",
    [
        lambda h: h.item() if h.numel() == 1 else h.sum(),
        lambda h: h.cpu(),
        lambda h: h.tolist(),
        lambda h: repr(h),
        lambda h: h.data_ptr(),
        lambda h: h.shape[0] + 1,
    ],
    ids=["item", "cpu", "tolist", "print", "data_ptr", "shape"],
)
def test_any_touch_at_the_callers_level_joins_first(touch: object) -> None:
    model = om.ParentOpBetween()
    backend = _wrap(model)
    seen: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.a(x)
        seen.append(om.pending_joins())
        touch(h)  # type: ignore[operator]
        seen.append(om.pending_joins())
        return h

    model.forward = forward  # type: ignore[method-assign]
    model(om.inputs())
    assert seen == [1, 0]
    waits = [c for c in backend.log if c.op == "wait_event" and c.stream == DEFAULT]
    assert waits and _idle()


def test_an_exception_out_of_the_forward_joins_all_and_restores_the_stream() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(om.DIM, om.DIM)
            self.second = om.Raises()
            self.third = nn.Linear(om.DIM, om.DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.first(x) + self.second(x) + self.third(x)
            return out

    model = Fails()
    backend = _wrap(model)
    with pytest.raises(ValueError, match="refuses"):
        model(om.inputs())
    assert backend.current_stream(torch.device("cpu")) == DEFAULT
    assert _idle()
    assert [e.kind for e in ooo_wrap.events_for(model)].count(EventKind.STAGE_FAILED) == 1
    model.eval()
    model(om.inputs())  # the next forward starts clean
    assert _idle()


def test_a_stage_that_raises_is_joined_at_once() -> None:
    model = om.FailingSecondTower()
    _wrap(model)
    seen: list[int] = []
    model.third.register_forward_pre_hook(lambda module, args: seen.append(om.pending_joins()))
    model(om.inputs())
    assert seen == [1]  # the first tower still pending; the failed second joined already
    assert _idle()


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_an_inference_forward_keeps_stages_on_side_streams(context: type) -> None:
    model = om.TowersSum()
    _wrap(model)
    with context():
        out = model(om.inputs())
    assert model.stats.stage_calls == 3 and model.stats.bypasses == 0
    assert out.shape == (4, om.DIM) and _idle()
    plain = om.TowersSum()
    ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static")
    with context():
        plain(om.inputs())
    assert plain.stats.stage_calls == 0 and plain.stats.bypasses == 3


def test_an_inference_forward_is_clean_under_the_detector() -> None:
    from ooo_wrap.testing import DetectingBackend, detect

    model = om.TowersCat()
    plain = om.TowersCat()
    plain.load_state_dict(model.state_dict())
    backend = DetectingBackend()
    ooo_wrap.OOOModule(model, backend=backend, overlap_forward=True, planner="static")
    x = om.inputs()
    with detect(backend, keep_alive=[model]) as found, torch.no_grad():
        out = model(x)
        total = out.sum()
    assert found.ok, found.races
    with torch.no_grad():
        assert torch.equal(total, plain(x).sum())


class BarrierTowers(om.TowersSum):
    """Towers whose forward meets another thread's while its joins are pending."""

    barrier = threading.Barrier(2)
    seen: ClassVar[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [tower(x) for tower in self.towers]
        self.barrier.wait()  # both threads hold pending joins now
        self.seen.append(om.pending_joins())
        self.barrier.wait()
        return torch.stack(outs).sum(0)


def test_pending_joins_are_per_thread() -> None:
    model = BarrierTowers()
    _wrap(model)
    idle: list[bool] = []

    def run() -> None:
        with torch.no_grad():
            model(om.inputs())
        idle.append(_idle())

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert BarrierTowers.seen == [3, 3]
    assert idle == [True, True]


def test_without_overlap_no_join_is_ever_pending() -> None:
    model = om.TowersSum()
    ooo_wrap.OOOModule(model, backend=SimulatedBackend(), planner="static")
    seen: list[int] = []
    original = model.towers[1].forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen.append(om.pending_joins())
        return original(x)

    model.towers[1].forward = forward  # type: ignore[method-assign]
    model(om.inputs())
    assert seen == [0] and _idle()


def test_from_config_reads_ooo_overlap_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from ooo_wrap._integrations import config as _config

    asked: list[bool] = []

    def fake(model: nn.Module, streams: int, *, overlap_forward: bool, **_: object) -> nn.Module:
        asked.append(overlap_forward)
        return model

    monkeypatch.setattr(_config, "OOOModule", fake)
    ooo_wrap.from_config(om.TowersSum(), {"ooo_backprop": True, "ooo_overlap_forward": True})
    ooo_wrap.from_config(om.TowersSum(), {"ooo_backprop": True})
    assert asked == [True, False]
    with pytest.raises(ooo_wrap.OOOConfigError, match="ooo_overlap_forward"):
        ooo_wrap.from_config(om.TowersSum(), {"ooo_backprop": True, "ooo_overlap_forward": 1})


def test_overlap_forward_must_be_a_bool() -> None:
    with pytest.raises(ooo_wrap.OOOConfigError, match="overlap_forward must be True or False"):
        ooo_wrap.OOOModule(
            om.TowersSum(), backend=SimulatedBackend(), overlap_forward="yes", planner="static"
        )


class Interrupted(om.TowersSum):
    """Raises KeyboardInterrupt in the parent while a join is pending: PyTorch's
    always-called hooks do not run for it."""

    interrupt = True
    pending_at_start = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pending_at_start = om.pending_joins()
        outs = [tower(x) for tower in self.towers]
        if self.interrupt:
            raise KeyboardInterrupt
        return torch.stack(outs).sum(0)


def test_an_interrupted_forward_is_joined_when_the_next_one_starts() -> None:
    model = Interrupted()
    _wrap(model)
    x = om.inputs()
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert om.pending_joins() == 3  # nothing ran after the interrupt
    model.interrupt = False
    model(x)  # made before: no torch call in between joins
    assert model.pending_at_start == 0  # the root's start joined what was left
    assert _idle()


def test_profile_ranges_and_overlap_forward_together() -> None:
    model = om.TowersSum()
    backend = SimulatedBackend(keep_all=True)
    ooo_wrap.OOOModule(
        model, backend=backend, overlap_forward=True, profile_ranges=True, planner="static"
    )
    with torch.profiler.profile() as prof:
        model(om.inputs()).sum().backward()
    names = {event.name for event in prof.events()}
    assert {"ooo/towers.0", "ooo/towers.1", "ooo/towers.2"} <= names
    assert model.stats.stage_calls == 3 and _idle()


def _defers_and_joins_on_touch() -> bool:
    """A fresh model on this thread still leaves a stage's join pending, and joins it at
    the first parent op."""
    model = om.ParentOpBetween()
    _wrap(model)
    seen: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.a(x)
        seen.append(om.pending_joins())
        h = h * 2
        seen.append(om.pending_joins())
        out: torch.Tensor = model.b(h)
        return out

    model.forward = forward  # type: ignore[method-assign]
    model(om.inputs())
    return seen == [1, 0] and _idle()


@pytest.fixture
def restore_mode_stack() -> Iterator[None]:
    """Pop whatever a failing test left on this thread's mode stack."""
    depth = torch._C._len_torch_function_stack()
    yield
    while torch._C._len_torch_function_stack() > depth:
        torch._C._pop_torch_function_stack()


@pytest.mark.usefixtures("restore_mode_stack")
def test_a_user_mode_around_a_stage_call_keeps_the_joins_and_leaves_with_its_block() -> None:
    report = check(om.UserModeAround(), om.inputs(), overlap_forward=True, planner="static")
    assert report.ok, str(report)
    model = om.UserModeAround()
    _wrap(model)
    model(om.inputs())
    mode = model.modes[-1]
    assert mode.calls > 0  # it saw stage a's ops
    seen = mode.calls
    _ = torch.ones(1) + 1
    assert mode.calls == seen  # off the stack since its block ended
    assert _idle()
    assert _defers_and_joins_on_touch()  # later models on the thread still defer


@pytest.mark.usefixtures("restore_mode_stack")
def test_the_join_mode_is_pushed_again_after_something_removed_it() -> None:
    model = om.TowersSum(2)
    _wrap(model)
    seen: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        first = model.towers[0](x)
        torch.overrides._pop_mode()  # the join mode, as code clearing the mode stack would
        second = model.towers[1](x)
        seen.append(om.pending_joins())
        out = first + second
        seen.append(om.pending_joins())
        return out

    model.forward = forward  # type: ignore[method-assign]
    model(om.inputs())
    assert seen == [2, 0]
    assert _idle() and _defers_and_joins_on_touch()


def test_the_join_mode_stays_above_the_default_device_mode() -> None:
    """``torch.set_default_device`` keeps its mode at the bottom of the stack and checks
    that it is still there when the default changes."""
    model = om.ParentOpBetween()
    _wrap(model)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.a(x)
        torch.set_default_device("cpu")  # while the join mode is on the stack
        out: torch.Tensor = model.b(h * 2)
        return out

    model.forward = forward  # type: ignore[method-assign]
    torch.set_default_device("cpu")
    try:
        model(om.inputs())
        assert om.pending_joins() == 0
    finally:
        torch.set_default_device(None)
    assert _idle()


def test_a_device_block_in_the_forward_leaves_with_its_block() -> None:
    """``with torch.device(...)`` pushes its mode on top and pops the top when it ends, as
    a user's mode does: the join mode must not be above it then."""
    model = om.ParentOpBetween()
    _wrap(model)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.a(x)  # its join is pending: the join mode is on the stack
        with torch.device("meta"):
            h = model.b(h * 2)
        out: torch.Tensor = h * 3
        return out

    model.forward = forward  # type: ignore[method-assign]
    model(om.inputs())
    assert torch.zeros(1).device.type == "cpu"  # the meta block did not outlive its with
    model(om.inputs())
    assert _idle()


@pytest.mark.parametrize("factory", [om.DeepFeed, om.DeepReturn])
def test_a_pending_output_deeper_than_the_search_is_joined(factory: type[nn.Module]) -> None:
    """Passed to the next stage nested too deep, or returned so: the hooks cannot track
    it, so the next stage waits on every pending join, or the stage is joined at once.
    (Its missing ``record_stream`` stays an allocator hazard, with an UNTRACKED event.)"""
    report = check(factory(), om.inputs(), overlap_forward=True, planner="static")
    assert report.races == (), str(report)
    assert _idle()


@pytest.mark.parametrize(
    "factory",
    [
        om.SharedNorm,
        functools.partial(om.SharedBuffer, (True, True)),
        functools.partial(om.SharedBuffer, (True, False)),
        functools.partial(om.SharedBuffer, (False, True)),
        om.TiedUnderAutocast,
    ],
    ids=["batch_norm", "both_write", "first_writes", "second_writes", "tied_under_autocast"],
)
def test_stages_sharing_a_buffer_are_ordered_in_forward(factory: Callable[[], nn.Module]) -> None:
    """Stages that share a parameter or buffer see each other's in-place writes in program
    order, though neither receives the other's outputs."""
    torch.manual_seed(0)
    report = check(factory(), om.inputs(), overlap_forward=True, planner="static")
    assert report.ok, str(report)
    assert all(entry.max_abs_diff == 0.0 for entry in report.parity)
    assert _idle()


def test_a_stage_sharing_nothing_still_forks_before_the_sharing_ones_join() -> None:
    model = om.SharedNorm()
    backend = _wrap(model)
    start = len(backend.log)
    model(om.inputs())
    log = list(backend.log)[start:]
    first, second, third = VirtualStream(1), VirtualStream(2), VirtualStream(3)
    a_done = next(c.event for c in log if c.op == "record_event" and c.stream == first)
    waits = [(c.stream, c.event) for c in log if c.op == "wait_event"]
    assert (second, a_done) in waits  # b updates the statistics a updated
    assert (third, a_done) not in waits  # c has its own
    _, a_joined = _join_of(log, first)
    c_forked = next(i for i, c in enumerate(log) if c.op == "wait_event" and c.stream == third)
    assert c_forked < a_joined
    assert _idle()


def test_a_stage_waits_once_per_stream_on_the_stages_it_shares_with() -> None:
    """Four stages on two streams, all writing one buffer: each waits on the newest
    pending join of the other stream only (that of its own stream is ordered already)."""
    torch.manual_seed(0)
    report = check(om.TiedTallies(), om.inputs(), streams=2, overlap_forward=True, planner="static")
    assert report.ok, str(report)
    model = om.TiedTallies()
    backend = SimulatedBackend(keep_all=True)
    ooo_wrap.OOOModule(model, backend=backend, overlap_forward=True, planner="static", streams=2)
    start = len(backend.log)
    model(om.inputs())
    log = list(backend.log)[start:]
    side_recorded = {
        c.event: c.stream for c in log if c.op == "record_event" and c.stream != DEFAULT
    }
    side_waits = [
        (c.stream, side_recorded[c.event])
        for c in log
        if c.op == "wait_event" and c.stream != DEFAULT and c.event in side_recorded
    ]
    side1, side2 = VirtualStream(1), VirtualStream(2)
    assert side_waits == [(side2, side1), (side1, side2), (side2, side1)]
    assert _idle()


def test_sharing_is_found_once_per_scheduler_not_at_every_arm_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tuning puts an arm's stage hooks on at each of its steps: finding which stages share
    # state walks every parameter, host time charged to the step, so it is done once.
    from ooo_wrap._runtime import deferred

    calls: list[int] = []
    found = deferred.share_state
    monkeypatch.setattr(deferred, "share_state", lambda *a: (calls.append(1), found(*a))[1])
    model = ooo_wrap.OOOModule(
        om.TowersSum(),
        backend=SimulatedBackend(step_time=lambda calls: 1.0),
        planner="static",
        overlap_forward=True,
        split_weight_grads=False,
        tune_arms=1,
    )
    x = om.inputs()
    for _ in range(12):  # plain and the overlap arm take turns: six switches to it
        model(x).sum().backward()
    assert len(calls) == 1


def _flat(model: nn.Module) -> nn.Module:
    """``model`` with every parameter a view of one flat buffer, side by side."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            view = flat[offset : offset + param.numel()].view_as(param)
            setattr(module, name, nn.Parameter(view))
            offset += param.numel()
    return model


def test_parameters_side_by_side_in_one_flat_buffer_share_nothing() -> None:
    # Sharing is by the bytes each tensor spans: towers whose weights sit side by side in
    # one buffer (as fused or sharded optimizers lay them out) still overlap in forward.
    model = _flat(om.TowersSum())
    ooo_wrap.OOOModule(model, backend=SimulatedBackend(), planner="static", overlap_forward=True)
    model(om.inputs())
    from ooo_wrap._wrapper.registry import wrapped

    scheduler = wrapped[model].scheduler
    assert scheduler is not None
    assert [stage.sharing for stage in scheduler._stages] == [(), (), ()]
    report = check(_flat(om.TowersSum()), om.inputs(), overlap_forward=True, planner="static")
    assert report.ok, str(report)
