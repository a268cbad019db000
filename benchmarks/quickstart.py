r"""The README's main command, measured: the quick-start's time, memory and test scores, greedy and beam 4.

  python -m benchmarks.quickstart [--output=docs/results/quickstart_<cpu kind>]

Runs `train.py --config=configs/quickstart.py` as the README does, from an empty workdir and an
empty compilation cache (tokenizer, compilation, training and the greedy test evaluation all
counted), then evaluates the last checkpoint on the test split again with beam 4 and the
config's length penalty (`--mode=eval`). Writes a record (benchmarks/records.py): wall time and
peak RSS of each command, test BLEU, chrF and loss with their sacreBLEU signatures, what served
the host's buffers (train.py's log), and a digest of the greedy hypotheses, which two runs of
the same training share bit for bit. The environment passes through, LD_PRELOAD included.
"""

import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks import records
from common.workdir import Workdir

_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: docs/results/quickstart_<cpu kind>).")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 4, "Beam of the second evaluation (0: skip it).")
_CONFIG = "configs/quickstart.py"
_SPLIT = "test"


def _run(arguments: list[str], log_path: str) -> dict:
    """Runs `python train.py arguments` from the repository's root; its wall time and peak RSS."""
    peak_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        subprocess.run(
            [sys.executable, "train.py", *arguments], cwd=records.REPO_ROOT, stderr=log, stdout=log, check=True
        )
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest of any child so far: the first command's is exact, a
    # later one's only where it exceeds the ones before (None: no larger).
    return {"wall_seconds": round(seconds, 1), "peak_rss_bytes": peak * 1024 if peak > peak_before else None}


def _scores(workdir: Workdir) -> dict:
    with open(workdir.scores(_SPLIT), encoding="utf-8") as scores:
        return json.load(scores)


def _host_memory(log_path: str) -> str | None:
    with open(log_path, encoding="utf-8") as log:
        found = re.search(r"Host memory: (.*)\.$", log.read(), re.MULTILINE)
    return found.group(1) if found else None


def _digest(path: str) -> str:
    with open(path, "rb") as text:
        return hashlib.sha256(text.read()).hexdigest()


def main(argv):
    del argv
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Workdir(os.path.join(scratch, "run"))
        common = [f"--config={_CONFIG}", f"--workdir={workdir.root}", f"--config.compilation_cache_dir={scratch}/cache"]
        train_log = os.path.join(scratch, "train.log")
        train = _run(common, train_log)
        greedy = _scores(workdir)
        figures = {
            "greedy": {
                **train,
                "bleu": greedy["bleu"],
                "chrf": greedy["chrf"],
                "loss": greedy["loss"],
                "bleu_signature": greedy["signature"],
                "chrf_signature": greedy["chrf_signature"],
                "checkpoint": greedy["checkpoint"],
                "hypotheses_sha256": _digest(os.path.join(workdir.evaluation(_SPLIT), "hypotheses.txt")),
            },
            "host_memory": _host_memory(train_log),
        }
        if _BEAM_SIZE.value:
            beam = _run([*common, "--mode=eval", f"--config.eval.beam_size={_BEAM_SIZE.value}"], train_log + ".eval")
            scores = _scores(workdir)
            figures["beam"] = {
                **beam,
                "decoding": scores["decoding"],
                "bleu": scores["bleu"],
                "chrf": scores["chrf"],
                "bleu_signature": scores["signature"],
            }
    record = records.new("quick-start: the README's main command", figures=figures, config=_CONFIG, split=_SPLIT)
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"quickstart_{record['machine']['cpu_kind']}")
    table = [
        "| command | wall time | peak RSS | test BLEU | chrF |",
        "|---|---|---|---|---|",
        f"| train + greedy evaluation | {train['wall_seconds']:.0f} s | {train['peak_rss_bytes'] / 1e9:.2f} GB "
        f"| {greedy['bleu']:.2f} | {greedy['chrf']:.1f} |",
    ]
    if "beam" in figures:
        beam = figures["beam"]
        table.append(
            f"| evaluation, {beam['decoding']} | {beam['wall_seconds']:.0f} s | "
            f"| {beam['bleu']:.2f} | {beam['chrf']:.1f} |"
        )
    table += ["", f"BLEU signature: `{greedy['signature']}`; host memory: {figures['host_memory']}."]
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
