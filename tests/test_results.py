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


@pytest.mark.parametrize("row", results_table.ROWS, ids=lambda row: row.records)
def test_every_kind_of_result_has_a_record_in_the_table(row):
    lines = [line for line in results_table.table() if line.startswith(f"| {row.what} |")]
    assert lines and all("](docs/results/" in line for line in lines)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(records.RESULTS_DIR, "*.json"))), ids=os.path.basename)
def test_a_record_says_what_ran_where_when_and_at_which_commit(path):
    record = records.read(os.path.basename(path).removesuffix(".json"))
    assert all(record.get(field) is not None for field in _RECORD_FIELDS), [
        f for f in _RECORD_FIELDS if record.get(f) is None
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
    # Made-up citations, built here so that this file cites none itself.
    first, second, date = "dead" + "b33f", "c0ffee" + "1", "-".join(("2000", "01", "31"))
    assert _COMMIT.findall(f"measured at commit {first} (and {second})") == [first, second]
    assert not _COMMIT.findall("a trim threshold of 4611686018427387904, page 01060300.html")
    assert _DATE.findall(f"on {date} at 23:57") == [date]
    prose = _prose(f'"""Measured on {date}."""\nx = "{first}"  # at commit {second}\n')
    assert _DATE.findall(prose) == [date] and _COMMIT.findall(prose) == [second]  # Not the string's value.
