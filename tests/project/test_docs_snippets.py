"""Every ```python block under a "Using with ..." or "Quickstart" heading of the docs runs.

The docs are README.md and every page in docs/. A block counts when any heading above it
(at its level or an outer one) starts with "Using with" or "Quickstart": the whole of
docs/integrations.md (titled "Using with the rest of PyTorch") and README's quickstart.
Blocks that call ``init_process_group`` run as two gloo ranks in fresh
processes with the environment torchrun sets; the others run in this process, each in a
fresh namespace. Interactive examples (``>>>``) are written as ``pycon`` or ``text`` blocks,
not ``python``, so they are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.distributed import (
    FSDP2_RUNS_ON_CPU,
    FSDP2_SKIP_REASON,
    REPO_ROOT,
    free_port,
)

README = REPO_ROOT / "README.md"
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
# A ```python block under a heading starting with one of these runs.
RUN_UNDER = ("Using with", "Quickstart")

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*```")


def using_with_snippets(markdown: str) -> list[tuple[str, str]]:
    """``(heading, code)`` of every ```python block under a heading starting with one of
    :data:`RUN_UNDER`."""
    found: list[tuple[str, str]] = []
    headings: list[tuple[int, str]] = []  # the open headings, outermost first
    block: list[str] | None = None
    language = ""
    for line in markdown.splitlines():
        if block is not None:
            if _FENCE.match(line):
                section = next((h for _, h in headings if h.startswith(RUN_UNDER)), None)
                if language == "python" and section is not None:
                    found.append((headings[-1][1], "\n".join(block) + "\n"))
                block = None
            else:
                block.append(line)
            continue
        if _FENCE.match(line):
            info = line.strip()[3:].split()  # "```python title=x" -> python
            block, language = [], info[0].lower() if info else ""
            continue
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            headings = [(lv, h) for lv, h in headings if lv < level]
            headings.append((level, heading.group(2)))
    return found


def _all_snippets() -> list[tuple[str, str]]:
    return [
        (f"{path.name}:{heading}", code)
        for path in DOCS
        for heading, code in using_with_snippets(path.read_text())
    ]


def _is_distributed(code: str) -> bool:
    return "init_process_group" in code


# Snippets importing these need the integrations extra: marked, and skipped without it.
_INTEGRATIONS = ("transformers", "accelerate", "lightning")


def _integrations_used(code: str) -> list[str]:
    return [m for m in _INTEGRATIONS if re.search(rf"^(from|import) {m}\b", code, re.MULTILINE)]


def _snippet_param(name: str, code: str) -> object:
    marks = [pytest.mark.integrations] if _integrations_used(code) else []
    return pytest.param(code, id=name, marks=marks)


# Runs in each rank: every distributed snippet in turn, each in a fresh namespace and with
# its own rendezvous port (a rank that finished the previous snippet early must not join
# the previous store), then one line of results.
_DRIVER = """
import json, os, sys, traceback
results = {}
with open(sys.argv[1]) as file:
    jobs = json.load(file)
for name, code, port in jobs:
    os.environ["MASTER_PORT"] = str(port)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
    finally:  # a failed snippet must not leave its group to the next one
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
print("RESULTS " + json.dumps(results))
"""


def _run_two_ranks(
    snippets: list[tuple[str, str]], tmp: Path, timeout: float = 120.0
) -> list[dict[str, str | None]]:
    """Run ``snippets`` as ranks 0 and 1 of a gloo job, as ``torchrun --nproc-per-node 2``.

    Returns each rank's ``{snippet id: None, or the traceback it raised}``.
    """
    jobs = tmp / "snippets.json"
    jobs.write_text(json.dumps([(name, code, free_port()) for name, code in snippets]))
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _DRIVER, str(jobs)],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for out in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
        assert lines, out
        results.append(json.loads(lines[-1].removeprefix("RESULTS ")))
    return results


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str | None]]:
    snippets = [(n, c) for n, c in _all_snippets() if _is_distributed(c)]
    results = _run_two_ranks(snippets, tmp_path_factory.mktemp("snippets"))
    # A port picked free can be taken by another job before rank 0 listens on it:
    # only that failure is retried, once, with fresh ports.
    failures = " ".join(tb for rank in results for tb in rank.values() if tb)
    if "EADDRINUSE" in failures or "address already in use" in failures.lower():
        results = _run_two_ranks(snippets, tmp_path_factory.mktemp("snippets"))
    return results


@pytest.mark.parametrize("name", [n for n, c in _all_snippets() if _is_distributed(c)])
def test_distributed_snippet_runs_on_two_ranks(
    name: str, distributed_results: list[dict[str, str | None]]
) -> None:
    if "FSDP2" in name and not FSDP2_RUNS_ON_CPU:
        pytest.skip(FSDP2_SKIP_REASON)
    for rank_results in distributed_results:
        assert rank_results[name] is None, rank_results[name]


@pytest.mark.parametrize(
    "code", [_snippet_param(n, c) for n, c in _all_snippets() if not _is_distributed(c)]
)
def test_snippet_runs(code: str) -> None:
    for module in _integrations_used(code):
        pytest.importorskip(
            module, reason="needs the integrations extra: pip install -e '.[integrations]'"
        )
    try:
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
    finally:
        torch.compiler.reset()


def test_the_docs_run_their_snippets_where_they_say() -> None:
    found = {path.name: [h for h, _ in using_with_snippets(path.read_text())] for path in DOCS}
    assert found.pop("README.md") == ["See it work on a CPU"]
    assert found.pop("integrations.md") == [
        "DDP",
        "FSDP2",
        "torch.compile",
        "Whole-network capture",
        "Partial-network capture",
        "Activation checkpointing",
        "AMP (autocast and GradScaler)",
        "The PyTorch profiler",
        "Copying and saving",
        "Hugging Face Trainer",
        "Accelerate",
        "Lightning",
    ]
    assert found.pop("weight-gradients.md") == [
        "Using with your own layer types: a registered rule"
    ]
    # The other pages' python blocks are fragments (``model``, ``x`` stand for yours).
    assert found and all(headings == [] for headings in found.values()), found


def test_snippet_extraction_follows_headings() -> None:
    markdown = "\n".join(
        [
            "# Title",
            "```python",
            "not_under_using_with = 1",
            "```",
            "## Using with X",
            "```Python title=a.py",
            "a = 1",
            "```",
            "```bash",
            "echo not python",
            "```",
            "### Details",
            "```python",
            "b = 2",
            "```",
            "## Other",
            "```python",
            "c = 3",
            "```",
            "## Quickstart",
            "### On a CPU",
            "```python",
            "d = 4",
            "```",
        ]
    )
    assert using_with_snippets(markdown) == [
        ("Using with X", "a = 1\n"),
        ("Details", "b = 2\n"),
        ("On a CPU", "d = 4\n"),
    ]


def test_only_the_trainer_snippets_need_the_integrations_extra() -> None:
    used = {name: _integrations_used(code) for name, code in _all_snippets()}
    needing = {name: modules for name, modules in used.items() if modules}
    assert needing == {
        "integrations.md:Hugging Face Trainer": ["transformers"],
        "integrations.md:Accelerate": ["accelerate"],
        "integrations.md:Lightning": ["lightning"],
    }
