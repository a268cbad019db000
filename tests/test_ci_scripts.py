"""The CI's own scripts: .ci/test_times.py reads pytest's JUnit XML and fails a tier with a test over its limit."""

import os
import runpy
import subprocess
import sys

from conftest import REPO_ROOT

TEST_TIMES = os.path.join(REPO_ROOT, ".ci", "test_times.py")

# As pytest writes it (junit_family xunit2): a suite with the session's wall time, a case per test.
_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" tests="3" time="42.5">
<testcase classname="tests.test_a" name="test_quick" time="0.3"/>
<testcase classname="tests.test_a" name="test_compiles[x]" time="12.25"/>
<testcase classname="tests.test_b" name="test_broken" time="4.0"><failure message="assert 0">...</failure></testcase>
</testsuite></testsuites>
"""


def _run(junit_xml, *arguments):
    return subprocess.run([sys.executable, TEST_TIMES, str(junit_xml), *arguments], capture_output=True, text=True)


def test_a_tier_prints_its_time_and_slowest_tests_and_fails_a_test_over_its_limit(tmp_path):
    junit_xml = tmp_path / "fast.xml"
    junit_xml.write_text(_JUNIT, encoding="utf-8")

    within = _run(junit_xml, "--tier=fast tier", "--slowest=2", "--limit_s=20")
    assert within.returncode == 0, within.stderr
    lines = within.stdout.splitlines()
    assert lines[0] == "fast tier: 3 tests in 42 s (0.7 min); the 2 slowest:"
    assert lines[1:] == ["     12.2 s  tests.test_a::test_compiles[x]", "      4.0 s  tests.test_b::test_broken"]

    over = _run(junit_xml, "--tier=fast tier", "--limit_s=10")
    assert over.returncode == 1
    assert over.stderr.splitlines() == [
        "error: tests.test_a::test_compiles[x] took 12.2 s, over the fast tier's 10 s: make it faster, or mark it "
        "slow if it needs its own process or training run"
    ]
    assert _run(junit_xml).returncode == 0  # No limit: only the printout.


def test_the_failed_tests_are_read_by_id_with_their_message(tmp_path):
    junit_xml = tmp_path / "fast.xml"
    junit_xml.write_text(_JUNIT, encoding="utf-8")
    test_times = runpy.run_path(TEST_TIMES)
    assert test_times["read_failures"](str(junit_xml)) == {"tests.test_b::test_broken": "assert 0"}
    wall, tests = test_times["read_times"](str(junit_xml))
    assert wall == 42.5 and [test for _, test in tests][0] == "tests.test_a::test_compiles[x]"
