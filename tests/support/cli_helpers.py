"""Helpers shared by the command-line tests: run the CLI in-process, read the docs' commands."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex
from dataclasses import dataclass

from ooo_wrap._cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The documents whose ```console blocks show commands: README's quickstart and the CLI page.
DOCS = (ROOT / "README.md", ROOT / "docs" / "cli.md")
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
    """The ``$ python -m ooo_wrap ...`` commands of the docs' console blocks, in order; a
    command shown twice (with the same output) is listed once."""
    commands: list[DocCommand] = []
    blocks = [
        block
        for doc in DOCS
        for block in re.findall(
            r"^```console\n(.*?)^```", doc.read_text(), re.MULTILINE | re.DOTALL
        )
    ]
    for block in blocks:
        for chunk in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, _, shown = chunk.partition("\n")
            words = shlex.split(command)
            assert words[:3] == ["python", "-m", "ooo_wrap"], command
            doc_command = DocCommand(tuple(words[3:]), shown)
            if doc_command not in commands:
                commands.append(doc_command)
    return commands
