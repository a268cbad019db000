r"""What installing the project costs: site-packages size, and `import train`'s time and memory.

Creates a fresh virtual environment per (checkout, extras), installs the checkout into it as the
README does (`pip install -e .`), then measures `python -c "import train"` in a new process
(wall time, median of --repeats, and peak RSS) and the size of site-packages. Writes a record
(benchmarks/records.py), by default docs/results/install_footprint.

  python -m benchmarks.install_footprint --checkouts=.,/tmp/base --extras=,tensorflow

A checkout may be another worktree or clone (e.g. the commit before a change), so that the
"before" and "after" rows come from one run on one machine.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import records

_CHECKOUTS = flags.DEFINE_list("checkouts", ["."], "Checkouts to install, each into its own environment.")
_EXTRAS = flags.DEFINE_list("extras", [""], "Extras to install with each checkout ('' for none).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Imports timed per environment.")
_OUT = flags.DEFINE_string("out", "docs/results/install_footprint", "Record path, without extension.")

_IMPORT_PROBE = (
    "import resource, sys, time; start = time.perf_counter(); import train; "
    "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
    "'tensorflow' in sys.modules)"
)


def _run(command: list[str], **kwargs) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True, **kwargs).stdout


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def _git(checkout: str, *args: str) -> str:
    try:
        return _run(["git", "-C", checkout, *args]).strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return ""


def _measure(checkout: str, extras: str, scratch: str) -> dict:
    checkout = os.path.abspath(checkout)
    venv = os.path.join(scratch, f"venv_{abs(hash((checkout, extras)))}")
    _run([sys.executable, "-m", "venv", venv])
    python = os.path.join(venv, "bin", "python")
    _run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    target = f"{checkout}[{extras}]" if extras else checkout
    start = time.perf_counter()
    _run([python, "-m", "pip", "install", "--quiet", "-e", target])
    install_seconds = time.perf_counter() - start
    site_packages = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    imports = []
    for _ in range(_REPEATS.value):
        seconds, rss_kb, tensorflow = _run([python, "-c", _IMPORT_PROBE], cwd=checkout).split()
        imports.append((float(seconds), int(rss_kb), tensorflow == "True"))
    packages = {
        p["name"].lower().replace("_", "-") for p in json.loads(_run([python, "-m", "pip", "list", "--format=json"]))
    }
    site_packages_bytes = _folder_bytes(site_packages)
    shutil.rmtree(venv)
    return {
        "checkout": checkout,
        "commit": _git(checkout, "rev-parse", "--short", "HEAD"),
        "extras": extras,
        "install_seconds": round(install_seconds, 1),
        "site_packages_bytes": site_packages_bytes,
        "import_train_seconds_median": round(statistics.median(s for s, _, _ in imports), 3),
        "import_train_peak_rss_bytes": statistics.median(kb for _, kb, _ in imports) * 1024,
        "import_train_loads_tensorflow": imports[0][2],
        "tensorflow_installed": bool(packages & {"tensorflow", "tensorflow-cpu"}),
        "packages": len(packages),
    }


def main(argv):
    del argv
    measured_source = records.source()
    with tempfile.TemporaryDirectory() as scratch:
        rows = [_measure(c, e, scratch) for c in _CHECKOUTS.value for e in _EXTRAS.value]
    record = records.new("install footprint", figures={"rows": rows}, **measured_source)
    table = [
        "| checkout | extras | site-packages | TensorFlow installed | `import train` s (median) | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        table.append(
            f"| {row['commit'] or row['checkout']} | {row['extras'] or '-'} "
            f"| {row['site_packages_bytes'] / 1e9:.2f} GB "
            f"| {'yes' if row['tensorflow_installed'] else 'no'} | {row['import_train_seconds_median']:.2f} "
            f"| {row['import_train_peak_rss_bytes'] / 1e6:.0f} MB |"
        )
    print("\n".join(table))
    print("wrote", records.write(record, _OUT.value, table))


if __name__ == "__main__":
    app.run(main)
