"""The tuning cache's store: its directory, its key, and its files under failure."""

from __future__ import annotations

import contextlib
import enum
import json
import multiprocessing
import os
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._planner.cost import H200
from ooo_wrap._wrapper import cache
from ooo_wrap._wrapper.cache import (
    TuningCache,
    cache_dir,
    holds_shape,
    key_digest,
    shapes_data,
    tuning_key,
)
from ooo_wrap.testing import SimulatedBackend

# --- the directory ---------------------------------------------------------------------


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No OOO_WRAP_CACHE nor XDG_CACHE_HOME, and a home directory under ``tmp_path``."""
    monkeypatch.delenv("OOO_WRAP_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_default_directory_is_under_home(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cache_dir(None) == tmp_path / "home" / ".cache" / "ooo_wrap"
    assert cache_dir(True) == tmp_path / "home" / ".cache" / "ooo_wrap"


def test_xdg_cache_home_moves_the_default(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(None) == tmp_path / "xdg" / "ooo_wrap"
    env.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore it
    assert cache_dir(None) == tmp_path / "home" / ".cache" / "ooo_wrap"


@pytest.mark.parametrize("off", ["off", "OFF", " Off "])
def test_the_environment_variable_turns_it_off(env: pytest.MonkeyPatch, off: str) -> None:
    env.setenv("OOO_WRAP_CACHE", off)
    assert cache_dir(None) is None


def test_the_environment_variable_moves_it(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("OOO_WRAP_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir(None) == tmp_path / "elsewhere"
    assert cache_dir(True) == tmp_path / "elsewhere"
    env.setenv("OOO_WRAP_CACHE", "~/c")
    assert cache_dir(None) == tmp_path / "home" / "c"
    env.setenv("OOO_WRAP_CACHE", "")  # set but empty: as if unset
    assert cache_dir(None) == tmp_path / "home" / ".cache" / "ooo_wrap"


def test_the_keyword_wins_over_the_environment(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("OOO_WRAP_CACHE", str(tmp_path / "env"))
    assert cache_dir(False) is None
    assert cache_dir("off") is None
    assert cache_dir(tmp_path / "mine") == tmp_path / "mine"
    assert cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    env.setenv("OOO_WRAP_CACHE", "off")
    assert cache_dir(tmp_path / "mine") == tmp_path / "mine"
    assert cache_dir(True) == tmp_path / "home" / ".cache" / "ooo_wrap"


def test_a_relative_path_is_made_absolute(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.chdir(tmp_path)
    assert cache_dir("rel") == tmp_path / "rel"


@pytest.mark.parametrize("setting", [3, "", "  ", ["a"]])
def test_a_bad_setting_is_a_config_error(setting: Any) -> None:
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"tuning cache setting .*pass a path"):
        cache_dir(setting)


# --- the key ---------------------------------------------------------------------------


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


_SHAPES = (((8, 4), torch.float32),)


def _key(model: nn.Module | None = None, **changes: Any) -> dict[str, object]:
    arguments: dict[str, Any] = {
        "options": {"streams": 4, "planner": "dataflow", "stages": None},
        "plan_fingerprint": "abc123",
        "dtypes": [torch.float32],
        "optimizer": "SGD",
        "world_size": 1,
        "device": torch.device("cpu"),
    }
    arguments.update(changes)
    return tuning_key(_model() if model is None else model, **arguments)


@contextlib.contextmanager
def _setting(owner: object, name: str, value: object) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@contextlib.contextmanager
def _precision(value: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _frozen_first_layer() -> nn.Module:
    model = _model()
    model[0].weight.requires_grad_(False)
    return model


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str, sms: int) -> None:
    """CUDA as seen on an initialized machine with one device of ``name`` and ``sms``."""
    properties = types.SimpleNamespace(
        name=name, major=9, minor=0, multi_processor_count=sms, total_memory=80 << 30
    )
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)


# Each entry changes exactly one thing the key must hold; every one must change the digest.
_MODEL_CHANGES: dict[str, Callable[[], dict[str, object]]] = {
    "a module's class": lambda: _key(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))),
    "a parameter's shape": lambda: _key(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2))),
    "a parameter's dtype": lambda: _key(_model().double()),
    "requires_grad": lambda: _key(_frozen_first_layer()),
    "a module without parameters": lambda: _key(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Identity())
    ),
    "the module order": lambda: _key(nn.Sequential(nn.ReLU(), nn.Linear(4, 8), nn.Linear(8, 2))),
    "the plan fingerprint": lambda: _key(plan_fingerprint="abc124"),
    "an option's value": lambda: _key(
        options={"streams": 2, "planner": "dataflow", "stages": None}
    ),
    "another option": lambda: _key(
        options={"streams": 4, "planner": "dataflow", "stages": None, "overlap_forward": True}
    ),
    "an input dtype": lambda: _key(dtypes=[torch.bfloat16]),
    "another input": lambda: _key(dtypes=[torch.float32, torch.int64]),
    "the optimizer": lambda: _key(optimizer="AdamW"),
    "no optimizer": lambda: _key(optimizer=None),
    "the world size": lambda: _key(world_size=8),
    "the device type": lambda: _key(device=torch.device("meta")),
    "no device known": lambda: _key(device=None),
}

_SETTING_CHANGES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "autocast on": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast's dtype": lambda: torch.autocast("cpu", dtype=torch.float16),
    "matmul TF32": lambda: _setting(torch.backends.cuda.matmul, "allow_tf32", True),
    "cuDNN TF32": lambda: _setting(torch.backends.cudnn, "allow_tf32", False),
    "float32 matmul precision": lambda: _precision("medium"),
    "cudnn.benchmark": lambda: _setting(torch.backends.cudnn, "benchmark", True),
    "cudnn.deterministic": lambda: _setting(torch.backends.cudnn, "deterministic", True),
    "deterministic algorithms": _deterministic,
}

_VERSION_CHANGES: dict[str, tuple[object, str, object]] = {
    "torch": (torch, "__version__", "9.9.9"),
    "CUDA": (torch.version, "cuda", "99.9"),
    "HIP": (torch.version, "hip", "9.9"),
    "cuDNN": (torch.backends.cudnn, "version", lambda: 99999),
    "ooo_wrap": (ooo_wrap, "__version__", "9.9.9"),
}


@pytest.mark.parametrize("change", sorted(_MODEL_CHANGES))
def test_each_argument_changes_the_digest(change: str) -> None:
    assert key_digest(_MODEL_CHANGES[change]()) != key_digest(_key())


@pytest.mark.parametrize("change", sorted(_SETTING_CHANGES))
def test_each_setting_changes_the_digest(change: str) -> None:
    with (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if change == "autocast's dtype"
        else (contextlib.nullcontext())
    ):
        before = key_digest(_key())
        with _SETTING_CHANGES[change]():
            after = key_digest(_key())
    assert after != before
    assert key_digest(_key()) == key_digest(_key())  # and the setting is restored


@pytest.mark.parametrize("change", sorted(_VERSION_CHANGES))
def test_each_version_changes_the_digest(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _key()
    owner, name, value = _VERSION_CHANGES[change]
    monkeypatch.setattr(owner, name, value)
    assert key_digest(_key()) != key_digest(before)


def test_the_driver_version_is_read_from_the_driver_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    driver = tmp_path / "version"
    monkeypatch.setattr(cache, "_DRIVER_FILE", driver)
    assert _key()["versions"]["driver"] is None  # type: ignore[index]
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5\n")
    first = _key()
    assert first["versions"]["driver"] == "550.54.15"  # type: ignore[index]
    driver.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  Rel\n")
    assert key_digest(_key()) != key_digest(first)


def test_a_cuda_device_adds_its_name_and_mig_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    _fake_cuda(monkeypatch, "NVIDIA H200", 132)
    whole = _key(device=cuda)
    assert whole["device"] == {
        "type": "cuda",
        "name": "NVIDIA H200",
        "capability": "9.0",
        "sms": 132,
        "memory": 80 << 30,
        "mig": False,
    }
    _fake_cuda(monkeypatch, "NVIDIA H200", 16)  # a MIG slice: fewer SMs
    assert key_digest(_key(device=cuda)) != key_digest(whole)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0a1b2c3d")
    _fake_cuda(monkeypatch, "NVIDIA H200", 132)
    assert key_digest(_key(device=cuda)) != key_digest(whole)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 132)
    assert key_digest(_key(device=cuda)) != key_digest(whole)


def test_the_key_never_initializes_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def initializes(*args: object) -> None:
        raise AssertionError("tuning_key initialized CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("init", "current_device", "get_device_properties", "device_count"):
        monkeypatch.setattr(torch.cuda, name, initializes)
    assert _key(device=torch.device("cuda"))["device"] == {"type": "cuda"}


def test_what_cannot_change_the_winner_leaves_the_digest() -> None:
    plain = _key()
    other_values = _model()  # other random weights, same structure
    assert key_digest(_key(other_values)) == key_digest(plain)
    grown = _model()  # a buffer that grows with the inputs met (a rotary table)
    grown.register_buffer("table", torch.zeros(4))
    before = key_digest(_key(grown))
    grown.table = torch.zeros(16)
    assert key_digest(_key(grown)) == before
    wrapped = ooo_wrap.OOOModule(_model(), backend=SimulatedBackend(), tune=False)
    assert key_digest(_key(wrapped)) == key_digest(plain)
    reordered = {"stages": None, "planner": "dataflow", "streams": 4}
    assert key_digest(_key(options=reordered)) == key_digest(plain)
    assert json.loads(json.dumps(plain)) == plain  # JSON data already: it survives a file


def test_a_record_holds_the_set_of_input_shapes_raced() -> None:
    longer = (((16, 4), torch.float32),)
    raced = shapes_data([_SHAPES, longer, _SHAPES])  # each signature once, in one order
    assert raced == shapes_data([longer, _SHAPES])
    assert sorted(map(json.dumps, raced)) == sorted(
        map(json.dumps, [[[[8, 4], "torch.float32"]], [[[16, 4], "torch.float32"]]])
    )
    stored = json.loads(json.dumps(raced))  # as read back from a file
    assert holds_shape(stored, _SHAPES) and holds_shape(stored, longer)
    assert not holds_shape(stored, (((24, 4), torch.float32),))  # another length
    assert not holds_shape(stored, (((8, 4), torch.bfloat16),))  # another dtype
    assert not holds_shape(None, _SHAPES)  # a record without the set: none


def test_options_become_json_or_an_error_naming_the_option() -> None:
    class Planner(enum.Enum):
        DATAFLOW = "dataflow"

    options = {
        "gpu": H200,
        "dtype": torch.float16,
        "stages": ("a", "b"),
        "planner": Planner.DATAFLOW,
    }
    key = _key(options=options)
    assert key["options"]["planner"] == "dataflow"  # type: ignore[index]
    assert key["options"]["dtype"] == "torch.float16"  # type: ignore[index]
    assert key["options"]["gpu"]["name"] == H200.name  # type: ignore[index]
    assert key["options"]["stages"] == ["a", "b"]  # type: ignore[index]
    with pytest.raises(TypeError, match=r"option 'backend' is not plain data \(a SimulatedBack"):
        _key(options={"backend": SimulatedBackend()})
    with pytest.raises(TypeError, match=r"option 'tune_steps' is not plain data \(Out of range"):
        _key(options={"tune_steps": float("nan")})


# --- the files -------------------------------------------------------------------------

_RECORD = {
    "arm": "regions",
    "medians_ms": {"plain": 10.0, "regions": 8.1},
    "device": "NVIDIA H200",
    "measured": "2026-12-03T12:00:00+00:00",
}


def test_a_stored_record_loads_back(tmp_path: Path) -> None:
    store = TuningCache(tmp_path / "c")
    key = _key()
    assert store.load(key) is None
    store.store(key, _RECORD)
    assert store.load(key) == _RECORD
    assert TuningCache(tmp_path / "c").load(json.loads(json.dumps(key))) == _RECORD
    assert store.load(_key(world_size=2)) is None
    store.store(key, {**_RECORD, "arm": "plain"})  # retune: overwritten
    assert store.load(key) == {**_RECORD, "arm": "plain"}
    assert [p.name for p in (tmp_path / "c" / "tuning").iterdir()] == [f"{key_digest(key)}.json"]


def test_another_key_or_format_in_the_file_misses_quietly(tmp_path: Path) -> None:
    store = TuningCache(tmp_path)
    key = _key()
    path = store.path(key)
    path.parent.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path.write_text(json.dumps({"format": 1, "key": _key(world_size=2), "record": _RECORD}))
        assert store.load(key) is None  # a digest collision
        path.write_text(json.dumps({"format": 0, "key": key, "record": _RECORD}))
        assert store.load(key) is None  # an older layout
        path.write_text(json.dumps({"format": 2, "key": key, "entries": []}))
        assert store.load(key) is None  # a newer one


def _one_warning(record: pytest.WarningsRecorder, path: Path, words: str) -> None:
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert str(path) in messages[0] and words in messages[0], messages[0]
    assert "OOO_WRAP_CACHE=off" in messages[0]
    assert record[0].filename == __file__  # attributed to the caller, not to ooo_wrap


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'{"format": 1, "key": {}}', b'{"record": 3}'],
)
def test_a_corrupt_file_is_one_warning_and_a_miss(tmp_path: Path, content: bytes) -> None:
    store = TuningCache(tmp_path)
    key = _key()
    path = store.path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.warns(UserWarning) as record:
        assert store.load(key) is None
    _one_warning(record, path, "is corrupt")
    store.store(key, _RECORD)  # and the next decision replaces it
    assert store.load(key) == _RECORD


def test_an_unreadable_file_is_one_warning_and_a_miss(tmp_path: Path) -> None:
    store = TuningCache(tmp_path)
    key = _key()
    store.path(key).mkdir(parents=True)  # a directory where the file should be
    with pytest.warns(UserWarning) as record:
        assert store.load(key) is None
    _one_warning(record, store.path(key), "cannot read")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode says")
def test_file_modes_are_one_warning_each(tmp_path: Path) -> None:
    store = TuningCache(tmp_path)
    key = _key()
    store.store(key, _RECORD)
    store.path(key).chmod(0)
    with pytest.warns(UserWarning) as record:
        assert store.load(key) is None
    _one_warning(record, store.path(key), "cannot read")
    store.path(key).parent.chmod(0o500)
    try:
        with pytest.warns(UserWarning) as record:
            store.store(key, _RECORD)
        _one_warning(record, store.path(key), "cannot write")
    finally:
        store.path(key).parent.chmod(0o700)


def test_an_unwritable_directory_is_one_warning_and_nothing_stored(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = TuningCache(tmp_path / "file")
    key = _key()
    with pytest.warns(UserWarning) as record:
        store.store(key, _RECORD)
    _one_warning(record, store.path(key), "cannot write")
    with pytest.warns(UserWarning) as record:
        assert store.load(key) is None
    _one_warning(record, store.path(key), "cannot read")


def test_a_read_only_directory_is_one_warning_and_nothing_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What creating a file in a read-only directory raises (as root, chmod does not).
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(kwargs.get("dir")))

    store = TuningCache(tmp_path)
    key = _key()
    monkeypatch.setattr(cache.tempfile, "mkstemp", refuse)
    with pytest.warns(UserWarning) as record:
        store.store(key, _RECORD)
    _one_warning(record, store.path(key), "cannot write")
    assert list(store.path(key).parent.iterdir()) == []


def test_a_failed_rename_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(source: str, target: object) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    store = TuningCache(tmp_path)
    key = _key()
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.warns(UserWarning) as record:
        store.store(key, _RECORD)
    _one_warning(record, store.path(key), "cannot write")
    assert list(store.path(key).parent.iterdir()) == []


def test_a_record_that_is_not_json_is_the_callers_error(tmp_path: Path) -> None:
    store = TuningCache(tmp_path)
    with pytest.raises(TypeError):
        store.store(_key(), {"arm": object()})
    assert not (tmp_path / "tuning").exists()


# Two processes store and load one key at once, each a record of about 200 kB (written in
# many system calls): each load must see a whole record, and the file must parse after.
_ROUNDS = 40


def _store_and_load(directory: str, worker: int, start: Any, failures: Any) -> None:
    store = TuningCache(directory)
    key = _key()
    start.wait()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for round_ in range(_ROUNDS):
            store.store(key, {"worker": worker, "round": round_, "pad": "x" * 200_000})
            loaded = store.load(key)
            if loaded is None or len(loaded.get("pad", "")) != 200_000:  # type: ignore[arg-type]
                failures.put(f"worker {worker} round {round_} loaded a partial record")
    for warning in seen:
        failures.put(f"worker {worker}: {warning.message}")


@pytest.mark.slow
def test_concurrent_writers_never_leave_a_corrupt_file(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    start, failures = context.Barrier(2), context.Queue()
    workers = [
        context.Process(target=_store_and_load, args=(str(tmp_path), n, start, failures))
        for n in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0]
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert found == []
    record = TuningCache(tmp_path).load(_key())
    assert record is not None and record["round"] == _ROUNDS - 1
    assert [p.suffix for p in (tmp_path / "tuning").iterdir()] == [".json"]  # no temporaries
