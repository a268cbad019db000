"""A test tier's times from pytest's JUnit XML: its wall time, its slowest tests, and those over a limit.

  python .ci/test_times.py fast.xml --tier="fast tier" --limit_s=10

Prints the tier's wall time and its `--slowest` tests; with `--limit_s`, exits 1 naming every
test that took longer (setup, call and teardown together, so a module fixture's cost falls on
its module's first test). The fast tier (`pytest -m "not slow"`) is what contributors run while
working; a test over the limit there belongs in the `slow` tier or should get faster.
"""

import argparse
import sys
import xml.etree.ElementTree as ET


def _cases(junit_xml: str) -> tuple[float, list[ET.Element]]:
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return sum(float(suite.get("time", 0)) for suite in suites), [case for s in suites for case in s.iter("testcase")]


def _id(case: ET.Element) -> str:
    return f"{case.get('classname')}::{case.get('name')}"


def read_times(junit_xml: str) -> tuple[float, list[tuple[float, str]]]:
    """The session's wall seconds and each test's (seconds, id), slowest first."""
    wall, cases = _cases(junit_xml)
    return wall, sorted(((float(case.get("time", 0)), _id(case)) for case in cases), reverse=True)


def read_failures(junit_xml: str, message_chars: int = 2000) -> dict[str, str]:
    """Each test that failed or errored: its id and the last `message_chars` of pytest's message (the assertion
    or the exception, with what the test put in it), so that a failure seen once can be read later."""
    failures = {}
    for case in _cases(junit_xml)[1]:
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failures[_id(case)] = (problem.get("message") or "")[-message_chars:]
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml")
    parser.add_argument("--tier", default="tests", help="the tier's name, for the printout")
    parser.add_argument("--slowest", type=int, default=10)
    parser.add_argument("--limit_s", type=float, default=None, help="fail if any test takes longer")
    args = parser.parse_args()

    wall, tests = read_times(args.junit_xml)
    print(f"{args.tier}: {len(tests)} tests in {wall:.0f} s ({wall / 60:.1f} min); the {args.slowest} slowest:")
    for seconds, test in tests[: args.slowest]:
        print(f"  {seconds:7.1f} s  {test}")
    if args.limit_s is None:
        return 0
    over = [(seconds, test) for seconds, test in tests if seconds > args.limit_s]
    for seconds, test in over:
        print(
            f"error: {test} took {seconds:.1f} s, over the {args.tier}'s {args.limit_s:g} s: make it faster, or mark "
            "it slow if it needs its own process or training run",
            file=sys.stderr,
        )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
