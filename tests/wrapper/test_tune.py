"""Measured tuning: plain and planned steps timed on a simulated clock, the faster kept."""

from __future__ import annotations

import copy
import doctest
import pickle
import random
import re
from collections.abc import Sequence

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError
from ooo_wrap._wrapper.tuning import MAX_ROUNDS, Tuning, compare
from ooo_wrap.testing import SimulatedBackend
from ooo_wrap.testing._simulated import StreamCall
from tests.support.distributed import REPO_ROOT
from tests.support.models import hook_count, make_two_towers, two_tower_input
from tests.support.step_clocks import StepTime, forked, planned_ms

STAGES = ["towers.0", "towers.1"]


def plan_ms(tuning: Tuning) -> tuple[float, ...]:
    """The racing step times of the one planned arm these models race against plain."""
    (planned,) = tuning.arms[1:]
    return planned.step_ms


def plain_ms(tuning: Tuning) -> tuple[float, ...]:
    return tuning.arms[0].step_ms


def plan_kept(tuning: Tuning | None) -> bool:
    return tuning is not None and tuning.decision not in ("plain", "pending")


def noisy_ms(plan: float, plain: float, noise: float, seed: int = 0) -> StepTime:
    """As :func:`planned_ms`, each step scaled by a uniform factor within ``noise``."""
    rng = random.Random(seed)
    base = planned_ms(plan, plain)
    return lambda calls: base(calls) * (1 + rng.uniform(-noise, noise))


def slow_plan_ms(calls: Sequence[StreamCall]) -> float:
    """Module-level (picklable): side streams make the step slower."""
    return 12.0 if forked(calls) else 10.0


def wrap(
    step_time: StepTime | None, *, planner: str = "static", **options: object
) -> tuple[nn.Module, SimulatedBackend]:
    backend = SimulatedBackend(step_time=step_time, keep_all=True)
    # These tests time stage plans; the weight-gradient split, which tuning races too by
    # default, is timed in tests/runtime/test_wgrad.py.
    options.setdefault("split_weight_grads", False)
    model = ooo_wrap.OOOModule(
        make_two_towers(),
        backend=backend,
        stages=STAGES,
        planner=planner,  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )
    return model, backend


def train(model: nn.Module, steps: int, x: torch.Tensor | None = None) -> None:
    x = two_tower_input() if x is None else x
    for _ in range(steps):
        loss = model(x).sum()
        loss.backward()


def until_decided(model: nn.Module, limit: int = 200) -> int:
    """Train until tuning decides; the number of forwards it took."""
    for step in range(1, limit + 1):
        train(model, 1)
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            return step
    raise AssertionError(f"tuning did not decide in {limit} forwards: {model.tuning}")


def kinds(model: nn.Module) -> list[tuple[EventKind, str]]:
    return [(event.kind, event.reason) for event in model.events]


def side_stream_calls(backend: SimulatedBackend) -> int:
    return sum(call.op == "set_stream" and call.stream.id != 0 for call in backend.log)


def syncs(backend: SimulatedBackend) -> int:
    return sum("synchronize" in call.op for call in backend.log)


@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_a_plan_measured_faster_is_kept(planner: str) -> None:
    model, backend = wrap(planned_ms(8.0, 10.0), planner=planner)
    until_decided(model)
    tuning = model.tuning
    assert plan_kept(tuning)
    assert tuning.arms[1].median_ms == 8.0 and tuning.arms[0].median_ms == 10.0
    assert tuning.speedup == pytest.approx(1.25)
    assert len(plan_ms(tuning)) == len(plain_ms(tuning)) == 6
    assert (EventKind.TUNED, "kept") in kinds(model)
    # Afterwards: stages still fork, and the tuner's marks are gone from the hot path.
    backend.clear_log()
    train(model, 2)
    assert side_stream_calls(backend) == 4
    assert not any(call.op == "record_timing_event" for call in backend.log)
    assert syncs(backend) == 0


@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_a_plan_measured_slower_is_dropped(planner: str) -> None:
    model, backend = wrap(slow_plan_ms, planner=planner)
    until_decided(model)
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "plain"
    assert tuning.speedup == pytest.approx(10 / 12)
    disabled = [e for e in model.events if e.kind is EventKind.DISABLED]
    assert disabled[-1].reason == "measured_slower"
    arm = "static" if planner == "static" else "regions"
    assert f"12.000 ms with {arm} vs 10.000 ms plain" in disabled[-1].message
    # No hook left at all, as with no_parallelism: the plain model runs.
    assert hook_count(model) == 0
    backend.clear_log()
    train(model, 2)
    assert side_stream_calls(backend) == 0


def test_a_small_gain_inside_large_noise_is_not_kept_and_costs_one_sync() -> None:
    model, backend = wrap(noisy_ms(9.9, 10.0, noise=0.3))
    until_decided(model)
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "plain"
    # Unclear evidence: more pairs ran, up to the cap, then one host sync read them all.
    assert min(len(plan_ms(tuning)), len(plain_ms(tuning))) == MAX_ROUNDS * 6
    assert syncs(backend) == 1


def test_a_clear_decision_needs_no_host_sync() -> None:
    model, backend = wrap(noisy_ms(5.0, 10.0, noise=0.05))
    until_decided(model)
    assert plan_kept(model.tuning)
    assert syncs(backend) == 0


def test_tuned_training_is_bitwise_plain_training() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    plain = make_two_towers()
    x = two_tower_input()
    for net in (model, plain):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(30):
            optimizer.zero_grad()
            net(x).pow(2).sum().backward()
            optimizer.step()
    assert plan_kept(model.tuning)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _priced_per_call(calls: Sequence[StreamCall]) -> float:
    """1 ms per scheduler call (the tuner's own are free), 1000 ms per probe call."""
    free = ("current_stream", "record_timing_event")
    return sum(
        1000.0 if call.tensor == "float32[7]" else float(call.op not in free) for call in calls
    )


def test_evaluation_forwards_are_cut_out_of_the_steps() -> None:
    # A probe logs a recognizable call inside evaluation forwards only, priced at 1000 ms:
    # any of it in a counted step would show in the step times.
    probe = torch.empty(7)
    found = []
    for evaluate in (False, True):
        backend = SimulatedBackend(step_time=_priced_per_call)
        model = ooo_wrap.OOOModule(
            make_two_towers(),
            backend=backend,
            stages=STAGES,
            planner="static",
            split_weight_grads=False,
        )

        def log_probe_in_eval(module: nn.Module, args: object, backend=backend) -> None:
            if not torch.is_grad_enabled():
                backend.record_stream(probe, backend.current_stream())

        model.get_submodule("towers.0").register_forward_pre_hook(log_probe_in_eval)
        x = two_tower_input()
        for _ in range(100):
            train(model, 1, x)
            if evaluate:
                with torch.no_grad():
                    model(x)
            assert model.tuning is not None
            if model.tuning.decision != "pending":
                break
        found.append(model.tuning)
        assert any(call.tensor == "float32[7]" for call in backend.log) == evaluate
    without, with_eval = found
    assert without is not None and with_eval is not None
    assert with_eval.decision == without.decision
    assert [arm.step_ms for arm in with_eval.arms] == [arm.step_ms for arm in without.arms]
    assert max(ms for arm in with_eval.arms for ms in arm.step_ms) < 1000.0


def test_forwards_that_must_not_count_are_skipped() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    x = two_tower_input()
    train(model, 4, x)  # warm-ups, then one counted step of each arm
    with ooo_wrap.disabled():
        train(model, 1, x)  # a step of the user's own inline model
    train(model, 1, two_tower_input(batch=7))  # other input shapes
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "pending"
    # Counted: the steps opened by forwards 3 and 4 (closed by forwards 4 and 5); the
    # disabled and reshaped steps were not.
    train(model, 2, x)
    tuning = model.tuning
    assert tuning is not None
    assert len(plan_ms(tuning)) + len(plain_ms(tuning)) == 3
    assert set(plan_ms(tuning)) <= {8.0} and set(plain_ms(tuning)) <= {10.0}


def test_a_forward_that_raised_opens_no_counted_step() -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.towers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
            if self.fail:
                raise RuntimeError("boom")
            return out

    # The step a failing forward opens is priced at 1000 ms (the clock is read when the
    # next forward's mark ends it): it must never be counted.
    inner = Failing()
    clock = planned_ms(8.0, 10.0)
    after_failure = [False]
    backend = SimulatedBackend(step_time=lambda c: 1000.0 if after_failure[0] else clock(c))
    model = ooo_wrap.OOOModule(
        inner, backend=backend, stages=STAGES, planner="static", split_weight_grads=False
    )
    x = two_tower_input()
    for step in range(120):
        inner.fail = step % 3 == 1
        if inner.fail:
            with pytest.raises(RuntimeError, match="boom"):
                model(x)
        else:
            model(x).sum().backward()
        after_failure[0] = inner.fail
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    assert plan_kept(model.tuning)
    assert max(plan_ms(model.tuning) + plain_ms(model.tuning)) < 1000.0


def test_a_capture_before_the_decision_is_reported_and_not_timed() -> None:
    model, backend = wrap(planned_ms(8.0, 10.0))
    x = two_tower_input()
    train(model, 3, x)
    backend.clear_log()
    with backend.capturing():
        train(model, 1, x)
    assert not any(call.op == "record_timing_event" for call in backend.log)
    assert side_stream_calls(backend) == 0  # the capture holds plain: unmeasured as a graph
    assert (EventKind.TUNED, "not_finished") in kinds(model)
    assert model.tuning is not None and model.tuning.decision == "pending"
    until_decided(model)
    assert plan_kept(model.tuning)


def test_a_backend_that_cannot_time_does_not_tune() -> None:
    model = ooo_wrap.OOOModule(
        make_two_towers(),
        backend=SimulatedBackend(),
        stages=STAGES,
        planner="static",
        split_weight_grads=False,
    )
    train(model, 3)
    assert model.tuning is None
    assert not any(event.kind is EventKind.TUNED for event in model.events)
    (enabled,) = [event for event in model.events if event.kind is EventKind.ENABLED]
    assert "not tuned: the planner's choice runs, nothing is measured" in enabled.message
    with pytest.raises(OOOConfigError, match="tune=True measures steps on the device"):
        ooo_wrap.OOOModule(make_two_towers(), backend=SimulatedBackend(), tune=True)
    with pytest.raises(OOOConfigError, match="does not tune"):
        model.retune()


def test_tune_false_never_tunes() -> None:
    model, backend = wrap(planned_ms(8.0, 10.0), tune=False)
    train(model, 20)
    assert model.tuning is None
    assert not any(call.op == "record_timing_event" for call in backend.log)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tune": "yes"}, "tune must be True, False or 'auto'"),
        ({"tune": 1}, "tune must be True, False or 'auto'"),
        ({"tune_steps": 1}, "tune_steps must be an int of at least 2"),
        ({"tune_steps": True}, "tune_steps must be an int of at least 2"),
    ],
)
def test_bad_tune_options_are_refused(options: dict[str, object], match: str) -> None:
    with pytest.raises(OOOConfigError, match=match):
        wrap(planned_ms(8.0, 10.0), **options)


def test_replan_and_retune_tune_again() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0), planner="dataflow")
    until_decided(model)
    model.retune()
    assert model.tuning is not None and model.tuning.decision == "pending"
    until_decided(model)
    assert plan_kept(model.tuning)
    model.replan()
    train(model, 1)  # the learning forward
    assert model.tuning is not None and model.tuning.decision == "pending"
    until_decided(model)
    assert plan_kept(model.tuning)


def test_retune_after_measured_slower_puts_the_plan_back() -> None:
    calls: list[float] = []
    slower = [True]

    def step_time(log: Sequence[StreamCall]) -> float:
        calls.append(1.0)
        return (12.0 if slower[0] else 6.0) if forked(log) else 10.0

    model, backend = wrap(step_time)
    until_decided(model)
    assert model.tuning is not None and model.tuning.decision == "plain"
    slower[0] = False
    model.retune()
    until_decided(model)
    assert plan_kept(model.tuning)
    backend.clear_log()
    train(model, 1)
    assert side_stream_calls(backend) == 2


def test_retune_without_a_plan_says_so() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.b(self.a(x))
            return out

    backend = SimulatedBackend(step_time=slow_plan_ms)
    model = ooo_wrap.OOOModule(Chain(), backend=backend, split_weight_grads=False)
    model(torch.randn(2, 4)).sum().backward()  # learns no_parallelism
    with pytest.raises(OOOConfigError, match="no plan to measure"):
        model.retune()


def test_copies_and_pickles_carry_the_option_and_tune_on_their_own() -> None:
    model, _ = wrap(slow_plan_ms)
    train(model, 5)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.tuning is not None and clone.tuning.decision == "pending"
        assert plan_ms(clone.tuning) == () and plain_ms(clone.tuning) == ()
        until_decided(clone)
        assert clone.tuning.decision == "plain"


def test_overlap_forward_tunes_too() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0), overlap_forward=True)
    until_decided(model)
    assert plan_kept(model.tuning)


def test_from_config_passes_ooo_tune() -> None:
    def wrapped(**config: object) -> nn.Module:
        backend = SimulatedBackend(step_time=planned_ms(8.0, 10.0))
        config = {"ooo_backprop": True, "ooo_planner": "static", **config}
        model = ooo_wrap.from_config(make_two_towers(), config, backend=backend)
        train(model, 1)
        return model

    assert wrapped(ooo_tune=False).tuning is None
    tuned = wrapped().tuning
    assert tuned is not None and tuned.decision == "pending"
    with pytest.raises(OOOConfigError, match=r"config\['ooo_tune'\]"):
        wrapped(ooo_tune="on")


def test_the_record_reads_as_a_table_with_the_kept_arm_marked() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    train(model, 1)
    assert str(model.tuning).splitlines()[0] == "tuning on simulated: pending (racing)"
    until_decided(model)
    assert str(model.tuning).splitlines() == [
        "tuning on simulated: static kept: faster than plain in the race and confirmed alone",
        "compared: step times at one input shape",
        "arm       steps  median ms  vs plain  spread  simulator's estimate",
        "plain     6      10.000     1.000     0.0%    -",
        "static *  6      8.000      0.800     0.0%    -",
        "confirmation round (each arm alone): plain 1.000 (6 steps), static 0.800 (6 steps)",
    ]
    assert model.tuning is not None and model.tuning.speedup == pytest.approx(1.25)


@pytest.mark.parametrize(
    ("arm", "plain", "final", "expected"),
    [
        ((0.8,) * 6, (1.0,) * 6, False, "faster"),
        ((1.0,) * 6, (1.0,) * 6, False, "pending"),  # a tie: measure more
        ((1.0,) * 6, (1.0,) * 6, True, "not_faster"),  # a tie at the cap: plain wins
        ((0.99,) * 6, (1.0,) * 6, True, "not_faster"),  # 1 %: below the smallest gain kept
        ((1.2,) * 6, (1.0,) * 6, False, "not_faster"),
        ((0.8,) * 5, (1.0,) * 6, False, "pending"),  # not enough steps yet
        ((0.8,), (1.0,), True, "not_faster"),  # too few clean steps: unmeasured, plain stands
    ],
)
def test_compare(
    arm: tuple[float, ...], plain: tuple[float, ...], final: bool, expected: str
) -> None:
    assert compare(arm, plain, 6, final=final) == expected


def test_compare_needs_the_gain_to_beat_the_spread() -> None:
    arm = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1)  # median 0.85, IQR/median ~ 0.44
    plain = (1.0,) * 6
    assert compare(arm, plain, 6, final=True) == "not_faster"
    assert compare((0.84, 0.85, 0.85, 0.85, 0.85, 0.86), plain, 6, final=False) == "faster"


def test_the_docs_example_prints_what_it_shows() -> None:
    page = (REPO_ROOT / "docs" / "tuning-and-performance.md").read_text()
    section = page.split("\n## Measured tuning", 1)[1]
    (block,) = re.findall(r"```pycon\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    test = doctest.DocTestParser().get_doctest(
        block,
        {"ooo_wrap": ooo_wrap, "two_towers": make_two_towers(), "x": two_tower_input()},
        "docs/tuning-and-performance.md: Measured tuning",
        "docs/tuning-and-performance.md",
        0,
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted >= 4


def test_retune_inside_a_forward_is_refused_and_leaves_tuning_as_it_was() -> None:
    model, backend = wrap(planned_ms(8.0, 10.0))
    until_decided(model)
    stage = model.get_submodule("towers.0")
    handle = stage.register_forward_pre_hook(lambda module, args: model.retune())
    with pytest.raises(ooo_wrap.OOOError, match=r"retune\(\) was called inside a forward"):
        model(two_tower_input())
    handle.remove()
    assert backend.current_stream().id == 0
    assert plan_kept(model.tuning)
    model.retune()  # between forwards: done
    assert model.tuning is not None and model.tuning.decision == "pending"


def test_a_model_called_inside_its_own_forward_is_one_step() -> None:
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.towers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
            out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
            return self(out, depth - 1) if depth else out

    backend = SimulatedBackend(step_time=planned_ms(8.0, 10.0))
    model = ooo_wrap.OOOModule(
        Recursive(), backend=backend, stages=STAGES, planner="static", split_weight_grads=False
    )
    until_decided(model)
    tuning = model.tuning
    assert plan_kept(tuning)
    assert len(plan_ms(tuning)) == len(plain_ms(tuning)) == 6
    assert set(plan_ms(tuning)) == {8.0} and set(plain_ms(tuning)) == {10.0}


def test_a_forward_that_raises_when_tuning_would_decide_keeps_its_exception() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    model.register_forward_hook(lambda module, args, output: None)  # the user's own
    fail = [False]

    def maybe_fail(module: nn.Module, args: object, output: object) -> None:
        if fail[0]:
            raise ValueError("the user's error")

    model.get_submodule("towers.1").register_forward_hook(maybe_fail)
    train(model, 14)  # the next clean forward would decide
    fail[0] = True
    with pytest.raises(ValueError, match="the user's error"):
        model(two_tower_input())
    fail[0] = False
    assert model.tuning is not None and model.tuning.decision == "pending"
    until_decided(model)
    assert plan_kept(model.tuning)


def test_an_interrupted_evaluation_forward_does_not_break_tuning() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    interrupt = [False]

    def maybe_interrupt(module: nn.Module, args: object) -> None:
        if interrupt[0]:
            raise KeyboardInterrupt

    model.get_submodule("towers.0").register_forward_pre_hook(maybe_interrupt)
    train(model, 4)
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(two_tower_input())
    interrupt[0] = False
    until_decided(model)
    tuning = model.tuning
    assert plan_kept(tuning)
    assert set(plan_ms(tuning)) == {8.0} and set(plain_ms(tuning)) == {10.0}


@pytest.mark.parametrize("forwards", [2, 3])
def test_a_step_of_several_forwards_runs_in_one_arm(forwards: int) -> None:
    # Gradient accumulation, or a loss over two forwards: the optimizer step bounds the
    # training step, and every forward in it runs the same arm.
    model, backend = wrap(planned_ms(8.0, 10.0))
    forked: list[bool] = []
    model.get_submodule("towers.0").register_forward_hook(
        lambda module, args, output: forked.append(backend.current_stream().id != 0)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = two_tower_input()
    per_step: list[list[bool]] = []
    for _ in range(60):
        forked.clear()
        loss = sum(model(x).sum() for _ in range(forwards))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        per_step.append(list(forked))
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    # The first step ran before any optimizer step was seen (each forward was a step);
    # the last one decided after its first forward.
    assert all(len(set(arms)) == 1 for arms in per_step[1:-1]), per_step
    assert {arms[0] for arms in per_step[1:-1]} == {True, False}
    tuning = model.tuning
    assert plan_kept(tuning)
    assert set(plan_ms(tuning)) == {8.0} and set(plain_ms(tuning)) == {10.0}


def test_two_models_in_one_loop_tune_one_at_a_time() -> None:
    # One backend for both: a step of either holds the calls of both. Model a's plan saves
    # 1 ms of the step, b's 3 ms; while one tunes the other runs its current arm (plain).
    backend = SimulatedBackend(step_time=lambda calls: 10.0 - gain(calls))
    options = {"backend": backend, "stages": STAGES, "planner": "static"}
    a = ooo_wrap.OOOModule(make_two_towers(), split_weight_grads=False, **options)  # type: ignore[arg-type]
    b = ooo_wrap.OOOModule(make_two_towers(), split_weight_grads=False, **options)  # type: ignore[arg-type]
    a_streams = {1, 2}

    def gain(calls: Sequence[StreamCall]) -> float:
        ids = {c.stream.id for c in calls if c.op == "set_stream" and c.stream.id}
        return (1.0 if ids & a_streams else 0.0) + (3.0 if ids - a_streams else 0.0)

    x = two_tower_input()
    for _ in range(200):
        train(a, 1, x)
        train(b, 1, x)
        assert a.tuning is not None and b.tuning is not None
        if b.tuning.decision != "pending":
            break
    assert plan_kept(a.tuning) and plan_kept(b.tuning)
    # a tuned while b ran plain (untimed); then b, with a's plan in force.
    assert set(plan_ms(a.tuning)) == {9.0} and set(plain_ms(a.tuning)) == {10.0}
    assert set(plan_ms(b.tuning)) == {6.0} and set(plain_ms(b.tuning)) == {9.0}


def test_forwards_called_while_an_exception_is_handled_are_counted() -> None:
    model, _ = wrap(planned_ms(8.0, 10.0))
    try:
        raise RuntimeError("out of memory, say: retry the step")
    except RuntimeError:
        until_decided(model)
    tuning = model.tuning
    assert plan_kept(tuning)
    assert len(plan_ms(tuning)) == len(plain_ms(tuning)) == 6


def test_shapes_never_seen_twice_keep_plain_unmeasured() -> None:
    model, backend = wrap(planned_ms(8.0, 10.0))
    for step in range(200):
        train(model, 1, two_tower_input(batch=2 + step))
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "plain" and tuning.speedup is None
    assert "nothing could be timed" in str(tuning)
    assert (EventKind.DISABLED, "measured_slower") in kinds(model)
    backend.clear_log()
    train(model, 1)
    assert side_stream_calls(backend) == 0


class Checkpointed(nn.Module):
    """Two towers that its forward checkpoints: backward recomputes both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def body(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.towers[0](x).tanh() + self.towers[1](x).tanh()
            return out

        out: torch.Tensor = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False)
        return out


def test_a_plain_step_recomputes_checkpointed_stages_inline() -> None:
    backend = SimulatedBackend(step_time=planned_ms(8.0, 10.0), keep_all=True)
    model = ooo_wrap.OOOModule(
        Checkpointed(), backend=backend, stages=STAGES, planner="static", split_weight_grads=False
    )
    until_decided(model)
    tuning = model.tuning
    assert plan_kept(tuning)
    assert set(plain_ms(tuning)) == {10.0}  # no recomputed stage forked in a plain step


def test_retuning_leaves_no_old_scheduler_alive() -> None:
    import gc
    import weakref

    from ooo_wrap._runtime.scheduler import Scheduler

    def schedulers() -> list[Scheduler]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, Scheduler)]

    # Weakly, by identity: an earlier test's scheduler freed meanwhile changes no count.
    before: weakref.WeakSet[Scheduler] = weakref.WeakSet(schedulers())
    model, _ = wrap(slow_plan_ms)
    for _ in range(3):
        until_decided(model)
        model.retune()
    train(model, 2)  # plain's warm-up, then the static arm's: its scheduler is made
    assert len([s for s in schedulers() if s not in before]) == 1
    ooo_wrap.unwrap(model)
    del model
    assert [s for s in schedulers() if s not in before] == []


def test_a_forward_replaying_a_graph_stops_tuning() -> None:
    from ooo_wrap._wrapper.registry import mark_graphed

    model, _ = wrap(planned_ms(8.0, 10.0))
    train(model, 3)
    mark_graphed(model)
    assert (EventKind.TUNED, "not_finished") in kinds(model)
    assert model.tuning is not None and model.tuning.decision == "pending"
    train(model, 40)
    assert model.tuning.decision == "pending"  # nothing times the replays


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_checkpoint_around_the_whole_model_recomputes_in_its_steps_arm(
    with_optimizer: bool,
) -> None:
    # Non-reentrant checkpoint recomputes the model in backward and stops early by raising
    # through it: neither a forward that raised nor a step of its own.
    model, backend = wrap(planned_ms(8.0, 10.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01) if with_optimizer else None
    forked: list[bool] = []
    model.get_submodule("towers.0").register_forward_hook(
        lambda module, args, output: forked.append(backend.current_stream().id != 0)
    )
    x = two_tower_input()
    per_step: list[tuple[list[bool], list[bool]]] = []
    for _ in range(100):
        forked.clear()
        loss = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum()
        in_forward = list(forked)
        loss.backward()
        per_step.append((in_forward, forked[len(in_forward) :]))
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    # Every backward recomputed the model once, in the arm its forward ran.
    assert all(backward == forward for forward, backward in per_step[:-1]), per_step
    tuning = model.tuning
    assert plan_kept(tuning)
    assert len(plan_ms(tuning)) == len(plain_ms(tuning)) == 6
    assert set(plan_ms(tuning)) == {8.0} and set(plain_ms(tuning)) == {10.0}


def _gan_step_ms(gain: float) -> StepTime:
    """A GAN iteration's simulated time: its discriminator phase costs 6 ms and its
    generator phase 2 ms (a probe call in each, whatever the arm), less ``gain`` if the
    wrapped model ran on side streams in it."""

    def step_time(calls: Sequence[StreamCall]) -> float:
        probes = sum(
            6.0 if c.tensor == "float32[6]" else 2.0 if c.tensor == "float32[2]" else 0.0
            for c in calls
        )
        return probes - (gain if forked(calls) else 0.0)

    return step_time


def _train_gan(wrapped: str, gain: float) -> ooo_wrap.OOOModule:
    """Train a GAN until the wrapped ``"generator"`` or ``"discriminator"`` has tuned: per
    iteration the generator runs twice and the discriminator three times, each with its
    own optimizer, the discriminator's stepping between the generator's forwards."""
    backend = SimulatedBackend(step_time=_gan_step_ms(gain))
    generator: nn.Module = make_two_towers()
    discriminator: nn.Module = make_two_towers()
    if wrapped == "generator":
        generator = ooo_wrap.OOOModule(
            generator, backend=backend, stages=STAGES, planner="static", split_weight_grads=False
        )
    else:
        discriminator = ooo_wrap.OOOModule(
            discriminator,
            backend=backend,
            stages=STAGES,
            planner="static",
            split_weight_grads=False,
        )
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    d_phase, g_phase = torch.empty(6), torch.empty(2)  # priced probes
    real = two_tower_input()
    z = two_tower_input(batch=3) * 0.5
    model = generator if wrapped == "generator" else discriminator
    for _ in range(200):
        fake = generator(z)
        d_loss = discriminator(fake.detach()).mean() - discriminator(real).mean()
        opt_d.zero_grad()
        d_loss.backward()
        backend.record_stream(d_phase, backend.current_stream())
        opt_d.step()
        g_loss = -discriminator(generator(z)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        backend.record_stream(g_phase, backend.current_stream())
        opt_g.step()
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    assert isinstance(model, ooo_wrap.OOOModule)
    return model


@pytest.mark.parametrize("wrapped", ["generator", "discriminator"])
@pytest.mark.parametrize(("gain", "speedup"), [(0.0, 1.0), (2.0, 4 / 3)])
def test_a_gan_iteration_is_one_step(wrapped: str, gain: float, speedup: float) -> None:
    # The discriminator's optimizer steps between the generator's two forwards: only the
    # wrapped model's own optimizer bounds its steps, so each arm times whole iterations.
    tuning = _train_gan(wrapped, gain).tuning
    assert tuning is not None and tuning.speedup is not None
    assert tuning.speedup == pytest.approx(speedup, rel=0.05)
    assert tuning.decision == ("static" if gain else "plain")
    assert set(plain_ms(tuning)) == {8.0} and set(plan_ms(tuning)) == {8.0 - gain}


@pytest.mark.parametrize("loop", ["two_optimizers", "frozen", "no_optimizer"])
def test_other_loops_decide_as_a_plain_loop_does(loop: str) -> None:
    # One model stepped by two optimizers back to back; a frozen wrapped model (no
    # optimizer holds it) in a loop with one optimizer; a loop with no optimizer at all.
    model, _ = wrap(planned_ms(8.0, 10.0))
    towers = [model.get_submodule(name) for name in STAGES]
    head = nn.Linear(4, 4)
    if loop == "two_optimizers":
        optimizers = [torch.optim.SGD(t.parameters(), lr=0.01) for t in towers]
    elif loop == "frozen":
        model.requires_grad_(False)
        optimizers = [torch.optim.SGD(head.parameters(), lr=0.01)]
    else:
        optimizers = []
    x = two_tower_input()
    for _ in range(100):
        head(model(x)).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    tuning = model.tuning
    assert plan_kept(tuning)
    assert len(plan_ms(tuning)) == len(plain_ms(tuning)) == 6
    assert set(plan_ms(tuning)) == {8.0} and set(plain_ms(tuning)) == {10.0}


def test_a_model_that_lost_its_turn_recomputes_as_its_forward_ran() -> None:
    # Model a's last tuned step ran its plan; then a paused and b took the turn. a's next
    # forward runs that arm untimed, and so must its backward's recomputations.
    backend = SimulatedBackend(step_time=planned_ms(8.0, 10.0))
    a = ooo_wrap.OOOModule(
        Checkpointed(), backend=backend, stages=STAGES, planner="static", split_weight_grads=False
    )
    b = ooo_wrap.OOOModule(
        make_two_towers(),
        backend=backend,
        stages=STAGES,
        planner="static",
        split_weight_grads=False,
    )
    forked: list[bool] = []
    a.get_submodule("towers.0").register_forward_hook(
        lambda module, args, output: forked.append(backend.current_stream().id != 0)
    )
    x = two_tower_input()
    train(a, 2, x)  # a's plain warm-up step, then its planned one
    assert forked == [False, False, True, True]
    train(b, 9, x)  # a idle for 8 forwards of others: b takes the turn
    forked.clear()
    loss = a(x).sum()
    in_forward = list(forked)
    loss.backward()
    assert in_forward == [True] and forked[1:] == [True]


def test_a_confirmation_round_that_times_nothing_says_so() -> None:
    # Steps that cannot count (every shape new, or disabled()) end a confirmation round
    # with no timing: the figures say so instead of formatting a missing median.
    from ooo_wrap._plan import Plan
    from ooo_wrap._wrapper.arms import Arm
    from ooo_wrap._wrapper.race import Race
    from ooo_wrap._wrapper.tuning import figures

    class Clock:
        device_name = "a clock"

        def synchronize(self, mark: object) -> None:
            pass

    plain = Arm("plain", Plan((), 4, "static"), False)
    wgrad = Arm("wgrad", Plan((), 4, "static"), True)
    race = Race([plain, wgrad], 6, Clock())  # type: ignore[arg-type]
    race.explain = lambda winner, kept: figures(race.record("pending", False))
    race.confirm(wgrad)  # a cached arm, with tune_cache_confirm=True
    for _ in range(1000):
        race.begun()
        race.decide()
        if race.stage == "decided":
            break
    assert race.verdict == "plain"
    assert race.why == "in the confirmation round, no step could be timed against plain on a clock"
