"""The weight-gradient split under one autocast region that spans optimizer steps.

Autocast caches the low-precision cast of a leaf weight for the whole autocast region (it
drops the cache only when the outermost region exits), so a stock layer called again in
the same region after an in-place update (``optimizer.step()``) reads the cast made before
the update. A split layer must read what the stock layer reads: under autocast it takes
autocast's own cast of each parameter, through that cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._runtime.wgrad import split_layers
from ooo_wrap.testing import DetectingBackend, detect
from tests.runtime.test_checkpoint_amp import Mixed
from tests.runtime.test_wgrad import STEPS, autocast_step, plain_step, run
from tests.support.wgrad_models import MODELS as WGRAD_MODELS

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mixed": (Mixed, lambda: torch.randn(5, 12)),
    **WGRAD_MODELS,
}


def test_stock_layers_read_the_cast_cached_before_an_in_place_update() -> None:
    # The mechanism, in plain PyTorch: inside one region the update is invisible to the
    # layer; a new region casts the updated weight.
    torch.manual_seed(0)
    layer, x = nn.Linear(4, 3), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        same_region = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new_region = layer(x)
    assert torch.equal(same_region, before)
    assert not torch.equal(new_region, before)


@pytest.mark.parametrize("planner", ["static", "dataflow"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_region_spanning_optimizer_steps_keeps_parity(name: str, planner: str) -> None:
    # Forward, backward and the optimizer step of every step in one region: from the
    # second step on, plain and split layers read the casts cached in the first. With
    # the dataflow planner the first step learns inline (stock layers fill the cache),
    # and the split layers of the later steps read those casts.
    make, data = MODELS[name]
    torch.manual_seed(1)
    x = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped, _ = run(make, x, plain_step, planner=planner)
    learning = 1 if planner == "dataflow" else 0
    calls = (STEPS - learning) * len(split_layers(make()))
    assert wrapped.stats.split_layer_calls == calls
    assert wrapped.stats.split_step_asides == 0


@pytest.mark.parametrize("name", ["mixed", "conv"])
def test_one_region_spanning_steps_without_the_weight_cache_keeps_parity(name: str) -> None:
    make, data = MODELS[name]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        wrapped, _ = run(make, data(), plain_step, planner="static")
    assert wrapped.stats.split_layer_calls == STEPS * len(split_layers(make()))


def test_under_autocast_the_accumulators_are_made_on_the_weight_gradient_stream() -> None:
    # Autocast's casts are made on the weight-gradient stream, so they are the parameters'
    # first use: each gradient accumulates on the stream that produced it, and the
    # layers' stream never waits for a dW to accumulate.
    torch.manual_seed(0)
    backend = DetectingBackend()
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(
            Mixed(), backend=backend, split_weight_grads=True, tune=False, planner="static"
        )
        found.keep_alive(model)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(5, 12)).float().square().mean()
            loss.backward()
            found.keep_alive(*(p.grad for p in model.parameters() if p.grad is not None))
            with found.phase("step"), torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(p.grad, alpha=0.1)
                    p.grad = None
    assert model.stats.split_layer_calls == 8
    assert found.ok, (found.races, found.allocator_hazards)
    assert found.accumulator_mismatches == ()


class Scaled(nn.Module):
    """``x * weight.sum()``, a 3-D weight: no op of it saves the weight's cast."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, 2))
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.sum()


def _scaled_forward(layer: nn.Module, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    return x * w.sum()


def _scaled_input_grad(
    layer: nn.Module, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    return g * w.sum()


def _scaled_weight_grads(
    layer: nn.Module, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool
) -> tuple[torch.Tensor, None]:
    return (g * x).sum().expand(w.shape).contiguous(), None


@pytest.fixture
def registered_scaled() -> Any:
    from ooo_wrap._runtime import wgrad_layers

    ooo_wrap.register_split_layer(
        Scaled,
        forward=_scaled_forward,
        input_grad=_scaled_input_grad,
        weight_grads=_scaled_weight_grads,
    )
    yield
    wgrad_layers._REGISTERED.pop(Scaled)


@pytest.mark.usefixtures("registered_scaled")
def test_a_layer_whose_op_saves_no_weight_cast_runs_stock_under_autocast() -> None:
    # Autocast's cast of the weight cannot be reached: the layer steps aside (counted, one
    # event), and the model trains bitwise as the plain one.
    def make() -> nn.Module:
        return nn.Sequential(Scaled(), nn.Tanh())

    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped, _ = run(make, torch.randn(2, 4), plain_step, planner="static")
    assert wrapped.stats.split_layer_calls == 0
    assert wrapped.stats.split_step_asides == STEPS
    assert [e.reason for e in wrapped.events].count("weight_grads_autocast_weight") == 1
    wrapped, _ = run(make, torch.randn(2, 4), plain_step, planner="static")
    assert wrapped.stats.split_layer_calls == STEPS  # without autocast it splits


def test_a_gradient_penalty_under_autocast_keeps_parity() -> None:
    # create_graph=True: dI and dW inline and differentiable; the penalty's gradient
    # reaches the weight through the cast dI read, as in the stock layer's double backward.
    def penalty_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = model(x)
            loss = out.float().square().mean()
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + dx.square().sum()).backward()
        return out

    wrapped, _ = run(Mixed, torch.randn(5, 12), penalty_step, planner="static")
    assert wrapped.stats.split_step_asides == STEPS * 4  # computed inline


class Twice(nn.Module):
    """One ``nn.Linear`` called twice per forward: both calls read one cached cast."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))
        return out


def test_a_layer_called_twice_under_autocast_keeps_parity() -> None:
    # Stock: both calls' weight gradients meet, in bfloat16, at the one cast's node, and
    # are converted to float32 once; the split hands both to that node too.
    wrapped, _ = run(Twice, torch.randn(4, 8), autocast_step, planner="static")
    assert wrapped.stats.split_layer_calls == STEPS * 3


class Picky(Scaled):
    """As :class:`Scaled`, with a forward that refuses an empty batch."""


def _picky_forward(layer: nn.Module, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    if x.shape[0] == 0:
        raise ValueError("expected a non-empty batch")
    return x * w.sum()


def test_a_layer_whose_forward_refuses_an_empty_batch_runs_stock_under_autocast() -> None:
    from ooo_wrap._runtime import wgrad_layers

    ooo_wrap.register_split_layer(
        Picky,
        forward=_picky_forward,
        input_grad=_scaled_input_grad,
        weight_grads=_scaled_weight_grads,
    )
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            wrapped, _ = run(
                lambda: nn.Sequential(Picky(), nn.Tanh()),
                torch.randn(2, 4),
                plain_step,
                planner="static",
            )
    finally:
        wgrad_layers._REGISTERED.pop(Picky)
    assert wrapped.stats.split_layer_calls == 0
    assert [e.reason for e in wrapped.events].count("weight_grads_autocast_weight") == 1
