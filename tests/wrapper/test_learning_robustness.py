"""The learning forward of the dataflow planner under what real training loops do to it:
an interrupt (``KeyboardInterrupt``, which skips PyTorch's always-called hooks), a forward
called inside an ``except`` block, lazy modules, several threads training one model."""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ooo_wrap
from ooo_wrap import EventKind, OOOModule
from ooo_wrap._wrapper.registry import wrapped as wrap_states
from ooo_wrap.testing import SimulatedBackend
from tests.support import dataflow_models
from tests.support.models import FailingTowers, hook_snapshot, two_tower_input
from tests.support.reference import FREE_FORK

# These models are far too small for a fork to pay on a real GPU: the learner's reference
# GPU gets a near-free fork, and the regions arm is pinned (every region the rule finds
# kept, where the default keeps only those whose simulated step pays), so that the
# dataflow planner puts the branches on streams.


def wrap(model: nn.Module) -> Any:
    """``model`` wrapped with the dataflow planner's regions arm on virtual streams."""
    return OOOModule(model, backend=SimulatedBackend(), gpu=FREE_FORK, tune_arm="regions")


def dispatch_depth() -> int:
    """How many dispatch modes are on this thread's stack."""
    return int(torch._C._len_torch_dispatch_stack())


def loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def planned_events(model: nn.Module) -> list[str]:
    return [e.reason for e in ooo_wrap.events_for(model) if e.kind is EventKind.PLANNED]


def interrupted(model: FailingTowers, x: torch.Tensor) -> None:
    """A forward that a ``KeyboardInterrupt`` ends inside the second tower."""
    model.towers[1].fail_with = KeyboardInterrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            model(x)
    finally:
        model.towers[1].fail_with = None


def recorded_items(model: nn.Module) -> int:
    """How many ops and calls the observation of ``model`` holds (0 if none is underway)."""
    learner = wrap_states[model].learner
    observer = None if learner is None else learner._observer
    if observer is None:
        return 0
    return sum(len(call.items) for call in observer._stack)


# --- an interrupt while learning ---------------------------------------------------------


def train(
    model: nn.Module, steps: int, interrupt_at: int | None
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """``steps`` optimizer steps; the outputs and every gradient of each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outputs, grads = [], []
    for step in range(steps):
        x = two_tower_input(batch=3 + step)
        if step == interrupt_at:
            assert isinstance(model, FailingTowers)
            interrupted(model, x)
        optimizer.zero_grad()
        out = model(x)
        loss(out).backward()
        outputs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        optimizer.step()
    return outputs, grads


def test_an_interrupted_learning_forward_leaves_the_stacks_and_learns_on_the_next() -> None:
    torch.manual_seed(0)
    plain = FailingTowers()
    model = copy.deepcopy(plain)
    wrapped = wrap(model)
    assert dispatch_depth() == 0
    expected = train(plain, 4, None)
    got = train(wrapped, 4, 0)
    assert dispatch_depth() == 0
    assert not wrapped.plan.pending and wrapped.plan.stages
    # The three steps after learning ran planned.
    assert wrapped.stats.stage_calls == 3 * len(wrapped.plan.stages)
    for step in range(4):
        assert torch.equal(got[0][step], expected[0][step]), step
        assert len(got[1][step]) == len(expected[1][step]) == 4
        for mine, theirs in zip(got[1][step], expected[1][step], strict=True):
            assert torch.equal(mine, theirs), step


def test_after_an_interrupt_no_op_is_recorded_and_the_observer_hooks_come_off() -> None:
    model = FailingTowers()
    before = hook_snapshot(model)
    wrapped = wrap(model)
    after_wrap = hook_snapshot(wrapped)
    interrupted(wrapped, two_tower_input())
    recorded = recorded_items(wrapped)
    for _ in range(50):  # the loop goes on outside the model: none of it is the model's
        torch.randn(4, 4).matmul(torch.randn(4, 4)).sum()
    assert recorded_items(wrapped) <= recorded
    assert hook_snapshot(wrapped) == after_wrap  # the learner's root hooks, nothing else
    wrapped.unwrap()
    assert dispatch_depth() == 0
    assert hook_snapshot(model) == before


def test_unwrap_right_after_an_interrupt_removes_every_hook_and_the_mode() -> None:
    model = FailingTowers()
    before = hook_snapshot(model)
    wrapped = wrap(model)
    interrupted(wrapped, two_tower_input())
    wrapped.unwrap()
    assert dispatch_depth() == 0
    assert hook_snapshot(model) == before


def test_replan_right_after_an_interrupt_learns_on_the_next_forward() -> None:
    wrapped = wrap(FailingTowers())
    interrupted(wrapped, two_tower_input())
    wrapped.replan()  # still learning: nothing to do but the interrupted observation
    loss(wrapped(two_tower_input())).backward()
    assert dispatch_depth() == 0
    assert not wrapped.plan.pending and wrapped.plan.stages


class Passing(TorchDispatchMode):
    """A user's dispatch mode that only counts ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_entered_after_the_interrupt_stays_when_the_observation_is_left() -> None:
    wrapped = wrap(FailingTowers())
    interrupted(wrapped, two_tower_input())
    with Passing() as mode:
        loss(wrapped(two_tower_input())).backward()  # leaves the observation under `mode`
        assert dispatch_depth() == 1
        assert torch._C._get_dispatch_stack_at(0) is mode
    assert mode.ops > 0 and dispatch_depth() == 0
    assert not wrapped.plan.pending and wrapped.plan.stages


# --- a forward inside an except block ----------------------------------------------------


def test_a_forward_called_while_an_exception_is_handled_learns() -> None:
    wrapped = wrap(FailingTowers())
    try:
        raise LookupError("a retry loop's previous attempt")
    except LookupError:
        loss(wrapped(two_tower_input())).backward()
    assert not wrapped.plan.pending and wrapped.plan.stages
    assert planned_events(wrapped) == ["learned"]


def test_a_forward_that_raises_inside_an_except_block_learns_on_the_next_one() -> None:
    wrapped = wrap(FailingTowers())
    wrapped.towers[1].fail_with = ValueError("the fallback path fails too")
    try:
        raise LookupError("first attempt")
    except LookupError:
        with pytest.raises(ValueError, match="fallback path"):
            wrapped(two_tower_input())
    wrapped.towers[1].fail_with = None
    assert wrapped.plan.pending
    loss(wrapped(two_tower_input())).backward()
    assert not wrapped.plan.pending and wrapped.plan.stages


# --- lazy modules -------------------------------------------------------------------------


class LazyTowers(nn.Module):
    """Two towers of lazy linear layers (input size inferred at the first forward)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.LazyLinear(dim), nn.LazyLinear(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return out


def lazy_run(model: nn.Module, steps: int) -> list[list[torch.Tensor]]:
    """The output and every gradient of each of ``steps`` optimizer steps, the first of
    which initializes the lazy parameters (from a fixed seed)."""
    torch.manual_seed(7)
    x = two_tower_input(dim=5)
    model(x)  # materialized outside the optimizer, as lazy modules need
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(x)
        loss(out).backward()
        seen.append([out.detach().clone(), *(p.grad.clone() for p in model.parameters())])
        optimizer.step()
    return seen


def test_a_lazy_model_trains_and_learns_once_its_parameters_are_initialized() -> None:
    wrapped = wrap(LazyTowers())
    x = two_tower_input(dim=5)
    loss(wrapped(x)).backward()  # initializes the lazy parameters: not learned from
    assert wrapped.plan.pending
    assert planned_events(wrapped) == ["lazy_parameters"]
    loss(wrapped(x)).backward()
    assert planned_events(wrapped) == ["lazy_parameters", "learned"]
    assert wrapped.plan.stages
    assert all(stage.num_params == 4 * 5 + 4 for stage in wrapped.plan.stages)
    calls = wrapped.stats.stage_calls
    loss(wrapped(x)).backward()
    assert wrapped.stats.stage_calls == calls + len(wrapped.plan.stages)


def test_a_lazy_model_trains_bitwise_as_the_plain_one() -> None:
    expected = lazy_run(LazyTowers(), 4)
    got = lazy_run(wrap(LazyTowers()), 4)
    for mine, theirs in zip(got, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


class LazyBranch(nn.Module):
    """Two towers and a lazy head that only ``use_head`` forwards call."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.LazyLinear(4)
        self.use_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.towers[0](x) + self.towers[1](x)
        return self.head(out) if self.use_head else out


def test_a_lazy_module_that_the_first_forwards_skip_does_not_stop_learning() -> None:
    wrapped = wrap(LazyBranch())
    loss(wrapped(two_tower_input())).backward()  # waits once for the lazy parameters
    assert wrapped.plan.pending
    wrapped.use_head = True  # the learning forward initializes the head itself
    loss(wrapped(two_tower_input())).backward()
    assert planned_events(wrapped) == ["lazy_parameters", "learned"]
    assert wrapped.plan.stages


# --- several threads ------------------------------------------------------------------------


@pytest.fixture
def fast_thread_switching() -> Iterator[None]:
    """Switch threads every few microseconds so forwards really interleave."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


class Probed(nn.Module):
    """``dataflow_models.TwoTower`` small, with a probe that fails if any parameter of the
    model is not its real shape while a forward runs (a placeholder another thread set)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dataflow_models.TwoTower(vocab=50, dim=32, depth=2)
        self.shapes: list[tuple[nn.Parameter, torch.Size]] = []
        self.placeholders = 0

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(query, doc)
        self.check()
        return out

    def check(self) -> None:
        if any(p.shape != shape for p, shape in self.shapes):
            self.placeholders += 1


def probed_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, 50, (4, 16), generator=generator),
        torch.randint(0, 50, (4, 24), generator=generator),
    )


def learned_alone() -> str:
    model = Probed()
    wrapped = wrap(model)
    loss(wrapped(*probed_inputs())).backward()
    return str(wrapped.plan)


def in_threads(count: int, body: Callable[[int], None]) -> list[BaseException]:
    """Run ``body(i)`` on ``count`` threads started together; the errors they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            barrier.wait()
            body(index)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.usefixtures("fast_thread_switching")
@pytest.mark.parametrize("attempt", range(3))
def test_threads_training_one_model_while_it_learns_learn_one_plan(attempt: int) -> None:
    model = Probed()
    model.shapes = [(p, p.shape) for p in model.parameters()]
    before = hook_snapshot(model)
    wrapped = wrap(model)
    inputs = probed_inputs()
    depths: list[int] = []

    def body(index: int) -> None:
        for _ in range(4):
            loss(wrapped(*inputs)).backward()
            model.check()
        depths.append(dispatch_depth())

    errors = in_threads(3, body)
    assert errors == []
    assert model.placeholders == 0
    assert depths == [0, 0, 0]
    assert planned_events(wrapped) == ["learned"], ooo_wrap.events_for(wrapped)
    assert str(wrapped.plan) == learned_alone()
    wrapped.unwrap()
    assert hook_snapshot(model) == before  # the observer's hooks came off too
