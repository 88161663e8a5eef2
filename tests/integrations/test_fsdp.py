"""FSDP2 (``fully_shard``) and OOOModule in every order: two gloo ranks on the CPU.

All six orders (shard the stages, the root or both; before or after wrapping) train with
gradients bitwise equal to the same ``fully_shard`` layout over the plain model. One
spawn runs every order (``_fsdp_worker``); the tests check its results. The same worker
runs on GPUs with NCCL and the real streams in the ``cuda`` test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend
from tests.support.distributed import (
    FSDP2_RUNS_ON_CPU,
    FSDP2_SKIP_REASON,
    assert_same_tensors,
    rank_device,
    run_ranks,
    train_history,
)

pytestmark = [
    pytest.mark.skipif(not FSDP2_RUNS_ON_CPU, reason=FSDP2_SKIP_REASON),
]

STEPS = 2


class Branches(nn.Module):
    """A stem and two towers over its output: three stages. The towers' inputs need grad,
    so FSDP's post-backward runs from its own autograd node, not only the final callback."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.left = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.left(h) * self.right(h)


def _shard_stages(model: nn.Module) -> None:
    fully_shard(model.stem)
    fully_shard(model.left)
    fully_shard(model.right)


def _shard_all(model: nn.Module) -> None:
    _shard_stages(model)
    fully_shard(model)


# order -> (shard before wrapping?, how to shard)
ORDERS: dict[str, tuple[bool, Callable[[nn.Module], None]]] = {
    "shard_stages_then_wrap": (True, _shard_stages),
    "shard_root_then_wrap": (True, fully_shard),
    "shard_all_then_wrap": (True, _shard_all),
    "wrap_then_shard_stages": (False, _shard_stages),
    "wrap_then_shard_root": (False, fully_shard),
    "wrap_then_shard_all": (False, _shard_all),
}


def _train(model: nn.Module, rank: int, device: torch.device) -> list[dict[str, Any]]:
    return train_history(model, rank, device, steps=STEPS, features=8)


class _HookStreams:
    """Which virtual stream is current when FSDP's forward hooks run, per module name.

    FSDP2 registers its hooks as bound methods of its (private) state class when
    ``fully_shard`` runs, so wrapping the class's methods first lets a test watch them.
    """

    def __init__(self, device: torch.device) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        self.backend = SimulatedBackend()  # a fresh one per watched model: side1, side2
        self.names: dict[int, str] = {}
        self.seen: list[tuple[str, str, str]] = []  # (hook, module name, stream)
        self.recording = False
        for hook in ("_pre_forward", "_post_forward"):
            setattr(FSDPState, hook, self._spy(hook, getattr(FSDPState, hook), device))

    def _spy(self, hook: str, original: Any, device: torch.device) -> Any:
        def spy(state: Any, module: nn.Module, *rest: Any) -> Any:
            if self.recording:
                stream = str(self.backend.current_stream(device))
                self.seen.append((hook, self.names.get(id(module), "?"), stream))
            return original(state, module, *rest)

        return spy


def _watch(
    spy: _HookStreams | None,
    shard_first: bool,
    shard: Callable[[nn.Module], None],
    device: torch.device,
) -> list[tuple[str, str, str]]:
    """One forward of a fresh model sharded and wrapped in this order, watched by ``spy``."""
    if spy is None:
        return []
    model = Branches().to(device)
    if shard_first:
        shard(model)
    spy.backend = SimulatedBackend()
    model = ooo_wrap.OOOModule(model, streams=2, backend=spy.backend, planner="static")
    if not shard_first:
        shard(model)
    spy.names = {id(m): name or "<root>" for name, m in model.named_modules()}
    spy.seen, spy.recording = [], True
    try:
        model(torch.zeros(6, 8, device=device)).sum().backward()
    finally:
        spy.recording = False
    return list(spy.seen)


def _fsdp_worker(rank: int, world_size: int, device_type: str) -> dict[str, Any]:
    device, backend = rank_device(rank, device_type)
    spy = _HookStreams(device) if backend is not None else None
    results: dict[str, Any] = {}
    for order, (shard_first, shard) in ORDERS.items():
        torch.manual_seed(0)
        plain = Branches().to(device)
        shard(plain)
        torch.manual_seed(0)
        model = Branches().to(device)
        if shard_first:
            shard(model)
        model = ooo_wrap.OOOModule(model, streams=2, backend=backend, planner="static")
        if not shard_first:
            shard(model)
        result: dict[str, Any] = {
            "plain": _train(plain, rank, device),
            "wrapped": _train(model, rank, device),
            "fsdp_hook_streams": _watch(spy, shard_first, shard, device),
            "stats": model.stats,
            "events": [(event.kind, event.reason) for event in model.events],
            "mro": [cls.__qualname__ for cls in type(model).__mro__],
            "is_fsdp": isinstance(model, FSDPModule),
            "stage_is_fsdp": isinstance(model.left, FSDPModule),
        }
        try:
            unwrapped = model.unwrap()
            result["unwrapped"] = type(unwrapped).__name__, isinstance(unwrapped, FSDPModule)
        except ooo_wrap.OOOConfigError as error:
            result["unwrap_error"] = str(error)
            result["still_wrapped"] = isinstance(model, ooo_wrap.OOOModule)
        results[order] = result
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_fsdp_worker, "cpu", world_size=2, timeout=60)


@pytest.mark.parametrize("order", list(ORDERS))
def test_fsdp_order_matches_plain_fsdp_bitwise(ranks: list[dict[str, Any]], order: str) -> None:
    for rank_results in ranks:
        result = rank_results[order]
        for wrapped_step, plain_step in zip(result["wrapped"], result["plain"], strict=True):
            assert_same_tensors(wrapped_step["grads"], plain_step["grads"], none_ok=False)
            assert_same_tensors(wrapped_step["params"], plain_step["params"], none_ok=False)
    # Reduce-scattered gradients: both ranks end with the same full gradients and weights.
    for step_0, step_1 in zip(ranks[0][order]["wrapped"], ranks[1][order]["wrapped"], strict=True):
        assert_same_tensors(step_0["grads"], step_1["grads"], none_ok=False)
        assert_same_tensors(step_0["params"], step_1["params"], none_ok=False)


@pytest.mark.parametrize("order", list(ORDERS))
def test_fsdp_order_keeps_stages_on_side_streams(ranks: list[dict[str, Any]], order: str) -> None:
    result = ranks[0][order]
    assert result["events"][0] == (ooo_wrap.EventKind.ENABLED, "simulated")
    assert result["stats"].stage_calls == 3 * STEPS
    assert result["stats"].bypasses == 0
    assert result["stage_is_fsdp"] == ("_root" not in order)
    assert result["is_fsdp"] == ("_stages" not in order)


@pytest.mark.parametrize("order", list(ORDERS))
def test_fsdp_hooks_run_on_the_callers_stream_except_post_forward_when_fsdp_came_first(
    ranks: list[dict[str, Any]], order: str
) -> None:
    # FSDP2 prepends its pre-forward hook, so it runs before the stage's switch to its side
    # stream in either order. Its post-forward is appended: registered before ours
    # (fully_shard first), it runs before the stage's stream is switched back.
    seen = ranks[0][order]["fsdp_hook_streams"]
    sharded = ["<root>"] if "_root" in order else ["stem", "left", "right"]
    if "_all" in order:
        sharded = ["stem", "left", "right", "<root>"]
    assert sorted({name for _, name, _ in seen}) == sorted(sharded)
    side = {"stem": "side1", "left": "side2", "right": "side1", "<root>": "default"}
    fsdp_first = order.startswith("shard_")
    for hook, name, stream in seen:
        if hook == "_pre_forward" or not fsdp_first:
            assert stream == "default", (hook, name)
        else:
            assert stream == side[name], (hook, name)


def test_fsdp_class_order_follows_wrap_order(ranks: list[dict[str, Any]]) -> None:
    # The wrapper applied last is leftmost in the MRO, as FSDP2 documents for itself.
    assert ranks[0]["shard_all_then_wrap"]["mro"][:3] == [
        "OOOFSDPBranches",
        "OOOModule",
        "FSDPBranches",
    ]
    # FSDP2 names its class FSDP<__name__>, and the wrapped class keeps the model's name.
    assert ranks[0]["wrap_then_shard_all"]["mro"][:4] == [
        "FSDPBranches",
        "FSDPModule",
        "OOOBranches",
        "OOOModule",
    ]


def test_unwrap_restores_the_fsdp_class_when_fsdp_came_first(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["shard_all_then_wrap"]["unwrapped"] == ("FSDPBranches", True)
    assert ranks[0]["shard_root_then_wrap"]["unwrapped"] == ("FSDPBranches", True)
    assert ranks[0]["shard_stages_then_wrap"]["unwrapped"] == ("Branches", False)
    assert ranks[0]["wrap_then_shard_stages"]["unwrapped"] == ("Branches", False)


@pytest.mark.parametrize("order", ["wrap_then_shard_root", "wrap_then_shard_all"])
def test_unwrap_after_fully_shard_of_the_root_refuses_clearly(
    ranks: list[dict[str, Any]], order: str
) -> None:
    result = ranks[0][order]
    assert "cannot unwrap this FSDPBranches" in result["unwrap_error"]
    assert "Unwrap before applying it" in result["unwrap_error"]
    assert result["still_wrapped"]


@pytest.mark.cuda
def test_fsdp_orders_on_gpus_match_plain_fsdp() -> None:
    world_size = min(2, torch.cuda.device_count())
    ranks = run_ranks(_fsdp_worker, "cuda", world_size=world_size, timeout=120, backend="nccl")
    for rank_results in ranks:
        for order in ORDERS:
            result = rank_results[order]
            assert result["events"][0][0] is ooo_wrap.EventKind.ENABLED
            assert result["stats"].stage_calls == 3 * STEPS
            for wrapped_step, plain_step in zip(result["wrapped"], result["plain"], strict=True):
                # Same kernels on other streams; allow the last-bit freedom cuBLAS has.
                torch.testing.assert_close(wrapped_step["grads"], plain_step["grads"])
                torch.testing.assert_close(wrapped_step["params"], plain_step["params"])


def test_a_later_in_place_wrapper_can_subclass_a_wrapped_class() -> None:
    # What fully_shard(model) does to a wrapped model, without a process group.
    model = ooo_wrap.OOOModule(Branches(), streams=2, backend=SimulatedBackend(), planner="static")
    wrapped_class = type(model)
    later = type(f"Later{wrapped_class.__name__}", (_Marker, wrapped_class), {})
    model.__class__ = later
    model(torch.randn(2, 8)).sum().backward()  # the hooks still run
    assert model.stats.stage_calls == 3
    with pytest.raises(ooo_wrap.OOOConfigError, match="cannot unwrap this LaterBranches"):
        model.unwrap()
    assert type(model) is later and isinstance(model, ooo_wrap.OOOModule)  # left as it was
    model.__class__ = wrapped_class  # the later wrapper undone: unwrap works again
    assert type(model.unwrap()) is Branches


class _Marker:
    """Stands in for ``FSDPModule`` in the class a later in-place wrapper creates."""
