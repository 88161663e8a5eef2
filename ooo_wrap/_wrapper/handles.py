"""Removing one part's hooks from a wrapped model while the rest stay."""

from __future__ import annotations

from torch.utils.hooks import RemovableHandle

__all__ = ["remove_part"]


def remove_part(part: list[RemovableHandle], handles: list[RemovableHandle]) -> None:
    """Remove the hooks in ``part`` (the learner's, the tuner's) and drop their handles from
    ``handles``, the wrap state's list of every hook; ``part`` is left empty."""
    mine = {id(handle) for handle in part}
    for handle in part:
        handle.remove()
    handles[:] = [handle for handle in handles if id(handle) not in mine]
    part.clear()
