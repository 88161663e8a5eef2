"""What one model's tuning shares: its decision with later runs, and with the other ranks.

**Later runs** (``cache.py``): the decision is stored under a key of everything that can
change the winner, and a later run with the same key starts decided, after its first
training step (the step that tells which optimizer updates the model), with no step
measured. The key's input shapes are those of that first step: a loop that starts with
the same batch (with dynamic padding, the same first length) hits. Nothing is read or
written where the cache is off (``tune_cache=False`` or ``OOO_WRAP_CACHE=off``), and
``retune()`` races again and overwrites.

**Other ranks** (``torch.distributed`` initialized, more than one rank): every rank must
keep the same arm, and no rank may wait in a collective the others never enter. So the
ranks agree only at training forwards whose index is a multiple of ``every`` (the same
forwards on every rank of one loop, whatever each rank counted), over the default
process group, named explicitly: rank 0 broadcasts its decision (or "pending"), and every
rank takes it. Only rank 0 reads and writes the cache; its cached decision reaches the
others through the same broadcast.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .arms import Arm
from .cache import Signature, TuningCache, cache_dir, tuning_key
from .options import WrapOptions
from .tuning import Tuning

__all__ = ["Shared"]


class Shared:
    """The cache and the ranks of one tuning model (held weakly), racing ``arms``."""

    def __init__(
        self,
        model: nn.Module,
        options: WrapOptions,
        arms: Sequence[Arm],
        device: torch.device,
        *,
        recall: bool,
    ) -> None:
        self._model = weakref.ref(model)
        self._options, self._arms, self._device = options, tuple(arms), device
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        directory = cache_dir(options.tune_cache) if self.rank == 0 else None
        self._cache = None if directory is None else TuningCache(directory)
        self._recall = recall
        self._key: dict[str, object] | None = None

    def recall(self, shape: Signature, optimizer: str | None) -> tuple[str, str] | None:
        """The arm a cached decision kept, and why, for a first step of ``shape`` (on rank
        0; the other ranks learn it when they agree)."""
        model = self._model()
        if self._cache is None or model is None:
            return None
        self._key = self._key_for(model, shape, optimizer)
        if not self._recall:
            return None
        record = self._cache.load(self._key)
        names = [arm.name for arm in self._arms]
        if record is None or record.get("arm") not in names:
            return None
        why = (
            f"from the cache: measured on {record.get('measured_on')} on "
            f"{record.get('device')}, not re-measured ({self._cache.path(self._key)}); "
            "model.retune() races again"
        )
        return str(record["arm"]), why

    def store(self, record: Tuning) -> None:
        """Remember a decision measured now (rank 0, where the cache is on)."""
        if self._cache is None or self._key is None or record.decision == "pending":
            return
        self._cache.store(
            self._key,
            {
                "arm": record.decision,
                "why": record.why,
                "device": record.device,
                "measured_on": datetime.date.today().isoformat(),
                "medians_ms": {arm.name: arm.median_ms for arm in record.arms},
            },
        )

    def agree(self, forward: int, decision: str, every: int) -> str:
        """The decision every rank keeps, at training forward ``forward``: the local one
        on a single rank; else rank 0's, at forwards that are multiples of ``every``
        ("pending" at the others)."""
        if self.world == 1:
            return decision
        if forward % every:
            return "pending"
        names = [arm.name for arm in self._arms]
        group = dist.group.WORLD
        on = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else "cpu"
        chosen = torch.tensor([names.index(decision) if decision in names else -1], device=on)
        dist.broadcast(chosen, src=0, group=group)
        index = int(chosen.item())
        return names[index] if index >= 0 else "pending"

    def everywhere(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag true on every rank (``flags`` the same length on each)."""
        if self.world == 1:
            return list(flags)
        group = dist.group.WORLD
        on = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else "cpu"
        mask = torch.tensor([int(flag) for flag in flags], device=on)
        dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=group)
        return [bool(value) for value in mask.tolist()]

    def _key_for(
        self, model: nn.Module, shape: Signature, optimizer: str | None
    ) -> dict[str, object]:
        options: dict[str, Any] = {
            name: getattr(self._options, name)
            for name in self._options.__dataclass_fields__
            if name not in ("backend", "tune_cache")
        }
        options["backend"] = type(self._options.backend).__name__
        fingerprint = ";".join(
            f"{arm.name}:{sorted((s.name, s.stream) for s in arm.plan.stages)}"
            for arm in self._arms
        )
        return tuning_key(
            model,
            options=options,
            plan_fingerprint=fingerprint,
            shapes=[shape],
            optimizer=optimizer,
            world_size=self.world,
            device=self._device,
        )


def _nccl(group: Any) -> bool:
    return str(dist.get_backend(group)) == "nccl"
