r"""The test suite timed as contributors and CI run it: the fast tier, then the whole suite, each alone.

  AIAYN_REQUIRE_BROWSER=1 python -m benchmarks.test_tiers --output=docs/results/test_tiers_cpu-amx

Runs the README's test command (`pytest -q -n 2 --dist loadfile`) with `-m "not slow"` (the
fast tier, what to run while working), then without (everything), one after the other on an
otherwise quiet machine, each cold as on CI's fresh machine: in a HOME of its own (the entry
points keep their compiled programs in ~/.cache) and with an empty pytest cache folder (where the
tests keep theirs, tests/conftest.py). Then the fast tier again, with the programs the whole
suite left, as a contributor meets it after a first run. The user's own caches are not touched.
Records each run's wall time, outcome and slowest tests (setup, call and teardown together, read
from pytest's JUnit XML by .ci/test_times.py), and the fast-tier tests over .ci/run's 10 s limit.
"""

import json
import os
import runpy
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from common import records

records.define_software_note_flag()

_OUTPUT = flags.DEFINE_string("output", None, "Record path without suffix, e.g. docs/results/test_tiers_cpu-amx.")
_SLOWEST = flags.DEFINE_integer("slowest", 20, "How many of each run's slowest tests to record.")

TEST_ARGUMENTS = ["-q", "-n", "2", "--dist", "loadfile"]  # The README's.
FAST_TIER = ["-m", "not slow"]
# Each run's pytest arguments, and whether it starts cold (with empty caches; else with those the run before left).
TIERS = {"fast tier": (FAST_TIER, True), "whole suite": ([], True), "fast tier, warm": (FAST_TIER, False)}
FAST_TIER_LIMIT_S = 10  # .ci/run fails a fast-tier test over it.

_TEST_TIMES = runpy.run_path(os.path.join(records.REPO_ROOT, ".ci", "test_times.py"))
read_times, read_failures = _TEST_TIMES["read_times"], _TEST_TIMES["read_failures"]


def _run(arguments: list[str], junit_xml: str, caches: str) -> dict:
    """pytest with the README's arguments and `arguments`, timed, with HOME and pytest's cache in `caches`."""
    command = [*TEST_ARGUMENTS, *arguments]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", f"cache_dir={caches}/pytest", *command, f"--junitxml={junit_xml}"],
        cwd=records.REPO_ROOT,
        env=dict(os.environ, HOME=caches),
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - started
    _, tests = read_times(junit_xml)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    return {
        "command": shlex.join(["pytest", *command]),
        "wall_seconds": round(wall, 1),
        "tests": len(tests),
        "passed": done.returncode == 0,
        "failed": read_failures(junit_xml),
        "summary": summary,
        "slowest": [[round(seconds, 1), test] for seconds, test in tests[: _SLOWEST.value]],
        "over_limit": [[round(s, 1), test] for s, test in tests if s > FAST_TIER_LIMIT_S]
        if arguments == FAST_TIER
        else None,
    }


def main(argv):
    del argv
    source = records.source()
    figures, caches = {}, None
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, (arguments, cold)) in enumerate(TIERS.items()):
            caches = tempfile.mkdtemp(dir=folder) if cold else caches
            figures[name] = {**_run(arguments, os.path.join(folder, f"{i}.xml"), caches), "cold": cold}
    figures["require_browser"] = os.environ.get("AIAYN_REQUIRE_BROWSER") == "1"
    what = "the test suite's fast tier and whole suite, each run alone and cold; the fast tier again, warm"
    record = records.new(what, figures=figures, **source)
    table = ["| run | wall | tests | outcome |", "|---|---:|---:|---|"]
    for name in TIERS:
        run = figures[name]
        table.append(
            f"| {name}: `{run['command']}` | {run['wall_seconds'] / 60:.1f} min | {run['tests']} | {run['summary']} |"
        )
    for name in TIERS:
        if figures[name]["failed"]:
            table += ["", f"Failed in the {name} (the end of each message; the JSON holds more of it):", ""]
            for test, message in figures[name]["failed"].items():
                last_line = message.strip().splitlines()[-1] if message.strip() else "no message"
                table.append(f"- `{test}`: `{last_line}`")
    fast = figures["fast tier"]
    table += [
        "",
        f"Fast-tier tests over {FAST_TIER_LIMIT_S} s: "
        + (", ".join(f"{test} ({seconds} s)" for seconds, test in fast["over_limit"]) or "none")
        + ".",
    ]
    for name in TIERS:
        table += [
            "",
            f"The {name}'s {_SLOWEST.value} slowest tests (setup, call and teardown):",
            "",
            "| s | test |",
            "|---:|---|",
        ]
        table += [f"| {seconds} | `{test}` |" for seconds, test in figures[name]["slowest"]]
    print(json.dumps(figures, indent=1))
    print(f"Record: {records.write(record, _OUTPUT.value, table=table)}")


if __name__ == "__main__":
    flags.mark_flag_as_required("output")
    app.run(main)
