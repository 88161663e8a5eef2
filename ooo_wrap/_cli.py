"""The command line: ``python -m ooo_wrap`` or ``ooo-wrap``.

``plan`` prints the plan table of the model a factory returns (the learned plan when
``--input`` shapes are given: one forward runs on the CPU under observation); ``check``
runs the CPU race check on it (``--overlap-forward``, ``--capture`` as for
``ooo_wrap.testing.check``). Exit status: 0 ok, 1 the check found something, 2 a usage
error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import re
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ._errors import OOOError, did_you_mean, positive_int
from ._planner.api import plan
from ._wrapper.module import unwrap

__all__ = ["main"]

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}

_SHAPE = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)*")


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


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
    check_parser.set_defaults(run=_run_check)
    return parser


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
        model = _on_cpu(model, args.factory)
        inputs = _inputs(args, model)
    try:
        if learn:
            the_plan = plan(
                model, args.streams, stages=args.stages, example_inputs=inputs, gpu=args.gpu
            )
        else:
            the_plan = plan(model, args.streams, stages=args.stages)
    except OOOError as error:
        raise UsageError(error) from None
    except Exception as error:  # the model itself failed: say so in one line
        raise UsageError(
            f"the model raised {type(error).__name__} while the plan was learned: "
            f"{_one_line(error)} (are the --input shapes and --dtype right for it?)"
        ) from None
    print(the_plan)
    if learn:
        if not the_plan.stages:
            print("note: nothing to overlap, so OOOModule(model) removes its hooks after learning")
    elif args.planner == "dataflow":
        print(
            "note: this is the static plan; OOOModule(model) learns its plan from the first "
            "training forward (pass --input SHAPE to see that plan here, or --planner static)"
        )
    elif len(the_plan.stages) < 2:
        print("note: fewer than two stages, so OOOModule(model) leaves this model untouched")
    return EXIT_OK


def _inputs(args: argparse.Namespace, model: nn.Module) -> list[torch.Tensor]:
    """Random CPU inputs of the --input shapes and --dtype types (see ``check --help``)."""
    shapes = [parse_shape(text) for text in args.inputs]
    dtypes = _dtypes_for(args.dtypes or ["float32"], len(shapes))
    if args.int_high is not None:
        positive_int(args.int_high, "--int-high")
    high = args.int_high if args.int_high is not None else default_int_high(model)
    generator = torch.Generator().manual_seed(args.seed)
    inputs = []
    for text, shape, dtype in zip(args.inputs, shapes, dtypes, strict=True):
        try:
            inputs.append(_random(shape, dtype, high, generator))
        except (RuntimeError, MemoryError) as error:  # too large for this machine
            name = next(key for key, value in DTYPES.items() if value == dtype)
            raise UsageError(
                f"cannot allocate --input {text} ({name}): {_one_line(error)}; give a "
                "smaller shape (a batch of a few samples is enough to plan or check)"
            ) from None
    return inputs


def _on_cpu(model: nn.Module, spec: str) -> nn.Module:
    """``model`` on the CPU, where ``plan --input`` and ``check`` run it; a model without
    data (built on the meta device) is a usage error naming the fix."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    meta = next((name for name, tensor in tensors if tensor.is_meta), None)
    if meta is not None:
        raise UsageError(
            f"{spec}() built the model on the meta device ({meta!r} has no data), and it "
            "must run on the CPU here; build it on the CPU, or materialize it in the "
            "factory (model.to_empty(device='cpu'), then load or initialize its weights)"
        )
    try:
        return model.cpu()
    except Exception as error:
        raise UsageError(
            f"moving the model of {spec}() to the CPU failed: {type(error).__name__}: "
            f"{_one_line(error)}"
        ) from None


def _run_check(args: argparse.Namespace) -> int:
    shapes = [parse_shape(text) for text in args.inputs]
    _dtypes_for(args.dtypes or ["float32"], len(shapes))
    for flag, value in (("--int-high", args.int_high), ("--steps", args.steps)):
        if value is not None:
            positive_int(value, flag)
    from . import testing  # lazily: the checker is only needed by this command

    torch.manual_seed(args.seed)
    model = _on_cpu(load_model(args.factory), args.factory)
    inputs = _inputs(args, model)
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
        )
    except testing.CaptureError as error:  # the model broke a capture rule: a finding
        print(f"ooo_wrap check: FAILED under simulated graph capture: {_one_line(error)}")
        return EXIT_FINDINGS
    except OOOError as error:
        raise UsageError(error) from None
    except Exception as error:  # the model itself failed: say so in one line
        raise UsageError(
            f"the model raised {type(error).__name__} during the check: {_one_line(error)} "
            "(are the --input shapes and --dtype right for it?)"
        ) from None
    print(report)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def load_model(spec: str) -> nn.Module:
    """Import ``PACKAGE.MODULE:FACTORY``, call the factory and return the module it builds."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(
            f"expected PACKAGE.MODULE:FACTORY, got {spec!r} (e.g. examples.quickstart:build_model)"
        )
    with _current_directory_importable():
        return _build(spec, module_name, attribute)


def _build(spec: str, module_name: str, attribute: str) -> nn.Module:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise UsageError(
                f"no module named {module_name!r}; run from the directory that contains it, "
                "or add that directory to PYTHONPATH"
            ) from None
        raise UsageError(f"importing {module_name!r} failed: {_one_line(error)}") from None
    except Exception as error:
        raise UsageError(
            f"importing {module_name!r} failed: {type(error).__name__}: {_one_line(error)}"
        ) from None
    factory: object = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            public = [name for name in dir(factory) if not name.startswith("_")]
            raise UsageError(
                f"{module_name!r} has no attribute {attribute!r}{did_you_mean(part, public)}"
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(
            f"{spec} is not callable (type {type(factory).__name__}); FACTORY must be a "
            "function or class that builds the model with no arguments"
        )
    try:
        model = factory()
    except Exception as error:
        raise UsageError(f"{spec}() raised {type(error).__name__}: {_one_line(error)}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{spec}() returned {type(model).__name__}, not a torch.nn.Module; "
            "FACTORY must return the model"
        )
    # The command's own options decide the stages and streams (and check wraps by itself).
    return unwrap(model)


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[None]:
    """As ``python -m`` does, so that the console script finds modules in the current
    directory; undone afterwards, so an in-process ``main()`` leaves ``sys.path`` alone."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8x64"`` -> ``(8, 64)``; positive sizes joined by ``x``."""
    if not _SHAPE.fullmatch(text):
        raise UsageError(
            f"bad --input shape {text!r}: expected positive sizes joined by 'x', e.g. 8x64"
        )
    return tuple(int(size) for size in text.split("x"))


def default_int_high(model: nn.Module) -> int:
    """The bound of integer inputs when ``--int-high`` is not given (see ``check --help``)."""
    sizes = [
        module.num_embeddings
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    ]
    return min(sizes) if sizes else 2


def _dtypes_for(names: list[str], count: int) -> list[torch.dtype]:
    for name in names:
        if name not in DTYPES:
            raise UsageError(
                f"bad --dtype {name!r}{did_you_mean(name, DTYPES)}; choose from {', '.join(DTYPES)}"
            )
    if len(names) == 1:
        return [DTYPES[names[0]]] * count
    if len(names) != count:
        raise UsageError(
            f"{len(names)} --dtype values for {count} --input shapes; give one for all, "
            "or one per input"
        )
    return [DTYPES[name] for name in names]


def _random(
    shape: tuple[int, ...], dtype: torch.dtype, high: int, generator: torch.Generator
) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(0, high, shape, generator=generator, dtype=dtype)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
