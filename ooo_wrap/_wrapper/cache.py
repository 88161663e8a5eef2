"""The tuning cache's store: where it lives, what keys a decision, one JSON file per key.

Users run one model many times (restarts, sweeps, every rank of a job), so a measured
decision is kept on disk, as Triton's autotuner and Inductor keep theirs; the tuner decides
what to record and when. One file per key (``<directory>/tuning/<digest>.json``), not one
file of entries: no store rewrites other keys' entries, so writers need no lock and a
corrupt file costs one key. Each write goes to a temporary file in the same directory, then
``os.replace``: a reader sees the old file or the new one, never part of one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from .._errors import OOOConfigError, warn_user

__all__ = [
    "ENV",
    "FORMAT",
    "TuningCache",
    "cache_dir",
    "holds_shape",
    "key_digest",
    "shapes_data",
    "tuning_key",
]

ENV = "OOO_WRAP_CACHE"
# The file layout's version: a file written in another format misses (and is overwritten).
FORMAT = 1
# Where Linux shows the NVIDIA kernel driver's version, readable without touching CUDA.
_DRIVER_FILE = Path("/proc/driver/nvidia/version")
_DRIVER_VERSION = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")

# One input signature of a forward: each tensor's shape and dtype, in order.
Signature = Sequence[tuple[Sequence[int], torch.dtype]]

_log = logging.getLogger("ooo_wrap")


def cache_dir(setting: str | os.PathLike[str] | bool | None) -> Path | None:
    """The tuning cache's directory, or ``None`` when the cache is off.

    ``setting`` is the per-model keyword: ``False`` or ``"off"``: off; a path: there;
    ``None``: the ``OOO_WRAP_CACHE`` variable (``off``: off; a path: there), else
    ``$XDG_CACHE_HOME/ooo_wrap``, else ``~/.cache/ooo_wrap``; ``True``: as ``None``, but on
    even when the variable says ``off``.

    Raises:
        OOOConfigError: ``setting`` is neither a path, a bool nor ``None``, or is empty.
    """
    if setting is False or _is_off(setting):
        return None
    if setting is None or setting is True:
        env = os.environ.get(ENV, "").strip()
        if env and not _is_off(env):
            return Path(env).expanduser().absolute()
        if _is_off(env) and setting is None:
            return None
        return _default_dir()
    if not isinstance(setting, (str, os.PathLike)) or not os.fspath(setting).strip():
        raise OOOConfigError(
            f"the tuning cache setting {setting!r} is not a directory: pass a path, "
            f"True (on), False or 'off' (off), or None (the {ENV} environment variable)"
        )
    return Path(setting).expanduser().absolute()


def _is_off(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "off"


def _default_dir() -> Path | None:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec ignores a relative path
        return Path(xdg) / "ooo_wrap"
    try:
        return Path.home() / ".cache" / "ooo_wrap"
    except RuntimeError:  # no home directory to be found: nowhere to keep decisions
        _log.info("ooo_wrap: no home directory, so no tuning cache; set %s to a path", ENV)
        return None


def tuning_key(
    model: nn.Module,
    *,
    options: Mapping[str, object],
    plan_fingerprint: str,
    dtypes: Iterable[torch.dtype],
    optimizer: str | None,
    world_size: int,
    device: torch.device | None,
) -> dict[str, object]:
    """Everything that can change which arm wins, as JSON data (see :func:`key_digest`).

    The model's structure (module names and classes; parameter shapes, dtypes and
    ``requires_grad``, in order; not values), the plan's fingerprint, the options, the
    input tensors' dtypes in order (not their shapes: a record holds the set of input
    shapes raced, :func:`shapes_data`), the autocast dtype in force for ``device`` here, the
    optimizer's type, the world size, the device (``None``: unknown; for CUDA, read only
    once CUDA is initialized: name, capability, SMs and memory, which tell MIG slices
    apart), the software versions and the math settings that change kernels.

    Raises:
        TypeError: an option's value is not plain data (str, number, bool, None, dtype,
            device, enum, dataclass, or a list, tuple or mapping of these).
    """
    return {
        "model": _structure(model),
        "plan": plan_fingerprint,
        "options": {str(name): _option(str(name), value) for name, value in options.items()},
        "input_dtypes": [str(dtype) for dtype in dtypes],
        "autocast": _autocast(device),
        "optimizer": optimizer,
        "world_size": world_size,
        "device": _device(device),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
            "driver": _driver_version(),
            # The package itself is imported before any of its modules; reading its version
            # here keeps this module below the package's __init__ in the layers.
            "ooo_wrap": getattr(sys.modules.get("ooo_wrap"), "__version__", None),
        },
        "math": {
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        },
    }


def shapes_data(signatures: Iterable[Signature]) -> list[object]:
    """The set of input signatures ``signatures`` as JSON data, for a record: sorted, each
    once."""
    return [json.loads(one) for one in sorted({_signature(one) for one in signatures})]


def holds_shape(stored: object, signature: Signature) -> bool:
    """Whether ``stored`` (a record's :func:`shapes_data`) holds ``signature``."""
    if not isinstance(stored, list):  # a record without its set of shapes: none holds it
        return False
    mine = _signature(signature)
    return any(_canonical(one) == mine for one in stored)


def key_digest(key: Mapping[str, object]) -> str:
    """The sha256 hex digest of ``key``'s canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(_canonical(key).encode()).hexdigest()


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _structure(model: nn.Module) -> dict[str, object]:
    def class_name(module: nn.Module) -> str:
        # A wrapped model's class is a cached subclass: the user's class is what it is.
        cls = getattr(type(module), "_ooo_original", type(module))
        return f"{cls.__module__}.{cls.__qualname__}"

    # Parameters, not buffers: some models grow a buffer (a rotary table) as they meet
    # longer inputs, and the key must not change between the tuner's load and its store.
    parts = {
        "modules": [[name, class_name(module)] for name, module in model.named_modules()],
        "parameters": [
            [name, list(p.shape), str(p.dtype), p.requires_grad]
            for name, p in model.named_parameters()
        ],
    }
    # The whole structure is hashed, so a large model's key stays small; the class and
    # counts stay readable in the file.
    return {
        "class": class_name(model),
        "parameters": sum(1 for _ in model.parameters()),
        "structure": hashlib.sha256(_canonical(parts).encode()).hexdigest(),
    }


def _option(name: str, value: object) -> object:
    """``value`` as JSON data, or ``TypeError`` naming the option."""
    try:
        return json.loads(json.dumps(value, default=_jsonable, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"ooo_wrap: the tuning key's option {name!r} is not plain data ({error}): pass a "
            f"str, finite number, bool, None, dtype, device, enum, dataclass, or a list, "
            f"tuple or str-keyed mapping of these"
        ) from None


def _jsonable(value: object) -> object:
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a ReferenceGPU
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    raise TypeError(f"a {type(value).__name__}, whose value is not stable across runs")


def _signature(signature: Signature) -> str:
    return _canonical([[[int(n) for n in shape], str(dtype)] for shape, dtype in signature])


def _autocast(device: torch.device | None) -> str | None:
    if device is None:  # no device known (a model without parameters): no autocast to read
        return None
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know: no autocast
        return None
    return str(torch.get_autocast_dtype(device.type)) if enabled else None


def _device(device: torch.device | None) -> dict[str, object]:
    if device is None or device.type != "cuda":
        return {"type": None if device is None else device.type}
    # Never the first to initialize CUDA: a model on a CUDA device has done so already.
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {"type": "cuda"}
    index = torch.cuda.current_device() if device.index is None else device.index
    properties = torch.cuda.get_device_properties(index)
    return {
        "type": "cuda",
        "name": properties.name,
        "capability": f"{properties.major}.{properties.minor}",
        # A MIG slice is a profile's share of SMs and memory: these tell them apart.
        "sms": properties.multi_processor_count,
        "memory": properties.total_memory,
        "mig": "MIG-" in os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }


def _driver_version() -> str | None:
    try:
        text = _DRIVER_FILE.read_text(encoding="utf-8", errors="replace")
    except OSError:  # not Linux, or no NVIDIA driver
        return None
    match = _DRIVER_VERSION.search(text)
    return match.group(1) if match else None


class TuningCache:
    """Tuning decisions kept in ``directory``, one JSON file per key.

    A corrupt, unreadable or unwritable file never raises: one warning naming the file,
    then a miss (``load``) or nothing stored (``store``).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, key: Mapping[str, object]) -> Path:
        """The file that holds ``key``'s record."""
        return self.directory / "tuning" / f"{key_digest(key)}.json"

    def load(self, key: Mapping[str, object]) -> dict[str, object] | None:
        """The record stored for ``key``, or ``None``: none stored, another key or format
        in its file (a digest collision, an older ooo_wrap), or a file that cannot be read.
        """
        path = self.path(key)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except OSError as error:
            _warn(f"cannot read the tuning cache file {path} ({error})", "tuning runs again")
            return None
        except ValueError as error:  # not JSON, or not UTF-8
            _warn(f"the tuning cache file {path} is corrupt ({error})", "tuning runs again")
            return None
        if isinstance(data, dict) and "format" in data and data["format"] != FORMAT:
            _log.info("ooo_wrap: %s has format %r, not %d: a miss", path, data["format"], FORMAT)
            return None
        if not (isinstance(data, dict) and isinstance(data.get("record"), dict)):
            _warn(f"the tuning cache file {path} is corrupt (no record)", "tuning runs again")
            return None
        if _canonical(data.get("key")) != _canonical(key):
            _log.info("ooo_wrap: %s holds another key with the same digest: a miss", path)
            return None
        return dict(data["record"])

    def store(self, key: Mapping[str, object], record: Mapping[str, object]) -> None:
        """Write ``record`` for ``key``, replacing what was there in one rename.

        Raises:
            TypeError: ``key`` or ``record`` is not JSON data (a caller's bug; nothing
                written).
        """
        path = self.path(key)
        text = json.dumps({"format": FORMAT, "key": key, "record": record}, indent=1)
        temporary: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(
                prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent
            )
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())  # the rename must not publish an empty file
            os.replace(temporary, path)
            temporary = None
        except OSError as error:
            _warn(
                f"cannot write the tuning cache file {path} ({error})",
                "this decision is not remembered",
            )
        finally:
            if temporary is not None:  # a failed write leaves no temporary file behind
                with contextlib.suppress(OSError):
                    os.unlink(temporary)


def _warn(problem: str, outcome: str) -> None:
    warn_user(
        f"ooo_wrap: {problem}; {outcome}. Delete the file or fix its directory's "
        f"permissions, point {ENV} at a writable directory, or set {ENV}=off"
    )
