"""Accelerate: ``OOOModule`` first, then ``Accelerator.prepare``.

``prepare`` moves the model to the device and, as configured, wraps it in DDP or compiles
it, so the wrap goes before it (on the device). Runs on virtual streams
(``SimulatedBackend``), compared bitwise with the plain model.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from examples.quickstart import build_model
from ooo_wrap.testing import SimulatedBackend
from tests.support.distributed import run_ranks

pytestmark = pytest.mark.integrations
accelerate = pytest.importorskip(
    "accelerate", reason="needs the integrations extra: pip install -e '.[integrations]'"
)
from accelerate.state import AcceleratorState  # noqa: E402

STEPS = 3


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Iterator[None]:
    # AcceleratorState is a process-wide singleton: one test's options must not leak.
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def batches() -> list[torch.Tensor]:
    return list(torch.randn(STEPS, 4, 64, generator=torch.Generator().manual_seed(0)))


def train(accelerator: Any, model: nn.Module, prepared: nn.Module | None = None) -> list[Any]:
    """``STEPS`` SGD steps; ``prepared`` is what ``prepare`` returned, if done already."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if prepared is None:
        prepared, optimizer = accelerator.prepare(model, optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
    losses = []
    for x in batches():
        optimizer.zero_grad()
        loss = prepared(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.detach())
    return losses


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) == STEPS
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[name], sb[name]) for name in sa)


def wrap(model: nn.Module) -> Any:
    return ooo_wrap.OOOModule(model, streams=4, backend=SimulatedBackend(), planner="static")


def test_wrap_then_prepare_trains_like_the_plain_model(tmp_path: Path) -> None:
    plain = build_model()
    plain_losses = train(accelerate.Accelerator(cpu=True), plain)
    AcceleratorState._reset_state(reset_partial_state=True)

    accelerator = accelerate.Accelerator(cpu=True)
    model = wrap(build_model())
    prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator.unwrap_model(prepared) is model
    losses = train(accelerator, model, prepared)
    assert_same(losses, plain_losses)
    assert_same_state(model, plain)
    assert model.stats.forwards == STEPS
    assert [event.reason for event in model.events] == ["simulated"]

    # save_state / load_state, and the saved weights into a plain model.
    accelerator.save_state(tmp_path / "state")
    from safetensors.torch import load_file

    plain_again = build_model()
    plain_again.load_state_dict(load_file(tmp_path / "state" / "model.safetensors"))
    assert_same_state(plain_again, plain)
    fresh = wrap(build_model())
    accelerator2 = accelerate.Accelerator(cpu=True)
    accelerator2.prepare(fresh)
    accelerator2.load_state(tmp_path / "state")
    assert_same_state(fresh, plain)


def test_prepare_then_wrap_works_on_one_process() -> None:
    # Without DDP or compile, prepare returns the model itself, moved to the device.
    plain = build_model()
    plain_losses = train(accelerate.Accelerator(cpu=True), plain)
    AcceleratorState._reset_state(reset_partial_state=True)

    accelerator = accelerate.Accelerator(cpu=True)
    prepared = accelerator.prepare(build_model())
    model = wrap(prepared)
    assert model is prepared
    assert_same(train(accelerator, model, prepared), plain_losses)


def test_prepare_with_dynamo_compiles_the_wrapped_model() -> None:
    accelerator = accelerate.Accelerator(cpu=True, dynamo_backend="eager")
    model = wrap(build_model())
    try:
        prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert prepared is not model  # an OptimizedModule around the wrapped model
        prepared(torch.randn(4, 64)).sum().backward()
    finally:
        torch.compiler.reset()
    # Ran compiled: one event, count 1; compiled calls are not counted in stats.
    assert [(event.reason, event.count) for event in model.events] == [
        ("simulated", 1),
        ("compiling", 1),
    ]
    assert model.stats.bypasses == 0


def test_wrapping_after_a_compiling_prepare_warns() -> None:
    accelerator = accelerate.Accelerator(cpu=True, dynamo_backend="eager")
    prepared = accelerator.prepare(build_model())
    with pytest.warns(UserWarning, match="torch.compile'd"):
        same = wrap(prepared)
    assert same is prepared
    assert [event.reason for event in ooo_wrap.events_for(prepared)] == ["compiled"]


def _ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Two gloo ranks through Accelerate's own DDP: each order of wrap and prepare."""
    # The group is up already (file rendezvous); Accelerate still checks torchrun's variables.
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Accelerate's notes about the CPU backend
        accelerator = accelerate.Accelerator(cpu=True)
    result: dict[str, Any] = {"type": accelerator.distributed_type.value}
    model = wrap(build_model())
    prepared = accelerator.prepare(model)
    result["ddp"] = isinstance(prepared, nn.parallel.DistributedDataParallel)
    result["unwrapped_is_model"] = accelerator.unwrap_model(prepared) is model
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    accelerator.backward(prepared(x).square().mean())
    result["grads"] = [p.grad.clone() for p in model.parameters()]
    result["stage_calls"] = model.stats.stage_calls
    late = accelerator.prepare(build_model())
    try:
        wrap(late)
    except ooo_wrap.OOOConfigError as error:
        result["late_error"] = str(error)
    return result


def test_accelerate_ddp_wraps_the_wrapped_model_and_refuses_the_other_order() -> None:
    ranks = run_ranks(_ddp_worker, world_size=2, timeout=120)
    for result in ranks:
        assert result["type"] == "MULTI_CPU"
        assert result["ddp"] and result["unwrapped_is_model"]
        assert result["stage_calls"] == 4
        assert "wrap the model first, then DDP" in result["late_error"]
    # Gradients were averaged by DDP over both ranks' different batches: the same on both.
    for a, b in zip(ranks[0]["grads"], ranks[1]["grads"], strict=True):
        assert torch.equal(a, b)
