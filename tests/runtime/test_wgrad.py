"""Out-of-order weight gradients (``split_weight_grads``): bitwise parity with the plain
model, the weight-gradient stream in the backend's log, the options, and the class swap.

Each parity test trains a plain model and a wrapped copy side by side on the CPU (virtual
streams) and compares outputs and every gradient bitwise, step by step. With the dataflow
planner the first wrapped forward is the learning step (inline, stock layers); the later
ones split.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ooo_wrap
from ooo_wrap import OOOConfigError
from ooo_wrap._runtime.wgrad import split_layers
from ooo_wrap.testing import SimulatedBackend
from tests.support.wgrad_models import MLP, MODELS, Block, ConvNet, Tied, mlp_input

STEPS = 4  # the learning step, then three with the split


def wrap_split(model: nn.Module, **options: Any) -> tuple[nn.Module, SimulatedBackend]:
    backend = SimulatedBackend(keep_all=True)
    options.setdefault("split_weight_grads", True)
    options.setdefault("tune", False)
    return ooo_wrap.OOOModule(model, backend=backend, **options), backend


Step = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def plain_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    out.square().mean().backward()
    return out


def run(
    make: Callable[[], nn.Module],
    x: torch.Tensor,
    step: Step = plain_step,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    set_to_none: bool = True,
    **options: Any,
) -> tuple[nn.Module, SimulatedBackend]:
    """Train plain and wrapped copies ``STEPS`` steps; assert bitwise parity each step."""
    torch.manual_seed(0)
    plain = make()
    wrapped, backend = wrap_split(copy.deepcopy(plain), **options)
    make_opt = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    opts = [make_opt(plain.parameters()), make_opt(wrapped.parameters())]
    for number in range(STEPS):
        outs = [step(m, x) for m in (plain, wrapped)]
        assert torch.equal(outs[0], outs[1]), f"output of step {number}"
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                assert b.grad is not None and torch.equal(a.grad, b.grad), f"{name} {number}"
                assert a.grad.stride() == b.grad.stride(), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b), name
    return wrapped, backend


def weight_grad_stream_used(model: nn.Module, backend: SimulatedBackend) -> bool:
    """The log shows a stream that waited on an event and ran work (a weight gradient):
    only the split's backward makes a stream wait with no stage in the plan."""
    waited = {c.stream for c in backend.log if c.op == "wait_event" and c.stream.id}
    entered = {c.stream for c in backend.log if c.op == "set_stream" and c.stream.id}
    return bool(waited & entered)


@pytest.mark.parametrize("name", list(MODELS))
def test_split_is_bitwise_the_plain_model(name: str) -> None:
    make, data = MODELS[name]
    torch.manual_seed(1)
    x = data()
    wrapped, backend = run(make, x)
    layers = len(split_layers(make()))
    assert wrapped.stats.split_layer_calls == (STEPS - 1) * layers
    assert wrapped.stats.split_step_asides == 0
    assert weight_grad_stream_used(wrapped, backend)
    assert any(e.reason == "weight_grads" for e in wrapped.events)


def test_a_chain_with_the_split_is_not_no_parallelism() -> None:
    wrapped, _ = wrap_split(MLP())
    plain_step(wrapped, mlp_input())
    reasons = [e.reason for e in wrapped.events]
    assert "no_parallelism" not in reasons
    message = next(e.message for e in wrapped.events if e.reason == "weight_grads")
    assert "split alone" in message and "3 layers" in message
    assert wrapped.plan.stages == ()


def test_gradient_accumulation_over_three_backward_calls() -> None:
    def accumulate(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for chunk in x.chunk(3):
            out = model(chunk)
            out.square().mean().backward()
            outs.append(out.detach())
        return torch.cat(outs)

    run(MLP, torch.randn(9, 12), accumulate)


def autocast_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out: torch.Tensor = model(x)
        loss = out.float().square().mean()
    loss.backward()
    return out


def test_bf16_autocast() -> None:
    run(Block, torch.randn(3, 8, 16), autocast_step)
    run(ConvNet, torch.randn(4, 3, 16), autocast_step)


def test_tied_weights_under_bf16_autocast() -> None:
    # The embedding reads the tied weight in float32 (no autocast rule), the head in
    # bfloat16 through its cast: two uses of one parameter, summed in float32.
    wrapped, backend = run(Tied, torch.randint(0, 20, (4, 7)), autocast_step)
    assert wrapped.stats.split_layer_calls == (STEPS - 1) * 2
    assert weight_grad_stream_used(wrapped, backend)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_adam_with_zero_grad(set_to_none: bool) -> None:
    run(
        Block,
        torch.randn(3, 8, 16),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        set_to_none=set_to_none,
    )


def test_gradient_penalty_with_create_graph() -> None:
    def penalty_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        out: torch.Tensor = model(x)
        loss = out.square().mean()
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + dx.square().sum()).backward()
        return out

    wrapped, _ = run(MLP, mlp_input(), penalty_step)
    assert wrapped.stats.split_step_asides == (STEPS - 1) * 3  # computed inline
    assert any(e.reason == "weight_grads_create_graph" for e in wrapped.events)


def test_hooks_fire_once_per_parameter_per_backward_with_the_same_values() -> None:
    torch.manual_seed(0)
    plain = Tied()
    wrapped, _ = wrap_split(copy.deepcopy(plain))
    ids = torch.randint(0, 20, (4, 7))
    seen: dict[str, list[tuple[str, str, torch.Tensor]]] = {"plain": [], "wrapped": []}
    for side, model in (("plain", plain), ("wrapped", wrapped)):
        for name, p in model.named_parameters():
            p.register_hook(lambda g, n=name, s=side: seen[s].append(("hook", n, g.clone())))
            p.register_post_accumulate_grad_hook(
                lambda q, n=name, s=side: seen[s].append(("post", n, q.grad.clone()))
            )
    for _ in range(STEPS):
        for side, model in (("plain", plain), ("wrapped", wrapped)):
            before = len(seen[side])
            plain_step(model, ids)
            fired = seen[side][before:]
            assert len(fired) == 2 * len(list(model.parameters()))  # once each, both kinds
            model.zero_grad()
    assert wrapped.stats.split_layer_calls > 0
    assert len(seen["plain"]) == len(seen["wrapped"])
    by_key = {(k, n): g for k, n, g in seen["wrapped"]}
    for kind, name, grad in seen["plain"]:
        assert torch.equal(grad, by_key[(kind, name)]), (kind, name)


def test_steps_aside_with_gradients_off_and_in_anomaly_mode() -> None:
    wrapped, _ = wrap_split(MLP())
    x = mlp_input()
    plain_step(wrapped, x)  # learning
    with torch.no_grad():
        wrapped(x)
    assert any(e.reason == "weight_grads_no_grad" for e in wrapped.events)
    with torch.autograd.set_detect_anomaly(True):
        plain_step(wrapped, x)
    assert any(e.reason == "weight_grads_anomaly" for e in wrapped.events)
    assert wrapped.stats.split_step_asides == 6 and wrapped.stats.split_layer_calls == 0


def test_steps_aside_under_functorch_and_disabled() -> None:
    wrapped, _ = wrap_split(MLP())
    x = mlp_input()
    plain_step(wrapped, x)
    params = dict(wrapped.named_parameters())
    torch.func.grad(lambda p: torch.func.functional_call(wrapped, p, (x,)).sum())(params)
    assert any(e.reason == "weight_grads_functorch" for e in wrapped.events)
    with ooo_wrap.disabled():
        plain_step(wrapped, x)
    assert any(e.reason == "weight_grads_outside_forward" for e in wrapped.events)
    assert wrapped.stats.split_layer_calls == 0


def test_options_are_checked() -> None:
    for bad in ("yes", 1, None):
        with pytest.raises(OOOConfigError, match="split_weight_grads must be"):
            ooo_wrap.OOOModule(MLP(), backend=SimulatedBackend(), split_weight_grads=bad)  # type: ignore[arg-type]
    with pytest.raises(OOOConfigError, match=r"'9'.*no sub-module"):
        ooo_wrap.OOOModule(MLP(), backend=SimulatedBackend(), split_weight_grads_exclude=["9"])
    with pytest.raises(OOOConfigError, match="ooo_split_weight_grads"):
        ooo_wrap.from_config(MLP(), {"ooo_backprop": True, "ooo_split_weight_grads": "on"})


def test_from_config_key() -> None:
    model = ooo_wrap.from_config(
        MLP(),
        {"ooo_backprop": True, "ooo_split_weight_grads": True, "ooo_tune": False},
        backend=SimulatedBackend(),
    )
    plain_step(model, mlp_input())
    plain_step(model, mlp_input())
    assert model.stats.split_layer_calls == 3


def test_excluded_layers_stay_plain() -> None:
    wrapped, _ = wrap_split(MLP(), split_weight_grads_exclude=["4"])
    plain_step(wrapped, mlp_input())
    assert type(wrapped[4]) is nn.Linear and type(wrapped[0]) is not nn.Linear
    plain_step(wrapped, mlp_input())
    assert wrapped.stats.split_layer_calls == 2


def test_false_and_auto_without_tuning_swap_nothing() -> None:
    for value in (False, "auto"):
        wrapped, _ = wrap_split(Block(), split_weight_grads=value)
        plain_step(wrapped, torch.randn(2, 4, 16))
        plain_step(wrapped, torch.randn(2, 4, 16))
        assert all(type(m).__qualname__[:8] != "OOOSplit" for m in wrapped.modules())
        assert wrapped.stats.split_layer_calls == 0


def test_auto_races_the_split_on_a_chain_when_tuning() -> None:
    # The planned arm (with the split) is measured faster than plain: kept.
    def step_time(calls: Any) -> float:
        return 8.0 if any(c.op == "wait_event" for c in calls) else 10.0

    backend = SimulatedBackend(step_time=step_time)
    model = ooo_wrap.OOOModule(MLP(), backend=backend, tune_steps=2)
    x = mlp_input()
    for _ in range(40):
        plain_step(model, x)
        if model.tuning is not None and model.tuning.decision != "pending":
            break
    assert model.tuning is not None and model.tuning.decision == "wgrad"
    # Plain steps carry no swapped layer (each arm runs only its own hooks): no step-aside.
    assert model.stats.split_layer_calls > 0 and model.stats.split_step_asides == 0
    assert type(model[0]).__qualname__ == "OOOSplitLinear"


def test_auto_drops_the_split_when_measured_slower() -> None:
    def step_time(calls: Any) -> float:
        return 12.0 if any(c.op == "wait_event" for c in calls) else 10.0

    model = ooo_wrap.OOOModule(MLP(), backend=SimulatedBackend(step_time=step_time), tune_steps=2)
    for _ in range(40):
        plain_step(model, mlp_input())
        if model.tuning is not None and model.tuning.decision != "pending":
            break
    assert model.tuning is not None and model.tuning.decision == "plain"
    assert all(type(m).__qualname__[:8] != "OOOSplit" for m in model.modules())


def test_unwrap_restores_every_layer_class() -> None:
    model = ConvNet()
    classes = {name: type(m) for name, m in model.named_modules()}
    wrapped, _ = wrap_split(model)
    plain_step(wrapped, torch.randn(4, 3, 16))
    assert type(wrapped.c2).__qualname__ == "OOOSplitConv2d"
    assert type(wrapped.c2).__name__ == "Conv2d" and isinstance(wrapped.c2, nn.Conv2d)
    ooo_wrap.unwrap(wrapped)
    assert {name: type(m) for name, m in model.named_modules()} == classes


def test_copies_pickles_and_state_dict_are_unchanged() -> None:
    torch.manual_seed(0)
    plain = Block()
    keys = list(plain.state_dict())
    wrapped, _ = wrap_split(copy.deepcopy(plain))
    x = torch.randn(2, 4, 16)
    plain_step(wrapped, x)
    assert type(wrapped.fc1).__qualname__ == "OOOSplitLinear"
    assert list(wrapped.state_dict()) == keys
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    clones = [
        copy.deepcopy(wrapped),
        pickle.loads(pickle.dumps(wrapped)),
        torch.load(buffer, weights_only=False),
    ]
    for clone in clones:
        assert list(clone.state_dict()) == keys
        # The copy is wrapped again with the same options: its layers are its own.
        assert clone.fc1 is not wrapped.fc1
        ooo_wrap.unwrap(clone)
        assert type(clone.fc1) is nn.Linear
        assert torch.equal(clone(x), ooo_wrap.unwrap(copy.deepcopy(wrapped))(x))


def test_a_subclass_that_overrides_forward_is_left_alone() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class Kept(nn.Linear):
        pass

    model = nn.Sequential(Scaled(4, 4), Kept(4, 4))
    assert [name for name, _ in split_layers(model)] == ["1"]


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D`` (transformers): a Linear with its weight stored transposed."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def _conv1d_forward(layer: nn.Module, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    out = torch.addmm(b, x.view(-1, x.size(-1)), w)
    return out.view(*x.shape[:-1], w.shape[1])


def _conv1d_input_grad(layer: nn.Module, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> Any:
    return g.reshape(-1, g.shape[-1]).mm(w.t()).view(x.shape)


def _conv1d_weight_grads(
    layer: nn.Module, g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: bool
) -> Any:
    g2 = g.reshape(-1, g.shape[-1])
    return x.reshape(-1, x.shape[-1]).t().mm(g2), g2.sum_to_size(w.shape[1:]) if bias else None


def test_a_registered_layer_type_is_split_bitwise() -> None:
    ooo_wrap.register_split_layer(
        Conv1D,
        forward=_conv1d_forward,
        input_grad=_conv1d_input_grad,
        weight_grads=_conv1d_weight_grads,
    )
    wrapped, _ = run(
        lambda: nn.Sequential(Conv1D(8, 6), nn.Tanh(), Conv1D(3, 8)), torch.randn(2, 5, 6)
    )
    assert wrapped.stats.split_layer_calls == (STEPS - 1) * 2


def test_register_split_layer_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="layer_type"):
        ooo_wrap.register_split_layer(object, forward=print, input_grad=print, weight_grads=print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_grad"):
        ooo_wrap.register_split_layer(Conv1D, forward=print, input_grad=1, weight_grads=print)  # type: ignore[arg-type]


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return out


def test_a_checkpoint_recomputes_split_layers_as_its_forward_ran_them() -> None:
    # The recomputation must save what the forward saved: split when the forward split.
    wrapped, _ = run(Checkpointed, mlp_input())
    assert wrapped.stats.split_layer_calls == 2 * (STEPS - 1) * 3  # forward and recompute


class LiveBytesBackend(SimulatedBackend):
    """Virtual streams on a device said to hold ``live`` bytes of tensors."""

    def __init__(self, live: int) -> None:
        super().__init__(keep_all=True)
        self.live = live

    def live_bytes(self, device: torch.device) -> int:
        return self.live


def lag_waits(backend: SimulatedBackend, layers: int = 6) -> list[SimpleNamespace]:
    """The waits of the caller's stream (the layers' stream) in the backward of one step
    of a chain of ``layers`` ``nn.Linear(8, 8)`` at batch 3: each on the event of a dW
    launched before (``event``), and the id of the last dW event recorded (``after``)."""
    model = ooo_wrap.OOOModule(
        nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))),
        backend=backend,
        split_weight_grads=True,
        tune=False,
    )
    x = torch.randn(3, 8)
    plain_step(model, x)  # learning
    backend.clear_log()
    plain_step(model, x)
    log = backend.log
    waits = [i for i, c in enumerate(log) if c.op == "wait_event" and c.stream.id == 0]
    found = []
    for i in waits:
        event = log[i].event
        assert event is not None and event.stream.id != 0
        launched = [c.event for c in log[:i] if c.op == "record_event" and c.stream.id != 0]
        assert event in launched
        found.append(SimpleNamespace(event=event, after=launched[-1].id))
    return found


# Each split Linear(8, 8) layer's dW at batch 3 holds its output gradient and input:
# 2 x 3 x 8 float32 (the first layer's input is x itself, also 96 bytes).
HELD = 2 * 3 * 8 * 4


def test_without_live_bytes_the_layer_stream_waits_on_each_dw_at_once() -> None:
    # The simulated backend cannot tell live bytes: a budget of 0, so A waits on each
    # layer's dW right after launching it (its dI, launched before, still overlaps it).
    waits = lag_waits(SimulatedBackend(keep_all=True))
    assert len(waits) == 6
    assert len({c.event.id for c in waits}) == 6  # each dW once


@pytest.mark.parametrize(
    ("live", "expected"),
    [(10 * HELD - 10, 6), (10 * HELD, 5), (20 * HELD, 4), (10**9, 0)],
    ids=["under-one-layer", "one-layer", "two-layers", "huge"],
)
def test_the_weight_gradients_lag_within_a_tenth_of_the_live_bytes(
    live: int, expected: int
) -> None:
    # The budget is HELD_FRACTION of the live bytes at the first dW: with room for k
    # layers' held bytes, A waits once each later layer launched its dW, on the dW k
    # layers back; with room for none, on each dW at once; on a huge device never in
    # backward (the engine's end-of-backward wait covers the pending ones).
    from ooo_wrap._runtime.wgrad import HELD_FRACTION

    assert HELD_FRACTION == 0.10
    waits = lag_waits(LiveBytesBackend(live))
    assert len(waits) == expected
    # Events are numbered per record, two per layer in backward order (A's, then W's):
    # layer i's dW is event 2 i + 2, waited on once layer i + lag launched its dW.
    lag = 0 if expected == 6 else 6 - expected
    assert [(c.event.id, c.after) for c in waits] == [
        (2 * i + 2, 2 * (i + lag) + 2) for i in range(expected)
    ]


def test_a_new_backward_starts_with_no_pending_weight_gradient() -> None:
    backend = LiveBytesBackend(10**9)
    assert lag_waits(backend) == []
    backend.live = 0  # the next backward measures its budget anew
    backend.clear_log()
    assert len(lag_waits(backend)) == 6


def test_torch_compile_of_the_split_model_runs_stock_layers_without_graph_breaks() -> None:
    torch.compiler.reset()
    torch.manual_seed(0)
    plain = MLP()
    wrapped, _ = wrap_split(copy.deepcopy(plain))
    x = mlp_input()
    plain_step(wrapped, x)  # learns the plan (the split alone) eagerly
    plain_step(plain, x)
    assert type(wrapped[0]).__qualname__ == "OOOSplitLinear"
    calls = wrapped.stats.split_layer_calls
    try:
        # fullgraph=True raises on any graph break, e.g. one caused by the swapped class.
        compiled = torch.compile(wrapped, backend="aot_eager", fullgraph=True)
        reference = torch.compile(plain, backend="aot_eager", fullgraph=True)
        for _ in range(2):
            out, expected = compiled(x), reference(x)
            torch.testing.assert_close(out, expected)
            out.square().mean().backward()
            expected.square().mean().backward()
        for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad)
    finally:
        torch.compiler.reset()
    assert wrapped.stats.split_layer_calls == calls  # compiled calls ran the stock layers


def test_graphed_step_trains_the_split_bitwise_as_plain() -> None:
    # Without CUDA graphed_step runs its steps eagerly; the capture rules themselves are
    # checked by check(..., capture=True, split_weight_grads=True).
    torch.manual_seed(0)
    plain = Block()
    wrapped, _ = wrap_split(copy.deepcopy(plain))

    def step_for(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step

    sample = torch.randn(2, 4, 16)
    batches = [torch.randn(2, 4, 16) for _ in range(3)]
    graphed = ooo_wrap.graphed_step(step_for(wrapped), sample, warmup=2)
    eager = step_for(plain)
    expected = [eager(sample) for _ in range(2)] + [eager(b) for b in batches]
    losses = [graphed(b) for b in batches]
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[2:], strict=True))
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b)
    assert wrapped.stats.split_layer_calls == 4 * 4  # the learning step aside


def test_a_keyword_input_runs_the_stock_layer() -> None:
    wrapped, _ = wrap_split(MLP())
    plain_step(wrapped, mlp_input())
    x = torch.randn(2, 12)
    assert torch.equal(wrapped[0](input=x), F.linear(x, wrapped[0].weight, wrapped[0].bias))
