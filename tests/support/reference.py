"""A reference GPU for tests of plan structure on tiny CPU models."""

from __future__ import annotations

import dataclasses

from ooo_wrap import H200

# At these sizes no fork pays on a real GPU: with a near-free fork the dataflow planner puts
# the branches of a tiny model on streams. Passed as ``gpu=`` to OOOModule, plan and check.
FREE_FORK = dataclasses.replace(H200, fork_join_us=1e-6)
