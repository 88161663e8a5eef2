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
from ooo_wrap._integrations.graphs import (
    GraphedStep,
    _ArgSpec,
    _graph_race,
    _wrapped_models_seen,
)
from ooo_wrap._wrapper import registry
from ooo_wrap._wrapper.tune import Tuner
from ooo_wrap._wrapper.tuning import shape_of
from ooo_wrap.testing import SimulatedBackend
from tests.support.models import make_two_towers, two_tower_input
from tests.support.step_clocks import planned_ms

STAGES = ["towers.0", "towers.1"]


def _wrap(plan_ms: float, plain_ms: float) -> tuple[nn.Module, SimulatedBackend]:
    """Steps that use side streams take ``plan_ms`` on the simulated clock, others
    ``plain_ms``."""
    backend = SimulatedBackend(step_time=planned_ms(plan_ms, plain_ms), keep_all=True)
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
    """A graph's stand-in: captured with an arm held, a replay runs the step eagerly with
    that arm held again while the race runs (a real replay runs the kernels captured,
    whatever hooks the model has now), then puts the arm held before back, and writes
    the step's loss into the outputs the capture made, as a replay rewrites them."""

    def __init__(self, race: _Race, tuner: Tuner) -> None:
        self.race, self.tuner, self.arm = race, tuner, tuner.active
        self.outputs = torch.zeros(())

    def replay(self) -> None:
        racing = self.tuner.decision == "pending"
        before = self.tuner.active
        if racing:
            self.tuner.hold(self.arm)
        self.outputs.copy_(self.race.step(self.race.x))
        if racing:
            self.tuner.hold(before)
        self.race.replayed.append(self)


class _Race:
    """A graphed step of the models that ``steps`` train (``model`` raced), its arms
    captured as stand-in graphs, through graphed_step's own race set-up."""

    def __init__(
        self,
        model: nn.Module,
        fail: str | None = None,
        warmup: int = 3,
        others: Sequence[nn.Module] = (),
    ) -> None:
        self.step = _step_for(model)
        other_steps = [_step_for(other) for other in others]
        self.x = two_tower_input()
        self.captured: list[tuple[str, ...]] = []  # the arms held at each capture
        self.replayed: list[_StandInGraph] = []
        with _wrapped_models_seen() as models:
            for _ in range(warmup):
                self.step(self.x)
                for step in other_steps:
                    step(self.x)
        assert models == ([model, *others] if warmup else [])
        models = [model, *others]
        tuners = [registry.race_as_graph(each) for each in (model, *others)]

        def capture() -> tuple[_StandInGraph, Any]:
            self.captured.append(tuple(t.active.name for t in tuners if t is not None))
            tuner = tuners[0]
            assert tuner is not None
            if tuner.active.name == fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            graph = _StandInGraph(self, tuner)
            return graph, graph.outputs

        race = _graph_race(models, capture, shape_of((self.x,), {}))
        assert race is not None
        self.tuner = tuners[0]
        specs = (_ArgSpec.of(self.x),)
        self.graphed = GraphedStep(
            self.step, specs, "captured", "stand-in", None, (self.x,), race=race
        )

    def call(self) -> Any:
        """One call of the graphed step; checks it returned the outputs of the graph it
        replayed."""
        out = self.graphed(self.x)
        assert out is self.replayed[-1].outputs
        return out

    def until_decided(self, calls: int = 200) -> int:
        for call in range(calls):
            if not self.graphed.racing:
                return call
            self.call()
        raise AssertionError(f"not decided after {calls} calls")


def _train_until_decided(
    model: nn.Module, step: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    step, x, steps = step or _step_for(model), two_tower_input(), 200
    for _ in range(steps):
        step(x)
        if model.tuning is not None and model.tuning.decision != "pending":
            return
    raise AssertionError(f"eager tuning did not decide in {steps} steps")


def test_the_warm_up_of_a_graphed_step_times_nothing() -> None:
    model, backend = _wrap(8.0, 10.0)
    backend.clear_log()
    race = _Race(model)
    assert not any(call.op == "record_timing_event" for call in backend.log)
    assert model.tuning is not None and model.tuning.decision == "pending"
    assert all(not arm.step_ms for arm in model.tuning.arms)
    assert race.captured == [("plain",), ("static",)]  # each arm captured with its hooks


def test_the_arms_race_as_graphs_and_the_winner_is_kept() -> None:
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model)
    assert race.graphed.racing == ("plain", "static") and race.graphed.captured
    assert race.graphed.graph is None  # one graph per arm while racing
    calls = race.until_decided()  # every call returns the outputs of the graph replayed
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "static" and tuning.as_graph
    assert "graph" in tuning.compared
    assert set(tuning.arm("static").step_ms) == {8.0}  # type: ignore[union-attr]
    assert set(tuning.arm("plain").step_ms) == {10.0}  # type: ignore[union-attr]
    # Warm-up replays apart, the steps counted are the replays: nothing else.
    assert sum(len(arm.step_ms) for arm in tuning.arms) + len(tuning.confirmation) <= calls
    kept = [e for e in ooo_wrap.events_for(model) if e.reason == "kept"]
    assert kept and "graph replays" in kept[-1].message
    graph = race.graphed.graph
    assert isinstance(graph, _StandInGraph) and graph.arm.name == "static"
    assert model.plan.stages and not registry.runs_plain(model)  # the winner's hooks
    assert race.graphed.static_outputs is graph.outputs
    # From the winner's next replay on, .grad are its graph's buffers.
    kept_grads = race.graphed._grads
    assert kept_grads is not None
    race.call()
    assert race.replayed[-1] is graph
    assert all(param.grad is grad for param, grad in kept_grads)


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


def test_plain_that_cannot_be_captured_raises_and_lets_the_tuner_go() -> None:
    model, _ = _wrap(8.0, 10.0)
    with pytest.raises(RuntimeError, match="operation not permitted"):
        _Race(model, fail="plain")
    state = registry.wrapped[model]
    assert state.tuner is not None and not state.tuner.held
    _train_until_decided(model)  # it tunes on eager steps again
    assert model.tuning is not None and not model.tuning.as_graph


def test_a_warm_up_that_raises_lets_the_tuners_go() -> None:
    model, _ = _wrap(8.0, 10.0)
    step, x = _step_for(model), two_tower_input()
    step(x)  # plain's eager warm-up: the tuner exists
    with pytest.raises(ValueError, match="boom"), _wrapped_models_seen():
        step(x)
        raise ValueError("boom")
    state = registry.wrapped[model]
    assert state.tuner is not None and not state.tuner.held
    _train_until_decided(model, step)


def test_a_graphed_step_dropped_undecided_lets_the_tuner_go() -> None:
    import gc

    model, _ = _wrap(8.0, 10.0)
    race = _Race(model)
    race.call()
    tuner = race.tuner
    assert tuner is not None and tuner.held
    del race
    gc.collect()
    assert not tuner.held
    _train_until_decided(model)


def test_an_undecided_eager_race_is_dropped_for_the_graphs() -> None:
    model, _ = _wrap(8.0, 10.0)
    step, x = _step_for(model), two_tower_input()
    for _ in range(40):  # until both arms have counted eager steps, undecided
        step(x)
        assert model.tuning is not None and model.tuning.decision == "pending"
        if all(arm.step_ms for arm in model.tuning.arms):
            break
    assert all(arm.step_ms for arm in model.tuning.arms)
    race = _Race(model)
    assert all(not arm.step_ms for arm in model.tuning.arms)  # the eager steps are dropped
    race.until_decided()
    assert model.tuning.as_graph and model.tuning.shapes == 1


def test_a_decision_from_eager_steps_is_raced_again_as_a_graph() -> None:
    model, _ = _wrap(8.0, 10.0)
    _train_until_decided(model)
    assert model.tuning is not None and model.tuning.decision == "static"
    assert not model.tuning.as_graph
    race = _Race(model)  # the eager decision does not apply to a replay
    assert race.graphed.racing == ("plain", "static")
    race.until_decided()
    assert model.tuning.as_graph
    # A decision measured as a graph stands for the next graphed step.
    assert registry.race_as_graph(model) is None


def test_a_second_graphed_step_of_the_model_adopts_the_decision() -> None:
    model, _ = _wrap(8.0, 10.0)
    first = _Race(model)
    second = _Race(model, warmup=0)  # the same race, fed by both
    assert second.tuner is first.tuner
    first.until_decided()
    assert second.graphed.racing  # not told yet
    second.call()
    assert not second.graphed.racing and isinstance(second.graphed.graph, _StandInGraph)
    assert second.graphed.graph.arm.name == model.tuning.decision  # type: ignore[union-attr]


def test_a_decision_for_a_replanned_model_is_not_applied() -> None:
    backend = SimulatedBackend(step_time=planned_ms(8.0, 10.0))
    model = ooo_wrap.OOOModule(
        make_two_towers(), backend=backend, stages=STAGES, split_weight_grads=False
    )  # the dataflow planner: replan() learns again
    step, x = _step_for(model), two_tower_input()
    step(x)  # learned: tuning
    old = registry.wrapped[model].tuner
    assert old is not None
    model.replan()
    step(x)  # learned again: a new tuner, undecided
    new = registry.wrapped[model].tuner
    assert new is not None and new is not old
    registry.graph_race_decided(model, old)  # the race of a tuner the model no longer has
    assert registry.wrapped[model].tuner is new and model.tuning.decision == "pending"  # type: ignore[union-attr]


def test_a_plan_learned_in_a_graphed_step_is_priced_as_a_graph_replay() -> None:
    from tests.support.cli_factories import graph_towers

    model = ooo_wrap.OOOModule(graph_towers(), backend=SimulatedBackend(), tune=False)
    with _wrapped_models_seen() as models:
        model(torch.randn(16, 256)).sum().backward()  # the learning step
    assert models == [model]
    estimate = model.plan.estimate
    assert estimate is not None and estimate.graphed and model.plan.stages


def test_a_second_tuning_model_in_the_step_is_held_plain_until_the_race_ends() -> None:
    first, _ = _wrap(8.0, 10.0)
    second, _ = _wrap(8.0, 10.0)
    step, x = _step_for(second), two_tower_input()
    step(x)
    step(x)  # the static arm's warm-up step: the second model runs that arm now
    assert registry.wrapped[second].tuner.active.name == "static"  # type: ignore[union-attr]
    race = _Race(first, others=[second])
    # Every capture held the second model plain, whatever arm it ran before.
    assert [held for _, held in race.captured] == ["plain", "plain"]
    events = [e for e in ooo_wrap.events_for(second) if e.reason == "not_finished"]
    assert events and "one model at a time" in events[0].message
    other = registry.wrapped[second].tuner
    assert other is not None and other.held
    race.until_decided()
    assert not other.held  # let go: its eager steps tune again


@pytest.mark.parametrize("grads_of", ["plain", "static"])
def test_each_replay_binds_the_gradients_of_its_own_graph(grads_of: str) -> None:
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model)
    graphs = race.graphed._race._graphs  # type: ignore[union-attr]
    # Stand-ins replay eagerly, so give each "graph" buffers of its own, as captures do.
    for name, captured in graphs.items():
        captured.grads = [(p, torch.full_like(p, float(len(name)))) for p, _ in captured.grads]
    for _ in range(4):
        race.call()
        if race.graphed._race.replaying == grads_of:  # type: ignore[union-attr]
            break
    replayed = race.graphed._race.replaying  # type: ignore[union-attr]
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


def _rank_race(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 cannot capture the static arm: it leaves the race on both ranks."""
    torch.manual_seed(0)
    model, _ = _wrap(8.0, 10.0)
    race = _Race(model, fail="static" if rank == 1 else None)
    arms = race.graphed.racing
    race.until_decided()
    torch.distributed.barrier()  # leave together (gloo's teardown)
    assert model.tuning is not None
    return {"arms": arms, "decision": model.tuning.decision}


def test_an_arm_one_rank_cannot_capture_leaves_the_race_on_every_rank() -> None:
    from tests.support.distributed import run_ranks

    results = run_ranks(_rank_race, timeout=300.0)
    assert [r["arms"] for r in results] == [("plain",), ("plain",)]
    assert [r["decision"] for r in results] == ["plain", "plain"]


def test_a_cached_arm_being_confirmed_is_raced_again_as_a_graph_not_labelled_cached() -> None:
    model, _ = _wrap(8.0, 10.0)
    _step_for(model)(two_tower_input())  # plain's warm-up: the tuner exists
    tuner = registry.wrapped[model].tuner
    assert tuner is not None
    tuner.recalled, tuner.shared.recalled = True, "static"  # as a recall being confirmed
    _Race(model).until_decided()
    reasons = [e.reason for e in ooo_wrap.events_for(model)]
    assert "kept" in reasons and "cached" not in reasons, reasons
