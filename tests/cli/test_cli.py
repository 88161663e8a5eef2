"""The command line: ``plan``, usage errors, the doc's commands, packaging, subprocesses."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

import ooo_wrap
from examples import quickstart, transformer
from tests.support.cli_factories import TokensAndFeatures
from tests.support.cli_helpers import PROG, ROOT, doc_commands, run_cli

# --- plan -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["examples.quickstart:build_model"], lambda: ooo_wrap.plan(quickstart.build_model())),
        (
            ["examples.transformer:build_model", "--streams", "2"],
            lambda: ooo_wrap.plan(transformer.build_model(), 2),
        ),
        (
            ["examples.quickstart:build_model", "--stages", "towers.3", "towers.0"],
            lambda: ooo_wrap.plan(quickstart.build_model(), stages=["towers.3", "towers.0"]),
        ),
    ],
)
def test_plan_prints_the_plan_table(argv: list[str], expected: Any) -> None:
    result = run_cli("plan", *argv, "--planner", "static")
    assert (result.status, result.err) == (0, "")
    assert result.out.startswith(f"{expected()}\nCandidate arms: plain and ")


def test_plan_lists_the_candidate_arms_and_says_the_device_decides() -> None:
    result = run_cli("plan", "examples.quickstart:build_model", "--planner", "static")
    assert (result.status, result.err) == (0, "")
    lines = result.out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Candidate arms: "))
    assert "the device decides among them" in lines[start]
    assert lines[start + 1].split() == ["arm", "estimated", "step", "raced", "by", "default"]
    rows = {line.split()[0]: line for line in lines[start + 2 :]}
    assert set(rows) == {"plain", "static", "wgrad", "static+wgrad"}
    assert all("not estimated" in rows[name] for name in ("wgrad", "static+wgrad"))


def test_plan_lists_the_learned_arms_with_their_estimates() -> None:
    argv = ["examples.quickstart:build_model", "--input", "64x64"]
    result = run_cli("plan", *argv)
    assert (result.status, result.err) == (0, "")
    rows = result.out.split("\nCandidate arms: ", 1)[1].splitlines()[2:]
    estimated = [row.split()[0] for row in rows if " µs " in row]
    assert "regions" in estimated  # the learned plan's estimate
    assert rows[-1].startswith("  (estimated on NVIDIA H200 SXM")


def test_plan_notes_a_model_with_too_few_stages() -> None:
    result = run_cli("plan", "tests.support.cli_factories:single_stage", "--planner", "static")
    assert result.status == 0
    assert result.out.startswith("Plan: 1 stage on 1 side stream (")
    assert "note: fewer than two stages: nothing for stages to overlap" in result.out
    # The split alone is still a candidate: the device decides whether it pays.
    assert result.out.splitlines()[-1].split()[:4] == ["wgrad", "not", "estimated", "yes"]


def test_a_wrapped_model_is_planned_with_the_command_options() -> None:
    result = run_cli("plan", "tests.support.cli_factories:already_wrapped", "--streams", "3")
    assert result.status == 0
    assert result.out.startswith("Plan: 3 stages on 3 side streams (max 3;")


def test_a_class_is_a_factory_too() -> None:
    result = run_cli("plan", "tests.support.cli_factories:TokensAndFeatures")
    assert result.status == 0
    assert str(ooo_wrap.plan(TokensAndFeatures())) in result.out


# --- errors: one line on stderr, exit status 2 ------------------------------------------------

ERRORS = [
    (["plan", "no_such_package.models:build"], "no module named 'no_such_package.models'"),
    (
        ["plan", "tests.support.cli_factories_broken:build"],
        "No module named 'not_a_real_dependency",
    ),
    (["plan", "examples.quickstart"], "expected PACKAGE.MODULE:FACTORY"),
    (["plan", "examples.quickstart:build_modle"], "did you mean 'build_model'?"),
    (["plan", "tests.support.cli_factories:NOT_CALLABLE"], "is not callable (type int)"),
    (
        ["plan", "tests.support.cli_factories:returns_tensor"],
        "returned Tensor, not a torch.nn.Module",
    ),
    (
        ["plan", "tests.support.cli_factories:raises"],
        "raised ValueError: factory failed on purpose",
    ),
    (["plan", "examples.quickstart:build_model", "--streams", "0"], "streams must be"),
    (["plan", "examples.quickstart:build_model", "--stages", "towers.9"], "no submodule"),
    (["check", "examples.quickstart:build_model", "--input", "8xa"], "bad --input shape '8xa'"),
    (["check", "examples.quickstart:build_model", "--input", "8x0"], "bad --input shape"),
    (
        ["check", "examples.quickstart:build_model", "--input", "8x64", "--dtype", "float33"],
        "bad --dtype 'float33'; did you mean 'float32'?",
    ),
    (
        [
            "check",
            "tests.support.cli_factories:TokensAndFeatures",
            "--input",
            "4x6",
            "--input",
            "4x8",
            "--dtype",
            "int64",
            "float32",
            "float32",
        ],
        "3 --dtype values for 2 --input shapes",
    ),
    (
        ["check", "examples.quickstart:build_model", "--input", "8x64", "--int-high", "0"],
        "--int-high must be a positive int",
    ),
    (
        ["check", "examples.quickstart:build_model", "--input", "8x64", "--steps", "0"],
        "--steps must be a positive int",
    ),
    (
        [
            "check",
            "examples.quickstart:build_model",
            "--input",
            "8x64",
            "--capture",
            "--steps",
            "1",
        ],
        "check(capture=True) with the dataflow planner needs steps >= 2",
    ),
]


@pytest.mark.parametrize(("argv", "message"), ERRORS)
def test_errors_are_one_line_and_exit_status_2(argv: list[str], message: str) -> None:
    result = run_cli(*argv)
    assert result.status == 2
    assert result.out == ""
    assert result.err.count("\n") == 1 and "Traceback" not in result.err
    assert result.err.startswith(f"{PROG}: error: ")
    assert message in result.err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["plan"],
        ["frobnicate"],
        ["check", "examples.quickstart:build_model"],  # --input is required
        ["plan", "examples.quickstart:build_model", "--streams", "two"],
    ],
)
def test_argparse_usage_errors_exit_2(argv: list[str]) -> None:
    result = run_cli(*argv)
    assert result.status == 2
    assert "Traceback" not in result.err
    assert re.search(rf"^{PROG}( plan| check)?: error: ", result.err, re.MULTILINE)


def test_help_exits_0() -> None:
    result = run_cli("--help")
    assert result.status == 0
    assert "plan" in result.out and "check" in result.out
    result = run_cli("check", "--help")
    assert result.status == 0 and "[0, HIGH)" in " ".join(result.out.split())


# --- packaging, the doc, the current directory, real subprocesses ---------------------------


def test_console_script_is_declared() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", pyproject, re.M | re.S)
    assert scripts is not None
    assert 'ooo-wrap = "ooo_wrap._cli:main"' in scripts.group(1).splitlines()


def test_doc_commands_with_shown_output_print_exactly_that() -> None:
    commands = [c for c in doc_commands() if c.shown]
    assert len(commands) == 3
    for command in commands:
        result = run_cli(*command.argv)
        assert result.out + result.err == command.shown, command.argv
        assert result.status == (2 if result.err else 0)


def test_doc_commands_without_output_are_race_checks() -> None:
    silent = [c for c in doc_commands() if not c.shown]
    assert silent and all(c.argv[0] == "check" for c in silent)  # run in test_cli_check.py


MODELS_IN_CWD = """
from torch import nn


def build():
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
"""

# What pip writes for a [project.scripts] entry: sys.path[0] is the script's folder.
CONSOLE_SCRIPT = """
import sys
from ooo_wrap._cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


def test_the_current_directory_is_importable_in_process(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models_in_cwd_a.py").write_text(MODELS_IN_CWD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path_before = list(sys.path)
    try:
        result = run_cli("plan", "models_in_cwd_a:build")
    finally:
        sys.modules.pop("models_in_cwd_a", None)
    assert (result.status, result.err) == (0, "")
    assert result.out.startswith("Plan: 2 stages")
    assert sys.path == path_before  # added for the import only


def test_the_console_script_finds_modules_in_the_current_directory(
    tmp_path: pathlib.Path,
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ooo-wrap").write_text(CONSOLE_SCRIPT)
    (tmp_path / "models_in_cwd_b.py").write_text(MODELS_IN_CWD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(bin_dir / "ooo-wrap"), "plan", "models_in_cwd_b:build"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("Plan: 2 stages")
    command[-1] = "models_in_cwd_b:nope"
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr == "ooo-wrap: error: 'models_in_cwd_b' has no attribute 'nope'\n"


def test_python_dash_m_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "ooo_wrap", "plan", "examples.quickstart:build_model"]
    command += ["--planner", "static"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith(f"{ooo_wrap.plan(quickstart.build_model())}\nCandidate arms: ")
    command = [sys.executable, "-m", "ooo_wrap", "plan", "no_such_module:build"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "python -m ooo_wrap: error: no module named 'no_such_module'; run from the directory "
        "that contains it, or add that directory to PYTHONPATH\n"
    )
