r"""Host allocators compared in one run: the train step's tokens/s and each process's peak RSS.

  python -m benchmarks.host_allocators --rounds=8 --note='a quiet machine'

XLA:CPU mallocs each step's temporaries anew (training/runtime/host_memory.py), so how the C library's
malloc serves them sets part of a CPU step's time. An allocator is chosen per process, so each
one runs in a process of its own, all of them alive at once: for each workload, this starts one
process per allocator, one after the other (each compiles its step, then runs an untimed round),
then runs `--rounds` rounds, each running its steps in every process in turn, every other round
in reverse order, so that a noisy neighbour or a drifting machine affects all alike. The
processes wait between rounds (benchmarks' `--rounds_from_stdin`).

Workloads:
- quickstart: benchmarks/train_throughput.py's packed step and stream for configs/quickstart.py
  (its dtype 'auto': bfloat16 on a CPU with bf16 matmul instructions); real target tokens/s.
- config_r: benchmarks/peer_throughput.py's config R step in bfloat16, this project's alone
  (one batch of random ids, no stream); target tokens/s.

Allocators (`ALLOCATORS`), each set in the process's environment: glibc's defaults, its
`hugetlb` tunable ('huge_pages'), freed memory kept for reuse ('mallopt', the start-up's setting,
training/runtime/host_memory.py; 'keep_freed', the same through GLIBC_TUNABLES: their difference shows the
run's resolution), tcmalloc and jemalloc (Debian's libraries through LD_PRELOAD, `--tcmalloc`,
`--jemalloc`). A process waits while the others run their rounds: an allocator that gives freed
memory back to the kernel on a timer (jemalloc's decay) may fault it in again after each wait.

Reported per workload and allocator: the median over rounds of its tokens/s, their range, the
median's ratio to the fastest allocator's, the median over rounds of each round's ratio to the
fastest's (free of the machine's slower drifts), and the process's peak RSS (ru_maxrss, compiling
included). Written as a record (benchmarks/records.py) to `--output`.
"""

import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import records

REPO_ROOT = records.REPO_ROOT


@dataclasses.dataclass(frozen=True)
class Allocator:
    how: str  # What a user does to run with it.
    tunables: str = ""  # GLIBC_TUNABLES; any glibc.malloc tunable turns the start-up's mallopt off.
    preload_flag: str = ""  # The flag naming the library for LD_PRELOAD, if any.


ALLOCATORS = {
    "glibc": Allocator("GLIBC_TUNABLES=glibc.malloc.hugetlb=0 (its default value)", "glibc.malloc.hugetlb=0"),
    "huge_pages": Allocator("GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=1"),
    "keep_freed": Allocator(
        "GLIBC_TUNABLES with the start-up's mallopt settings (one arena, no mmap, trim threshold 2^62)",
        "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904",
    ),
    "mallopt": Allocator("nothing: mallopt(M_ARENA_MAX 1, M_MMAP_MAX 0, M_TRIM_THRESHOLD -1) at start-up"),
    "tcmalloc": Allocator("LD_PRELOAD of gperftools' tcmalloc (minimal)", preload_flag="tcmalloc"),
    "jemalloc": Allocator("LD_PRELOAD of jemalloc", preload_flag="jemalloc"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    description: str
    arguments: tuple[str, ...]  # Python's arguments: the benchmark module and its flags.
    steps_flag: str  # This benchmark's flag for the steps of a round.


WORKLOADS = {
    "quickstart": Workload(
        "the quick-start's packed step and stream (configs/quickstart.py, dtype 'auto'), real target tokens/s",
        ("-m", "benchmarks.train_throughput", "--config=configs/quickstart.py", "--batchings=packed"),
        "quickstart_steps",
    ),
    "config_r": Workload(
        "config R's step in bfloat16 (benchmarks/peer_throughput.py, this project's step only), target tokens/s",
        ("-m", "benchmarks.peer_throughput", "--variants=bfloat16", "--frameworks=jax", "--output=none"),
        "config_r_steps",
    ),
}

_WORKLOADS = flags.DEFINE_list("workloads", list(WORKLOADS), f"Of: {', '.join(WORKLOADS)}.")
_ALLOCATORS = flags.DEFINE_list("allocators", list(ALLOCATORS), f"Of: {', '.join(ALLOCATORS)}.")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Timed rounds; each runs every allocator's process once.", lower_bound=1)
flags.DEFINE_integer("quickstart_steps", 20, "Steps per round of the quick-start workload.", lower_bound=1)
flags.DEFINE_integer("config_r_steps", 10, "Steps per round of the config R workload.", lower_bound=1)
_TCMALLOC = flags.DEFINE_string(
    "tcmalloc", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "tcmalloc (Debian: libtcmalloc-minimal4)."
)
_JEMALLOC = flags.DEFINE_string("jemalloc", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc (libjemalloc2).")
_OUTPUT = flags.DEFINE_string("output", "", "The record's path without suffix (default: docs/results/host_allocators).")
_NOTE = flags.DEFINE_string("note", "", "A note for the record: how quiet the machine was, and why the run.")


class _Process:
    """A benchmark process that runs a round of steps for each line it reads (`--rounds_from_stdin`)."""

    def __init__(self, command: list[str], environment: dict[str, str], log_path: str):
        self._log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:  # The child keeps its own descriptor.
            self._popen = subprocess.Popen(
                command, cwd=REPO_ROOT, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )

    def run_round(self) -> float:
        """Runs a round; returns its tokens/s."""
        self._popen.stdin.write(b"\n")
        self._popen.stdin.flush()
        for line in self._popen.stdout:
            if line.startswith(b"{"):
                (tokens_per_second,) = json.loads(line)["tokens_per_second"].values()
                return tokens_per_second
        with open(self._log_path, encoding="utf-8", errors="replace") as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{shlex.join(self._popen.args)} ended before its round:\n{tail}")

    def finish(self) -> int:
        """Lets the process end (its stdin closed); returns its peak RSS in bytes."""
        self._popen.stdin.close()
        self._popen.stdout.read()  # Its own report, unread.
        _, status, usage = os.wait4(self._popen.pid, 0)
        self._popen.returncode = os.waitstatus_to_exitcode(status)
        if self._popen.returncode:
            raise RuntimeError(f"{shlex.join(self._popen.args)} exited with {self._popen.returncode}")
        return usage.ru_maxrss * 1024  # KiB on Linux.


def _environment(allocator: Allocator) -> dict[str, str]:
    """This process's environment with `allocator`'s settings in place of its own."""
    environment = {key: value for key, value in os.environ.items() if key not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, environment.get("PYTHONPATH")]))
    environment.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    if allocator.tunables:
        environment["GLIBC_TUNABLES"] = allocator.tunables
    if allocator.preload_flag:
        environment["LD_PRELOAD"] = flags.FLAGS[allocator.preload_flag].value
    return environment


def _command(workload: Workload, workdir: str) -> list[str]:
    steps = flags.FLAGS[workload.steps_flag].value
    command = [sys.executable, *workload.arguments, f"--steps={steps}", "--rounds_from_stdin"]
    if "benchmarks.train_throughput" in workload.arguments:
        command.append(f"--workdir={workdir}")  # Prepared by the first process, read by the others.
    return command


def _measure(workload: Workload, names: list[str], scratch: str) -> dict:
    """Per allocator: its rounds' tokens/s, its untimed round's, and its process's peak RSS."""
    processes, warm_up = {}, {}
    for name in names:
        allocator = ALLOCATORS[name]
        log_path = os.path.join(scratch, f"{workload.steps_flag}_{name}.log")
        processes[name] = _Process(
            _command(workload, os.path.join(scratch, "workdir")), _environment(allocator), log_path
        )
        warm_up[name] = processes[name].run_round()  # Compiled and faulted in, before the next one starts.
        print(f"  {name}: started, untimed round {warm_up[name]:,.0f} tokens/s", flush=True)
    rounds = {name: [] for name in names}
    load = []
    for round_index in range(_ROUNDS.value):
        load.append(os.getloadavg()[0])
        for name in names[::-1] if round_index % 2 else names:
            rounds[name].append(processes[name].run_round())
        print(f"  round {round_index + 1}: " + ", ".join(f"{n} {rounds[n][-1]:,.0f}" for n in names), flush=True)
    peak_rss = {name: process.finish() for name, process in processes.items()}
    return _figures(rounds, warm_up, peak_rss) | {"load_average_at_each_round": load}


def _figures(rounds: dict[str, list[float]], warm_up: dict[str, float], peak_rss: dict[str, int]) -> dict:
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    fastest = max(medians, key=medians.get)
    figures = {}
    for name, values in rounds.items():
        within_rounds = [value / best for value, best in zip(values, rounds[fastest])]
        figures[name] = {
            "round_tokens_per_second": values,
            "tokens_per_second": medians[name],
            "range": [min(values), max(values)],
            "ratio_to_fastest": medians[name] / medians[fastest],
            "within_round_ratio_to_fastest": statistics.median(within_rounds),
            "untimed_round_tokens_per_second": warm_up[name],
            "peak_rss_bytes": peak_rss[name],
        }
    return {"fastest": fastest, "allocators": figures}


def _output(*command: str) -> str | None:
    """What `command` prints, stripped, or None where it fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _debian_package(path: str) -> str | None:
    """'name version' of the Debian package holding `path`, or None."""
    owner = _output("dpkg-query", "-S", os.path.realpath(path))
    if not owner:
        return None
    package = owner.split(":")[0]
    return f"{package} {_output('dpkg-query', '-W', '-f=${Version}', package)}"


def _described(allocator: Allocator) -> dict:
    described = {"how": allocator.how, "GLIBC_TUNABLES": allocator.tunables}
    if allocator.preload_flag:
        described["LD_PRELOAD"] = flags.FLAGS[allocator.preload_flag].value
    return described


def _allocator_versions() -> dict:
    return {
        "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "tcmalloc": _debian_package(_TCMALLOC.value),
        "jemalloc": _debian_package(_JEMALLOC.value),
    }


def _table(results: dict, rounds: int) -> list[str]:
    names = list(next(iter(results.values()))["allocators"])
    lines = [
        f"Target tokens/s, median of {rounds} rounds (range); x fastest: the medians' ratio (the median of "
        "the rounds' ratios); peak RSS of the process.",
        "",
        "| allocator |" + "".join(f" {workload}: tokens/s | x fastest | peak RSS |" for workload in results),
        "|---|" + "---:|---:|---:|" * len(results),
    ]
    for name in names:
        row = f"| {name} |"
        for workload in results.values():
            f = workload["allocators"][name]
            low, high = f["range"]
            row += (
                f" {f['tokens_per_second']:,.0f} ({low:,.0f}-{high:,.0f}) | {f['ratio_to_fastest']:.3f} "
                f"({f['within_round_ratio_to_fastest']:.3f}) | {f['peak_rss_bytes'] / 1e9:.2f} GB |"
            )
        lines.append(row)
    return lines


def main(argv):
    del argv
    for flag, known in ((_WORKLOADS, WORKLOADS), (_ALLOCATORS, ALLOCATORS)):
        if unknown := [name for name in flag.value if name not in known]:
            raise app.UsageError(f"--{flag.name}: unknown {', '.join(unknown)}; choose among {', '.join(known)}.")
    names = []
    for name in _ALLOCATORS.value:
        preload = ALLOCATORS[name].preload_flag
        if preload and not os.path.exists(flags.FLAGS[preload].value):
            print(f"Skipping {name}: no {flags.FLAGS[preload].value} (--{preload}).")
        else:
            names.append(name)
    measured_source = records.source()
    start, load_at_start = time.monotonic(), os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for workload_name in _WORKLOADS.value:
            workload = WORKLOADS[workload_name]
            print(f"{workload_name}: {workload.description}", flush=True)
            results[workload_name] = {
                "description": workload.description,
                "arguments": list(workload.arguments),
                "steps_per_round": flags.FLAGS[workload.steps_flag].value,
            } | _measure(workload, names, scratch)
    record = records.new(
        "host allocators: the step's tokens/s and peak RSS under each",
        figures=results,
        **measured_source,
        note=_NOTE.value,
        wall_seconds=round(time.monotonic() - start),
        load_average=[load_at_start, os.getloadavg()],
        allocator_versions=_allocator_versions(),
        rounds=_ROUNDS.value,
        allocators={name: _described(ALLOCATORS[name]) for name in names},
    )
    table = _table(results, _ROUNDS.value)
    print("\n".join(table))
    print("wrote", records.write(record, _OUTPUT.value or os.path.join(records.RESULTS_DIR, "host_allocators"), table))


if __name__ == "__main__":
    app.run(main)
