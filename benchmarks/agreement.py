"""The planner's estimate against the race checker's, on CPU-sized models.

Run: ``python -m benchmarks.agreement``. For each model it learns the plan the planner
keeps by default (regions the simulated step pays for) and prints its estimate, the
timeline ``check()`` lays out from the ops it recorded running it
(``CheckReport.timeline_estimate``: the backward as the engine ran it, not modelled from
the forward), and their difference; then
the same for the plan with every region the region rule finds (``by_simulation=False``),
to compare the two estimates where the default keeps no side stream; then the static
plan's simulated step on the same record; then the CLIP replica on the ``meta`` device,
default against static plan, per number of streams. Every figure is an estimate on the
reference GPU, never a measurement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ooo_wrap
from ooo_wrap._planner.cost import H200
from ooo_wrap._planner.dataflow import LearnedPlan, learn_plan
from ooo_wrap._planner.simulate import estimate_arm
from ooo_wrap.testing import check


def _cases() -> dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]]:
    from examples import quickstart
    from tests.support import dataflow_models as models

    return {
        "two towers 512-2048-512, batch 1024": lambda: (
            models.MLPTowers(2, 512, 2048, 1),
            (torch.randn(1024, 512),),
        ),
        "three towers width 1024, batch 512": lambda: (
            models.MLPTowers(3, 1024, 1024, 2),
            (torch.randn(512, 1024),),
        ),
        "quickstart": lambda: (quickstart.build_model(), (quickstart.example_input(),)),
        "inception replica (2 blocks, 8x28x28)": lambda: (
            models.Inception(blocks=2, c=32, width=32),
            (torch.randn(8, 3, 28, 28),),
        ),
        "clip replica": lambda: (models.Clip(), models.clip_inputs("cpu")),
        "residual chain": lambda: (models.ResidualChain(), (torch.randn(64, 512),)),
        "tiny towers (4 x 32-32-32, batch 8)": lambda: (
            models.MLPTowers(4, 32, 32, 1),
            (torch.randn(8, 32),),
        ),
    }


def _row(
    model: nn.Module, inputs: tuple[Any, ...], by_simulation: bool
) -> tuple[str, str, str, str]:
    """Outcome and stages, the plan's estimate, check()'s and the wrapped-step difference,
    for the plan ``learn_plan`` makes with ``by_simulation``."""
    learned = learn_plan(model, inputs, by_simulation=by_simulation)
    planned = learned.estimate
    assert planned is not None
    outcome = f"{learned.outcome} ({len(learned.stages)})"
    own = f"{planned.wrapped_us:.1f} µs {planned.speedup:.3f}x"
    if len(learned.stages) < 2:  # no stage arm for check() to run: nothing to compare
        return outcome, own, "-", "-"
    got = check(model, *inputs, tune_arm="regions").timeline_estimate  # the learned arm
    diff = f"{(planned.wrapped_us / got.wrapped_us - 1) * 100:+.1f}%"
    return outcome, own, f"{got.wrapped_us:.1f} µs {got.speedup:.3f}x", diff


def _static(model: nn.Module, learned: LearnedPlan, streams: int = 4) -> str:
    """The static plan's simulated step on the record ``learned`` was learned from."""
    static = {stage.name: stage.stream for stage in ooo_wrap.plan(model, streams).stages}
    ids = {c.call_id: static[c.name] for c in learned.record.calls() if c.name in static}
    est = estimate_arm(learned.record, ids, H200)
    return f"{est.wrapped_us:.1f} µs {est.speedup:.3f}x"


def _clip_on_meta() -> None:
    """The CLIP replica on the ``meta`` device (attention as its math ops, no check()):
    the default plan against the static plan, by the simulator, per number of streams."""
    from tests.support import dataflow_models as models

    print("\nCLIP replica on the meta device: default plan vs static plan (simulated step)")
    for streams in (1, 2, 4):
        torch.manual_seed(0)
        model = models.Clip().to("meta")
        learned = learn_plan(model, models.clip_inputs(), streams=streams)
        assert learned.estimate is not None
        own = f"{learned.estimate.wrapped_us:.1f} µs {learned.estimate.speedup:.3f}x"
        print(
            f"  streams={streams}: default {learned.outcome} ({len(learned.stages)}) {own}; "
            f"static {_static(model, learned, streams)}"
        )


def main() -> None:
    print(f"All figures: estimated step µs on {H200.name}, not measurements.")
    print(
        f"{'model':<38} {'default plan':<20} {'plan est.':>18} {'check() est.':>18} "
        f"{'diff':>6} | {'by rule':<20} {'plan est.':>18} {'check() est.':>18} {'diff':>6} "
        f"| {'static plan est.':>18}"
    )
    for name, make in _cases().items():
        torch.manual_seed(0)
        model, inputs = make()
        judged = _row(model, inputs, by_simulation=True)
        ruled = _row(model, inputs, by_simulation=False)
        cells = [f"{judged[0]:<20}", f"{judged[1]:>18}", f"{judged[2]:>18}", f"{judged[3]:>6}"]
        cells += ["|", f"{ruled[0]:<20}", f"{ruled[1]:>18}", f"{ruled[2]:>18}", f"{ruled[3]:>6}"]
        torch.manual_seed(0)
        static = _static(model, learn_plan(model, inputs))
        print(f"{name:<38} " + " ".join([*cells, "|", f"{static:>18}"]))
    _clip_on_meta()


if __name__ == "__main__":
    main()
