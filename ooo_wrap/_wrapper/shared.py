"""What one model's tuning shares: its decision with later runs, and with the other ranks.

**Later runs** (``cache.py``): the decision is stored under a key of everything that can
change the winner, and a later run with the same key starts decided, after its first
training step (the step that tells which optimizer updates the model), with no step
measured. The key holds no input shape: the record holds the set of input shapes raced
(those of the counted steps), and a later run hits when every shape it has seen by then
(the learning forward's, the first tuned step's) is in that set. So a loop over a handful
of lengths (dynamic padding) hits from whichever of them it starts with; one that starts
outside the set misses, races, and its record replaces the old one. With
``tune_cache_confirm=True`` a cached arm other than plain is not taken as is: it goes to
the tuner's confirmation round against plain, and a record it fails is overwritten.
Nothing is read or written where the cache is off (``tune_cache=False`` or
``OOO_WRAP_CACHE=off``), and ``retune()`` races again and overwrites.

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
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .arms import Arm
from .cache import Signature, TuningCache, cache_dir, holds_shape, shapes_data, tuning_key
from .options import WrapOptions
from .tuning import Tuning

__all__ = ["Shared"]

_log = logging.getLogger("ooo_wrap")


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
        learned_on: Signature | None = None,
    ) -> None:
        self._model = weakref.ref(model)
        self._options, self._arms, self._device = options, tuple(arms), device
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        directory = cache_dir(options.tune_cache) if self.rank == 0 else None
        self._cache = None if directory is None else TuningCache(directory)
        self._recall = recall
        self.confirm = options.tune_cache_confirm  # a cached arm is confirmed, not taken
        # The input signature of the learning forward, if one came before tuning.
        self._learned_on = learned_on
        self._key: dict[str, object] | None = None
        self.recalled: str | None = None  # the arm of the decision recalled, if one was
        self._measured, self._path = "", ""  # where it came from

    def recall(self, shape: Signature, optimizer: str | None) -> str | None:
        """The arm a cached decision kept, for a first tuned step of ``shape`` (on rank 0;
        the other ranks learn it when they agree): only if every input shape seen so far
        was raced for it."""
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
        path = self._cache.path(self._key)
        seen = [shape] if self._learned_on is None else [self._learned_on, shape]
        if not all(holds_shape(record.get("shapes"), one) for one in seen):
            _log.info("ooo_wrap: %s was raced on other input shapes than %s: a miss", path, seen)
            return None
        self.recalled = str(record["arm"])
        self._measured = f"measured on {record.get('measured_on')} on {record.get('device')}"
        self._path = str(path)
        return self.recalled

    def cached_why(self) -> str:
        """Why a recalled decision stands, unconfirmed."""
        return (
            f"from the cache: {self._measured}, not re-measured ({self._path}); "
            "model.retune() races again"
        )

    def confirmed_why(self, arm: str, figures: str, *, kept: bool) -> str:
        """Why a recalled ``arm`` was kept after its confirmation round, or plain was."""
        if kept:
            return (
                f"from the cache, confirmed now: {figures} ({arm} {self._measured}, {self._path})"
            )
        return (
            f"from the cache, not confirmed now: {figures}; {arm} ({self._measured}, "
            f"{self._path}) was not faster than plain alone: plain is kept, and the cache now "
            "holds plain"
        )

    def store(self, record: Tuning, shapes: Iterable[Signature]) -> None:
        """Remember a decision measured now on input ``shapes`` (rank 0, where the cache
        is on)."""
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
                "shapes": shapes_data(shapes),
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
            if name not in ("backend", "tune_cache", "tune_cache_confirm")
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
            dtypes=[dtype for _, dtype in shape],
            optimizer=optimizer,
            world_size=self.world,
            device=self._device,
        )


def _nccl(group: Any) -> bool:
    return str(dist.get_backend(group)) == "nccl"
