"""Where stage parameters' gradients accumulate, in a loop that keeps the previous loss alive.

Autograd caches a parameter's ``AccumulateGrad`` node weakly and makes a new one (on the
stream current then) only once the old one is dead. A loop that keeps ``loss`` until the
next step's forward keeps the previous step's nodes alive, so a step that ran inline (the
dataflow planner's learning step, measured tuning's plain steps) would otherwise leave its
caller's-stream accumulators to every later planned step.
"""

from __future__ import annotations

import gc
import weakref

import torch
from models import make_two_towers, two_tower_input
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ooo_wrap.testing import check, detect

STAGES = ["towers.0", "towers.1"]


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
    report = check(model, two_tower_input(), stages=STAGES, steps=3)
    assert report.ok, str(report)
    # The wrapped copy's three steps, then the plain copy's: only the last keeps the
    # previous step's graph; the others start from a dropped graph.
    assert alive == [False, False, True] * 2
    assert not [note for note in report.notes if "AccumulateGrad" in note], report.notes


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
    (mismatch,) = found.accumulator_mismatches
    assert (mismatch.producer, mismatch.accumulator) == (side, main)
