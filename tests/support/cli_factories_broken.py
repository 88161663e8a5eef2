"""A factory module whose own import fails: a missing dependency, not a missing module."""

from __future__ import annotations

import not_a_real_dependency_of_ooo_wrap  # noqa: F401


def build() -> None:
    return None
