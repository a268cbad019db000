"""Figures are records: the README's results table comes from docs/results/, and no prose cites a commit or a date.

The records under docs/results/ carry the command, machine, software, date and commit of each
measurement (benchmarks/records.py); the README and docs link them instead of copying figures,
and the code says why, not when.
"""

import ast
import glob
import os
import re

import pytest
from conftest import REPO_ROOT

from benchmarks import records, results_table

# A commit hash as prose cites one: 7 to 40 hex digits, at least one letter and one digit.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")

_DOCS = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
_CODE_FOLDERS = ("common", "configs", "models", "input_pipeline", "training", "sweeps", "benchmarks", "scripts")
_ENTRY_POINTS = ("train.py", "translate.py", "classify.py", "sweep.py", "export.py")
_RECORD_FIELDS = ("measurement", "command", "date", "commit", "machine", "software", "figures")


def _code_files() -> list[str]:
    files = [os.path.join(REPO_ROOT, name) for name in _ENTRY_POINTS if os.path.exists(os.path.join(REPO_ROOT, name))]
    for folder in _CODE_FOLDERS:
        files += sorted(glob.glob(os.path.join(REPO_ROOT, folder, "**", "*.py"), recursive=True))
    return files


def _prose(text: str) -> str:
    """Python source's docstrings and comments: where code would cite a run."""
    tree = ast.parse(text)
    docstrings = [
        ast.get_docstring(node, clean=False) or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    return "\n".join(docstrings + comments)


def test_the_readme_results_table_is_the_one_the_records_make():
    with open(results_table.README, encoding="utf-8") as readme:
        current = readme.read()
    assert results_table.with_table(current, results_table.table()) == current, (
        "README.md's results table is not generated from docs/results/: run python -m benchmarks.results_table"
    )


def test_every_results_row_links_a_record():
    rows = [line for line in results_table.table()[2:] if "docs/results/" in line]
    assert len(rows) >= len(results_table.ROWS)  # At least one record for each kind of measurement.


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(records.RESULTS_DIR, "*.json"))), ids=os.path.basename)
def test_a_record_says_what_ran_where_when_and_at_which_commit(path):
    record = records.read(os.path.basename(path).removesuffix(".json"))
    assert all(record.get(field) is not None for field in _RECORD_FIELDS), [
        f for f in _RECORD_FIELDS if f not in record
    ]
    assert os.path.exists(path.removesuffix(".json") + ".md")


@pytest.mark.parametrize("path", _DOCS, ids=lambda path: os.path.relpath(path, REPO_ROOT))
def test_the_guide_cites_no_commit_or_date(path):
    with open(path, encoding="utf-8") as page:
        text = page.read()
    assert not _COMMIT.findall(text) and not _DATE.findall(text)


@pytest.mark.parametrize("path", _DOCS, ids=lambda path: os.path.relpath(path, REPO_ROOT))
def test_the_guide_links_files_that_exist(path):
    with open(path, encoding="utf-8") as page:
        targets = [target for target, _ in _LINK.findall(page.read()) if "://" not in target]
    missing = [t for t in targets if not os.path.exists(os.path.join(os.path.dirname(path), t))]
    assert not missing


def test_code_says_why_not_when():
    cited = {}
    for path in _code_files():
        with open(path, encoding="utf-8") as source:
            prose = _prose(source.read())
        if found := _COMMIT.findall(prose) + _DATE.findall(prose):
            cited[os.path.relpath(path, REPO_ROOT)] = found
    assert not cited


def test_the_checks_catch_what_they_look_for():
    assert _COMMIT.findall("measured at commit 94797b1 (and 4fe2e45)") == ["94797b1", "4fe2e45"]
    assert not _COMMIT.findall("a trim threshold of 4611686018427387904, page 01060300.html")
    assert _DATE.findall("on 2026-11-25 at 23:57") == ["2026-11-25"]
    prose = _prose('"""Measured on 2026-11-24."""\nx = "94797b1"  # at commit 0dd50a9\n')
    assert _DATE.findall(prose) and _COMMIT.findall(prose) == ["0dd50a9"]  # Not the string's value.
