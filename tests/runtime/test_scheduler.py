"""The per-stage-call protocol of ``_runtime/scheduler.py``, run on virtual streams."""

from __future__ import annotations

import copy
import gc
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ooo_wrap
import ooo_wrap.testing
from ooo_wrap import EventKind, OOOStats
from ooo_wrap._runtime import inflight
from ooo_wrap._wrapper.classswap import _classes
from ooo_wrap._wrapper.registry import wrapped as _wrapped
from ooo_wrap.testing import SimulatedBackend, StreamCall, VirtualEvent, VirtualStream
from tests.support.models import (
    CalledInExcept,
    FailingTowers,
    KwargsDict,
    ProbeTowers,
    StreamProbe,
    TokenModel,
    Towers,
    hook_count,
    make_two_towers,
    two_tower_input,
)

DEFAULT = VirtualStream(0)


def side_streams(backend: SimulatedBackend) -> list[VirtualStream]:
    """The streams created so far, in creation order (stage stream index -> stream)."""
    return [call.stream for call in backend.log if call.op == "new_stream"]


def wrap(model: nn.Module, backend: SimulatedBackend, streams: int = 4) -> list[VirtualStream]:
    """Wrap ``model`` on ``backend``; return the side streams it created."""
    before = len(side_streams(backend))
    assert ooo_wrap.OOOModule(model, streams, backend=backend, planner="static") is model
    return side_streams(backend)[before:]


def thread_state(model: nn.Module) -> tuple[list[object], list[object]]:
    """The calling thread's in-flight frames and calls (``model``'s scheduler's among them)."""
    assert _wrapped[model].scheduler is not None
    return inflight.thread_state.frames, inflight.thread_state.calls


def events_of(model: nn.Module, kind: EventKind) -> list[ooo_wrap.OOOEvent]:
    return [event for event in ooo_wrap.events_for(model) if event.kind is kind]


# --- the protocol, call by call -------------------------------------------------------------


def _stage_calls(
    side: VirtualStream, tensor_in: str, tensor_out: str, fork: str, join: str
) -> list[tuple[str, VirtualStream, str | None, str | None]]:
    """Protocol steps 1-5 for one stage call with one tensor in and one out."""
    return [
        ("current_stream", DEFAULT, None, None),  # ambient
        # record_stream comes before each event record: older CUDA Stream Sanitizers
        # count record_stream as a write on the current stream, which the event must cover.
        ("record_stream", side, None, tensor_in),  # 2. inputs kept alive for s
        ("record_event", DEFAULT, fork, None),  # 1. s waits on ambient ...
        ("wait_event", side, fork, None),
        ("set_stream", side, None, None),  # 3. switch; the stage runs here
        ("record_stream", DEFAULT, None, tensor_out),  # outputs read on ambient
        ("record_event", side, join, None),  # 4. e on s ...
        ("set_stream", DEFAULT, None, None),  # ambient restored
        ("wait_event", DEFAULT, join, None),  # ambient waits on e
    ]


def _match(
    log: tuple[StreamCall, ...],
    expected: list[tuple[str, VirtualStream, str | None, str | None]],
) -> None:
    """``log`` is exactly ``expected``; an event label binds at its record, checks at its wait."""
    assert [(c.op, c.stream, c.tensor) for c in log] == [(o, s, t) for o, s, _, t in expected]
    bound: dict[str, VirtualEvent] = {}
    for call, (op, _, label, _) in zip(log, expected, strict=True):
        if label is None:
            assert call.event is None, call
        elif op == "record_event":
            assert call.event is not None and call.event.stream == call.stream
            assert label not in bound, f"{label} recorded twice"
            bound[label] = call.event
        else:
            assert call.event == bound[label], f"{call} should wait on {label}"
    assert len(set(bound.values())) == len(bound)  # every event is a fresh one


def test_two_tower_forward_log_is_exactly_the_protocol_sequence() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    streams = wrap(model, backend)
    assert [c.op for c in backend.log] == ["new_stream", "new_stream"]
    s0, s1 = streams
    assert s0 != s1 and DEFAULT not in streams
    assert [(s.name, streams[s.stream]) for s in model.plan.stages] == [
        ("towers.0", s0),
        ("towers.1", s1),
    ]
    backend.clear_log()

    model(two_tower_input())

    t = "float32[3, 4]"
    expected = [
        *_stage_calls(s0, t, t, fork="fork0", join="join0"),
        *_stage_calls(s1, t, t, fork="fork1", join="join1"),
        # 5. root post-hook: the caller's stream waits on every stage stream used.
        ("current_stream", DEFAULT, None, None),
        ("record_event", s0, "end0", None),
        ("wait_event", DEFAULT, "end0", None),
        ("record_event", s1, "end1", None),
        ("wait_event", DEFAULT, "end1", None),
    ]
    _match(backend.log, expected)
    assert {call.thread for call in backend.log} == {threading.current_thread().name}
    assert backend.current_stream() == DEFAULT


def test_stages_sharing_a_stream_are_joined_once_at_the_end() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    (s0,) = wrap(model, backend, streams=1)
    backend.clear_log()
    model(two_tower_input())
    t = "float32[3, 4]"
    _match(
        backend.log,
        [
            *_stage_calls(s0, t, t, fork="fork0", join="join0"),
            *_stage_calls(s0, t, t, fork="fork1", join="join1"),
            ("current_stream", DEFAULT, None, None),
            ("record_event", s0, "end", None),
            ("wait_event", DEFAULT, "end", None),
        ],
    )


def test_backward_makes_no_stream_calls() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    wrap(model, backend)
    loss = model(two_tower_input()).sum()
    backend.clear_log()
    loss.backward()
    assert backend.log == ()


def test_every_tensor_in_args_kwargs_and_nested_outputs_gets_record_stream() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = KwargsDict(dim=6)
    enc_stream, dec_stream, out_stream = wrap(model, backend, streams=3)
    backend.clear_log()
    model(torch.randn(5, 6), scale=torch.rand(6))
    records = [(c.stream, c.tensor) for c in backend.log if c.op == "record_stream"]
    assert records == [
        (enc_stream, "float32[5, 6]"),  # enc: x
        (enc_stream, "float32[6]"),  # enc: scale=
        (DEFAULT, "float32[5, 6]"),  # enc out: {"h", "gate"}
        (DEFAULT, "float32[5, 6]"),
        (dec_stream, "float32[5, 6]"),  # dec: x
        (dec_stream, "float32[6]"),  # dec: scale=
        (dec_stream, "float32[5, 6]"),  # dec: bias=
        (DEFAULT, "float32[5, 6]"),
        (DEFAULT, "float32[5, 6]"),
        (out_stream, "float32[5, 6]"),  # out: x
        (DEFAULT, "float32[5, 2]"),  # out
    ]
    assert model.stats.record_streams == len(records)


def test_integer_inputs_get_record_stream_too() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = TokenModel()
    embed_stream = wrap(model, backend)[0]
    backend.clear_log()
    model(torch.randint(0, TokenModel.VOCAB, (2, 3)))
    first = next(c for c in backend.log if c.op == "record_stream")
    assert (first.stream, first.tensor) == (embed_stream, "int64[2, 3]")


# --- stats ------------------------------------------------------------------------------------


def test_stats_counters_are_exact_for_two_towers() -> None:
    model = make_two_towers()
    wrap(model, SimulatedBackend())
    assert model.stats == OOOStats()
    x = two_tower_input()
    for _ in range(5):
        model(x).sum().backward()
    # Per forward: 2 stage calls, 2 forks, 1 input + 1 output per stage, 2 stage joins
    # plus 2 streams joined at the end.
    assert model.stats == OOOStats(
        forwards=5, stage_calls=10, waits=10, record_streams=20, joins=20, bypasses=0
    )


def test_stats_counters_are_exact_with_more_stages_than_streams() -> None:
    model = Towers(n=3)
    wrap(model, SimulatedBackend(), streams=2)
    model(torch.randn(2, 6))
    # 4 stages (3 towers and a head) on 2 streams: 4 stage joins + 2 final joins.
    assert model.stats == OOOStats(
        forwards=1, stage_calls=4, waits=4, record_streams=8, joins=6, bypasses=0
    )


def test_stats_is_a_frozen_snapshot() -> None:
    model = make_two_towers()
    wrap(model, SimulatedBackend())
    before = model.stats
    model(two_tower_input())
    assert before == OOOStats()
    assert model.stats.forwards == 1
    with pytest.raises(AttributeError):
        model.stats.forwards = 3  # type: ignore[misc]


# --- exceptions -------------------------------------------------------------------------------


class StageError(Exception):
    pass


@pytest.mark.parametrize("failing", [0, 1])
def test_a_stage_that_raises_restores_the_stream_and_propagates_unchanged(failing: int) -> None:
    backend = SimulatedBackend(keep_all=True)
    model = FailingTowers()
    plain = copy.deepcopy(model)
    wrap(model, backend)
    x = two_tower_input()
    error = StageError("tower exploded")
    model.towers[failing].fail_with = error

    with pytest.raises(StageError) as info:
        model(x)

    assert info.value is error
    assert error.__cause__ is None and error.__context__ is None
    assert backend.current_stream() == DEFAULT
    assert [c.stream for c in backend.log if c.op == "set_stream"][-1] == DEFAULT
    (failed,) = events_of(model, EventKind.STAGE_FAILED)
    assert failed.stage == f"towers.{failing}"
    assert failed.reason == "StageError"
    assert failed.count == 1
    assert model.stats.failures == 1
    assert thread_state(model) == ([], [])

    model.towers[failing].fail_with = None
    out = model(x)
    assert torch.equal(out, plain(x))
    out.sum().backward()
    assert backend.current_stream() == DEFAULT
    assert model.stats.stage_calls == (failing + 1) + 2  # the failed call counts too
    assert model.stats.failures == 1
    assert thread_state(model) == ([], [])


def test_repeated_failures_are_one_counted_event() -> None:
    model = FailingTowers()
    wrap(model, SimulatedBackend())
    model.towers[1].fail_with = StageError("again")
    for _ in range(5):
        with pytest.raises(StageError):
            model(two_tower_input())
    (failed,) = events_of(model, EventKind.STAGE_FAILED)
    assert failed.count == 5
    assert model.stats.failures == 5


def test_keyboard_interrupt_in_a_stage_does_not_leave_the_caller_on_a_side_stream() -> None:
    # torch runs always_call hooks only for ``Exception``; after a KeyboardInterrupt
    # (Ctrl-C in a notebook) the next forward must still start and end on the caller's
    # stream, with no stale in-flight state.
    backend = SimulatedBackend()
    model = FailingTowers()
    wrap(model, backend)
    model.towers[1].fail_with = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        model(two_tower_input())
    model.towers[1].fail_with = None
    model(two_tower_input())
    assert backend.current_stream() == DEFAULT
    assert thread_state(model) == ([], [])


def test_a_stage_called_inside_an_except_block_is_not_a_failure() -> None:
    backend = SimulatedBackend()
    model = CalledInExcept()
    plain = copy.deepcopy(model)
    wrap(model, backend)
    x = two_tower_input()
    assert torch.equal(model(x), plain(x))
    assert events_of(model, EventKind.STAGE_FAILED) == []
    assert model.stats.failures == 0
    assert model.stats.stage_calls == 2
    assert backend.current_stream() == DEFAULT


# --- bypass -----------------------------------------------------------------------------------


def test_disabled_runs_stages_inline_with_one_counted_event() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    plain = copy.deepcopy(model)
    wrap(model, backend)
    backend.clear_log()
    x = two_tower_input()
    with ooo_wrap.disabled():
        for _ in range(3):
            assert torch.equal(model(x), plain(x))
    assert {c.op for c in backend.log} <= {"current_stream"}
    assert not any(c.op == "set_stream" for c in backend.log)
    (bypassed,) = events_of(model, EventKind.BYPASSED)
    assert bypassed.reason == "disabled"
    assert bypassed.count == 6
    assert model.stats == OOOStats(forwards=3, bypasses=6)

    model(x)  # enabled again outside the block
    assert model.stats.stage_calls == 2
    assert any(c.op == "set_stream" for c in backend.log)
    assert events_of(model, EventKind.BYPASSED)[0].count == 6


def test_disabled_nests_and_is_per_thread() -> None:
    backend = SimulatedBackend()
    model = make_two_towers()
    wrap(model, backend)
    x = two_tower_input()
    other_thread_stats: list[OOOStats] = []

    def in_other_thread() -> None:
        model(x)
        other_thread_stats.append(model.stats)

    with ooo_wrap.disabled():
        with ooo_wrap.disabled():
            model(x)
        model(x)
        worker = threading.Thread(target=in_other_thread)
        worker.start()
        worker.join()
    assert model.stats.bypasses == 4
    assert model.stats.stage_calls == 2  # only the other thread's forward used streams
    assert other_thread_stats[0].stage_calls == 2


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_inference_runs_stages_inline_with_one_counted_event(mode: type) -> None:
    # No backward to overlap, and forward is joined stage by stage: side streams would
    # only add stream calls.
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    plain = copy.deepcopy(model)
    wrap(model, backend)
    backend.clear_log()
    x = two_tower_input()
    with mode():
        for _ in range(3):
            assert torch.equal(model(x), plain(x))
    assert not any(c.op in ("set_stream", "wait_event", "record_stream") for c in backend.log)
    (bypassed,) = events_of(model, EventKind.BYPASSED)
    assert (bypassed.reason, bypassed.count) == ("no_grad", 6)
    assert model.stats == OOOStats(forwards=3, bypasses=6)
    model(x).sum().backward()  # gradients on again: side streams again
    assert model.stats.stage_calls == 2


def test_graph_capture_forks_exactly_as_eager() -> None:
    # Regression: stages used to run inline (BYPASSED/graph_capture) under capture. The
    # eager protocol is what a capture needs (the fork event pulls each side stream in,
    # the joins bring it back), so the calls made are the same, call for call.
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    wrap(model, backend)
    model(two_tower_input())
    backend.clear_log()
    model(two_tower_input())
    eager = [(c.op, c.stream) for c in backend.log]
    backend.clear_log()
    with backend.capturing():
        model(two_tower_input())
    assert [(c.op, c.stream) for c in backend.log] == eager
    assert any(c.op == "set_stream" and c.stream.id != 0 for c in backend.log)
    assert events_of(model, EventKind.BYPASSED) == []
    assert model.stats.bypasses == 0
    assert model.stats.stage_calls == 6


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_trace_runs_stages_inline() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    wrap(model, backend)
    backend.clear_log()
    x = two_tower_input()
    traced = torch.jit.trace(model, x, check_trace=False)
    assert not any(c.op == "set_stream" for c in backend.log)
    (bypassed,) = events_of(model, EventKind.BYPASSED)
    assert (bypassed.reason, bypassed.count) == ("tracing", 2)
    assert model.stats.stage_calls == 0
    assert torch.equal(traced(x), model(x))


# --- threads -------------------------------------------------------------------------------


@pytest.fixture
def fast_thread_switching() -> Iterator[None]:
    """Switch threads every few microseconds so forwards really interleave."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("fast_thread_switching")
@pytest.mark.parametrize("shared_backend", [True, False], ids=["shared", "separate"])
def test_two_threads_never_see_each_others_streams(shared_backend: bool) -> None:
    iterations = 300
    backends = [SimulatedBackend(keep_all=True), SimulatedBackend(keep_all=True)]
    if shared_backend:
        backends[1] = backends[0]
    models = [ProbeTowers(backends[i].current_stream) for i in range(2)]
    streams = [wrap(models[i], backends[i]) for i in range(2)]
    if shared_backend:
        assert set(streams[0]).isdisjoint(streams[1])
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def run(i: int) -> None:
        try:
            barrier.wait()
            x = torch.randn(2, 4)
            for _ in range(iterations):
                models[i](x).sum().backward()
                if backends[i].current_stream() != DEFAULT:
                    raise AssertionError(f"thread {i} left on a side stream")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,), name=f"ooo-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    barrier.wait()
    main_seen: set[VirtualStream] = set()
    while any(thread.is_alive() for thread in threads):
        main_seen.add(backends[0].current_stream())
        main_seen.add(backends[1].current_stream())
    for thread in threads:
        thread.join()

    assert errors == []
    assert main_seen == {DEFAULT}
    for i, model in enumerate(models):
        for tower_index, tower in enumerate(model.towers):
            assert isinstance(tower, StreamProbe)
            own = streams[i][model.plan.stages[tower_index].stream]
            assert len(tower.seen) == iterations
            assert set(tower.seen) == {own}, f"model {i} tower {tower_index}"
        assert model.stats.stage_calls == 2 * iterations
        assert thread_state(model) == ([], [])
    if shared_backend:
        # The two workers really interleaved: their calls alternate in the shared log.
        workers = [c.thread for c in backends[0].log if c.thread.startswith("ooo-")]
        switches = sum(a != b for a, b in itertools.pairwise(workers))
        assert switches >= 2


def test_one_model_in_two_threads_keeps_state_per_thread() -> None:
    backend = SimulatedBackend()
    model = ProbeTowers(backend.current_stream)
    streams = wrap(model, backend)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            x = torch.randn(2, 4)
            for _ in range(200):
                model(x)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for index, tower in enumerate(model.towers):
        assert isinstance(tower, StreamProbe)
        assert set(tower.seen) == {streams[index]}
    assert model.stats.forwards == 400
    assert backend.current_stream() == DEFAULT


# --- nothing grows without bound ------------------------------------------------------------


def test_ten_thousand_forwards_keep_every_structure_at_a_fixed_size() -> None:
    backend = SimulatedBackend()  # default: bounded log
    model = make_two_towers(dim=2)
    wrap(model, backend)
    state = _wrapped[model]
    x = torch.randn(1, 2)

    def sizes() -> dict[str, int]:
        frames, calls = thread_state(model)
        return {
            "events": len(model.events),
            "event_log": len(state.log._events),
            "stats": sys.getsizeof(state.counters),
            "stats_fields": len(vars(model.stats)),
            "backend_log": len(backend.log),
            "frames": len(frames),
            "calls": len(calls),
            "handles": len(state.handles),
            "scheduler_attrs": len(vars(state.scheduler)),
            "wrapped_models": len(_wrapped),
            "classes": len(_classes),
            "hooks": hook_count(model),
        }

    # Gradients on (each output dropped at once): under no_grad stages would run inline.
    for _ in range(1_000):
        model(x)
    first = sizes()
    for _ in range(9_000):
        model(x)
    assert sizes() == first
    assert first["backend_log"] == 10_000
    assert first["frames"] == 0 and first["calls"] == 0
    assert first["events"] == 1
    assert model.stats.forwards == 10_000
    assert model.stats.stage_calls == 20_000


def test_ten_thousand_bypassed_calls_are_one_event() -> None:
    model = make_two_towers(dim=2)
    wrap(model, SimulatedBackend())
    x = torch.randn(1, 2)
    with torch.no_grad(), ooo_wrap.disabled():
        for _ in range(5_000):  # two stage calls each
            model(x)
    events = model.events
    assert [e.kind for e in events] == [EventKind.ENABLED, EventKind.BYPASSED]
    assert events[-1].count == 10_000
    assert model.stats.bypasses == 10_000
    assert thread_state(model) == ([], [])


def test_repeated_failures_leave_no_in_flight_state() -> None:
    model = FailingTowers(dim=2)
    wrap(model, SimulatedBackend())
    model.towers[0].fail_with = StageError("x")
    x = torch.randn(1, 2)
    for _ in range(1_000):
        with pytest.raises(StageError):
            model(x)
    assert thread_state(model) == ([], [])
    assert len(model.events) == 2
    assert events_of(model, EventKind.STAGE_FAILED)[0].count == 1_000


def test_keep_all_log_keeps_everything_and_bounded_log_keeps_the_latest() -> None:
    everything = SimulatedBackend(keep_all=True)
    recent = SimulatedBackend(log_size=5)
    for backend in (everything, recent):
        model = make_two_towers()
        wrap(model, backend)
        for _ in range(3):
            model(two_tower_input())
    assert len(everything.log) == 2 + 3 * 23
    assert isinstance(recent.log, tuple)
    assert recent.log == everything.log[-5:]  # the same run: the latest 5 calls, newest last


class _EventCounting(SimulatedBackend):
    """Counts the events it is asked to create (``record_event`` without one to re-use)."""

    created = 0

    def record_event(
        self, stream: VirtualStream, event: VirtualEvent | None = None
    ) -> VirtualEvent:
        if event is None:
            self.created += 1
            return super().record_event(stream)
        return super().record_event(stream, event)


def test_events_are_made_once_per_stage_and_thread_then_reused() -> None:
    backend = _EventCounting()
    model = make_two_towers()
    wrap(model, backend)
    x = two_tower_input()
    model(x).sum().backward()
    first = backend.created  # a fork and a join per stage, a final join per stream
    assert first == 2 * 2 + 2
    for _ in range(5):
        model(x).sum().backward()
    assert backend.created == first
    worker = threading.Thread(target=lambda: model(x))  # another thread: its own events
    worker.start()
    worker.join()
    assert backend.created == 2 * first


# --- each stage's frame, reused call after call ------------------------------------------


class CallsItself(nn.Module):
    """A stage whose forward calls the stage again, ``depth`` levels deep."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return self(out, depth - 1) if depth > 0 else out


class RecursiveTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.deep = CallsItself()
        self.flat = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.deep(x, 2) + self.flat(x)


def test_a_stage_that_calls_itself_forks_and_joins_each_call() -> None:
    """The stage's frame is on the stack when it calls itself: the inner calls get their own."""
    x = torch.randn(3, 4)
    report = ooo_wrap.testing.check(RecursiveTowers(), x, planner="static", stages=["deep", "flat"])
    assert report.ok, str(report)
    backend = SimulatedBackend()
    model = RecursiveTowers()
    ooo_wrap.OOOModule(model, backend=backend, planner="static", stages=["deep", "flat"])
    for _ in range(2):
        model(x).sum().backward()
        assert backend.current_stream() == DEFAULT
        assert thread_state(model) == ([], [])
    assert model.stats.stage_calls == 2 * 4


class Handled(Exception):
    """An exception type that can be referred to weakly."""


def test_a_stage_call_keeps_nothing_of_its_own_alive_after_it() -> None:
    """Neither the inputs nor the exception handled around the call stay on the frame the
    stage's next call reuses."""
    model = make_two_towers()
    wrap(model, SimulatedBackend())
    x = two_tower_input()
    seen = weakref.ref(x)
    try:
        raise Handled("handled around the forward")
    except Handled as error:
        handled = weakref.ref(error)
        model(x)
    del x
    gc.collect()
    assert seen() is None and handled() is None
