"""Pricing a plan: the weight-gradient split, a CUDA graph replay, and ``estimate_arm``.

Records come from small models observed on the ``meta`` device (no math runs); the
simulated ops pin where each split kernel runs and what it waits for.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._errors import OOOConfigError
from ooo_wrap._planner.backward import (
    SPLIT_HOST_LAUNCHES,
    SPLIT_LAG,
    backward_cost,
    split_cost,
    split_host_us,
)
from ooo_wrap._planner.cost import H200
from ooo_wrap._planner.dataflow import learn, learn_plan
from ooo_wrap._planner.observe import CallRecord, observe
from ooo_wrap._planner.simulate import SimOp, estimate_arm, simulate, step_ops

WGRAD = -1  # the weight-gradient stream in step_ops


def _chain_record(layers: int = 6, width: int = 512, batch: int = 8) -> CallRecord:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        x = torch.randn(batch, width, requires_grad=True)
    return observe(model, (x,))


def _towers_record() -> CallRecord:
    """The docs' target case: 8 towers, width 2048, depth 4, batch 16."""
    from benchmarks.models import Towers

    with torch.device("meta"):
        model = Towers(8, 2048, 4)
        x = torch.randn(16, 2048)
    return observe(model, (x,))


def test_split_backward_sums_to_the_unsplit_backward() -> None:
    for name in ("aten.addmm.default", "aten.mm.default", "aten.convolution.default"):
        for first in (False, True):
            (di, di_kernels), (dw, dw_kernels) = split_cost(name, first)
            factor, kernels = backward_cost(name, first)
            assert di + dw == pytest.approx(factor)
            # A convolution's one convolution_backward becomes two kernels.
            extra = 1.0 if name == "aten.convolution.default" and not first else 0.0
            assert di_kernels + dw_kernels == kernels + extra


def test_split_runs_each_weight_gradient_on_its_stream_after_the_output_gradient() -> None:
    record = _chain_record()
    ops = step_ops(record, {}, H200, split=True)
    result = simulate(ops)
    dws = [i for i, op in enumerate(ops) if op.stream == WGRAD]
    assert len(dws) == 6  # one dW per Linear (its bias gradient with it)
    for count, index in enumerate(dws):
        dw = ops[index]
        assert dw.device_us > 0
        # The fork: dW waits on the layer's stream as it was when the output gradient
        # was ready, the op just before the layer's dI on stream 0.
        (ready,) = dw.waits
        di = index - 1
        assert ops[di].stream == 0 and ops[ready].stream == 0 and ready < di
        assert result.starts[index] >= result.ends[ready]
        # The lag bound: the layer's dI waits on the dW SPLIT_LAG split layers back.
        if count >= SPLIT_LAG:
            assert dws[count - SPLIT_LAG] in ops[di].waits
            assert result.starts[di] >= result.ends[dws[count - SPLIT_LAG]]
        else:
            assert ops[di].waits == ()
    # The caller's stream waits for the weight-gradient stream before the optimizer.
    join = next(op for op in ops[dws[-1] :] if op.device_us == 0 and dws[-1] in op.waits)
    assert join.stream == 0


def test_a_dropped_split_wait_is_seen_by_the_simulated_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutations of the split's two ordering points: without them a dW (or a dI) starts
    before what it must wait for, so the checks above can fail (replayed as a graph, where
    no launch spaces the ops out; with dW five times its usual cost, so that the
    weight-gradient stream lags and the lag bound binds)."""
    heavy = lambda name, first=False: (split_cost(name, first)[0], (5.0, 1.0))  # noqa: E731
    monkeypatch.setattr("ooo_wrap._planner.simulate.split_cost", heavy)
    ops = step_ops(_chain_record(), {}, H200, split=True, graphed=True)
    dws = [i for i, op in enumerate(ops) if op.stream == WGRAD]
    lagged = [(i - 1, dws[n - SPLIT_LAG]) for n, i in enumerate(dws) if n >= SPLIT_LAG]
    kept = simulate(ops)
    assert all(kept.starts[di] >= kept.ends[dw] for di, dw in lagged)
    unforked = [SimOp(**{**vars(op), "waits": ()}) if op.stream == WGRAD else op for op in ops]
    result = simulate(unforked)
    assert any(result.starts[i] < result.ends[ops[i].waits[0]] for i in dws)
    no_lag = [
        SimOp(**{**vars(op), "waits": ()}) if op.stream == 0 and op.waits else op for op in ops
    ]
    result = simulate(no_lag)
    assert any(result.starts[di] < result.ends[dw] for di, dw in lagged)


def test_split_host_cost_is_the_measured_figure_scaled_to_the_reference() -> None:
    assert split_host_us(H200) == pytest.approx(119.0 / 46.8 * 4 * H200.launch_us)
    assert split_host_us(H200) == pytest.approx(SPLIT_HOST_LAUNCHES * 5.0)
    record = _chain_record()
    plain = step_ops(record, {}, H200)
    split = step_ops(record, {}, H200, split=True)
    added = sum(op.host_us for op in split) - sum(op.host_us for op in plain)
    # As many launches as unsplit (dI, and dW with the bias sum); per event wait half a
    # fork/join: each dW's fork, each lag wait, and the caller's wait for the
    # weight-gradient stream at the end of backward.
    waits = 6 + (6 - SPLIT_LAG) + 1
    assert added == pytest.approx(6 * split_host_us(H200) + waits * H200.fork_join_us / 2)
    graphed = step_ops(record, {}, H200, split=True, graphed=True)
    assert sum(op.host_us for op in graphed) == H200.launch_us  # the replay's one launch


def test_eager_split_of_a_small_chain_is_slower_and_graphed_it_is_faster() -> None:
    record = _chain_record(layers=8, width=1024, batch=8)
    eager = estimate_arm(record, {}, H200, split=True)
    graphed = estimate_arm(record, {}, H200, split=True, graphed=True)
    # Eagerly the host's per-layer cost dominates these tiny GEMMs (as the docs' check()
    # of the same chain shows); replayed, dW overlaps the next layer's dI.
    assert eager.speedup < 0.9
    assert graphed.speedup > 1.01
    assert eager.split and graphed.split and graphed.graphed and not eager.graphed
    assert "with the weight-gradient split" in str(eager)
    # Without the split and stages, the arm is the plain model.
    plain = estimate_arm(record, {}, H200)
    assert plain.wrapped_us == plain.one_stream_us == eager.one_stream_us


def test_a_graph_replay_launches_once_and_forks_are_edges() -> None:
    record = _towers_record()
    ids = {c.call_id: i % 4 for i, c in enumerate(record.children[0].children)}
    ops = step_ops(record, ids, H200, graphed=True)
    assert ops[0].host_us == H200.launch_us and ops[0].device_us == 0
    assert all(op.host_us == 0 for op in ops[1:])
    assert any(op.waits for op in ops)  # the forks and joins are still dependencies
    plain = step_ops(record, {}, H200, one_stream=True, graphed=True)
    device = sum(op.device_us for op in plain)
    assert simulate(plain).length_us == pytest.approx(H200.launch_us + device)


def test_the_target_towers_keep_their_regions_priced_as_a_graph() -> None:
    record = _towers_record()
    eager = learn(record, 4, gpu=H200)
    assert eager.outcome == "no_parallelism" and not eager.stages
    assert eager.estimate is not None and not eager.estimate.graphed
    assert len(eager.rejected) == 1
    text = str(eager)
    assert "priced as eager launches" in text
    assert "host-bound: 30.9 µs of kernels, 35.0 µs to launch them" in text
    graphed = learn(record, 4, gpu=H200, graphed=True)
    assert graphed.outcome == "parallel" and len(graphed.stages) == 7
    assert graphed.estimate is not None and graphed.estimate.graphed
    assert graphed.estimate.speedup > 1.1
    text = str(graphed)
    assert "priced as a CUDA graph replay" in text
    assert "one graph launch, no per-kernel launch, fork/joins as graph edges" in text
    # The plan's one estimate is estimate_arm's for its stages.
    assert graphed.arm(H200, graphed=True) == graphed.estimate
    assert eager.arm(H200) == eager.estimate


def test_plan_takes_graphed_and_says_so() -> None:
    from benchmarks.models import Towers

    with torch.device("meta"):
        model = Towers(8, 2048, 4)
        x = torch.randn(16, 2048)
    graphed = ooo_wrap.plan(model, example_inputs=(x,), graphed=True)
    assert graphed.stages and graphed.estimate is not None and graphed.estimate.graphed
    eager = ooo_wrap.plan(model, example_inputs=(x,))
    assert not eager.stages and "priced as eager launches" in str(eager)
    with pytest.raises(OOOConfigError, match="graphed must be True or False, got 'yes'"):
        ooo_wrap.plan(model, example_inputs=(x,), graphed="yes")  # type: ignore[arg-type]


def test_learn_plan_graphed_matches_learn() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        x = torch.randn(4, 64)
    learned = learn_plan(model, (x,), graphed=True)
    assert learned.estimate is not None and learned.estimate.graphed


def test_a_wrapped_model_still_to_learn_can_be_priced_as_a_graph_replay() -> None:
    from ooo_wrap._wrapper.registry import price_as_graph_replay
    from ooo_wrap.testing import SimulatedBackend
    from tests.support.cli_factories import graph_towers

    model = ooo_wrap.OOOModule(graph_towers(), backend=SimulatedBackend(), tune=False)
    assert price_as_graph_replay(model)
    model(torch.randn(16, 256)).sum().backward()  # the learning step
    estimate = model.plan.estimate
    assert estimate is not None and estimate.graphed and model.plan.stages
    assert not price_as_graph_replay(model)  # learned: nothing left to price
    assert not price_as_graph_replay(nn.Linear(2, 2))  # not wrapped
