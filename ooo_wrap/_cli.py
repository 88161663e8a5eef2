"""The command line: ``python -m ooo_wrap`` or ``ooo-wrap``.

``plan`` prints the plan table of the model a factory returns (the learned plan when
``--input`` shapes are given: one forward runs on the CPU under observation) and the
candidate arms measured tuning races; ``check`` runs the CPU race check on every arm
(``--overlap-forward``, ``--capture``, ``--tune-arm`` as for ``ooo_wrap.testing.check``).
Exit status: 0 ok (also for a model with no arm but plain: nothing can race), 1 the check
found something, 2 a usage error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Literal

import torch

from ._cli_inputs import (
    DTYPES,
    UsageError,
    dtypes_for,
    load_model,
    on_cpu,
    one_line,
    parse_shape,
    random_inputs,
)
from ._errors import OOOError, positive_int
from ._planner.api import plan
from ._wrapper.arms import raced
from ._wrapper.options import WrapOptions

__all__ = ["main"]

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def main(argv: Sequence[str] | None = None, *, prog: str = "ooo-wrap") -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Example::

        $ python -m ooo_wrap plan examples.quickstart:build_model --streams 2
        $ python -m ooo_wrap check examples.transformer:build_model --input 8x31 --dtype int64
    """
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # argparse has printed its usage error, or --help
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    try:
        status: int = args.run(args)
    except (UsageError, OOOError) as error:  # bad options the library refused
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return status


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Out-of-order backprop from the shell: show the plan of a model, or run "
        "the CPU race check on it. The model comes from FACTORY, a function (or class) "
        "called with no arguments, in an importable module; the current directory is "
        "importable.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan_parser = commands.add_parser(
        "plan",
        help="print the plan table: stages, streams, devices, parameters",
        description="Print the plan OOOModule(model) would use, without touching a device. "
        "With --input, the plan the dataflow planner learns: one forward of a copy of the "
        "model runs on the CPU on random inputs of those shapes, observed (regions, "
        "streams, estimated device time per stage on a reference GPU, dataflow edges). "
        "Without --input (or with --planner static), the static plan.",
    )
    _add_model_arguments(plan_parser)
    _add_input_arguments(plan_parser, required=False)
    plan_parser.set_defaults(run=_run_plan)

    check_parser = commands.add_parser(
        "check",
        help="run the CPU race check and print its report (exit status 1 on findings)",
        description="Run the model on virtual streams on the CPU and report unordered "
        "cross-stream accesses. Float inputs are standard normal; integer inputs (token ids, "
        "labels) are uniform in [0, HIGH): HIGH is --int-high if given, else the smallest "
        "num_embeddings of the model's nn.Embedding / nn.EmbeddingBag modules (valid ids "
        "for every table), else 2 (0 and 1 index any dimension of size 2 or more).",
    )
    _add_model_arguments(check_parser)
    _add_input_arguments(check_parser, required=True)
    check_parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    check_parser.add_argument(
        "--overlap-forward",
        action="store_true",
        help="check the wrapper with deferred forward joins, as "
        "OOOModule(..., overlap_forward=True) runs it",
    )
    check_parser.add_argument(
        "--capture",
        action="store_true",
        help="run the last step under a simulated CUDA graph capture (the earlier ones "
        "eagerly, as warm-up); a broken capture rule is a finding (exit status 1). With "
        "the dataflow planner it needs --steps 2 or more",
    )
    check_parser.add_argument(
        "--split-weight-grads",
        choices=["on", "off", "auto"],
        default="auto",
        help="on: check each Linear/Conv layer's weight gradient on the weight-gradient "
        "stream (OOOModule(..., split_weight_grads=True)); off: never; auto (default): as "
        "OOOModule's default, which the checker (no tuning) leaves off",
    )
    check_parser.add_argument(
        "--tune-arm",
        metavar="NAME",
        help="check this arm only (as OOOModule(..., tune_arm=NAME) runs it; `plan` lists "
        "them); default: every candidate arm measured tuning might keep",
    )
    check_parser.set_defaults(run=_run_check)
    return parser


_SPLIT: dict[str, bool | Literal["auto"]] = {"on": True, "off": False, "auto": "auto"}


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "factory",
        metavar="PACKAGE.MODULE:FACTORY",
        help="e.g. examples.quickstart:build_model",
    )
    parser.add_argument(
        "--streams", type=int, default=4, metavar="N", help="most side streams (default 4)"
    )
    parser.add_argument(
        "--stages", nargs="+", metavar="NAME", help="dotted stage names (default: automatic)"
    )
    parser.add_argument(
        "--planner",
        choices=["dataflow", "static"],
        default="dataflow",
        help="dataflow (default): stages and streams learned from one forward; static: "
        "stage names or automatic expansion, streams round-robin",
    )
    parser.add_argument(
        "--gpu",
        metavar="PATH",
        help="a ReferenceGPU JSON (the GPU kit writes one measured on its device) to "
        "estimate on instead of the H200 datasheet figures",
    )
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="price the step as a CUDA graph replay (a step run under graphed_step: no "
        "per-kernel launch on the host, forks and joins as graph edges) instead of eager "
        "launches; the learned plan is priced, and kept, so",
    )


def _add_input_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--input",
        dest="inputs",
        action="append",
        required=required,
        metavar="SHAPE",
        help="shape of one positional input, sizes joined by 'x' (e.g. 8x64); repeat it "
        "for each input, in order",
    )
    parser.add_argument(
        "--dtype",
        dest="dtypes",
        action="extend",
        nargs="+",
        metavar="DTYPE",
        help=f"one of {', '.join(DTYPES)}: one for all inputs, or one per input, in "
        "order (default float32)",
    )
    parser.add_argument(
        "--int-high", type=int, metavar="HIGH", help="exclusive upper bound of integer inputs"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the factory and the inputs (default 0)"
    )


def _run_plan(args: argparse.Namespace) -> int:
    learn = args.planner == "dataflow" and args.inputs
    if learn:
        torch.manual_seed(args.seed)
    model = load_model(args.factory)
    if learn:
        model = on_cpu(model, args.factory)
        inputs = random_inputs(args, model)
    try:
        if learn:
            the_plan = plan(
                model,
                args.streams,
                stages=args.stages,
                example_inputs=inputs,
                gpu=args.gpu,
                graphed=args.graphed,
            )
        else:
            the_plan = plan(model, args.streams, stages=args.stages)
    except OOOError as error:
        raise UsageError(error) from None
    except Exception as error:  # the model itself failed: say so in one line
        raise UsageError(
            f"the model raised {type(error).__name__} while the plan was learned: "
            f"{one_line(error)} (are the --input shapes and --dtype right for it?)"
        ) from None
    print(the_plan)
    if args.graphed and not (learn and the_plan.estimate is not None):
        print(
            "note: --graphed prices the plan the dataflow planner learns and judges "
            "(pass --input SHAPE, and no --stages)"
        )
    if learn:
        if not the_plan.stages:
            print(
                "note: no stage pays on the estimate alone (with tune=False, OOOModule(model) "
                "removes its hooks after learning); measured tuning still races the arms below"
            )
    elif args.planner == "dataflow":
        print(
            "note: this is the static plan; OOOModule(model) learns its plan from the first "
            "training forward (pass --input SHAPE to see that plan and its candidate arms "
            "here, or --planner static)"
        )
        return EXIT_OK
    elif len(the_plan.stages) < 2:
        print("note: fewer than two stages: nothing for stages to overlap")
    print("\n".join(_arm_lines(args, model, inputs if learn else None)))
    return EXIT_OK


def _arm_lines(
    args: argparse.Namespace, model: torch.nn.Module, inputs: list[torch.Tensor] | None
) -> list[str]:
    """The candidate arms measured tuning races on the device, with their estimates."""
    from .testing._arms import learn_candidates  # lazily, as check's

    options = {"streams": args.streams, "stages": args.stages, "planner": args.planner}
    found = learn_candidates(model, lambda copy: copy(*(inputs or ())), options | {"gpu": args.gpu})
    if not found.arms:
        return [f"Candidate arms: none: {found.setup_failed or found.runs_plain}"]
    gpus = {arm.estimate_gpu for arm in found.arms if arm.estimate_gpu is not None}
    limit = WrapOptions.tune_arms
    chosen = raced(found.arms, limit)
    lines = [
        f"Candidate arms: plain and {len(found.arms)} more; measured tuning "
        f"races plain and at most {limit} of them (tune_arms={limit}) on your device, and the "
        "device decides among them (OOOModule(..., tune_arm=NAME) runs one, racing nothing)",
        f"  {'arm':<16}{'estimated step':<18}raced by default",
        f"  {'plain':<16}{'-':<18}yes (the model as if unwrapped)",
    ]
    for arm in found.arms:
        estimate = f"{arm.estimate_us:,.1f} µs" if arm.estimate_us is not None else "not estimated"
        lines.append(f"  {arm.name:<16}{estimate:<18}{'yes' if arm in chosen else 'no'}")
    if gpus:
        lines.append(f"  (estimated on {', '.join(sorted(gpus))}: estimates, not measurements)")
    return lines


def _run_check(args: argparse.Namespace) -> int:
    shapes = [parse_shape(text) for text in args.inputs]
    dtypes_for(args.dtypes or ["float32"], len(shapes))
    for flag, value in (("--int-high", args.int_high), ("--steps", args.steps)):
        if value is not None:
            positive_int(value, flag)
    from . import testing  # lazily: the checker is only needed by this command

    torch.manual_seed(args.seed)
    model = on_cpu(load_model(args.factory), args.factory)
    inputs = random_inputs(args, model)
    try:
        report = testing.check(
            model,
            *inputs,
            example_kwargs=None,  # --input shapes are positional inputs only
            streams=args.streams,
            stages=args.stages,
            steps=args.steps,
            planner=args.planner,
            overlap_forward=args.overlap_forward,
            capture=args.capture,
            gpu=args.gpu,
            split_weight_grads=_SPLIT[args.split_weight_grads],
            graphed=args.graphed,
            tune_arm=args.tune_arm,
        )
    except testing.CaptureError as error:  # the model broke a capture rule: a finding
        print(f"ooo_wrap check: FAILED under simulated graph capture: {one_line(error)}")
        return EXIT_FINDINGS
    except OOOError as error:
        raise UsageError(error) from None
    except Exception as error:  # the model itself failed: say so in one line
        raise UsageError(
            f"the model raised {type(error).__name__} during the check: {one_line(error)} "
            "(are the --input shapes and --dtype right for it?)"
        ) from None
    print(report)
    return EXIT_OK if report.ok else EXIT_FINDINGS
