"""Helpers shared by the command-line tests: run the CLI in-process, read the doc's commands."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex
from dataclasses import dataclass

from ooo_wrap._cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "README.md"
PROG = "python -m ooo_wrap"


@dataclass(frozen=True)
class Result:
    status: int
    out: str
    err: str


def run_cli(*argv: str) -> Result:
    """Run ``python -m ooo_wrap ARGV`` in this process, capturing what it prints."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv), prog=PROG)
    return Result(status, out.getvalue(), err.getvalue())


@dataclass(frozen=True)
class DocCommand:
    argv: tuple[str, ...]
    shown: str  # the output the doc shows under the command ("" if none)


def doc_commands() -> list[DocCommand]:
    """The ``$ python -m ooo_wrap ...`` commands of the doc's console blocks, in order."""
    commands: list[DocCommand] = []
    blocks = re.findall(r"^```console\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    for block in blocks:
        for chunk in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, _, shown = chunk.partition("\n")
            words = shlex.split(command)
            assert words[:3] == ["python", "-m", "ooo_wrap"], command
            commands.append(DocCommand(tuple(words[3:]), shown))
    return commands
