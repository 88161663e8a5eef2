"""Where stage parameters' gradients accumulate, in a loop that keeps the previous loss alive.

Autograd caches a parameter's ``AccumulateGrad`` node weakly and makes a new one (on the
stream current then) only once the old one is dead. A loop that keeps ``loss`` until the
next step's forward keeps the previous step's nodes alive, so a step that ran inline (the
dataflow planner's learning step, measured tuning's plain steps) would otherwise leave its
caller's-stream accumulators to every later planned step.
"""

from __future__ import annotations

import copy
import gc
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

import ooo_wrap
from ooo_wrap.testing import DetectingBackend, Detection, SimulatedBackend, check, detect
from ooo_wrap.testing._simulated import VirtualStream
from tests.support.models import make_two_towers, two_tower_input

STAGES = ["towers.0", "towers.1"]


def _stage_streams(model: nn.Module, found: Detection) -> dict[str, list[VirtualStream]]:
    """Note the stream each stage call's forward runs on (inside the stage, whatever the
    order of its hooks: while measured tuning races arms, an arm's stage hooks are
    registered as its step starts)."""
    seen: dict[str, list[VirtualStream]] = {name: [] for name in STAGES}
    for name in STAGES:
        stage = model.get_submodule(name)

        def noted(*args: object, name: str = name, forward: Any = stage.forward) -> object:
            seen[name].append(found.stream_now())
            return forward(*args)

        stage.forward = noted
    return seen


def _accumulator_streams(model: nn.Module, found: Detection) -> dict[str, VirtualStream | None]:
    """Per stage parameter, the stream the engine model runs its current accumulator on."""
    return {
        f"{stage}.{name}": found.node_stream(get_gradient_edge(p).node)
        for stage in STAGES
        for name, p in model.get_submodule(stage).named_parameters()
    }


def _keep_loss_loop(model: nn.Module, steps: int) -> Iterator[torch.Tensor]:
    """``loss = model(x).sum(); loss.backward()``: each loss lives on into the next forward."""
    x = two_tower_input()
    loss = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        loss.backward()
        yield loss


@pytest.mark.parametrize("planner", ["dataflow", "static"])
def test_stage_parameters_accumulate_on_their_stage_streams_while_the_old_loss_lives(
    planner: str,
) -> None:
    backend = DetectingBackend()
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(
            make_two_towers(),
            backend=backend,
            stages=STAGES,
            planner=planner,  # type: ignore[arg-type]
        )
        found.keep_alive(model)
        steps = _keep_loss_loop(model, 4)
        if planner == "dataflow":
            next(steps)  # the learning step, inline on the caller's stream
        seen = _stage_streams(model, found)
        for step, _ in enumerate(steps):
            streams = _accumulator_streams(model, found)
            for name, stream in streams.items():
                stage = next(s for s in STAGES if name.startswith(s + "."))
                assert stream == seen[stage][step], (step, name, stream, seen[stage])
                assert stream is not None and stream.id != 0, (step, name)
    assert found.ok, (found.races, found.allocator_hazards)


def test_tuning_steps_accumulate_where_they_run_plain_on_the_caller_planned_on_the_stage() -> None:
    # Measured tuning alternates plain and planned steps; each arm's accumulators are
    # made on the streams it runs on, whichever arm ran before.
    backend = DetectingBackend(step_time=lambda calls: 1.0)
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(
            make_two_towers(),
            backend=backend,
            stages=STAGES,
            planner="dataflow",
            tune=True,
            split_weight_grads=False,  # the stages' own streams (the split's: test_wgrad.py)
        )
        found.keep_alive(model)
        steps = _keep_loss_loop(model, 7)
        next(steps)  # learning
        seen = _stage_streams(model, found)
        arms = []
        for _ in steps:
            streams = set(_accumulator_streams(model, found).values())
            arms.append(streams)
        tuning = model.tuning
        assert tuning is not None and tuning.decision == "pending"
    # plain, plan, plain, ...: the plain arm's on the caller's stream, the plan's on the
    # stages' own (every stage call of a planned step forks).
    caller = VirtualStream(0)
    stage_streams = {s for calls in seen.values() for s in calls if s != caller}
    assert len(stage_streams) == 2
    assert arms == [{caller}, stage_streams] * 3
    assert found.ok, (found.races, found.allocator_hazards)


def test_gradients_and_parameter_hooks_are_those_of_the_plain_model() -> None:
    plain = make_two_towers()
    wrapped = ooo_wrap.OOOModule(
        copy.deepcopy(plain), backend=DetectingBackend(), stages=STAGES, tune=False
    )
    calls: dict[str, list[str]] = {"plain": [], "wrapped": []}
    history: dict[str, list[dict[str, torch.Tensor]]] = {"plain": [], "wrapped": []}
    x = two_tower_input()
    for label, model in (("plain", plain), ("wrapped", wrapped)):
        log = calls[label]
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name, log=log: log.append(f"pre {name}"))
            p.register_post_accumulate_grad_hook(
                lambda p, name=name, log=log: log.append(f"post {name}")
            )
        params = list(model.parameters())
        loss = None
        for _ in range(4):  # each loss lives into the next forward; .grad accumulates
            loss = model(x).sum()
            # This step's graph reaches every parameter's current accumulator.
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            loss.backward()
            step = {f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()}
            step.update({f"autograd.grad:{i}": g for i, g in enumerate(grads)})
            history[label].append(step)
    for a, b in zip(history["plain"], history["wrapped"], strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a), [
            n for n in a if not torch.equal(a[n], b[n])
        ]
    assert calls["plain"] == calls["wrapped"]
    assert all(p.requires_grad and p.is_leaf for p in wrapped.parameters())


def test_an_accumulator_someone_held_before_the_first_forward_is_kept() -> None:
    # DistributedDataParallel takes every accumulator when it is constructed, and keeps
    # hooks on it: the wrapper must never make it stale.
    backend = DetectingBackend()
    model = ooo_wrap.OOOModule(
        make_two_towers(), backend=backend, stages=STAGES, planner="dataflow"
    )
    weight = model.get_submodule(STAGES[0]).weight
    held = get_gradient_edge(weight).node
    ran: list[int] = []
    held.register_hook(lambda *_: ran.append(1))
    for _ in _keep_loss_loop(model, 3):
        pass
    assert len(ran) == 3  # every step accumulated through the held node


def test_the_engine_models_hooks_keep_no_graph_alive() -> None:
    # A graph the caller dropped is gone without a garbage collection: the next forward
    # makes fresh nodes, accumulators included, as a real loop that drops the graph does.
    w = nn.Parameter(torch.randn(3))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with detect() as found:
            loss = (w * 2).sum()
            loss.backward()
            assert found.node_stream(get_gradient_edge(w).node) is not None
            del loss
            # The engine model holds each op's outputs until the next op tags their
            # nodes: one more op lets the look-up's view above go.
            torch.ones(1).add_(1)
            assert found.node_stream(get_gradient_edge(w).node) is None
    finally:
        if was_enabled:
            gc.enable()


def test_check_runs_its_last_step_with_the_previous_loss_alive() -> None:
    model = make_two_towers()
    outputs: list[weakref.ref[torch.Tensor]] = []
    alive: list[bool] = []

    def note(module: nn.Module, args: object, output: torch.Tensor) -> None:
        alive.append(bool(outputs) and outputs[-1]() is not None)
        outputs.append(weakref.ref(output))

    model.register_forward_hook(note)  # deep-copied with the model: both copies note
    report = check(model, two_tower_input(), stages=STAGES, steps=3, tune_arm="regions")
    assert report.ok, str(report)
    # The wrapped copy's three steps, then the plain copy's: only the last keeps the
    # previous step's graph; the others start from a dropped graph.
    assert alive == [False, False, True] * 2
    assert not [note for note in report.notes if "AccumulateGrad" in note], report.notes


def test_check_finds_no_accumulator_left_on_the_learning_steps_stream() -> None:
    # steps=2: the planned step runs while the learning step's graph is still alive.
    report = check(make_two_towers(), two_tower_input(), stages=STAGES, steps=2, tune_arm="regions")
    assert report.ok, str(report)
    assert not [note for note in report.notes if "AccumulateGrad" in note], report.notes


def test_a_step_under_disabled_leaves_no_accumulator_to_the_next_planned_step() -> None:
    backend = DetectingBackend()
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(
            make_two_towers(), backend=backend, stages=STAGES, planner="static"
        )
        found.keep_alive(model)
        x = two_tower_input()
        first = model(x).sum()
        first.backward()
        model.zero_grad(set_to_none=True)
        with ooo_wrap.disabled():
            inline = model(x).sum()  # inline: makes its accumulators on the caller's stream
        assert set(_accumulator_streams(model, found).values()) == {VirtualStream(0)}
        inline.backward()
        model.zero_grad(set_to_none=True)
        seen = _stage_streams(model, found)
        last = model(x).sum()
        last.backward()
        for name, stream in _accumulator_streams(model, found).items():
            stage = next(s for s in STAGES if name.startswith(s + "."))
            assert stream == seen[stage][0], name
        del first, inline, last
    assert found.ok, (found.races, found.allocator_hazards)


def test_the_checker_sees_a_gradient_accumulated_away_from_its_producer() -> None:
    cpu = torch.device("cpu")
    w = nn.Parameter(torch.randn(3))
    with detect() as found:
        b = found.backend
        main, side = b.current_stream(cpu), b.new_stream(cpu)
        old = (w * 2).sum()  # w's accumulator is made on main, and old keeps it alive
        b.wait_event(side, b.record_event(main))
        b.set_stream(side)
        loss = (w * 3).sum()  # the same accumulator: w's gradient is made on side
        b.set_stream(main)
        b.wait_event(main, b.record_event(side))
        loss.backward()
        del old
    # No backward ended between the two forwards: a mismatch, not an older graph's node.
    (mismatch,) = found.accumulator_mismatches
    assert (mismatch.producer, mismatch.accumulator, mismatch.stale) == (side, main, False)


def test_the_checker_sees_an_accumulator_an_older_graph_kept_alive() -> None:
    cpu = torch.device("cpu")
    w = nn.Parameter(torch.randn(3))
    with detect() as found:
        b = found.backend
        main, side = b.current_stream(cpu), b.new_stream(cpu)
        old = (w * 2).sum()  # w's accumulator is made on main
        old.backward()  # ...and old keeps it alive past its backward
        b.wait_event(side, b.record_event(main))
        b.set_stream(side)
        loss = (w * 3).sum()
        b.set_stream(main)
        b.wait_event(main, b.record_event(side))
        loss.backward()
        del old
    (mismatch,) = found.accumulator_mismatches
    assert (mismatch.producer, mismatch.accumulator, mismatch.stale) == (side, main, True)


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [False, True])
def test_no_accumulate_grad_stream_mismatch_on_a_gpu_in_a_loop_keeping_the_loss(
    tune: bool,
) -> None:
    device = torch.device("cuda")
    model = ooo_wrap.OOOModule(make_two_towers().to(device), stages=STAGES, tune=tune)
    x = two_tower_input().to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = None
        # The learning step, then planned steps (with tune: plain and planned arms in
        # turn, while tuning is pending).
        for _ in range(8):
            model.zero_grad(set_to_none=True)
            loss = model(x).sum()
            loss.backward()
        torch.cuda.synchronize()
    assert tune is False or (model.tuning is not None and model.tuning.decision == "pending")
    mismatches = [str(w.message) for w in caught if "AccumulateGrad node's stream" in str(w)]
    assert mismatches == []
    assert model.stats.stage_calls > 0


def test_two_forwards_into_one_backward_across_a_switch_share_one_accumulator() -> None:
    # A siamese step whose first forward is the dataflow planner's inline learning forward
    # and whose second is planned: the first forward's accumulators have not run yet, so
    # they are kept (one per parameter, as plain autograd has), not doubled on two streams.
    import copy as copy_module

    from ooo_wrap.testing import DetectingBackend, detect
    from tests.support.models import make_two_towers, two_tower_input

    plain = make_two_towers()
    backend = DetectingBackend()
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(
            copy_module.deepcopy(plain),
            backend=backend,
            stages=["towers.0", "towers.1"],
            tune=False,
        )
        found.keep_alive(model)
        calls: dict[str, int] = {}
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1)
            )
        x1, x2 = two_tower_input(), two_tower_input() * 2
        (model(x1).sum() + model(x2).sum()).backward()
        (plain(x1).sum() + plain(x2).sum()).backward()
    assert set(calls.values()) == {1}
    assert found.ok, found.races
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_a_thread_that_only_evaluates_the_model_turns_the_look_ups_off() -> None:
    """Looking an accumulator up swaps ``param.data`` for a moment: once a second thread has
    run the model, even under ``no_grad``, none is looked up or released again."""
    model = ooo_wrap.OOOModule(
        make_two_towers(), backend=SimulatedBackend(), stages=STAGES, planner="static"
    )
    x = two_tower_input()
    with ooo_wrap.disabled():
        inline = model(x).sum()  # inline: its accumulators are released by a planned forward
    inline.backward()
    weight = model.get_submodule(STAGES[0]).weight
    node = get_gradient_edge(weight).node

    def evaluate() -> None:
        with torch.no_grad():
            model(x)

    thread = threading.Thread(target=evaluate)
    thread.start()
    thread.join()
    planned = model(x).sum()
    assert get_gradient_edge(weight).node is node  # kept, as autograd made it
    planned.backward()
    del inline, planned
