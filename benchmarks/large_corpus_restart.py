r"""Starts and restarts at WMT's scale: the quick-start on a 4.5M-pair corpus, in one process and in two.

  python -m benchmarks.large_corpus_restart [--corpus=/work/large_corpus] [--processes=1,2]

For each number of processes, from an empty workdir and compilation cache: a first start that
trains 5 steps (preparing the corpus's records, sampling the tokenizer's sentences, compiling),
then the same command resumed to step 10, which opens the prepared records and reads only what
its batches need. Two processes run on localhost (`--coordinator_address=127.0.0.1:...`), one
CPU device each. Each command is timed from its start to its last step's line in the training
metrics (`<workdir>/metrics/train.jsonl`) and to its end (the test evaluation included, with
`eval.max_decode_length` 8); peak RSS per process. The corpus is made by
scripts/make_large_corpus.py when `--corpus` is not given. Writes a record (benchmarks/records.py).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import records
from common.workdir import Workdir

_CORPUS = flags.DEFINE_string("corpus", "", "A parallel_text folder (default: made by scripts/make_large_corpus.py).")
_PAIRS = flags.DEFINE_integer("pairs", 4_500_000, "Training pairs of the corpus made when --corpus is not given.")
_PROCESSES = flags.DEFINE_list("processes", ["1", "2"], "Numbers of processes to measure.")
_OUTPUT = flags.DEFINE_string(
    "output", "", "Record path without suffix (default: docs/results/large_corpus_restart_<cpu kind>)."
)
_FIRST_STEPS, _RESUMED_STEPS = 5, 10
_POLL_SECONDS = 0.05


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_step_seen(metrics_path: str, step: int) -> bool:
    try:
        with open(metrics_path, encoding="utf-8") as metrics:
            return any(json.loads(line).get("step") == step for line in metrics if line.endswith("\n"))
    except FileNotFoundError:
        return False


def _run(arguments: list[str], processes: int, workdir: Workdir, steps: int, log_prefix: str) -> dict:
    """Runs train.py in `processes` processes; seconds to the last step's metrics and to the end, peak RSS of each."""
    port = _free_port()
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    running = []
    for index in range(processes):
        command = [sys.executable, "train.py", *arguments, f"--config.num_train_steps={steps}"]
        if processes > 1:
            command += [
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={processes}",
                f"--process_id={index}",
            ]
        with open(f"{log_prefix}.{index}.log", "w", encoding="utf-8") as log:
            running.append(
                subprocess.Popen(command, cwd=records.REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
            )
    to_last_step = None
    peak_rss, ended = {}, {}
    while len(ended) < processes:
        if to_last_step is None and _last_step_seen(workdir.metrics("train"), steps):
            to_last_step = time.monotonic() - start
        for index, process in enumerate(running):
            if index not in ended:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    ended[index] = time.monotonic() - start
                    peak_rss[index] = usage.ru_maxrss * 1024
                    if os.waitstatus_to_exitcode(status) != 0:
                        raise RuntimeError(f"train.py failed (process {index}): see {log_prefix}.{index}.log")
        time.sleep(_POLL_SECONDS)
    return {
        "to_last_step_seconds": round(to_last_step, 1) if to_last_step is not None else None,
        "whole_command_seconds": round(max(ended.values()), 1),
        "peak_rss_bytes": [peak_rss[index] for index in range(processes)],
    }


def _make_corpus(folder: str) -> str:
    script = os.path.join(records.REPO_ROOT, "scripts", "make_large_corpus.py")
    subprocess.run([sys.executable, script, f"--out={folder}", f"--pairs={_PAIRS.value}"], check=True)
    return folder


def main(argv):
    del argv
    measured_source = records.source()
    restarts, starts = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = _CORPUS.value or _make_corpus(os.path.join(scratch, "corpus"))
        for processes in map(int, _PROCESSES.value):
            name = "1 process" if processes == 1 else f"{processes} processes"
            workdir = Workdir(os.path.join(scratch, f"run_{processes}"))
            arguments = [
                "--config=configs/quickstart.py",
                f"--workdir={workdir.root}",
                f"--config.dataset.path={corpus}",
                f"--config.checkpoint_every_steps={_FIRST_STEPS}",
                "--config.eval.max_decode_length=8",
                f"--config.compilation_cache_dir={scratch}/cache_{processes}",
            ]
            log = os.path.join(scratch, f"log_{processes}")
            starts[name] = _run(arguments, processes, workdir, _FIRST_STEPS, log + "_first")
            restarts[name] = _run(arguments, processes, workdir, _RESUMED_STEPS, log + "_restart")
            print(name, "first start", starts[name], "restart", restarts[name], flush=True)
    record = records.new(
        "the quick-start on a 4.5M-pair corpus: a first start, then a restart",
        figures={"first_starts": starts, "restarts": restarts},
        corpus_pairs=None if _CORPUS.value else _PAIRS.value,
        steps={"first_start": _FIRST_STEPS, "restart": _RESUMED_STEPS},
        **measured_source,
    )
    table = ["| | to the last step | whole command | peak RSS per process |", "|---|---|---|---|"]
    for label, runs in (("first start", starts), ("restart", restarts)):
        for name, run in runs.items():
            rss = ", ".join(f"{value / 1e9:.2f} GB" for value in run["peak_rss_bytes"])
            table.append(
                f"| {name}, {label} | {run['to_last_step_seconds']} s | {run['whole_command_seconds']} s | {rss} |"
            )
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"large_corpus_restart_{record['machine']['cpu_kind']}")
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
