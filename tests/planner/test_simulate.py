"""The step simulator the planner decides with and the checker reports with.

Hand-made op lists pin the model (processor sharing by occupancy, host-bound issue,
chains); small models pin the planner's decisions and that its estimate is the checker's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._plan import StepEstimate
from ooo_wrap._planner.cost import H200
from ooo_wrap._planner.dataflow import MIN_GAIN_US, learn_plan
from ooo_wrap._planner.placement import assign_regions
from ooo_wrap._planner.simulate import SimOp, estimate_arm, simulate
from ooo_wrap.testing import check
from tests.support import dataflow_models as models

LAUNCH = H200.launch_us


def _kernel(stream: int, us: float, occupancy: float, waits: tuple[int, ...] = ()) -> SimOp:
    return SimOp(stream, us, occupancy, waits, host_us=0.0)


def test_kernels_that_fit_together_run_at_full_speed() -> None:
    ops = [_kernel(0, 10.0, 0.5), _kernel(1, 10.0, 0.5)]
    assert simulate(ops).length_us == pytest.approx(10.0)


def test_two_kernels_of_occupancy_0_6_side_by_side_take_longer_than_one() -> None:
    ops = [_kernel(0, 10.0, 0.6), _kernel(1, 10.0, 0.6)]
    together = simulate(ops).length_us
    assert together == pytest.approx(12.0)  # 1.2 of the GPU asked for: each at 1/1.2
    assert 10.0 < together < 20.0
    full = [_kernel(0, 10.0, 1.0), _kernel(1, 10.0, 1.0)]
    assert simulate(full).length_us == pytest.approx(20.0)  # no gain when both fill it


def test_the_kernel_floor_is_not_shared() -> None:
    ops = [SimOp(s, 10.0, 1.0, floor_us=2.0) for s in (0, 1)]
    assert simulate(ops).length_us == pytest.approx(18.0)  # 2 x 8 µs of work, one floor


def test_host_bound_branches_gain_nothing() -> None:
    # Kernels shorter than their launch: the host issues one at a time either way.
    serial = [SimOp(0, 1.0, 0.1, host_us=LAUNCH) for _ in range(10)]
    split = [SimOp(i % 2, 1.0, 0.1, host_us=LAUNCH) for i in range(10)]
    assert simulate(split).length_us == pytest.approx(simulate(serial).length_us)


def test_a_chain_across_streams_gains_nothing() -> None:
    chain = [_kernel(i % 2, 10.0, 0.2, (i - 1,) if i else ()) for i in range(6)]
    serial = [_kernel(0, 10.0, 0.2) for _ in range(6)]
    assert simulate(chain).length_us == pytest.approx(simulate(serial).length_us)


def test_a_host_sync_holds_the_host_and_waits_order_streams() -> None:
    ops = [
        SimOp(0, 50.0, 0.1, host_us=LAUNCH),
        SimOp(1, 10.0, 0.1, waits=(0,), host_us=LAUNCH),  # after op 0
        SimOp(0, 5.0, 0.1, host_us=LAUNCH, sync=True),
        SimOp(1, 1.0, 0.1, host_us=LAUNCH),  # issued once the sync returned
    ]
    result = simulate(ops)
    assert result.starts[1] == pytest.approx(LAUNCH + 50)
    assert result.ends[2] == pytest.approx(LAUNCH + 55)
    assert result.starts[3] == pytest.approx(LAUNCH + 55 + LAUNCH)


class _TinyTowers(nn.Module):
    """Four towers of small matmuls: each kernel shorter than its launch."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([t(x) for t in self.towers]).sum(0)


def test_a_tiny_host_bound_towers_model_learns_no_parallelism_and_says_why() -> None:
    learned = learn_plan(_TinyTowers(), (torch.randn(8, 32),))  # the default decides
    assert learned.outcome == "no_parallelism" and not learned.stages
    message = learned.no_parallelism_message
    assert "best candidate: 4 branches" in message and "µs forward" in message, message
    assert learned.estimate is not None and learned.estimate.speedup == pytest.approx(1.0)


def test_a_residual_chain_learns_no_parallelism() -> None:
    learned = learn_plan(models.ResidualChain(), (torch.randn(64, 512),))
    assert learned.outcome == "no_parallelism"
    message = learned.no_parallelism_message
    assert f"µs of the {learned.forward_us:.1f} µs forward" in message, message
    assert learned.chain_us > 0.9 * learned.forward_us  # a chain: nearly all of it


def test_no_learned_plan_is_slower_than_one_stream_by_the_simulation() -> None:
    model = models.Inception().to("meta")
    ruled = learn_plan(model, (models.inception_input(),), by_simulation=False)
    judged = learn_plan(model, (models.inception_input(),))
    assert ruled.estimate is not None and judged.estimate is not None
    assert judged.estimate.wrapped_us <= judged.estimate.one_stream_us
    assert judged.estimate.wrapped_us <= ruled.estimate.wrapped_us + 1e-6
    if ruled.estimate.speedup < 1.0:  # the rule alone would lose: the simulation says so
        assert judged.rejected


def test_by_default_a_plan_the_simulator_says_loses_is_not_learned() -> None:
    # The old quickstart's towers: each tower outlasts its fork/join, so the region rule
    # keeps them, but the simulated step is slower with the side streams than without.
    model, x = models.MLPTowers(4, 64, 256, 3), torch.randn(8, 64)
    ruled = learn_plan(model, (x,), by_simulation=False)
    assert ruled.stages and ruled.estimate is not None and ruled.estimate.speedup < 1.0
    learned = learn_plan(model, (x,))
    assert learned.outcome == "no_parallelism" and not learned.stages
    assert learned.estimate is not None and learned.estimate.speedup == pytest.approx(1.0)
    message = learned.no_parallelism_message
    assert "best rejected: region <root>" in message and "µs step" in message, message
    text = str(learned)  # every branch of the rejected region says why, in numbers
    assert "region <root> (width 4): rejected, it would add" in text
    assert text.count("host-bound: 17.4 µs of kernels, 35.0 µs to launch them") == 4, text
    assert ooo_wrap.plan(model, example_inputs=(x,)).stages == ()


@pytest.mark.parametrize(
    ("towers", "dim", "width", "batch"),
    [(4, 64, 256, 8), (2, 512, 2048, 1024), (3, 1024, 1024, 512), (2, 256, 1024, 512)],
)
def test_no_learned_plan_with_side_streams_is_slower_by_check(
    towers: int, dim: int, width: int, batch: int
) -> None:
    model, x = models.MLPTowers(towers, dim, width, 2), torch.randn(batch, dim)
    learned = learn_plan(model, (x,))
    assert learned.estimate is not None and learned.estimate.speedup >= 1.0
    if learned.stages:
        report = check(model, x, tune_arm="regions")
        assert report.ok and report.estimate.speedup >= 1.0, report.estimate


@pytest.mark.parametrize(("depth", "moves"), [(6, True), (3, False)])
def test_the_heaviest_branch_leaves_the_callers_stream_only_where_the_simulation_says_so(
    depth: int, moves: bool
) -> None:
    model, x = (
        models.MLPTowers(4, 1024, 1024, depth).to("meta"),
        torch.empty(512, 1024, device="meta"),
    )
    learned = learn_plan(model, (x,))
    kept = assign_regions(learned.record, 4, H200)
    (region,) = kept.regions
    moved = assign_regions(learned.record, 4, H200, moved=frozenset({region.key}))
    on_caller = estimate_arm(learned.record, kept.stage_stream, H200).wrapped_us
    on_side = estimate_arm(learned.record, moved.stage_stream, H200).wrapped_us
    assert (on_side < on_caller - MIN_GAIN_US) is moves, (on_side, on_caller)
    assert learned.estimate is not None
    assert learned.estimate.wrapped_us == pytest.approx(on_side if moves else on_caller)
    assert len(learned.stages) == (4 if moves else 3)
    (row,) = [b for b in learned.regions[0].branches if b.why.startswith("heaviest")]
    assert ("moved to a side stream" if moves else "kept") in row.why
    assert f"{on_side:.1f} µs with it on a side stream" in row.why and H200.name in row.why


def test_plan_and_check_report_one_estimate_type() -> None:
    model = _TinyTowers()
    x = torch.randn(8, 32)
    learned = ooo_wrap.plan(model, example_inputs=(x,))
    assert isinstance(learned.estimate, StepEstimate)
    assert ooo_wrap.plan(model).estimate is None  # a static plan is never estimated
    report = check(model, x, planner="static", tune_arm="static")
    assert isinstance(report.estimate, StepEstimate)
    for text in (str(learned), str(report)):
        assert f"an estimate on {H200.name}" in text


def test_the_plan_estimate_agrees_with_the_checkers_for_the_same_plan() -> None:
    torch.manual_seed(0)
    model = models.MLPTowers(3, 1024, 1024, 2)  # sized so that the simulated step keeps its streams
    x = torch.randn(512, 1024)
    learned = learn_plan(model, (x,))
    assert learned.stages and learned.estimate is not None
    report = check(model, x, tune_arm="regions")  # the learned plan's arm
    assert report.ok
    # The simulator's modelled backward against the backward the checker recorded.
    planned, checked = learned.estimate, report.timeline_estimate
    assert planned.wrapped_us == pytest.approx(checked.wrapped_us, rel=0.10)
    assert planned.one_stream_us == pytest.approx(checked.one_stream_us, rel=0.10)


def test_the_quickstart_gets_one_estimate_in_its_table_and_check() -> None:
    from examples import quickstart

    model, x = quickstart.build_model(), quickstart.example_input()
    table = ooo_wrap.plan(model, example_inputs=(x,)).estimate
    # The stage arms, whose figure the table gives (test_checker_examples.py proves the
    # quickstart's split arms too).
    report = check(model, x, split_weight_grads=False)
    assert report.ok and table is not None
    assert report.estimate.speedup == pytest.approx(table.speedup, rel=0.01)
    assert report.estimate.wrapped_us == pytest.approx(table.wrapped_us, rel=0.01)
    # One headline: the report prints the plan's figure once as the estimate, and names
    # the timeline's figure for what it covers.
    lines = str(report).splitlines()
    headlines = [line for line in lines if line.strip().startswith("estimated step:")]
    assert len(headlines) == 1 and f"({table.speedup:.2f}x)" in headlines[0]
    assert "(as model.tuning and plan show it)" in headlines[0]
    assert any("the timeline of save_timeline and save_trace" in line for line in lines)
    learned_note = next(line for line in lines if "planned/learned" in line)
    assert f"({table.speedup:.2f}x)" in learned_note


def test_check_prices_the_split_it_checks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    x = torch.randn(8, 64)
    report = check(model, x, stages=["0", "1"], split_weight_grads=True)
    assert report.ok
    learned = ooo_wrap.plan(model, stages=["0", "1"], example_inputs=(x,)).learned
    both = report.arm_report("regions+wgrad").plan_estimate  # the learned stages and the split
    assert both is not None and both.split
    assert learned is not None
    assert both.wrapped_us == pytest.approx(learned.arm(H200, split=True).wrapped_us)  # type: ignore[attr-defined]
    assert "on these streams with the weight-gradient split" in str(report)
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"check\(\): graphed must be True or"):
        check(model, x, graphed=1)  # type: ignore[arg-type]


def test_a_long_step_finishes() -> None:
    # Millions of µs in: a duration far below the float spacing at ``now`` must still end
    # the op it belongs to, and the loop must advance.
    ops = [SimOp(0, 8220283.5, 0.95), SimOp(1, 10989302.6, 0.78), SimOp(0, 1e7, 0.7)]
    result = simulate(ops)
    # No faster than stream 0's two ops in a row, no slower than all three in a row.
    assert 8220283.5 + 1e7 <= result.length_us <= 8220283.5 + 10989302.6 + 1e7


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_costs_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        simulate([SimOp(0, bad)])
