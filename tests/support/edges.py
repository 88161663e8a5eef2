"""How many stage-to-stage dataflow edges a plan puts across streams, for the planner tests
and the figures of docs/planner.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ooo_wrap._planner.learned_plan import LearnedPlan, edges_between_stages


@dataclass(frozen=True)
class EdgeCount:
    """Stage-to-stage dataflow edges of one forward: all of them, those across streams, and
    those that split a chain (an edge across streams between two links of one chain)."""

    edges: int
    cross_stream: int
    chain_splits: int


def count_edges(learned: LearnedPlan, stage_streams: Mapping[str, int]) -> EdgeCount:
    """The stage edges of any plan (e.g. the static one) on the forward ``learned`` saw."""
    edges = edges_between_stages(learned.record, stage_streams, learned.lanes)
    cross = [e for e in edges if e.cross_stream]
    return EdgeCount(len(edges), len(cross), sum(e.chain_link for e in cross))
