"""Observing one forward (the call tree, storages, costs) and the child DAG built from it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from ooo_wrap._compat import storage_address, storage_id
from ooo_wrap._planner.cost import H200
from ooo_wrap._planner.dataflow import learn
from ooo_wrap._planner.observe import CallRecord, ObservedOp, Observer, observe
from ooo_wrap._planner.regions import Parallel, Series, call_dag, choose
from tests.support import dataflow_models as models


def one_us(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
    """Every op that is not a view costs 1 µs: branch costs become op counts."""
    return 0.0 if func.is_view else 1.0


class Twice(nn.Module):
    """Calls ``inner`` twice, the second time on the first call's result, then adds in place."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(self.inner(x))
        return y.add_(1)


def test_a_module_called_twice_is_two_calls_and_data_flows_between_them() -> None:
    record = observe(Twice(), (torch.randn(2, 4),), op_cost=one_us)
    first, second = record.children
    assert (first.name, second.name) == ("inner", "inner")
    assert first.call_id < second.call_id
    written = {key for op in first.ops() for key in op.fresh}
    read = {key for op in second.ops() for key in op.reads}
    assert written & read  # the second call reads what the first one wrote
    (add,) = [op for op in record.items if isinstance(op, ObservedOp)]
    assert add.name == "aten.add_.Tensor" and add.writes and not add.fresh
    assert call_dag(record).ancestors == (frozenset(), frozenset({0}))
    assert record.device_us == sum(op.device_us for op in record.ops())


def test_the_observer_leaves_no_hook_behind_even_when_the_forward_raises() -> None:
    model = models.ResidualChain(dim=8, depth=2)
    model.blocks[1].norm = nn.LayerNorm(9)  # wrong width: the second block raises
    with pytest.raises(RuntimeError), Observer(model):
        model(torch.randn(2, 8))
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    watch = Observer(models.ResidualChain(dim=8, depth=1))
    with watch:
        pass
    with pytest.raises(RuntimeError, match="no forward of the model completed"):
        _ = watch.record


def test_a_lazy_module_is_observed_with_its_parameters_once_initialized() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3))
    record = observe(model, (torch.randn(2, 5),), op_cost=one_us)
    lazy, _, plain = record.children
    assert lazy.params == ((4 * 5, 4), (4, 4)) and plain.params == ((3 * 4, 4), (3, 4))


def test_another_thread_calling_the_observed_modules_is_not_recorded() -> None:
    model = Twice()
    x = torch.randn(2, 4)
    with Observer(model, op_cost=one_us) as watch:
        other = threading.Thread(target=model, args=(x,))
        other.start()
        other.join()
        model(x)
    assert len(watch._top) == 1
    assert [call.name for call in watch.record.calls()] == ["", "inner", "inner"]


def test_cpu_and_meta_observations_agree() -> None:
    torch.manual_seed(0)
    model = models.Inception(blocks=1, c=8, width=8)
    x = torch.randn(2, 3, 12, 12)

    def shape(call: CallRecord) -> list[Any]:
        return [
            (i.name, len(i.reads), len(i.writes), len(i.fresh), i.device_us)
            if isinstance(i, ObservedOp)
            else (i.name, shape(i))
            for i in call.items
        ]

    on_cpu = observe(model, (x,))
    on_meta = observe(model.to("meta"), (x.to("meta"),))
    assert shape(on_cpu) == shape(on_meta)
    assert call_dag(on_cpu).ancestors == call_dag(on_meta).ancestors


def test_an_inception_block_decomposes_into_four_chains() -> None:
    record = observe(models.InceptionBlock(8, 8), (torch.randn(2, 8, 6, 6),), op_cost=one_us)
    dag = call_dag(record)
    assert dag.width() == 4
    (parallel,) = dag.series().parts
    assert isinstance(parallel, Parallel)
    chains = sorted(tuple(c.name for c in b.calls()) for b in parallel.branches)
    assert chains == [("b1",), ("b2", "b2_conv"), ("b3_reduce", "b3_a", "b3_b"), ("pool",)]
    assert dag.own_us == 1.0  # the cat


class Tangle(nn.Module):
    """``c`` reads ``a``; ``d`` reads ``a`` and ``b``: no cut and one component."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        return self.c(a) + self.d(a + b)


def test_a_tangle_is_kept_whole_as_one_chain() -> None:
    dag = call_dag(observe(Tangle(), (torch.randn(2, 4),), op_cost=one_us))
    assert dag.width() == 2
    series = dag.series()
    assert all(not isinstance(part, Parallel) for part in series.parts)
    assert [c.name for c in series.calls()] == ["a", "b", "c", "d"]


class Fork(nn.Module):
    """A stem, then branches of 4, 2 and 1 Linear calls, then a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.long = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
        self.mid = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.short = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.long(x) + self.mid(x) + self.short(x)


@pytest.mark.parametrize(
    ("fork_join_us", "leaving"),
    [(0.5, {"mid", "short"}), (1.5, {"mid"}), (5.0, set())],
)
def test_a_branch_leaves_only_if_it_outlasts_its_fork_and_join(
    fork_join_us: float, leaving: set[str]
) -> None:
    # With one_us, a Linear with bias costs 1 µs (addmm) and the branches cost 4, 2 and 1.
    record = observe(Fork(), (torch.randn(2, 4),), op_cost=one_us)
    gpu = dataclasses.replace(H200, fork_join_us=fork_join_us)
    (stem, parallel, *_) = call_dag(record).series().parts
    assert isinstance(stem, CallRecord) and isinstance(parallel, Parallel)
    assert sorted(b.device_us for b in parallel.branches) == [1.0, 2.0, 4.0]
    choice = choose(parallel, gpu)
    names = [next(b.calls()).name for b in parallel.branches]
    if not leaving:
        assert choice is None
        assert learn(record, 4, gpu=gpu, by_simulation=False).outcome == "no_parallelism"
        return
    assert choice is not None
    assert names[choice.heaviest] == "long"  # stays on the caller's stream
    assert {names[i] for i in choice.leaving} == leaving
    learned = learn(record, 4, gpu=gpu, by_simulation=False)
    assert set(learned.stage_streams) == leaving
    assert "stem" not in learned.stage_streams  # a chain link outside the region


def test_series_cost_is_the_sum_of_its_calls() -> None:
    record = observe(Fork(), (torch.randn(2, 4),), op_cost=one_us)
    series = call_dag(record).series()
    assert isinstance(series, Series)
    assert series.device_us == sum(c.device_us for c in record.children) == 8.0


class ForkWithIdentity(Fork):
    """``mid`` is written out as a chain with a kernel-free ``nn.Identity`` link inside."""

    def __init__(self) -> None:
        super().__init__()
        self.mid_a, self.nothing, self.mid_b = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.long(x) + self.mid_b(self.nothing(self.mid_a(x))) + self.short(x)


def test_a_link_that_launches_no_kernel_is_neither_a_stage_nor_counted_by_the_rule() -> None:
    record = observe(ForkWithIdentity(), (torch.randn(2, 4),), op_cost=one_us)
    # mid costs 2 µs over 2 kernel-launching calls: it leaves at 0.9 µs per fork, not at 1.1
    leaves = learn(record, 4, gpu=dataclasses.replace(H200, fork_join_us=0.9), by_simulation=False)
    assert set(leaves.stage_streams) == {"mid_a", "mid_b", "short"}
    assert leaves.stage_streams["mid_a"] == leaves.stage_streams["mid_b"]
    stays = learn(record, 4, gpu=dataclasses.replace(H200, fork_join_us=1.1), by_simulation=False)
    assert stays.outcome == "no_parallelism"


class UpdateStats(nn.Module):
    """SyncBatchNorm's statistics update, on the CPU: always in place."""

    def __init__(self) -> None:
        super().__init__()
        self.running_mean, self.running_var = nn.Buffer(torch.zeros(4)), nn.Buffer(torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.batch_norm_update_stats(x, self.running_mean, self.running_var, 0.1)


@pytest.mark.parametrize(
    ("make", "writes"),
    [
        (lambda: nn.BatchNorm1d(4), True),
        (lambda: nn.BatchNorm1d(4).eval(), False),  # eval mode reads its statistics
        (UpdateStats, True),
    ],
    ids=["batch_norm", "batch_norm_eval", "batch_norm_update_stats"],
)
def test_ops_updating_running_statistics_write_them(
    make: Callable[[], nn.Module], writes: bool
) -> None:
    # Neither op's schema marks the statistics as written: the observer must know.
    norm = make()
    record = observe(norm, (torch.randn(8, 4),), op_cost=one_us)
    (op,) = [op for op in record.ops() if "batch_norm" in op.name]
    stats = {storage_id(t) for t in (norm.running_mean, norm.running_var)}
    assert (stats <= set(op.writes), stats <= set(op.reads)) == (writes, not writes)


def test_the_two_storage_identities_answer_different_questions() -> None:
    # Which StorageImpl (planner, joins): distinct on meta, where every address is 0.
    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert storage_address(a) == storage_address(b) == 0
    assert storage_id(a) != storage_id(b) and storage_id(a) == storage_id(a[1:])
    # Which memory (the checker's allocator model): resize_ moves the same StorageImpl.
    x = torch.empty(4)
    impl, address = storage_id(x), storage_address(x)
    x.resize_(1 << 20)
    assert storage_id(x) == impl and storage_address(x) != address


def linears(n: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))


class Between(nn.Module):
    """An inner region (``a`` against ``b``) between two links ``pre`` and ``post``."""

    def __init__(self, ends: int) -> None:
        super().__init__()
        self.pre, self.a, self.b, self.post = linears(ends), linears(4), linears(4), linears(ends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        return self.post(self.a(x) + self.b(x))


class PricedFork(nn.Module):
    """A long branch against ``side`` (a region inside) followed by a one-kernel ``tail``."""

    def __init__(self, ends: int) -> None:
        super().__init__()
        self.long, self.side, self.tail = linears(24), Between(ends), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.long(x) + self.tail(self.side(x))


@pytest.mark.parametrize(
    ("ends", "stages"),
    [
        (1, {"side"}),  # pre and post (1 µs) cannot pay a fork: side runs whole
        (3, {"side.pre", "side.a", "side.b", "side.post"}),  # every link pays: split
    ],
)
def test_a_branch_is_priced_as_the_stages_it_runs_as(ends: int, stages: set[str]) -> None:
    # Regression: side was priced as one stage call, then run as one stage per link,
    # pre and post (1 µs) among them; tail (1 µs) was a stage of its own too.
    record = observe(PricedFork(ends), (torch.randn(2, 4),), op_cost=one_us)
    gpu = dataclasses.replace(H200, fork_join_us=2.0)
    learned = learn(record, 4, gpu=gpu, by_simulation=False)
    assert set(learned.stage_streams) == stages
    for stage in learned.stages:
        assert stage.device_us > stage.calls * gpu.fork_join_us, stage
    side = learned.stage_streams.get("side", learned.stage_streams.get("side.pre"))
    assert side is not None and learned.stage_streams.get("side.post", side) == side
