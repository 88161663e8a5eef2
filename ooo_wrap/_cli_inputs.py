"""What a command of the command line runs on: the model its factory builds, on the CPU,
and random inputs of its ``--input`` shapes and ``--dtype`` types.

Every mistake in those options is a :class:`UsageError`, which ``_cli.main`` reports in one
line (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import re
import sys
from collections.abc import Iterator

import torch
from torch import nn

from ._errors import did_you_mean, positive_int
from ._wrapper.module import unwrap

__all__ = [
    "DTYPES",
    "UsageError",
    "default_int_high",
    "dtypes_for",
    "load_model",
    "on_cpu",
    "one_line",
    "parse_shape",
    "random_inputs",
]

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


def random_inputs(args: argparse.Namespace, model: nn.Module) -> list[torch.Tensor]:
    """Random CPU inputs of the --input shapes and --dtype types (see ``check --help``)."""
    shapes = [parse_shape(text) for text in args.inputs]
    dtypes = dtypes_for(args.dtypes or ["float32"], len(shapes))
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
                f"cannot allocate --input {text} ({name}): {one_line(error)}; give a "
                "smaller shape (a batch of a few samples is enough to plan or check)"
            ) from None
    return inputs


def on_cpu(model: nn.Module, spec: str) -> nn.Module:
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
            f"{one_line(error)}"
        ) from None


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
        raise UsageError(f"importing {module_name!r} failed: {one_line(error)}") from None
    except Exception as error:
        raise UsageError(
            f"importing {module_name!r} failed: {type(error).__name__}: {one_line(error)}"
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
        raise UsageError(f"{spec}() raised {type(error).__name__}: {one_line(error)}") from None
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


def dtypes_for(names: list[str], count: int) -> list[torch.dtype]:
    """The ``--dtype`` of each of ``count`` inputs: one name for all, or one per input."""
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


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (its type's name if it has none)."""
    return " ".join(str(error).split()) or type(error).__name__
