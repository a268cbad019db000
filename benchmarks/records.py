"""Records of measurements: what ran, on what machine and software, at which commit, and its figures.

A record is `docs/results/<name>.json` and a short Markdown page generated beside it
(`<name>.md`). The README and docs cite records rather than copying figures by hand;
`benchmarks/results_table.py` builds the README's results table from them.

    record = records.new("quick-start", figures={...})
    records.write(record, "docs/results/quickstart_cpu-avx512-bf16", table=["| a | b |", ...])
"""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "docs", "results")

# The packages whose versions change what a measurement of this project means.
DEFAULT_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")

# CPU features that decide how XLA:CPU runs this model's matmuls, most capable first:
# AMX tiles, AVX-512 with bf16 dot products, AVX-512, AVX2.
_CPU_KINDS = (
    ("amx_bf16", "cpu-amx"),
    ("avx512_bf16", "cpu-avx512-bf16"),
    ("avx512f", "cpu-avx512"),
    ("avx2", "cpu-avx2"),
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


def source() -> dict:
    """The commit measured, and whether the working tree differed from it (outside docs/results/)."""
    status = _git("status", "--porcelain", "--", ".", ":(exclude)docs/results")
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted_changes": bool(status) if status is not None else None}


def command() -> str:
    """This process's command line as run from the repository's root (`python -m benchmarks.x ...`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0], REPO_ROOT)]
    return shlex.join(["python", *program, *sys.argv[1:]])


def new(measurement: str, *, figures: dict, packages: Sequence[str] = DEFAULT_PACKAGES, **fields) -> dict:
    """A record of `measurement` run by this process's command, now, on this machine and software.

    `fields` add what the measurement needs beside its figures (a note, its settings, the
    accelerator it ran on); a `machine` field replaces the host's description, and `commit` and
    `uncommitted_changes` taken with `source()` when the measurement began replace those of now.
    """
    return {
        "measurement": measurement,
        "command": command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **source(),
        "machine": fields.pop("machine", None) or machine(),
        "software": software(packages),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **fields,
        "figures": figures,
    }


def write(record: dict, path: str, table: Sequence[str] = ()) -> str:
    """Writes `record` as `path`.json and a Markdown page `path`.md (a header, then `table`); returns the JSON's path.

    Written to a temporary name and renamed, so a record is either whole or absent.
    """
    path = path.removesuffix(".json")
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
