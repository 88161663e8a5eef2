"""DistributedDataParallel over a wrapped model: two gloo ranks on the CPU, SimulatedBackend.

One spawn runs every DDP mode (``_ddp_worker``); the tests below check its results.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend
from tests.support.distributed import assert_same_tensors, rank_device, run_ranks

STEPS = 3

# mode -> (DDP keyword arguments, whether the ``extra`` stage runs at a step)
MODES: dict[str, tuple[dict[str, bool], Any]] = {
    "default": ({}, lambda step: True),
    # The unused set changes from step to step: only find_unused_parameters handles that.
    "find_unused_parameters": ({"find_unused_parameters": True}, lambda step: step % 2 == 0),
    # static_graph needs the same graph every step; ``extra`` never runs (unused, constant).
    "static_graph": ({"static_graph": True}, lambda step: False),
    # torch.compile over DDP over the wrapped model: stages run inline (one BYPASSED event).
    "compiled": ({}, lambda step: True),
}
EAGER_MODES = [mode for mode in MODES if mode != "compiled"]


class Branches(nn.Module):
    """Two towers and an optional head over the same input: three stages."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.extra = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        out = self.left(x) * self.right(x)
        return out + self.extra(x) if use_extra else out


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.detach().cpu().clone()
        for name, p in model.named_parameters()
    }


def _train(model: nn.Module, mode: str, rank: int, device: torch.device) -> list[dict[str, Any]]:
    """A few SGD steps on rank-specific data; the gradients and parameters of each step."""
    kwargs, uses_extra = MODES[mode]
    device_ids = [device.index] if device.type == "cuda" else None
    ddp: nn.Module = DistributedDataParallel(model, device_ids=device_ids, **kwargs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if mode == "compiled":
        ddp = torch.compile(ddp, backend="aot_eager")
    history = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(6, 8, generator=generator).to(device)
        optimizer.zero_grad(set_to_none=True)
        ddp(x, use_extra=uses_extra(step)).pow(2).mean().backward()
        grads = _grads(model)
        optimizer.step()
        params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
        history.append({"grads": grads, "params": params})
    return history


def _ddp_worker(rank: int, world_size: int, device_type: str) -> dict[str, Any]:
    device, backend = rank_device(rank, device_type)
    results: dict[str, Any] = {"stream_mismatch_warnings": []}
    for mode in MODES:
        torch.manual_seed(0)
        plain = Branches().to(device)
        torch.manual_seed(0)
        wrapped = ooo_wrap.OOOModule(
            Branches().to(device), streams=2, backend=backend, planner="static"
        )
        plain_history = _train(plain, mode, rank, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped_history = _train(wrapped, mode, rank, device)
        results["stream_mismatch_warnings"] += [
            str(w.message) for w in caught if "AccumulateGrad node's stream" in str(w.message)
        ]
        results[mode] = {
            "plain": plain_history,
            "wrapped": wrapped_history,
            "events": [(event.kind, event.reason) for event in wrapped.events],
            "stats": wrapped.stats,
            "stages": [stage.name for stage in wrapped.plan.stages],
            "class": (type(wrapped).__name__, type(wrapped).__qualname__),
        }
    try:
        ooo_wrap.OOOModule(
            DistributedDataParallel(Branches()), backend=SimulatedBackend(), planner="static"
        )
    except ooo_wrap.OOOConfigError as error:
        results["ddp_first_error"] = str(error)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_ddp_worker, "cpu", world_size=2, timeout=60)


@pytest.mark.parametrize("mode", list(MODES))
def test_wrapped_ddp_gradients_match_plain_ddp_bitwise(
    ranks: list[dict[str, Any]], mode: str
) -> None:
    for rank_results in ranks:
        runs = rank_results[mode]
        for wrapped_step, plain_step in zip(runs["wrapped"], runs["plain"], strict=True):
            assert_same_tensors(wrapped_step["grads"], plain_step["grads"], none_ok=True)
            assert_same_tensors(wrapped_step["params"], plain_step["params"], none_ok=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_wrapped_ddp_gradients_identical_on_both_ranks(
    ranks: list[dict[str, Any]], mode: str
) -> None:
    first, second = ranks[0][mode]["wrapped"], ranks[1][mode]["wrapped"]
    for step_0, step_1 in zip(first, second, strict=True):
        assert_same_tensors(step_0["grads"], step_1["grads"], none_ok=True)
        assert_same_tensors(step_0["params"], step_1["params"], none_ok=True)
    # The ranks saw different data, so identical gradients come from DDP's all-reduce.
    assert any(g is not None and g.abs().sum() > 0 for g in first[0]["grads"].values())


@pytest.mark.parametrize("mode", EAGER_MODES)
def test_wrapped_ddp_ran_stages_on_side_streams(ranks: list[dict[str, Any]], mode: str) -> None:
    _, uses_extra = MODES[mode]
    calls = sum(3 if uses_extra(step) else 2 for step in range(STEPS))
    for rank_results in ranks:
        runs = rank_results[mode]
        assert runs["class"] == ("Branches", "OOOBranches")
        assert runs["stages"] == ["left", "right", "extra"]
        expected = [(ooo_wrap.EventKind.ENABLED, "simulated")]
        if not all(uses_extra(step) for step in range(STEPS)):  # a forward skipped extra
            expected.append((ooo_wrap.EventKind.STAGE_NOT_CALLED, "not_called"))
        assert runs["events"] == expected
        assert runs["stats"].forwards == STEPS
        assert runs["stats"].stage_calls == calls
        assert runs["stats"].bypasses == 0


def test_compiled_ddp_runs_stages_inline_with_one_bypassed_event(
    ranks: list[dict[str, Any]],
) -> None:
    for rank_results in ranks:
        runs = rank_results["compiled"]
        assert runs["events"] == [
            (ooo_wrap.EventKind.ENABLED, "simulated"),
            (ooo_wrap.EventKind.BYPASSED, "compiling"),
        ]
        # Compiled calls are left out of stats (counting them would recompile each call).
        assert (runs["stats"].stage_calls, runs["stats"].bypasses) == (0, 0)


def test_unused_head_gets_no_gradient_with_find_unused_parameters(
    ranks: list[dict[str, Any]],
) -> None:
    history = ranks[0]["find_unused_parameters"]["wrapped"]
    assert history[0]["grads"]["extra.weight"] is not None
    # set_to_none before step 1, where extra did not run: DDP leaves its grad None.
    assert history[1]["grads"]["extra.weight"] is None


def test_wrapping_a_ddp_model_names_the_order_to_use(ranks: list[dict[str, Any]]) -> None:
    for rank_results in ranks:
        message = rank_results["ddp_first_error"]
        assert "DistributedDataParallel(ooo_wrap.OOOModule(model" in message
        assert "wrap the model first, then DDP" in message


@pytest.mark.cuda
def test_wrapped_ddp_on_gpus_matches_plain_ddp() -> None:
    world_size = min(2, torch.cuda.device_count())
    ranks = run_ranks(_ddp_worker, "cuda", world_size=world_size, timeout=120, backend="nccl")
    # DDP made every gradient accumulator on the caller's stream, and it stays there (see
    # docs/integrations.md, DDP): torch releases with the mismatch warning give it, once per
    # process.
    warns = hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch")
    assert [len(r["stream_mismatch_warnings"]) for r in ranks] == [int(warns)] * world_size
    for rank_results in ranks:
        for mode in MODES:
            runs = rank_results[mode]
            assert runs["events"][0][0] is ooo_wrap.EventKind.ENABLED
            for wrapped_step, plain_step in zip(runs["wrapped"], runs["plain"], strict=True):
                # Same kernels on other streams; allow the last-bit freedom cuBLAS has.
                torch.testing.assert_close(wrapped_step["grads"], plain_step["grads"])
                torch.testing.assert_close(wrapped_step["params"], plain_step["params"])
