"""Figures are records: the README's results table comes from docs/results/, and no prose cites a commit or a date.

The records under docs/results/ carry the command, machine, software, date and commit of each
measurement (common/records.py), and each is what its command wrote at a clean commit with
software within pyproject.toml's pins (or a note saying why not); the README and docs link them
instead of copying figures, and the code says why, not when.
"""

import ast
import fnmatch
import glob
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO_ROOT
from packaging.requirements import Requirement  # pytest's dependency: the judge of records.py's reading of pins.
from packaging.utils import canonicalize_name

from benchmarks import results_table
from common import records

# A commit hash as prose cites one: 7 to 40 hex digits, at least one letter and one digit.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# A measured figure: a duration, a speed, a ratio, a percentage with decimals, a score. Settings (d_model 256, 4,000
# warm-up steps) and facts (glibc's 32 MiB threshold) are not matched. '4 min 46 s' is one figure.
_FIGURE = re.compile(
    r"\d+ min \d+ s\b"
    r"|\d(?:[\d,]*\.\d+|[\d,]*)(?:×| ?ms\b| s\b| seconds\b| min\b| minutes\b| hours?\b| ?tokens/s| ?subwords/s)"
    r"|\d+\.\d+%|\b(?:BLEU|chrF|NLL|MFU|accuracy|macro-F1|perplexity) \d+(?:\.\d+)?"
)
# A number as prose and records write it: '1,509', '24.70', '236.4'.
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
# A link to a record, from docs/ or from the README: its name.
_RECORD_LINK = re.compile(r"\]\((?:docs/)?results/([\w.-]+)\.(?:md|json)[)#]")
_FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")

_DOCS = [os.path.join(REPO_ROOT, "README.md"), *sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))]
_CODE_FOLDERS = ("common", "configs", "models", "input_pipeline", "training", "sweeps", "benchmarks", "scripts")
_ENTRY_POINTS = ("train.py", "translate.py", "classify.py", "sweep.py", "export.py")
_RECORDS = sorted(glob.glob(os.path.join(records.RESULTS_DIR, "**", "*.json"), recursive=True))

# Records written before the check below existed, which it rejects: each is to be written again by its command at a
# clean commit (on a GPU image outside the pins, with --software_note saying why), then taken off this list.
_TO_REGENERATE = {
    "accelerator_check_base_big_gpu",  # jax 0.11.2 and orbax-checkpoint 0.12.4, outside the pins, with no note.
    "accelerator_check_copy_lr_gpu",  # The same.
}


def _code_files() -> list[str]:
    files = [os.path.join(REPO_ROOT, name) for name in _ENTRY_POINTS if os.path.exists(os.path.join(REPO_ROOT, name))]
    for folder in _CODE_FOLDERS:
        files += sorted(glob.glob(os.path.join(REPO_ROOT, folder, "**", "*.py"), recursive=True))
    return files


def _record_writers() -> list[str]:
    """The programs that make records (call `records.new`)."""
    writers = []
    for path in _code_files():
        with open(path, encoding="utf-8") as source:
            if "records.new(" in source.read() and path != records.__file__:
                writers.append(path)
    return writers


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


def test_the_readme_results_table_and_the_records_page_are_the_ones_the_records_make():
    for path, text in results_table.generated().items():
        with open(path, encoding="utf-8") as current:
            assert current.read() == text, (
                f"{path} is not generated from docs/results/: python -m benchmarks.results_table"
            )


def _platforms(pattern: str) -> set[str]:
    """The platforms of the records named by `pattern` that pass the records check."""
    named = [os.path.basename(path)[: -len(".json")] for path in _RECORDS]
    passing = [records.read(name) for name in fnmatch.filter(named, pattern) if name not in _TO_REGENERATE]
    # A GPU names the record's machine: 'NVIDIA H200 (gpu)'.
    return {re.search(r"\((\w+)\)$", r["machine"].get("accelerator") or "(cpu)").group(1) for r in passing}


@pytest.mark.parametrize("row", results_table.ROWS, ids=lambda row: row.records)
def test_every_kind_of_result_has_a_row_a_platform_in_the_table_or_is_named_as_left_out(row):
    lines = results_table.table()
    rows = [line for line in lines if line.startswith(f"| {row.what} |")]
    left_out = [name for name in _TO_REGENERATE if fnmatch.fnmatch(name, row.records) and f"[{name}]" in lines[-1]]
    assert (rows and all("](docs/results/" in line for line in rows)) or left_out
    assert len(rows) == len(_platforms(row.records))  # One a platform: 'cpu' whatever its kind, 'gpu'.


def test_every_record_is_linked_from_the_records_page_which_the_readme_links():
    page = "\n".join(results_table.page())
    unlinked = [p for p in _RECORDS if f"](results/{os.path.relpath(p, records.RESULTS_DIR)[:-5]}.md)" not in page]
    assert not unlinked
    assert "[docs/records.md](docs/records.md)" in "\n".join(results_table.table())


@pytest.mark.parametrize("path", _RECORDS, ids=lambda path: os.path.relpath(path, records.RESULTS_DIR))
def test_a_record_is_what_its_command_wrote_at_a_clean_commit(path):
    name = os.path.relpath(path, records.RESULTS_DIR).removesuffix(".json")
    problems = records.problems(records.read(name))
    if name in _TO_REGENERATE:
        assert problems, f"{name} passes the check now: take it off _TO_REGENERATE"
    else:
        assert not problems
    assert os.path.exists(path.removesuffix(".json") + ".md")


def test_the_records_to_regenerate_exist():
    assert not _TO_REGENERATE - {os.path.relpath(p, records.RESULTS_DIR).removesuffix(".json") for p in _RECORDS}


def _lowest_allowed(pin) -> str:
    """The lowest version a pin such as '>=0.10.2,<0.11' or '==2.13.0' allows."""
    return next(version for operator, version in pin if operator in (">=", "=="))


def _clean_record() -> dict:
    """A record as records.new writes one at a clean commit, with software at the pins' lowest versions."""
    pins = records.pins()
    software = {package: _lowest_allowed(pins[package]) for package in ("python", "jax", "flax", "optax", "numpy")}
    software |= {"orbax-checkpoint": _lowest_allowed(pins["orbax-checkpoint"]), "jaxlib": software["jax"]}
    return {
        "measurement": "a synthetic measurement",
        "command": "python -m benchmarks.example --steps=3",
        "date": "-".join(("2000", "01", "31")) + "T00:00:00+00:00",
        "commit": "0123456789abcdef" * 2 + "01234567",
        "uncommitted_changes": False,
        "machine": {"cpu_model": "a CPU", "cpu_kind": "cpu-avx2", "cores": 2},
        "software": software | {"torch": _lowest_allowed(pins["torch"]) + "+cpu"},  # A local label is within '=='.
        "figures": {"seconds": 1.0},
    }


def test_a_record_written_at_a_clean_commit_passes_and_is_written_under_the_results(tmp_path):
    record = _clean_record()
    assert records.problems(record) == []
    records.write(record, str(tmp_path / "example"), ["| a |"], results_dir=str(tmp_path))
    assert records.read("example", str(tmp_path)) == record


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"uncommitted_changes": True}, "written from a working tree with uncommitted changes"),
        ({"uncommitted_changes": None}, "whether the working tree was clean is unknown"),
        ({"command": ""}, "no command"),
        ({"command": None}, "no command"),
        ({"machine": None}, "no machine"),
        ({"commit": "0123456"}, "is not a full commit hash"),
        ({"software": {"python": "3.11.7"}}, "no jax version"),
        ({"software": None}, "no software"),
        ({"software": {**_clean_record()["software"], "jax": "0.11.2"}}, "outside pyproject.toml's pins"),
        ({"software": {**_clean_record()["software"], "torch": "2.14.0"}}, "torch 2.14.0"),
        ({"software": {**_clean_record()["software"], "python": "3.10.12"}}, "python 3.10.12"),
    ],
    ids=lambda value: str(value)[:40],
)
def test_the_check_rejects_a_record_that_is_not_what_a_command_wrote_at_a_commit(tmp_path, capsys, change, problem):
    record = _clean_record() | change
    assert any(problem in found for found in records.problems(record)), records.problems(record)
    with pytest.raises(SystemExit) as refused:  # Not under docs/results/.
        records.write(record, str(tmp_path / "results" / "example"), results_dir=str(tmp_path / "results"))
    assert refused.value.code == 2 and not os.path.exists(tmp_path / "results" / "example.json")
    message = capsys.readouterr().err
    assert message.startswith("error: not written to ") and problem in message and message.count("\n") == 1


def test_a_record_from_uncommitted_changes_is_written_elsewhere_and_says_so(tmp_path):
    """A test's or a development run's --output outside docs/results/."""
    record = _clean_record() | {"uncommitted_changes": True}
    records.write(record, str(tmp_path / "elsewhere" / "example"), results_dir=str(tmp_path / "results"))
    assert records.read("example", str(tmp_path / "elsewhere"))["uncommitted_changes"] is True
    assert "with uncommitted changes" in (tmp_path / "elsewhere" / "example.md").read_text()


def test_software_outside_the_pins_passes_where_the_record_says_why():
    record = _clean_record()
    record["software"] |= {"jax": "0.11.2", "jaxlib": "0.11.2"}
    assert records.problems(record)
    assert records.problems(record | {"software_note": "the GPU image's jax; the pins' has no wheel there"}) == []


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


def _record_text(name: str) -> str:
    """docs/results/<name>.md and .json, one after the other ('' for a record that does not exist)."""
    paths = [os.path.join(records.RESULTS_DIR, f"{name}.{ext}") for ext in ("md", "json")]
    return "\n".join(open(path, encoding="utf-8").read() for path in paths if os.path.exists(path))


def _figure_value(figure: str) -> tuple[float, float]:
    """The number a figure states, and half its last digit (how far the record's may be before rounding).

    Durations in minutes or hours are in seconds, as records keep them: '4 min 46 s' is 286 s give or take
    0.5, 'about 7 minutes' 420 s give or take 30. '1,509 subwords/s' is 1509 give or take 0.5; 'BLEU 24.70'
    24.7 give or take 0.005.
    """
    if minutes_seconds := re.fullmatch(r"(\d+) min (\d+) s", figure):
        return 60 * int(minutes_seconds[1]) + int(minutes_seconds[2]), 0.5
    number = _NUMBER.search(figure.split(" ", 1)[1] if figure[0].isalpha() else figure)[0].replace(",", "")
    half_digit = 0.5 * 10.0 ** -len(number.partition(".")[2])
    unit = 3600 if re.search(r" hours?$", figure) else 60 if re.search(r" min(utes)?$", figure) else 1
    return float(number) * unit, half_digit * unit


def _unheld_figures(text: str, record_text=_record_text) -> list[str]:
    """The measured figures of a page that no record linked from their paragraph, or the one introducing it, holds.

    A record holds a figure where its Markdown or JSON has a number that rounds to it (thousands separators
    dropped; durations in minutes compared in seconds). Each found figure comes with its paragraph's start.
    """
    paragraphs = re.split(r"\n\s*\n", _FENCED.sub("", text))
    unheld = []
    for before, paragraph in zip(["", *paragraphs], paragraphs, strict=False):
        figures = _FIGURE.findall(paragraph)
        if not figures:
            continue
        held = [
            float(n.replace(",", ""))
            for name in _RECORD_LINK.findall(before + paragraph)
            for n in _NUMBER.findall(record_text(name))
        ]
        for figure in figures:
            value, tolerance = _figure_value(figure)
            if not any(abs(number - value) <= tolerance * (1 + 1e-9) for number in held):
                unheld.append(f"{figure!r} in {' '.join(paragraph.split())[:80]!r}...")
    return unheld


@pytest.mark.parametrize("path", _DOCS[1:], ids=lambda path: os.path.relpath(path, REPO_ROOT))
def test_a_figure_in_the_docs_is_in_the_record_its_paragraph_links(path):
    with open(path, encoding="utf-8") as page:
        assert not _unheld_figures(page.read())


def test_the_figure_check_finds_a_figure_no_linked_record_holds():
    record = {"x": "| base | 44.21 | 22.0% | 1,509 | 236.4 |\n", "y": '{"wall_seconds": 418.2}'}.get
    cited = "On one H100 ([record](results/x.md)):\n\n- base: 44.2 ms a step, MFU 22.0%, 1509 subwords/s.\n"
    assert not _unheld_figures(cited, record)
    assert not _unheld_figures("All of it in 3 min 56 s ([record](docs/results/x.json)).", record)
    assert not _unheld_figures("About 7 minutes ([record](results/y.md)).", record)
    assert _unheld_figures("About 8 minutes ([record](results/y.md)).", record)
    assert _unheld_figures("MFU 22.0%, 44.3 ms a step ([record](results/x.md)).", record) == [
        "'44.3 ms' in 'MFU 22.0%, 44.3 ms a step ([record](results/x.md)).'..."
    ]
    assert _unheld_figures("One record under docs/results/: 44.2 ms a step.", record)  # Named, not linked.
    assert _unheld_figures(
        "Probes found no bug.\n\nOn one H100 it passed in 1,500 steps\n(NLL 10.79 → 1.07).\n", record
    )
    assert _unheld_figures("Greedy decoding: 6.0 s against 6.2 s (1.03×).", record)
    assert not _unheld_figures(
        "d_model 256, 4 heads, 4,000 warm-up steps; buffers above 32 MiB; 92% of memory.", record
    )


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


def test_a_record_keeps_the_software_note_its_command_was_given():
    script = (
        "import sys; from absl import flags; from common import records; records.define_software_note_flag(); "
        "records.define_software_note_flag(); flags.FLAGS(sys.argv); "  # Twice: as two modules of one script may.
        "print(records.new('m', figures={'a': 1})['software_note'])"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, "--software_note=the image's jax"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert run.stdout == "the image's jax\n"


def test_importing_the_records_module_defines_no_flag():
    script = "from absl import flags; import common.records; print(sorted(flags.FLAGS))"
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "software_note" not in run.stdout


# Being rewritten elsewhere; it defines the flag with its rewrite, then leaves this set.
def test_every_script_that_writes_records_takes_a_software_note():
    """A GPU image's jax is outside the pins: without --software_note its record would be refused."""
    missing = []
    for path in _record_writers():
        with open(path, encoding="utf-8") as source:
            if "records.define_software_note_flag()" not in source.read():
                missing.append(os.path.relpath(path, REPO_ROOT))
    assert not missing, missing


@pytest.mark.parametrize("version", ["0.9.9", "0.10.1", "0.10.2", "0.10.10", "0.11", "0.11.0", "2.13.0+cpu", "2.14"])
def test_the_pins_are_read_as_pip_reads_them(version):
    """records.py reads pyproject.toml without `packaging` (bare GPU images lack it); here packaging is the judge."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as file:
        project = tomllib.load(file)["project"]
    specifiers = {}
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        specifiers[name] = specifiers.get(name, requirement.specifier) & requirement.specifier
    pins = records.pins()
    for name, specifier in specifiers.items():
        pip_allows = specifier.contains(version, prereleases=True)
        assert (not records.outside_pins({name: version}, pins)) == pip_allows, (name, version, str(specifier))


def test_the_decoding_cell_shows_the_engines_and_searches_its_record_has():
    """A record of this project alone, greedy alone: no CTranslate2 and no beam 4."""
    row = {"engine": "this project, auto", "beam_size": 1, "output_subwords_per_second": 1234.4}
    assert results_table._decode_speed({"rows": [row]}) == "output subwords/s, greedy: ours 'auto' 1,234"
    ct2 = {"engine": "CTranslate2, float32", "beam_size": 4, "output_subwords_per_second": 99.0}
    cell = results_table._decode_speed({"rows": [row, ct2]})
    assert cell == "output subwords/s, greedy / beam 4: ours 'auto' 1,234 / -; CTranslate2 float32 - / 99"


def test_the_decoding_cell_compares_matching_dtypes_and_whole_processes():
    rows = [
        {"engine": engine, "beam_size": 1, "output_subwords_per_second": speed}
        for engine, speed in (
            ("this project, auto", 2000.0),
            ("this project, float32", 1000.0),
            ("CTranslate2, float32", 900.0),
        )
    ]
    startup = {
        "float32: whole split cached, beam 1, over CTranslate2 float32's": 1.234,
        "float32: one line, cached, less the bare imports (s)": 0.87,
        "auto: whole split cached, beam 1, over CTranslate2 float32's": 1.1,
    }
    cell = results_table._decode_speed({"rows": rows, "startup": startup})
    assert cell == (
        "output subwords/s, greedy: ours float32 1,000; CTranslate2 float32 900; whole processes, cached, greedy: "
        "1.23× CTranslate2's time; one line 0.9 s over the bare imports"
    )


def _results_with(tmp_path, name: str, record: dict) -> str:
    """A results folder holding `record` as `name`."""
    folder = tmp_path / "results"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(record))
    return str(folder)


def test_a_record_with_problems_gets_no_row(tmp_path):
    record = records.read("quickstart_cpu-avx512-bf16") | {"uncommitted_changes": True}
    folder = _results_with(tmp_path, "quickstart_cpu-avx512-bf16", record)
    lines = results_table.table(folder)
    assert not [line for line in lines if "[quickstart_cpu-avx512-bf16]" in line and line.startswith("| ")]
    assert "uncommitted changes" in lines[-1] and "[quickstart_cpu-avx512-bf16]" in lines[-1]  # Named below.
    clean = _results_with(tmp_path, "quickstart_cpu-avx512-bf16", record | {"uncommitted_changes": False})
    assert sum(line.startswith("| quick-start") for line in results_table.table(clean)) == 2


def test_a_failed_check_is_shown_failed():
    figures = records.read("accelerator_check_base_big_gpu")["figures"]  # The copy check failed for both sizes.
    row = next(row for row in results_table.ROWS if row.result is results_table._accelerator)
    assert results_table._result(row, figures).startswith("FAILED (base copy, big copy): target tokens/s")
    workflow = records.read("workflow_check_gpu")["figures"]
    row = next(row for row in results_table.ROWS if row.result is results_table._workflow)
    assert results_table._result(row, workflow).startswith("every phase passed")
    assert results_table._result(row, workflow | {"passed": False}).startswith("FAILED: ran in ")


def _table3_variant(diffs: dict, holm: dict) -> dict:
    """A Table 3 record's variant: each seed's Δ BLEU to the base and its Holm-adjusted p-value."""
    return {
        "runs_finished": len(diffs),
        "runs_planned": 3,
        "test_bleu_diff": {"mean": sum(diffs.values()) / len(diffs)},
        "test_bleu_diff_by_seed": diffs,
        "test_bleu_holm_p_values": holm,
        "test_bleu_significant_seeds_after_holm": sum(p < 0.05 for p in holm.values()),
    }


def test_the_table3_row_names_differences_in_every_seed_apart_from_those_in_some_or_of_opposite_signs():
    base = {"runs_finished": 3, "runs_planned": 3, "test_bleu": {"mean": 14.0, "std": 0.5}}
    figures = {
        "significance_level": 0.05,
        "variants": {
            "base": base,
            "every": _table3_variant({"0": -1.0, "1": -2.0, "2": -3.0}, {"0": 0.01, "1": 0.01, "2": 0.02}),
            "opposite": _table3_variant({"0": 1.5, "1": 0.1, "2": -1.5}, {"0": 0.01, "1": 0.9, "2": 0.01}),
            # Its one unsurvived seed goes the other way: its survivors agree, so no "opposite signs".
            "one": _table3_variant({"0": 0.3, "1": -0.6, "2": 0.9}, {"0": 1.0, "1": 1.0, "2": 0.01}),
            "none": _table3_variant({"0": 0.2, "1": 0.1, "2": -0.3}, {"0": 1.0, "1": 1.0, "2": 1.0}),
            "one_seed": _table3_variant({"0": 0.5}, {"0": 0.01}),  # A partial ledger: seeds 1 and 2 not run.
            "all_opposite": _table3_variant({"0": 1.0, "1": -1.0, "2": 2.0}, {"0": 0.01, "1": 0.01, "2": 0.01}),
        },
    }
    row = results_table._table3(figures)
    every, some = row.split("; in some seeds or opposite ways (seeds where it does / seeds compared): ")
    assert every.endswith("in every seed compared: every -2.00, one_seed +0.50 (1/1)")
    assert (
        some == "opposite +0.03 (2/3, of opposite signs), one +0.20 (1/3), all_opposite +0.67 (3/3, of opposite signs)"
    )
    assert row.startswith("19 of 21 runs (partial); base test BLEU 14.00 ± 0.50;")


def _git(folder, *arguments: str) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *arguments]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, check=True).stdout.strip()


def _repository(tmp_path, monkeypatch):
    """A repository in `tmp_path`, which records' git questions ask, with a commit of models/search.py and README.md;
    returns its folder and that commit."""
    repository = tmp_path / "repository"
    (repository / "models").mkdir(parents=True)
    (repository / "models" / "search.py").write_text("a = 1\n")
    (repository / "README.md").write_text("a\n")
    _git(repository, "init", "-q")
    _git(repository, "add", ".")
    _git(repository, "commit", "-qm", "measured")
    monkeypatch.setattr(records, "REPO_ROOT", str(repository))
    return repository, _git(repository, "rev-parse", "HEAD")


def _link_cell(folder: str, name: str) -> str:
    """The record cell of `name`'s row in the README's table made from `folder`."""
    (line,) = [line for line in results_table.table(folder) if f"[{name}]" in line]
    return line.split(" | ")[-1].removesuffix(" |")


def test_a_record_is_marked_when_its_measured_code_changed_after_its_commit(tmp_path, monkeypatch):
    """decode_speed measures models/: a later commit there marks it, one to the README does not."""
    repository, measured = _repository(tmp_path, monkeypatch)
    (repository / "README.md").write_text("b\n")
    _git(repository, "commit", "-qam", "not measured code")
    record = records.read("decode_speed_gpu") | {"commit": measured}
    folder = _results_with(tmp_path, "decode_speed_gpu", record)

    def link_cell() -> str:
        return _link_cell(folder, "decode_speed_gpu")

    assert "older code" not in link_cell()
    (repository / "models" / "search.py").write_text("a = 2\n")
    assert "measured on older code: 1 later commit changed it" in link_cell()  # Uncommitted: one commit to come.
    _git(repository, "commit", "-qam", "measured code")
    assert "measured on older code: 1 later commit changed it" in link_cell()
    (repository / "models" / "search.py").write_text("a = 3\n")
    _git(repository, "commit", "-qam", "measured code again")
    assert "measured on older code: 2 later commits changed it" in link_cell()
    _results_with(tmp_path, "decode_speed_gpu", record | {"commit": "0123456789abcdef" * 2 + "01234567"})
    assert "not in this clone's history" in link_cell()


def test_a_record_measured_before_a_landmark_says_so(tmp_path, monkeypatch):
    """A landmark names a commit that replaced measured code, and the records it concerns."""
    repository, measured = _repository(tmp_path, monkeypatch)
    (repository / "models" / "search.py").write_text("a = 2\n")
    _git(repository, "commit", "-qam", "the search replaced")
    replaced = _git(repository, "rev-parse", "HEAD")
    landmark = results_table.Landmark(replaced, "before the new search", ("decode_speed_*", "export_agreement_*"))
    monkeypatch.setattr(results_table, "LANDMARKS", (landmark,))
    folder = _results_with(tmp_path, "decode_speed_gpu", records.read("decode_speed_gpu") | {"commit": measured})
    assert _link_cell(folder, "decode_speed_gpu").endswith(
        "; measured before the new search; measured on older code: 1 later commit changed it"
    )
    _results_with(tmp_path, "decode_speed_gpu", records.read("decode_speed_gpu") | {"commit": replaced})
    assert "before" not in _link_cell(folder, "decode_speed_gpu")  # Measured at the landmark: its code is today's.
    unknown = "0123456789abcdef" * 2 + "01234567"
    _results_with(tmp_path, "decode_speed_gpu", records.read("decode_speed_gpu") | {"commit": unknown})
    assert "before" not in _link_cell(folder, "decode_speed_gpu")  # Not in this clone's history: unknown.
    classify = records.read("classify_cpu-avx512-bf16") | {"commit": measured}  # A record the landmark is not of.
    _results_with(tmp_path, "classify_cpu-avx512-bf16", classify)
    assert "older code" in _link_cell(folder, "classify_cpu-avx512-bf16")
    assert "before" not in _link_cell(folder, "classify_cpu-avx512-bf16")


def test_the_landmarks_name_the_commit_that_replaced_the_code_and_records_that_exist():
    (continuous_batching,) = results_table.LANDMARKS
    if records.is_ancestor(continuous_batching.commit, "HEAD") is None:
        pytest.skip("a clone without the landmark's commit (shallow)")
    added = ["log", "--diff-filter=A", "--format=%H", "--", "models/continuous_batching.py"]
    assert _git(REPO_ROOT, *added) == continuous_batching.commit
    names = [os.path.basename(path)[: -len(".json")] for path in _RECORDS]
    assert all(fnmatch.filter(names, pattern) for pattern in continuous_batching.records)


def test_two_cpu_kinds_give_one_readme_row_the_fresher_and_the_records_page_lists_both(tmp_path, monkeypatch):
    """By date, whatever the names' order; of one date, the record of the later commit."""
    repository, first = _repository(tmp_path, monkeypatch)
    _git(repository, "commit", "-q", "--allow-empty", "-m", "second")
    second = _git(repository, "rev-parse", "HEAD")
    older, newer = (f"{'-'.join(('2000', '01', day))}T00:00:00+00:00" for day in ("30", "31"))

    def shown(avx2: dict, avx512: dict) -> tuple[list[str], list[str]]:
        """The records of the decoding rows, of the README's table and of the records page, with these changes."""
        for name, change in (("decode_speed_cpu-avx2", avx2), ("decode_speed_cpu-avx512-bf16", avx512)):
            folder = _results_with(tmp_path, name, records.read(name) | change)
        readme, page = (
            [line.split(" | ")[-1].split("]")[0].removeprefix("[") for line in lines if line.startswith("| decoding")]
            for lines in (results_table.table(folder), results_table.page(folder))
        )
        return readme, page

    readme, page = shown({"date": older}, {"date": newer})
    assert readme == ["decode_speed_cpu-avx512-bf16"]
    assert page == ["decode_speed_cpu-avx512-bf16", "decode_speed_cpu-avx2"]  # Both, the fresher first.
    assert shown({"date": newer}, {"date": older}) == (["decode_speed_cpu-avx2"], page[::-1])
    assert shown({"date": newer, "commit": first}, {"date": newer, "commit": second})[0] == [page[0]]
    assert shown({"date": newer, "commit": second}, {"date": newer, "commit": first})[0] == [page[1]]
    _results_with(tmp_path, "decode_speed_gpu", records.read("decode_speed_gpu") | {"date": older})
    assert shown({"date": older}, {"date": newer})[0] == ["decode_speed_cpu-avx512-bf16", "decode_speed_gpu"]


def _project_imports(path: str, leave_out: str = "") -> list[str]:
    """The statements of `path` (its functions' too, but function `leave_out`'s) that import this project's modules."""
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as source:
        tree = ast.parse(source.read())
    skipped = {node for f in ast.walk(tree) if getattr(f, "name", None) == leave_out for node in ast.walk(f)}
    statements = []
    for node in ast.walk(tree):
        if node in skipped or not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        names = [node.module] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
        tops = [os.path.join(REPO_ROOT, name.split(".")[0]) for name in names if name]  # Not `from . import`.
        if any(os.path.isdir(top) or os.path.exists(top + ".py") for top in tops):
            statements.append(ast.unparse(node))
    return statements


def _loaded_files(statements: list[str]) -> set[str]:
    """The repository's files that running `statements` loads, but packages holding a docstring alone (no code to
    measure) and common/records.py (writing a record is not what it measures)."""
    script = "\n".join(
        [*statements, "import sys", "print(*(getattr(m, '__file__', None) for m in sys.modules.values()))"]
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    found = set()
    for path in run.stdout.split():
        if not os.path.isabs(path) or os.path.commonpath([path, REPO_ROOT]) != REPO_ROOT or "site-packages" in path:
            continue  # Not the project's: another folder, or a virtual environment inside the checkout (.venv).
        with open(path, encoding="utf-8") as source:
            body = ast.parse(source.read()).body
        if not all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body):
            found.add(os.path.relpath(path, REPO_ROOT))
    return found - {"common/records.py"}


# What each decoding program runs, as import statements: translate.py's, where the program runs it (decode_speed
# without asking for attention maps); the program's own, where it decodes in its process.
_RUNS = {
    "benchmarks.decode_speed": lambda: ["import translate", *_project_imports("translate.py", "_draw_attention_maps")],
    "benchmarks.workflow_check": lambda: ["import translate", *_project_imports("translate.py")],
    "benchmarks.attention_page": lambda: ["import translate", *_project_imports("translate.py")],
    "benchmarks.export_agreement": lambda: _project_imports("benchmarks/export_agreement.py"),
}


@pytest.mark.parametrize("program", _RUNS)
def test_every_module_a_decoding_program_runs_lies_on_its_measured_paths(program):
    """A change to any of them marks the program's records as measured on older code."""
    paths = [path for path in results_table.MEASURED_PATHS[program] if not path.startswith(":(")]
    loaded = _loaded_files(_RUNS[program]())
    assert {"models/continuous_batching.py", "training/inference.py", "input_pipeline/text_lines.py"} <= loaded
    outside = [f for f in loaded if not any(f == path or (path.endswith("/") and f.startswith(path)) for path in paths)]
    assert not outside


def test_every_program_that_writes_records_declares_the_code_it_measures():
    writers = {os.path.relpath(path, REPO_ROOT).removesuffix(".py").replace(os.sep, ".") for path in _record_writers()}
    assert writers == set(results_table.MEASURED_PATHS)
    for paths in results_table.MEASURED_PATHS.values():
        missing = [p for p in paths if not p.startswith(":(") and not os.path.exists(os.path.join(REPO_ROOT, p))]
        assert not missing
    programs = {results_table._program(records.read(os.path.basename(p)[:-5])["command"]) for p in _RECORDS}
    assert programs <= set(results_table.MEASURED_PATHS)
