"""``torch.compile(wrapped)``: stages run inline in the compiled graph, same numbers as
``torch.compile(plain)``, compiled once, one ``BYPASSED`` event, no per-step warnings.

Compiled calls are not counted one by one: a count kept inside compiled code is Python
state Dynamo guards on, and would recompile every call. The event says the model ran
compiled (count 1) and ``stats`` leave compiled calls out.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend

STEPS = 3
STAGES = 3


class Heads(nn.Module):
    """A stem and two heads: three stages."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.head_a = nn.Sequential(nn.ReLU(), nn.Linear(16, 4))
        self.head_b = nn.Sequential(nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head_a(h) - self.head_b(h)


@pytest.fixture(autouse=True)
def _fresh_compiler() -> Iterator[None]:
    torch.compiler.reset()  # no compiled code carried over between tests
    yield
    torch.compiler.reset()


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = Heads()
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(Heads(), streams=2, backend=SimulatedBackend(), planner="static")
    return plain, wrapped


def _train(model: nn.Module, compiled: nn.Module, batches: list[torch.Tensor]) -> list[object]:
    """SGD steps through ``compiled``; every output, gradient and parameter along the way."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[object] = []
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        out = compiled(x)
        out.pow(2).mean().backward()
        seen.append(out.detach().clone())
        seen += [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        seen += [p.detach().clone() for p in model.parameters()]
    return seen


def _assert_bitwise(a: list[object], b: list[object]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        assert torch.equal(x, y)


def _ooo_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "ooo_wrap" in str(w.message)]


def test_compiled_wrapped_matches_compiled_plain_bitwise_aot_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain, wrapped = _pair()
    batches = [torch.randn(4, 8) for _ in range(STEPS)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="ooo_wrap"):
            expected = _train(plain, torch.compile(plain, backend="aot_eager"), batches)
            got = _train(wrapped, torch.compile(wrapped, backend="aot_eager"), batches)
            events = wrapped.events
    _assert_bitwise(got, expected)
    bypassed = [e for e in events if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert [(e.reason, e.count) for e in bypassed] == [("compiling", 1)]
    assert len(_ooo_warnings(caught)) <= 1
    assert sum("bypassed/compiling" in r.getMessage() for r in caplog.records) == 1
    assert wrapped.stats == ooo_wrap.OOOStats()  # compiled calls are left out


def test_recompiles_keep_one_bypassed_event_and_no_warnings() -> None:
    _plain, wrapped = _pair()
    compiled = torch.compile(wrapped, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 3, 5, 7):  # new shapes: recompiles (then dynamic shapes)
            compiled(torch.randn(batch, 8)).sum().backward()
            assert len([e for e in wrapped.events if e.reason == "compiling"]) == 1
    assert len(_ooo_warnings(caught)) <= 1
    (event,) = [e for e in ooo_wrap.events_for(wrapped) if e.reason == "compiling"]
    assert event.count == 1


def test_hooks_compile_without_graph_breaks() -> None:
    plain, wrapped = _pair()
    x = torch.randn(4, 8)
    # fullgraph=True raises on any graph break, e.g. one caused by the hooks.
    out = torch.compile(wrapped, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, torch.compile(plain, backend="aot_eager", fullgraph=True)(x))


def test_eager_calls_after_compiled_ones_still_use_side_streams() -> None:
    _plain, wrapped = _pair()
    x = torch.randn(4, 8)
    torch.compile(wrapped, backend="aot_eager")(x).sum().backward()
    wrapped(x).sum().backward()  # the same object, called eagerly
    stats = wrapped.stats
    assert (stats.forwards, stats.stage_calls, stats.bypasses) == (1, STAGES, 0)
    (event,) = [e for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert (event.reason, event.count) == ("compiling", 1)


def test_module_compile_in_place_bypasses_the_same_way() -> None:
    plain, wrapped = _pair()
    batches = [torch.randn(4, 8) for _ in range(2)]
    plain.compile(backend="aot_eager")
    wrapped.compile(backend="aot_eager")
    _assert_bitwise(_train(wrapped, wrapped, batches), _train(plain, plain, batches))
    assert [e.reason for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED] == [
        "compiling"
    ]
    assert wrapped.stats.stage_calls == 0
    assert isinstance(wrapped, ooo_wrap.OOOModule)


def test_compiled_wrapped_matches_compiled_plain_inductor() -> None:
    plain, wrapped = _pair()
    batches = [torch.randn(4, 8) for _ in range(2)]
    expected = _train(plain, torch.compile(plain), batches)
    got = _train(wrapped, torch.compile(wrapped), batches)
    # The same graph compiles to the same kernels, so equality is exact here too.
    _assert_bitwise(got, expected)
    assert [e.reason for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED] == [
        "compiling"
    ]


@pytest.mark.cuda
def test_compiled_wrapped_on_gpu_matches_compiled_plain() -> None:
    plain, wrapped = _pair()
    plain.cuda()
    wrapped = ooo_wrap.OOOModule(
        wrapped.unwrap().cuda(), streams=2, planner="static"
    )  # real streams
    assert wrapped.events[-1].kind is ooo_wrap.EventKind.ENABLED
    batches = [torch.randn(4, 8, device="cuda") for _ in range(2)]
    expected = _train(plain, torch.compile(plain), batches)
    got = _train(wrapped, torch.compile(wrapped), batches)
    for a, b in zip(got, expected, strict=True):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        torch.testing.assert_close(a, b)
    (event,) = [e for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert (event.reason, event.count) == ("compiling", 2 * STAGES)


def test_twenty_fullgraph_calls_compile_once() -> None:
    # The hooks run inside the compiled frame: any Python state they change and Dynamo
    # guards on (a counter read and bumped) fails the guards on the next call, so each
    # call recompiles, until the recompile limit stops fullgraph=True with an error.
    from torch._dynamo.testing import CompileCounter  # Dynamo's own compile counter

    plain, wrapped = _pair()
    counter = CompileCounter()
    compiled = torch.compile(wrapped, backend=counter, fullgraph=True)
    compiled_plain = torch.compile(plain, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    for _ in range(20):
        assert torch.equal(compiled(x), compiled_plain(x))
    assert counter.frame_count == 1
    (event,) = [e for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert event.reason == "compiling"


# --- compiled before the dataflow planner learned the plan -------------------------------


def _learning() -> nn.Module:
    """A wrapped model whose plan the first eager training forward learns."""
    torch.manual_seed(0)
    return ooo_wrap.OOOModule(Heads(), streams=2, backend=SimulatedBackend())


def test_compiled_before_learning_says_the_plan_waits_for_an_eager_forward() -> None:
    wrapped = _learning()
    compiled = torch.compile(wrapped, backend="aot_eager")
    for _ in range(STEPS):
        compiled(torch.randn(4, 8)).sum().backward()
    (event,) = [e for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert (event.reason, event.count) == ("compiling", 1)
    assert "before the plan was learned" in event.message
    assert "run one eager training forward" in event.message
    assert "to be learned" in str(wrapped.plan)
    # Doing what it says learns the plan.
    wrapped(torch.randn(4, 8)).sum().backward()
    assert [e.reason for e in wrapped.events if e.kind is ooo_wrap.EventKind.PLANNED] == ["learned"]


def test_compiled_before_learning_is_reported_even_if_events_are_read_after_learning() -> None:
    wrapped = _learning()
    torch.compile(wrapped, backend="aot_eager")(torch.randn(4, 8)).sum().backward()
    wrapped(torch.randn(4, 8)).sum().backward()  # learns: the learner's hooks come off
    kinds = [(e.kind, e.reason) for e in ooo_wrap.events_for(wrapped)]
    assert (ooo_wrap.EventKind.BYPASSED, "compiling") in kinds
    assert kinds.index((ooo_wrap.EventKind.BYPASSED, "compiling")) < kinds.index(
        (ooo_wrap.EventKind.PLANNED, "learned")
    )


def test_compiled_before_learning_compiles_once_without_graph_breaks() -> None:
    from torch._dynamo.testing import CompileCounter  # Dynamo's own compile counter

    wrapped = _learning()
    counter = CompileCounter()
    compiled = torch.compile(wrapped, backend=counter, fullgraph=True)
    for _ in range(20):
        compiled(torch.randn(4, 8)).sum().backward()
    assert counter.frame_count == 1
    assert [e.reason for e in wrapped.events if e.kind is ooo_wrap.EventKind.BYPASSED] == [
        "compiling"
    ]
