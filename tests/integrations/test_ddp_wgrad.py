"""DistributedDataParallel over a model wrapped with the weight-gradient split: two gloo
ranks on the CPU, SimulatedBackend. DDP makes every parameter's accumulator when it is
constructed (on the caller's stream) and hooks it; the split's pass-through node hands dW
on from the weight-gradient stream, so the engine orders DDP's hooks after each dW."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ooo_wrap
from tests.support.distributed import (
    assert_same_tensors,
    rank_device,
    run_ranks,
    train_history,
)
from tests.support.wgrad_models import MLP

STEPS = 4  # the learning step, then three with the split


def _train(model: nn.Module, rank: int, device: torch.device) -> list[dict[str, Any]]:
    return train_history(
        model, rank, device, steps=STEPS, features=12, call=DistributedDataParallel(model)
    )


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    device, backend = rank_device(rank, "cpu")
    torch.manual_seed(0)
    plain = MLP()
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(MLP(), backend=backend, split_weight_grads=True, tune=False)
    return {
        "plain": _train(plain, rank, device),
        "wrapped": _train(wrapped, rank, device),
        "split_layer_calls": wrapped.stats.split_layer_calls,
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, world_size=2, timeout=90)


def test_ddp_over_the_split_is_bitwise_ddp_over_the_plain_model(
    ranks: list[dict[str, Any]],
) -> None:
    for results in ranks:
        assert results["split_layer_calls"] == (STEPS - 1) * 3
        for wrapped, plain in zip(results["wrapped"], results["plain"], strict=True):
            assert_same_tensors(wrapped["grads"], plain["grads"], none_ok=False)
            assert_same_tensors(wrapped["params"], plain["params"], none_ok=False)
    # Different data per rank, identical gradients: DDP's all-reduce ran on every dW.
    first, second = ranks[0]["wrapped"], ranks[1]["wrapped"]
    for a, b in zip(first, second, strict=True):
        assert_same_tensors(a["grads"], b["grads"], none_ok=False)
