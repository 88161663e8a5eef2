"""Racing a tuning model's arms as CUDA graphs (``graphed_step``), on the CPU.

No CUDA graph can be captured here, so a stand-in takes the capture's place: its "replay"
runs the step eagerly with the arm it captured held, as a real replay runs that arm's
kernels. What is tested is the library's side, on the simulated clock: the warm-up times
nothing, each arm is captured with its own hooks, the replays rotate and are timed, the
tuner decides as for eager steps, and every call replays the winner's graph from then
on. The real captures run on a GPU in ``tests/gpu/test_cuda.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap._integrations.graph_race import GraphRace
from ooo_wrap._integrations.graphs import GraphedStep, _ArgSpec, _wrapped_models_seen
from ooo_wrap._wrapper import registry
from ooo_wrap._wrapper.tune import Tuner
from ooo_wrap.testing import SimulatedBackend
from ooo_wrap.testing._simulated import StreamCall
from tests.support.models import make_two_towers, two_tower_input

STAGES = ["towers.0", "towers.1"]


def _forked(calls: Sequence[StreamCall]) -> bool:
    return any(call.op == "set_stream" and call.stream.id != 0 for call in calls)


def _wrap(plan_ms: float, plain_ms: float) -> tuple[nn.Module, SimulatedBackend]:
    """Steps that use side streams take ``plan_ms`` on the simulated clock, others
    ``plain_ms``."""
    backend = SimulatedBackend(
        step_time=lambda calls: plan_ms if _forked(calls) else plain_ms, keep_all=True
    )
    model = ooo_wrap.OOOModule(
        make_two_towers(),
        backend=backend,
        stages=STAGES,
        planner="static",
        split_weight_grads=False,
        tune_steps=4,
    )
    return model, backend


def _step_for(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


class _StandInGraph:
    """Replaying runs the step eagerly with the arm held at capture held again."""

    def __init__(self, step: Callable[[], Any], tuner: Tuner | None) -> None:
        self.step, self.tuner = step, tuner
        self.arm = None if tuner is None else tuner.active

    def replay(self) -> None:
        if self.tuner is not None and self.arm is not None and self.tuner.held:
            self.tuner.hold(self.arm)
        self.step()


class _Race:
    """A graphed step of ``model`` racing its arms through stand-in graphs."""

    def __init__(self, model: nn.Module, fail: str | None = None, warmup: int = 3) -> None:
        self.step = _step_for(model)
        self.x = two_tower_input()
        self.captured: list[str] = []  # the arm held at each capture, in order
        with _wrapped_models_seen() as models:
            for _ in range(warmup):
                self.step(self.x)
        assert models == [model]
        tuner = registry.race_as_graph(model)
        assert tuner is not None
        self.tuner = tuner

        def capture() -> tuple[_StandInGraph, Any]:
            self.captured.append(tuner.active.name)
            if tuner.active.name == fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            return _StandInGraph(lambda: self.step(self.x), tuner), torch.zeros(())

        race = GraphRace(model, tuner, capture)
        specs = (_ArgSpec.of(self.x),)
        self.graphed = GraphedStep(
            self.step, specs, "captured", "stand-in", None, (self.x,), race=race
        )

    def until_decided(self, calls: int = 200) -> int:
        for call in range(calls):
            if not self.graphed.racing:
                return call
            self.graphed(self.x)
        raise AssertionError(f"not decided after {calls} calls")


def _kinds(model: nn.Module) -> list[tuple[EventKind, str]]:
    return [(e.kind, e.reason) for e in ooo_wrap.events_for(model)]


def test_the_warm_up_of_a_graphed_step_times_nothing() -> None:
    model, backend = _wrap(8.0, 10.0)
    backend.clear_log()
    race = _Race(model)
    assert not any(call.op == "record_timing_event" for call in backend.log)
    assert model.tuning is not None and model.tuning.decision == "pending"
    assert all(not arm.step_ms for arm in model.tuning.arms)
    assert race.captured == ["plain", "static"]  # each arm captured with its hooks held


def test_the_arms_race_as_graphs_and_the_winner_is_captured_for_good() -> None:
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model)
    assert race.graphed.racing == ("plain", "static") and race.graphed.captured
    calls = race.until_decided()
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "static" and tuning.as_graph
    assert "graph" in tuning.compared
    assert set(tuning.arm("static").step_ms) == {8.0}  # type: ignore[union-attr]
    assert set(tuning.arm("plain").step_ms) == {10.0}  # type: ignore[union-attr]
    kept = [
        e for e in ooo_wrap.events_for(model) if (e.kind, e.reason) == (EventKind.TUNED, "kept")
    ]
    assert kept and "graph replays" in kept[-1].message
    kept_graph = race.graphed.graph
    assert isinstance(kept_graph, _StandInGraph) and kept_graph.arm is not None
    assert kept_graph.arm.name == "static" and calls > 0
    assert model.plan.stages and not registry.runs_plain(model)  # the winner's hooks
    for param in model.parameters():  # bound to the kept graph's gradient buffers
        assert param.grad is not None


def test_plain_kept_as_a_graph_runs_plain() -> None:
    model, _ = _wrap(12.0, 10.0)
    race = _Race(model)
    race.until_decided()
    assert model.tuning is not None and model.tuning.decision == "plain"
    assert registry.runs_plain(model)
    slower = [e for e in ooo_wrap.events_for(model) if e.reason == "measured_slower"]
    assert slower and "graph replays" in slower[-1].message


def test_an_arm_that_cannot_be_captured_leaves_the_race() -> None:
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model, fail="static")
    assert race.graphed.racing == ("plain",)
    events = [e for e in ooo_wrap.events_for(model) if e.reason == "not_captured"]
    assert events and "static arm could not be captured" in events[0].message
    race.until_decided()
    assert model.tuning is not None and model.tuning.decision == "plain"
    assert "no arm could be raced" in model.tuning.why


def test_a_decision_from_eager_steps_is_raced_again_as_a_graph() -> None:
    model, _ = _wrap(8.0, 10.0)
    x = two_tower_input()
    for _ in range(200):
        model(x).sum().backward()
        if model.tuning is not None and model.tuning.decision != "pending":
            break
    assert model.tuning is not None and model.tuning.decision == "static"
    assert not model.tuning.as_graph
    race = _Race(model)  # the eager decision does not apply to a replay
    assert race.graphed.racing == ("plain", "static")
    race.until_decided()
    assert model.tuning.as_graph
    # A decision measured as a graph stands for the next graphed step.
    assert registry.race_as_graph(model) is None


def test_a_plan_learned_in_a_graphed_step_is_priced_as_a_graph_replay() -> None:
    from tests.support.cli_factories import graph_towers

    model = ooo_wrap.OOOModule(graph_towers(), backend=SimulatedBackend(), tune=False)
    with _wrapped_models_seen() as models:
        model(torch.randn(16, 256)).sum().backward()  # the learning step
    assert models == [model]
    estimate = model.plan.estimate
    assert estimate is not None and estimate.graphed and model.plan.stages


def test_a_second_tuning_model_in_the_step_holds_plain_and_says_so() -> None:
    first, _ = _wrap(8.0, 10.0)
    second, _ = _wrap(8.0, 10.0)
    step_first, step_second = _step_for(first), _step_for(second)
    x = two_tower_input()
    with _wrapped_models_seen() as models:
        for _ in range(3):
            step_first(x)
            step_second(x)
    assert models == [first, second]
    from ooo_wrap._integrations.graphs import _graph_race

    race = _graph_race(models, lambda: (_StandInGraph(lambda: None, None), None))
    assert race is not None and race.arms == ("plain", "static")
    held = [e for e in ooo_wrap.events_for(second) if e.reason == "not_finished"]
    assert held and "one model at a time" in held[0].message


@pytest.mark.parametrize("grads_of", ["plain", "static"])
def test_each_replay_binds_the_gradients_of_its_own_graph(grads_of: str) -> None:
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model)
    graphs = race.graphed._race._graphs  # type: ignore[union-attr]
    # Stand-ins replay eagerly, so give each "graph" buffers of its own, as captures do.
    for name, captured in graphs.items():
        captured.grads = [(p, torch.full_like(p, float(len(name)))) for p, _ in captured.grads]
    for _ in range(4):
        race.graphed(race.x)
        if race.graphed._race.replaying == grads_of:
            break
    replayed = race.graphed._race.replaying
    assert replayed == grads_of
    for param in model.parameters():
        assert param.grad is not None and torch.all(param.grad == len(replayed))


def test_the_arms_of_a_step_learned_for_a_graph_include_regions_eager_pricing_rejects() -> None:
    from tests.support.cli_factories import graph_towers

    def arms(graphed: bool) -> tuple[str, ...]:
        model = ooo_wrap.OOOModule(
            graph_towers(), backend=SimulatedBackend(step_time=lambda calls: 1.0)
        )
        x = torch.randn(16, 256)
        if graphed:
            with _wrapped_models_seen():
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        return tuple(arm.name for arm in registry.arms_of(model))

    eager, graphed = arms(False), arms(True)
    assert "regions" in graphed and "regions" not in eager, (eager, graphed)
