"""The options of one wrap, checked once and kept as frozen data (copies re-wrap with them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._backend import Backend
from ._errors import OOOConfigError
from ._plan import as_stage_names, check_streams

__all__ = ["WrapOptions"]


@dataclass(frozen=True)
class WrapOptions:
    """What :class:`~ooo_wrap.OOOModule` was asked for, validated on construction.

    Kept in the wrap state (never on the model) so that ``copy.deepcopy`` and ``pickle``
    can wrap the copy exactly as the original was wrapped.

    Attributes:
        streams: the most side streams to use, a positive int.
        stages: dotted stage names, stored as a tuple; ``None`` for the model's
            ``ooo_stage_names`` or automatic expansion.
        backend: where streams come from; ``None`` for the real accelerator.
        profile_ranges: run each stage's forward inside
            ``torch.profiler.record_function("ooo/<stage name>")``.
    """

    streams: int = 4
    stages: Sequence[str] | None = None
    backend: Backend | None = None
    profile_ranges: bool = False

    def __post_init__(self) -> None:
        check_streams(self.streams)
        if self.stages is not None:
            # A tuple, normalised once here, so that the frozen options stay immutable.
            object.__setattr__(self, "stages", tuple(as_stage_names(self.stages, "stages=")))
        if not isinstance(self.profile_ranges, bool):
            raise OOOConfigError(
                f"profile_ranges must be True or False, got {self.profile_ranges!r}; "
                "pass profile_ranges=True to see stage names in profiler traces"
            )
