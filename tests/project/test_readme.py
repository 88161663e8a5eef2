"""The repository's own documents: set-up order, the main job's install, a short README that
links every docs/ page, links and anchors that resolve, references that stay inside the
repository, and one numbering of streams in the plan and the check report."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import check

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = sorted((ROOT / "docs").glob("*.md"))


def _set_up_section() -> str:
    start = README.index("## Set up")
    return README[start : README.index("\n## ", start + 1)]


def test_the_cpu_torch_install_comes_before_the_set_up_commands() -> None:
    section = _set_up_section()
    cpu_torch = section.index("--index-url https://download.pytorch.org/whl/cpu")
    assert cpu_torch < section.index("pip install -e")


def test_the_main_job_installs_numpy() -> None:
    # Without NumPy, `import torch` warns on stderr ("Failed to initialize NumPy").
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is new in Python 3.11")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "numpy" in project["optional-dependencies"]["examples"]
    assert 'pip install -e ".[examples]" && python examples/quickstart.py' in _set_up_section()


# Spelled in pieces, so that this file does not match itself.
_OUTSIDE = re.compile(
    "|".join(["DES" + "IGN", "\u00a7", "the se" + "ed's", "the iss" + "ue", r"iss" + r"ue \d"]),
    re.IGNORECASE,
)


def test_no_reference_to_documents_outside_the_repository() -> None:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for folder in ("ooo_wrap", "tests", "examples", "benchmarks", "scripts", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert found == []


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    assert len(README.splitlines()) <= 300
    assert PAGES
    for page in PAGES:
        assert f"](docs/{page.name})" in README, page.name


_FENCE = re.compile(r"^\s*```")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown text's headings."""
    found: set[str] = set()
    for line in _prose(text):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            number = 0
            while (anchor := slug + (f"-{number}" if number else "")) in found:
                number += 1
            found.add(anchor)
    return found


def test_the_slugs_follow_github() -> None:
    assert _anchors("# Forward overlap (`overlap_forward=True`)\n## A\n## A") == {
        "forward-overlap-overlap_forwardtrue",
        "a",
        "a-1",
    }


@pytest.mark.parametrize(
    "doc",
    [ROOT / "README.md", *PAGES, ROOT / "benchmarks" / "results" / "NOTES.md"],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_every_link_inside_the_repository_resolves(doc: Path) -> None:
    broken = []
    for line in _prose(doc.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"{target}: no {linked}")
            elif anchor and anchor not in _anchors(linked.read_text(encoding="utf-8")):
                broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert broken == []


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(x) + self.c(x)
        return out


def test_the_plan_and_the_check_report_name_streams_alike() -> None:
    model = Three()
    planned = {stage.stream_name for stage in ooo_wrap.plan(model, streams=2).stages}
    report = check(model, torch.randn(2, 4), streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)
    assert planned == {"side1", "side2"}
    assert {row.stream for row in report.ops} - {"default"} == planned
    table = str(ooo_wrap.plan(model, streams=2))
    assert [line.split()[1] for line in table.splitlines()[2:]] == ["side1", "side2", "side1"]


def _own_code_block() -> str:
    """The text block after "In your own code:" in the quickstart."""
    start = README.index("```text\n", README.index("In your own code:")) + len("```text\n")
    return README[start : README.index("```", start)]


def test_the_own_code_snippet_runs_on_a_model_that_fell_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # On the CPU OOOModule returns the model untouched: the snippet must still run, and
    # print why, instead of raising AttributeError on model.events or model.tuning.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    code = _own_code_block().replace('model.to("cuda")', "model.to(device)")
    exec(code, {"ooo_wrap": ooo_wrap, "model": model, "device": "cpu"})
    assert capsys.readouterr().out.startswith("disabled/cpu: ")
