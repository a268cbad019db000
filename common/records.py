"""Records of measurements: what ran, on what machine and software, at which commit, and its figures.

A record is `docs/results/<name>.json` and a short Markdown page generated beside it
(`<name>.md`). The README and docs cite records rather than copying figures by hand;
`benchmarks/results_table.py` builds the README's results table from them.

    record = records.new("quick-start", figures={...})
    records.write(record, "docs/results/quickstart_cpu-avx512-bf16", table=["| a | b |", ...])

A record under docs/results/ is what its command wrote at a commit: `problems` names what keeps a
record from being one (uncommitted changes, a missing command, machine or version, software
outside pyproject.toml's pins with no `software_note` saying why), and `write` refuses such a
record there with one `error:` line; elsewhere (`--output=/tmp/...`, a test) it is written as it
is. Every script that writes records defines `--software_note` with `define_software_note_flag()`,
e.g. for a GPU image whose jax is newer than the pins. The machine, the commit (from git) and the
pins (from pyproject.toml) are read here, so that every record describes them the same way.
"""

import datetime
import importlib.metadata
import json
import operator
import os
import platform
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence

from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "docs", "results")
PYPROJECT = os.path.join(REPO_ROOT, "pyproject.toml")

# The packages whose versions change what a measurement of this project means.
DEFAULT_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
# The fields every record has, filled.
REQUIRED_FIELDS = ("measurement", "command", "date", "commit", "machine", "software", "figures")

_SOFTWARE_NOTE = "software_note"

# CPU features that decide how XLA:CPU runs this model's matmuls, most capable first:
# AMX tiles, AVX-512 with bf16 dot products, AVX-512, AVX2.
_CPU_KINDS = (
    ("amx_bf16", "cpu-amx"),
    ("avx512_bf16", "cpu-avx512-bf16"),
    ("avx512f", "cpu-avx512"),
    ("avx2", "cpu-avx2"),
)


def define_software_note_flag() -> None:
    """Defines --software_note, which `new` records, for a script that writes records; a second call does nothing.

    Called by the script rather than at import, so importing this module defines no flag.
    """
    if _SOFTWARE_NOTE not in flags.FLAGS:
        flags.DEFINE_string(
            "software_note",
            "",
            "Why the software is outside pyproject.toml's pins (a GPU image's jax, say), for the record.",
        )


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_kind(flags: Iterable[str]) -> str:
    """The kind of x86-64 CPU by its matmul features: 'cpu-amx', 'cpu-avx512-bf16', ..., or 'cpu'."""
    flags = set(flags)
    return next((kind for flag, kind in _CPU_KINDS if flag in flags), "cpu")


def machine(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """The host: CPU model and kind, the matmul features it has, cores, memory, OS."""
    info = _cpuinfo(cpuinfo_path)
    flags = info.get("flags", "").split()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    return {
        "cpu_model": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_kind": cpu_kind(flags),
        "cpu_matmul_features": [flag for flag, _ in _CPU_KINDS if flag in flags],
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "system": f"{platform.system()} {platform.release()}",
    }


def software(packages: Sequence[str] = DEFAULT_PACKAGES) -> dict:
    """Python's version and each installed package's (None where it is not installed)."""
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _git(*arguments: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *arguments], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commits_since(commit: str, paths: Sequence[str]) -> int | None:
    """How many commits after `commit` changed `paths`; None where git does not have `commit` (a shallow clone).

    Uncommitted changes to `paths` count as one more commit, so that a count taken before committing them holds after.
    """
    if _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    count = _git("rev-list", "--count", f"{commit}..HEAD", "--", *paths)
    uncommitted = _git("status", "--porcelain", "--", *paths)
    return None if count is None else int(count) + bool(uncommitted)


def is_ancestor(ancestor: str, commit: str) -> bool | None:
    """Whether `ancestor` is `commit` or one of its ancestors; None where git lacks either (a shallow clone)."""
    if any(_git("cat-file", "-e", f"{c}^{{commit}}") is None for c in (ancestor, commit)):
        return None
    # Exit status 1 means 'not an ancestor', which _git cannot tell from an error.
    found = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=REPO_ROOT, timeout=30)
    return found.returncode == 0


def source(*, warn: bool = True) -> dict:
    """The commit measured, and whether the working tree differed from it (outside docs/results/).

    Warns on stderr where it did (unless not `warn`): a record of this run will not be taken under docs/results/.
    """
    status = _git("status", "--porcelain", "--", ".", ":(exclude)docs/results")
    uncommitted = None if status is None else bool(status)
    if uncommitted and warn:
        print("warning: uncommitted changes: this run's record will be refused under docs/results/", file=sys.stderr)
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": uncommitted}


def command() -> str:
    """This process's command line as run from the repository's root (`python -m benchmarks.x ...`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0], REPO_ROOT)]
    return shlex.join(["python", *program, *sys.argv[1:]])


def new(measurement: str, *, figures: dict, packages: Sequence[str] = DEFAULT_PACKAGES, **fields) -> dict:
    """A record of `measurement` run by this process's command, now, on this machine and software.

    `fields` add what the measurement needs beside its figures (a note, its settings, the
    `accelerator` it ran on, see `add_accelerator`); a `machine` field replaces the host's description, and `commit` and
    `uncommitted_changes` taken with `source()` when the measurement began replace those of now.
    `--software_note` (see `define_software_note_flag`), where given, is the record's `software_note`.
    """
    if _SOFTWARE_NOTE in flags.FLAGS and flags.FLAGS.is_parsed() and (note := flags.FLAGS[_SOFTWARE_NOTE].value):
        fields.setdefault(_SOFTWARE_NOTE, note)
    record = {
        "measurement": measurement,
        "command": command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **({} if "commit" in fields else source()),
        "machine": fields.pop("machine", None) or machine(),
        "software": software(packages),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **fields,
        "figures": figures,
    }
    if fields.get("accelerator"):
        add_accelerator(record, fields["accelerator"])
    if found := [problem for problem in problems(record) if problem != "no figures"]:
        print(f"warning: this record will be refused under docs/results/: {'; '.join(found)}", file=sys.stderr)
    return record


def add_accelerator(record: dict, accelerator: dict) -> None:
    """Records the `accelerator` a measurement ran on (benchmarks/accelerator_step.py's description of it).

    A GPU or TPU then names the record's machine; a CPU is described as the host is, model and kind.
    """
    record["accelerator"] = accelerator
    if accelerator["platform"] != "cpu":
        record["machine"]["accelerator"] = f"{accelerator['device_kind']} ({accelerator['platform']})"


# A requirement of pyproject.toml: name, extras, version specifiers, environment marker. Parsed here rather than with
# `packaging`, which the accelerator check's bare GPU images need not have.
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")
_SPECIFIER = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*")
_COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _name(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()


def _release(version: str, length: int) -> tuple[int, ...] | None:
    """`version`'s release numbers padded to `length` ('2.13.0+cpu' -> (2, 13, 0)); None if it has none."""
    if not (found := re.match(r"\d+(?:\.\d+)*", version)):
        return None
    numbers = tuple(int(part) for part in found.group().split("."))
    return numbers + (0,) * (length - len(numbers))


def pins(pyproject: str = PYPROJECT) -> dict[str, list[tuple[str, str]]]:
    """The version specifiers pyproject.toml gives each package (its extras' too) and Python ('python').

    Returns {name: [(operator, version), ...]}, names lower-cased with '-' ('ml-collections').
    Raises:
        ValueError: a specifier this reader does not take ('~=', wildcards).
    """
    with open(pyproject, "rb") as file:
        project = tomllib.load(file)["project"]
    extras = project.get("optional-dependencies", {}).values()
    requirements = [f"python{project['requires-python']}", *project["dependencies"]]
    allowed = {}
    for text in [*requirements, *(requirement for extra in extras for requirement in extra)]:
        name, specifiers = _REQUIREMENT.match(text).groups()
        for specifier in filter(str.strip, specifiers.split(",")):
            if not (found := _SPECIFIER.fullmatch(specifier)):
                raise ValueError(f"pyproject.toml: {text!r}: {specifier!r} is not a specifier records.py reads")
            if found.groups() not in (pin := allowed.setdefault(_name(name), [])):
                pin.append(found.groups())
    return allowed


def outside_pins(versions: dict, allowed: dict[str, list[tuple[str, str]]]) -> list[str]:
    """`versions`' packages whose version the pins in `allowed` exclude, as 'name version (pin)'.

    Release numbers are compared; a local label ('+cpu') is ignored, as pip ignores it against '=='.
    """
    outside = []
    for package, version in versions.items():
        if not version or not (pin := allowed.get(_name(package))):
            continue
        length = max(len(part.split(".")) for part in (version, *(bound for _, bound in pin)))
        release = _release(version, length)
        if release is None or not all(_COMPARE[relation](release, _release(bound, length)) for relation, bound in pin):
            outside.append(f"{package} {version} ({','.join(relation + bound for relation, bound in pin)})")
    return outside


def problems(record: dict, allowed: dict[str, list[tuple[str, str]]] | None = None) -> list[str]:
    """What keeps `record` from being what a command wrote at a clean commit, with known software; [] if nothing.

    `allowed` is the pins the software must be within (default: pyproject.toml's), unless the
    record's `software_note` says why not.
    """
    found = [f"no {field}" for field in REQUIRED_FIELDS if not record.get(field)]
    commit = record.get("commit")
    if commit and not re.fullmatch(r"[0-9a-f]{40}", commit):
        found.append(f"commit {commit!r} is not a full commit hash")
    if record.get("uncommitted_changes") is None:
        found.append("no uncommitted_changes: whether the working tree was clean is unknown")
    elif record["uncommitted_changes"]:
        found.append("written from a working tree with uncommitted changes")
    versions = record.get("software") or {}
    found += [f"no {package} version" for package in ("python", *DEFAULT_PACKAGES) if not versions.get(package)]
    outside = outside_pins(versions, pins() if allowed is None else allowed)
    if outside and not record.get("software_note"):
        found.append(f"software outside pyproject.toml's pins, with no software_note saying why: {', '.join(outside)}")
    return found


def write(record: dict, path: str, table: Sequence[str] = (), results_dir: str = RESULTS_DIR) -> str:
    """Writes `record` as `path`.json and a Markdown page `path`.md (a header, then `table`); returns the JSON's path.

    Written to a temporary name and renamed, so a record is either whole or absent. Under
    `results_dir`, a record with `problems` is refused: one `error:` line, exit status 2.
    """
    path = path.removesuffix(".json")
    inside = os.path.commonpath([os.path.abspath(path), os.path.abspath(results_dir)]) == os.path.abspath(results_dir)
    if inside and (found := problems(record)):
        print(f"error: not written to {path}.json: {'; '.join(found)}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    machine_line = record["machine"].get("accelerator") or (
        f"{record['machine']['cpu_model']} ({record['machine']['cpu_kind']}), {record['machine']['cores']} cores"
    )
    commit = (record.get("commit") or "unknown")[:12] + (
        " with uncommitted changes" if record.get("uncommitted_changes") else ""
    )
    page = [
        f"# {record['measurement']}",
        "",
        f"- command: `{record['command']}`",
        f"- machine: {machine_line}",
        "- software: " + ", ".join(f"{name} {version}" for name, version in record["software"].items() if version),
        f"- date: {record['date']}, commit {commit}",
        "",
        *table,
        "",
        f"Generated from [{os.path.basename(path)}.json]({os.path.basename(path)}.json).",
    ]
    for suffix, text in ((".json", json.dumps(record, indent=2) + "\n"), (".md", "\n".join(page) + "\n")):
        with open(path + suffix + ".tmp", "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(path + suffix + ".tmp", path + suffix)
    return path + ".json"


def read(name: str, results_dir: str = RESULTS_DIR) -> dict:
    """The record `name` (its file name without .json) from `results_dir`."""
    with open(os.path.join(results_dir, name + ".json"), encoding="utf-8") as record:
        return json.load(record)
