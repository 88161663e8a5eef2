"""FSDP2 (``fully_shard``) over a model wrapped with the weight-gradient split: two gloo
ranks on the CPU. FSDP2's post-backward reads ``.grad`` in the middle of backward, so the
split steps aside for every layer it manages; the model trains bitwise as plain under
the same sharding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import ooo_wrap
from tests.support.distributed import (
    FSDP2_RUNS_ON_CPU,
    FSDP2_SKIP_REASON,
    assert_same_tensors,
    rank_device,
    run_ranks,
    train_history,
)
from tests.support.wgrad_models import MLP

pytestmark = [
    pytest.mark.skipif(not FSDP2_RUNS_ON_CPU, reason=FSDP2_SKIP_REASON),
]

STEPS = 3


def _shard(model: nn.Module) -> None:
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)


def _train(model: nn.Module, rank: int, device: torch.device) -> list[dict[str, Any]]:
    return train_history(model, rank, device, steps=STEPS, features=12)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    device, backend = rank_device(rank, "cpu")
    torch.manual_seed(0)
    plain = MLP()
    _shard(plain)
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(MLP(), backend=backend, split_weight_grads=True, tune=False)
    _shard(wrapped)
    return {
        "plain": _train(plain, rank, device),
        "wrapped": _train(wrapped, rank, device),
        "stats": wrapped.stats,
        "events": [e.reason for e in wrapped.events],
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, world_size=2, timeout=90)


def test_fsdp_over_the_split_steps_aside_and_trains_bitwise(ranks: list[dict[str, Any]]) -> None:
    for results in ranks:
        for wrapped, plain in zip(results["wrapped"], results["plain"], strict=True):
            assert_same_tensors(wrapped["grads"], plain["grads"], none_ok=False)
            assert_same_tensors(wrapped["params"], plain["params"], none_ok=False)
        assert results["stats"].split_layer_calls == 0
        assert results["stats"].split_step_asides == (STEPS - 1) * 3
        assert "weight_grads_fsdp" in results["events"]
