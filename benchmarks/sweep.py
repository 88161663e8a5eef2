"""The benchmark suite's command line and the sweep of points it measures.

The defaults are the full sweep; the towers batch sweep starts at the target point, so a
run cut short by ``--budget-s`` still has it.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import DTYPES, GRAPHED_MODES, MODE_DESCRIPTIONS, MODES, Dtype, Point, check_modes
from .models import FAMILIES, ModelSpec

__all__ = ["build_points", "parse_args"]

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTION = (
    "A/B benchmark of ooo_wrap on one CUDA GPU: plain vs wrapped, interleaved in one process; "
    "optionally also wrapped with overlap_forward=True and whole-step CUDA graphs of both."
)
EPILOG = "modes (each point measures every mode asked for, interleaved):\n" + "\n".join(
    textwrap.fill(text, 88, initial_indent=f"  {mode:17}", subsequent_indent=" " * 19)
    for mode, text in MODE_DESCRIPTIONS.items()
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the modes list kept as written."""


def _modes(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return list(check_modes(names))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(allowed)}"
            )
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; defaults are the full sweep, including the towers target point."""
    p = argparse.ArgumentParser(
        description=DESCRIPTION, epilog=EPILOG, formatter_class=_HelpFormatter
    )
    p.add_argument(
        "--models", type=_names(FAMILIES), default=list(FAMILIES), help="comma-separated families"
    )
    p.add_argument(
        "--dtypes",
        type=_names(DTYPES),
        default=list(DTYPES),
        help="float32 and/or bfloat16 (autocast)",
    )
    g = p.add_argument_group("towers (K independent MLPs, summed)")
    g.add_argument("--towers", type=int, default=8, help="number of towers K")
    g.add_argument("--towers-width", type=int, default=2048, help="layer width")
    g.add_argument("--towers-depth", type=int, default=4, help="linear layers per tower")
    g.add_argument("--towers-batches", type=_ints, default=[16, 64, 256], help="batch sweep")
    g.add_argument(
        "--towers-widths",
        type=_ints,
        default=[512, 1024, 4096],
        help="width sweep, at the first towers batch size",
    )
    g = p.add_argument_group("branches (Inception-style, concatenated)")
    g.add_argument("--branches", type=int, default=4, help="number of branches")
    g.add_argument("--branches-channels", type=int, default=64, help="channels per branch")
    g.add_argument("--branches-depth", type=int, default=2, help="convolutions per branch")
    g.add_argument("--branches-image", type=int, default=32, help="image side in pixels")
    g.add_argument("--branches-batches", type=_ints, default=[16, 64, 256], help="batch sweep")
    g = p.add_argument_group("transformer (examples/transformer.py; defaults: its own size)")
    g.add_argument("--transformer-depth", type=int, default=4, help="blocks")
    g.add_argument("--transformer-dim", type=int, default=64, help="model width")
    g.add_argument("--transformer-heads", type=int, default=4, help="attention heads")
    g.add_argument("--transformer-seq", type=int, default=32, help="sequence length")
    g.add_argument("--transformer-batches", type=_ints, default=[8, 32, 128], help="batch sweep")
    g = p.add_argument_group("fanout (launch-bound: many small MLP branches, concatenated)")
    g.add_argument("--fanout", type=int, default=16, help="number of branches")
    g.add_argument("--fanout-width", type=int, default=128, help="layer width")
    g.add_argument("--fanout-depth", type=int, default=2, help="linear layers per branch")
    g.add_argument("--fanout-batches", type=_ints, default=[32, 256], help="batch sweep")
    g = p.add_argument_group("method")
    g.add_argument("--warmup", type=int, default=5, help="warm-up steps per side, reported apart")
    g.add_argument("--steps", type=int, default=30, help="steady-state steps per side")
    g.add_argument("--mem-steps", type=int, default=3, help="steps per side for peak memory")
    g.add_argument("--streams", type=int, default=4, help="OOOModule(streams=...)")
    g.add_argument(
        "--planner",
        choices=["dataflow", "static", "both"],
        default="both",
        help="OOOModule(planner=...); 'both' measures every point with each, side by side",
    )
    g.add_argument(
        "--modes",
        type=_modes,
        default="plain,wrapped",
        help=f"the sides of every point, from {', '.join(MODES)}; plain and wrapped are "
        "required (listed below)",
    )
    g.add_argument(
        "--overlap-forward",
        action="store_true",
        help="add the mode wrapped_overlap: OOOModule(overlap_forward=True), stage joins "
        "deferred until touched, beside wrapped",
    )
    g.add_argument(
        "--tuned",
        action="store_true",
        help="add the mode wrapped_tuned: OOOModule(tune='auto'), the wrapper's own measured "
        "decision recorded beside this mode's interleaved times",
    )
    g.add_argument(
        "--split",
        action="store_true",
        help="add the mode wrapped_split: OOOModule(split_weight_grads=True), every Linear "
        "and Conv weight gradient on a weight-gradient stream",
    )
    g.add_argument(
        "--graphs",
        action="store_true",
        help="add the modes plain_graphed and wrapped_graphed: the whole training step "
        "captured with ooo_wrap.graphed_step and replayed",
    )
    g.add_argument(
        "--graph-warmup",
        type=int,
        default=3,
        help="eager steps (on a side stream) before each capture of a graphed mode; at "
        "least 2 (graphed_step's warmup)",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds parameters and batch")
    g.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate (momentum 0.9)")
    g.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop starting new points after this many seconds (0: no limit); "
        "points not measured are listed in the report",
    )
    g.add_argument("--overhead-repeats", type=int, default=30, help="host-overhead probe")
    g.add_argument("--overhead-calls", type=int, default=200, help="host-overhead probe")
    g = p.add_argument_group("output")
    g.add_argument(
        "--out-dir", type=Path, default=ROOT / "benchmarks" / "results", help="JSON and PNG folder"
    )
    g.add_argument("--json", type=Path, default=None, help="JSON path (default: in --out-dir)")
    g.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside the JSON)")
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")
    g.add_argument(
        "--reference-gpu",
        type=Path,
        default=None,
        metavar="PATH",
        help="also measure launch, fork/join and kernel floor on this GPU "
        "(benchmarks/calibrate.py) and write them as a ReferenceGPU JSON here",
    )
    g.add_argument(
        "--require-gpu", action="store_true", help="exit with status 2 if no CUDA GPU is visible"
    )
    g.add_argument(
        "--summarize", type=Path, default=None, help="print the report of an earlier JSON and exit"
    )
    args = p.parse_args(argv)
    wanted = list(args.modes)
    if args.overlap_forward:
        wanted.append("wrapped_overlap")
    if args.tuned:
        wanted.append("wrapped_tuned")
    if args.split:
        wanted.append("wrapped_split")
    if args.graphs:
        wanted += GRAPHED_MODES
    args.modes = list(check_modes(wanted))
    if args.graph_warmup < 2:  # the dataflow planner learns on the first, inline
        p.error(f"--graph-warmup must be >= 2, got {args.graph_warmup}")
    return args


def build_points(args: argparse.Namespace) -> list[Point]:
    """The sweep: float32 first, then bfloat16; per precision, the families in order given.

    The towers batch sweep starts at the towers target point (batch 16 by default), so
    a run cut short by ``--budget-s`` still has it.
    """
    points: list[Point] = []
    dtypes: list[Dtype] = [d for d in DTYPES if d in args.dtypes]
    for dtype in dtypes:
        for family in args.models:
            if family == "towers":
                spec = ModelSpec.towers(args.towers, args.towers_width, args.towers_depth)
                points += [Point(spec, b, dtype) for b in args.towers_batches]
                for width in args.towers_widths:
                    if width != args.towers_width:
                        other = ModelSpec.towers(args.towers, width, args.towers_depth)
                        points.append(Point(other, args.towers_batches[0], dtype))
            elif family == "branches":
                spec = ModelSpec.branches(
                    args.branches, args.branches_channels, args.branches_depth, args.branches_image
                )
                points += [Point(spec, b, dtype) for b in args.branches_batches]
            elif family == "fanout":
                spec = ModelSpec.fanout(args.fanout, args.fanout_width, args.fanout_depth)
                points += [Point(spec, b, dtype) for b in args.fanout_batches]
            else:
                spec = ModelSpec.transformer(
                    args.transformer_depth,
                    args.transformer_dim,
                    args.transformer_heads,
                    args.transformer_seq,
                )
                points += [Point(spec, b, dtype) for b in args.transformer_batches]
    return points
