"""The planner's estimate against the race checker's, on CPU-sized models.

Run: ``python -m benchmarks.agreement``. For each model it learns the plan the planner
keeps (regions the simulated step pays for) and prints its estimate; then, to compare the
two estimates on a plan with side streams, it learns the plan with every region the
region rule finds, prints that plan's estimate and the estimate ``check()`` reports for
the same model running it. Every figure is an estimate on the reference GPU, never a
measurement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ooo_wrap._planner import dataflow as _dataflow
from ooo_wrap._planner.cost import H200
from ooo_wrap._planner.dataflow import learn_plan
from ooo_wrap.testing import check


class Towers(nn.Module):
    """``towers`` MLPs over one input, summed: ``hidden`` hidden layers of ``width``."""

    def __init__(self, towers: int, dim: int, width: int, hidden: int) -> None:
        super().__init__()
        layers = lambda: [  # noqa: E731
            nn.Linear(dim, width),
            *(m for _ in range(hidden - 1) for m in (nn.ReLU(), nn.Linear(width, width))),
            nn.ReLU(),
            nn.Linear(width, dim),
        ]
        self.towers = nn.ModuleList(nn.Sequential(*layers()) for _ in range(towers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([tower(x) for tower in self.towers]).sum(0)


def _cases() -> dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]]:
    from examples import quickstart
    from tests.support import dataflow_models as models

    return {
        "two towers 512-2048-512, batch 1024": lambda: (
            Towers(2, 512, 2048, 1),
            (torch.randn(1024, 512),),
        ),
        "three towers width 1024, batch 512": lambda: (
            Towers(3, 1024, 1024, 2),
            (torch.randn(512, 1024),),
        ),
        "quickstart": lambda: (quickstart.build_model(), (quickstart.example_input(),)),
        "inception replica (2 blocks, 8x28x28)": lambda: (
            models.Inception(blocks=2, c=32, width=32),
            (torch.randn(8, 3, 28, 28),),
        ),
        "clip replica": lambda: (models.Clip(), models.clip_inputs("cpu")),
        "residual chain": lambda: (models.ResidualChain(), (torch.randn(64, 512),)),
    }


def main() -> None:
    print(f"All figures: estimated step µs on {H200.name}, not measurements.")
    header = (
        f"{'model':<40} {'learned':<30} {'learned est.':>13} | "
        f"{'by-rule plan est.':>18} {'check() est.':>13} {'diff':>6}"
    )
    print(header)
    for name, make in _cases().items():
        torch.manual_seed(0)
        model, inputs = make()
        judged = learn_plan(model, inputs)
        kept = judged.estimate
        assert kept is not None
        learned = f"{judged.outcome} ({len(judged.stages)})"
        if judged.stages:  # the learned plan with side streams, as check() runs it
            own = check(model, *inputs)
            learned += f" check {own.estimate.speedup:.2f}x"
        _dataflow.BY_SIMULATION = False
        try:
            ruled = learn_plan(model, inputs)
            report = check(model, *inputs) if ruled.stages else None
        finally:
            _dataflow.BY_SIMULATION = True
        planned = ruled.estimate
        assert planned is not None
        if report is None or report.not_checked is not None:
            checked, diff = "-", "-"
        else:
            got = report.estimate
            checked = f"{got.speedup:.2f}x"
            diff = f"{(planned.wrapped_us / got.wrapped_us - 1) * 100:+.1f}%"
        print(
            f"{name:<40} {learned:<30} {kept.speedup:>12.2f}x | "
            f"{planned.wrapped_us:>8.1f} µs {planned.speedup:>5.2f}x {checked:>13} {diff:>6}"
        )


if __name__ == "__main__":
    main()
