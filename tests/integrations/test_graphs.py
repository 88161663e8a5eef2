"""CUDA graph recipes on the CPU: ``graphed_step``'s eager fallback (bitwise the eager
steps), its argument errors, ``make_graphed_callables`` without CUDA, and the root hook
lift that lets PyTorch's ``make_graphed_callables`` take a wrapped model.

The capture paths themselves need a GPU: see the graph tests in ``tests/gpu/test_cuda.py``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

import ooo_wrap
from ooo_wrap._compat import forward_hook_dicts
from ooo_wrap._wrapper import registry
from ooo_wrap.testing import DetectingBackend, SimulatedBackend, detect
from tests.support.models import Towers, hook_count
from tests.support.reference import FREE_FORK

DIM = 6
STEPS = 4
# Not torch.cuda.is_available(): the CPU tests pass CPU tensors, so on a GPU machine the
# reason is that the args are not on CUDA.
EXPECTED_REASON = "not_on_cuda" if torch.cuda.is_available() else "no_cuda"


def _wrapped(plain: nn.Module, planner: str = "static", **options: Any) -> nn.Module:
    model = ooo_wrap.OOOModule(
        copy.deepcopy(plain), streams=2, backend=SimulatedBackend(), planner=planner, **options
    )
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    return model


def _step_for(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _batches(count: int, batch: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(batch, DIM, generator=generator), torch.randn(batch, 2, generator=generator))
        for _ in range(count)
    ]


def test_without_cuda_graphed_step_gives_the_eager_losses_bit_for_bit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = Towers()
    model = _wrapped(plain)
    sample, *batches = _batches(1 + STEPS)
    eager_step = _step_for(plain)
    with caplog.at_level(logging.INFO, logger="ooo_wrap"):
        graphed = ooo_wrap.graphed_step(_step_for(model), *sample, warmup=3)
    # The warm-up steps are real steps on the sample args, on every device.
    expected = [eager_step(*sample) for _ in range(3)]
    expected += [eager_step(*batch) for batch in batches]
    losses = [graphed(*batch) for batch in batches]
    assert [torch.equal(a, e) for a, e in zip(losses, expected[3:], strict=True)] == [True] * STEPS
    for (name, p), (_, w) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(w, p), name
    assert graphed.captured is False and graphed.graph is None
    assert graphed.reason == EXPECTED_REASON
    assert "not captured" in graphed.message
    assert graphed.static_args == () and graphed.static_outputs is None
    assert repr(graphed) == f"GraphedStep(captured=False, reason={EXPECTED_REASON!r})"
    logged = [r for r in caplog.records if "graphed_step" in r.getMessage()]
    assert [r.levelno for r in logged] == [logging.INFO]
    assert EXPECTED_REASON in logged[0].getMessage()
    # The wrapper was active throughout: every step ran the stages on their streams.
    assert model.stats.stage_calls == (3 + STEPS) * len(model.plan.stages)
    assert model.stats.bypasses == 0


def test_the_warm_up_learns_a_dataflow_plan_before_the_capture_would_start() -> None:
    # The regions arm pinned: every region the rule finds (none pays at this size).
    model = _wrapped(Towers(), planner="dataflow", gpu=FREE_FORK, tune_arm="regions")
    assert model.plan.pending
    ooo_wrap.graphed_step(_step_for(model), *_batches(1)[0], warmup=2)
    assert not model.plan.pending and len(model.plan.stages) >= 2
    # Step 1 learned inline; step 2 ran every stage on its side stream, as a capture would.
    assert model.stats.stage_calls == len(model.plan.stages)


class _CheckpointedTowers(nn.Module):
    """Towers whose parent checkpoints them: backward recomputes each tower's stage."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Towers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def test_a_capture_after_a_plain_tuning_step_recomputes_as_its_forward_ran() -> None:
    # The default warmup=3 with the static plan: plain, planned, plain steps of measured
    # tuning, then a capture of the planned arm, as racing the arms as graphs holds it
    # (a plain step ran last). Its backward must recompute the checkpointed stages on
    # their side streams too, as its forward ran them.
    backend = DetectingBackend(step_time=lambda calls: 1.0)
    model = ooo_wrap.OOOModule(_CheckpointedTowers(), streams=2, backend=backend, planner="static")
    assert model.tuning is not None
    where: list[tuple[bool, int]] = []  # (in the forward, stream id) per stage call
    in_forward = [True]
    for stage in model.plan.stages:
        # Inside the stage's forward, whatever the order of hooks (an arm's stage hooks are
        # registered as its tuning step starts).
        module = model.get_submodule(stage.name)

        def noted(*args: Any, forward: Any = module.forward) -> Any:
            where.append((in_forward[0], backend.current_stream().id))
            return forward(*args)

        module.forward = noted
    step = _step_for(model)
    sample = _batches(1)[0]
    ooo_wrap.graphed_step(step, *sample, warmup=3)  # no CUDA here: the warm-up only
    assert model.tuning.decision == "pending"
    tuner = registry.race_as_graph(model)
    assert tuner is not None
    tuner.hold(next(arm for arm in tuner.arms if arm.name == "static"))
    where.clear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with detect(backend, keep_alive=[model]) as found, backend.capturing():
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(sample[0]), sample[1])
        in_forward[0] = False
        loss.backward()
        # Gradients live in .grad until the next zero_grad, like parameters.
        found.keep_alive(*(p.grad for p in model.parameters() if p.grad is not None))
        with found.phase("step"):
            optimizer.step()
    forward = [stream for forward, stream in where if forward]
    backward = [stream for forward, stream in where if not forward]
    assert forward == backward and 0 not in forward, where
    assert not found.races and not found.allocator_hazards


def test_a_step_returning_a_nest_of_tensors_returns_it() -> None:
    model = _wrapped(Towers())
    step = _step_for(model)

    def nested(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        loss = step(x, y)
        return {"loss": loss, "extra": (loss * 2, None)}

    graphed = ooo_wrap.graphed_step(nested, *_batches(1)[0])
    out = graphed(*_batches(2)[1])
    assert torch.equal(out["extra"][0], out["loss"] * 2) and out["extra"][1] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup": 1}, r"warmup must be at least 2, got 1: .*dataflow.*pass warmup=2"),
        ({"warmup": 0}, r"warmup must be a positive int of at least 2, got 0"),
        ({"warmup": True}, r"warmup must be a positive int of at least 2, got True"),
        ({"warmup": 2.5}, r"warmup must be a positive int of at least 2, got 2.5"),
    ],
)
def test_warmup_is_checked(kwargs: dict[str, Any], match: str) -> None:
    calls: list[int] = []
    with pytest.raises(ooo_wrap.OOOConfigError, match=match):
        ooo_wrap.graphed_step(lambda x: calls.append(1), torch.ones(2), **kwargs)
    assert calls == []  # nothing ran


def test_sample_args_are_checked() -> None:
    def step(*args: Any) -> torch.Tensor:
        return torch.zeros(())

    with pytest.raises(ooo_wrap.OOOConfigError, match="step_fn must be callable, got Tensor"):
        ooo_wrap.graphed_step(torch.ones(2), torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"needs the step's input tensors"):
        ooo_wrap.graphed_step(step)
    with pytest.raises(
        ooo_wrap.OOOConfigError,
        match=r"sample arg 1 of graphed_step is a float, not a tensor.*partial",
    ):
        ooo_wrap.graphed_step(step, torch.ones(2), 0.5)  # type: ignore[arg-type]
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"span several devices \(cpu, meta\)"):
        ooo_wrap.graphed_step(step, torch.ones(2), torch.empty(2, device="meta"))


def test_a_step_must_return_tensors() -> None:
    with pytest.raises(
        ooo_wrap.OOOConfigError, match=r"not tensors: output\[1\] \(float\); .*host sync"
    ):
        ooo_wrap.graphed_step(lambda x: (x.sum(), 1.5), torch.ones(2))


def test_replay_args_must_match_the_sample_args() -> None:
    graphed = ooo_wrap.graphed_step(lambda x, y: x.sum() + y.sum(), torch.ones(4, 3), torch.ones(2))
    assert torch.equal(graphed(torch.ones(4, 3), torch.ones(2)), torch.tensor(14.0))
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"takes 2 tensor args .*got 1"):
        graphed(torch.ones(4, 3))
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"arg 1 of the graphed step is a list"):
        graphed(torch.ones(4, 3), [1.0, 1.0])  # type: ignore[arg-type]
    with pytest.raises(
        ooo_wrap.OOOConfigError,
        match=r"arg 0 .* shape \(3, 3\) on cpu, but the step was made for a torch.float32 "
        r"tensor of shape \(4, 3\) on cpu: a graph replays fixed shapes.*Pad the batch",
    ):
        graphed(torch.ones(3, 3), torch.ones(2))
    with pytest.raises(
        ooo_wrap.OOOConfigError, match=r"arg 1 of the graphed step is a torch.float64 tensor"
    ):
        graphed(torch.ones(4, 3), torch.ones(2, dtype=torch.float64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: no CUDA device")
def test_make_graphed_callables_without_cuda_returns_the_callables(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _wrapped(Towers())
    before = _ordered_hooks(model)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(5, DIM)
    with caplog.at_level(logging.INFO, logger="ooo_wrap"):
        assert ooo_wrap.make_graphed_callables(model, (x,)) is model
        both = (model, fn)
        assert ooo_wrap.make_graphed_callables(both, ((x,), (x,))) is both
    assert _ordered_hooks(model) == before
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("make_graphed_callables: no CUDA device" in m for m in messages) == 2


# --- the root hook lift --------------------------------------------------------------


def _ordered_hooks(model: nn.Module) -> dict[str, list[list[tuple[int, Any]]]]:
    """Every module's forward hook dicts, as ordered lists: the order is the call order."""
    return {
        name: [list(hooks.items()) for hooks in forward_hook_dicts(module)]
        for name, module in model.named_modules(remove_duplicate=False)
    }


def _model_with_user_hooks() -> tuple[nn.Module, nn.Module]:
    plain = Towers()
    model = _wrapped(plain)
    # The caller's own hooks around the wrapper's, on the root and on a stage.
    model.register_forward_pre_hook(lambda module, args: None, prepend=True)
    model.register_forward_hook(lambda module, args, output: None)
    model.towers[0].register_forward_hook(lambda module, args, output: None)
    return plain, model


def test_the_lift_takes_only_the_root_hooks_off_and_puts_them_back_exactly() -> None:
    plain, model = _model_with_user_hooks()
    before = _ordered_hooks(model)
    x = torch.randn(5, DIM)
    with registry.root_hooks_lifted(model):
        lifted = _ordered_hooks(model)
        assert [len(hooks) for hooks in lifted[""]] == [1, 0, 1, 0, 0]  # the caller's only
        assert {k: v for k, v in lifted.items() if k} == {k: v for k, v in before.items() if k}
        # The stage hooks alone fork and join each stage call: same result, on streams.
        forwards = model.stats.forwards
        model(x).sum().backward()
        assert model.stats.forwards == forwards  # no root call
        assert model.stats.stage_calls == len(model.plan.stages)
    assert _ordered_hooks(model) == before
    plain(x).sum().backward()
    for (name, p), (_, w) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert p.grad is not None and w.grad is not None and torch.equal(w.grad, p.grad), name
    model(x)
    assert model.stats.forwards == forwards + 1  # the root hooks work again
    ooo_wrap.unwrap(model)  # the handles kept are still the ones that remove the hooks
    assert hook_count(model) == 3  # the caller's three


def test_the_lift_puts_the_hooks_back_when_the_block_raises() -> None:
    _, model = _model_with_user_hooks()
    before = _ordered_hooks(model)
    with pytest.raises(KeyError, match="inside"), registry.root_hooks_lifted(model):
        raise KeyError("inside")
    assert _ordered_hooks(model) == before


def test_the_lift_puts_the_hooks_back_when_removing_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, model = _model_with_user_hooks()
    before = _ordered_hooks(model)
    removed: list[int] = []
    real_remove = RemovableHandle.remove

    def remove_once(handle: RemovableHandle) -> None:
        if removed:
            raise RuntimeError("remove failed")
        removed.append(handle.id)
        real_remove(handle)

    monkeypatch.setattr(RemovableHandle, "remove", remove_once)
    with pytest.raises(RuntimeError, match="remove failed"), registry.root_hooks_lifted(model):
        pytest.fail("the block must not run")
    assert removed and _ordered_hooks(model) == before


def test_the_lift_keeps_hooks_the_block_adds_and_is_a_no_op_on_a_plain_model() -> None:
    _, model = _model_with_user_hooks()
    before = _ordered_hooks(model)
    with registry.root_hooks_lifted(model):
        added = model.register_forward_hook(lambda module, args, output: None)
    after = _ordered_hooks(model)
    assert after[""][2][:-1] == before[""][2] and after[""][2][-1][0] == added.id
    plain = Towers()
    plain_before = _ordered_hooks(plain)
    with registry.root_hooks_lifted(plain):
        pass
    assert _ordered_hooks(plain) == plain_before


def _fake_torch_make_graphed_callables(fail: bool) -> Callable[..., Any]:
    """PyTorch's hook check and its module result (a forward that calls no stage), with no
    CUDA work: what ooo_wrap.make_graphed_callables relies on, testable on the CPU."""

    def fake(callables: Any, sample_args: Any, **kwargs: Any) -> Any:
        items = callables if isinstance(callables, tuple) else (callables,)
        samples = sample_args if isinstance(callables, tuple) else (sample_args,)
        for item, args in zip(items, samples, strict=True):
            if isinstance(item, nn.Module):
                if item._forward_hooks or item._forward_pre_hooks or item._backward_hooks:
                    raise AssertionError("Modules must not have hooks registered")
                item(*args).sum().backward()  # the warm-up: stage hooks only
        if fail:
            raise RuntimeError("capture failed")
        for item in items:
            if isinstance(item, nn.Module):
                item.forward = lambda x: torch.zeros(x.shape[0], 2)  # the graph's replay
        return callables

    return fake


@pytest.mark.parametrize("outcome", ["graphed", "torch raises"])
def test_make_graphed_callables_lifts_the_root_hooks_for_torchs_call(
    outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model = _wrapped_and_plain()
    before = _ordered_hooks(model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = _fake_torch_make_graphed_callables(fail=outcome != "graphed")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    x = torch.randn(5, DIM)
    if outcome == "graphed":
        assert ooo_wrap.make_graphed_callables(model, (x,), num_warmup_iters=1) is model
    else:
        with pytest.raises(RuntimeError, match="capture failed"):
            ooo_wrap.make_graphed_callables((model,), ((x,),))
    assert _ordered_hooks(model) == before
    assert model.stats.stage_calls == len(model.plan.stages)  # torch's warm-up, on streams
    model(x)  # graphed, it calls no stage: expected, not news
    assert ooo_wrap.EventKind.STAGE_NOT_CALLED not in {event.kind for event in model.events}
    forwards_calling_stages = 1 if outcome == "graphed" else 2  # not graphed: eager again
    assert model.stats.stage_calls == forwards_calling_stages * len(model.plan.stages)


def _wrapped_and_plain() -> tuple[nn.Module, nn.Module]:
    plain = Towers()
    return plain, _wrapped(plain)


def test_a_stage_passed_alone_is_refused_with_what_to_pass() -> None:
    model = _wrapped(Towers())
    stage = model.get_submodule(model.plan.stages[1].name)
    x = torch.randn(5, DIM)
    with pytest.raises(
        ooo_wrap.OOOConfigError,
        match=r"callable 1 .* is stage 'towers.1' of a wrapped Towers.*pass the wrapped model",
    ):
        ooo_wrap.make_graphed_callables((model, stage), ((x,), (x,)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: no CUDA device")
def test_model_surgery_on_another_wrapped_model_does_not_break_make_graphed_callables() -> None:
    cut, replaced = _wrapped(Towers()), _wrapped(Towers())
    del cut.towers[2]  # stage 'towers.2' no longer exists
    old = replaced.towers[0]
    replaced.towers[0] = nn.Linear(DIM, DIM)  # not a stage: it carries no hook
    x = torch.randn(5, DIM)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert ooo_wrap.make_graphed_callables(fn, (x,)) is fn
    assert ooo_wrap.make_graphed_callables(replaced.towers[0], (x,)) is replaced.towers[0]
    # The replaced module still carries the wrapper's hooks, which PyTorch would refuse.
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"callable 0 .* is stage 'towers.0'"):
        ooo_wrap.make_graphed_callables(old, (x,))


def test_torchs_own_function_refuses_a_wrapped_model() -> None:
    # The premise of ooo_wrap.make_graphed_callables; PyTorch checks hooks before any CUDA
    # work, so this runs on the CPU too.
    model = _wrapped(Towers())
    with pytest.raises(AssertionError, match="Modules must not have hooks registered"):
        torch.cuda.make_graphed_callables(model, (torch.randn(5, DIM),))
