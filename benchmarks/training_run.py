r"""A README command measured: a config trained from scratch, its time, memory and test scores.

  python -m benchmarks.training_run --config=configs/quickstart.py   # the README's main command
  python -m benchmarks.training_run --config=configs/classify.py

Runs `train.py --config=CONFIG` as the README does, from an empty workdir and an empty
compilation cache (data preparation, tokenizer, compilation, training and the test evaluation
all counted). For translation it then evaluates the last checkpoint on the test split again
with beam `--beam_size` and the config's length penalty (`--mode=eval`). Writes a record
(common/records.py) named after the config and the CPU kind: wall time and peak RSS of
each command, the test scores (with their sacreBLEU signatures), what served the host's
buffers (train.py's log), and a digest of the test outputs, which two runs of the same
training share bit for bit. The environment passes through, LD_PRELOAD included.
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
from ml_collections import config_flags

from common import records
from common.workdir import Workdir

records.define_software_note_flag()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "The config file train.py trains.")
_OUTPUT = flags.DEFINE_string("output", "", "Record path without suffix (default: docs/results/<config>_<cpu kind>).")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 4, "Translation: beam of the second evaluation (1: none).")
_KEEP = flags.DEFINE_string(
    "keep", "", "An empty folder to train in and keep (e.g. to export or translate with it); default: a temporary one."
)
_SPLIT = "test"
# What evaluating the split writes beside its scores, by task: the outputs the digest covers.
_OUTPUTS = {"translation": "hypotheses.txt", "classification": "predictions.tsv"}


def _run(arguments: list[str], log_path: str) -> dict:
    """Runs `python train.py arguments` from the repository's root; its wall time and peak RSS."""
    peak_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        command = [sys.executable, "train.py", *arguments]
        subprocess.run(command, cwd=records.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    seconds = time.monotonic() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest of any child so far: the first command's is exact, a
    # later one's only where it exceeds the ones before (None: no larger).
    return {"wall_seconds": round(seconds, 1), "peak_rss_bytes": peak * 1024 if peak > peak_before else None}


def _host_memory(log_path: str) -> str | None:
    with open(log_path, encoding="utf-8") as log:
        found = re.search(r"Host memory: (.*)\.$", log.read(), re.MULTILINE)
    return found.group(1) if found else None


def _digest(path: str) -> str:
    with open(path, "rb") as text:
        return hashlib.sha256(text.read()).hexdigest()


def _evaluation(workdir: Workdir, task: str, run: dict) -> dict:
    """The split's scores as evaluating wrote them, with the command's time and memory and the outputs' digest."""
    with open(workdir.scores(_SPLIT), encoding="utf-8") as scores:
        return {
            **run,
            **json.load(scores),
            "outputs_sha256": _digest(os.path.join(workdir.evaluation(_SPLIT), _OUTPUTS[task])),
        }


def _table(evaluations: dict[str, dict]) -> list[str]:
    """The record's page: one row per command."""
    rows = []
    for name, evaluation in evaluations.items():
        if "bleu" in evaluation:
            scores = f"BLEU {evaluation['bleu']:.2f}, chrF {evaluation['chrf']:.1f} ({evaluation['decoding']})"
        else:
            scores = f"accuracy {evaluation['accuracy']:.4f}, macro-F1 {evaluation['macro_f1']:.4f}"
        memory = f"{evaluation['peak_rss_bytes'] / 1e9:.2f} GB" if evaluation["peak_rss_bytes"] else ""
        rows.append(f"| {name} | {evaluation['wall_seconds']:.0f} s | {memory} | {scores} |")
    return ["| command | wall time | peak RSS | test scores |", "|---|---|---|---|", *rows]


def main(argv):
    del argv
    if _KEEP.value and os.path.isdir(_KEEP.value) and os.listdir(_KEEP.value):
        raise app.UsageError(f"--keep={_KEEP.value} is not empty: the command is measured from an empty workdir.")
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    task = _CONFIG.value.task
    measured_source = records.source()  # The code measured: what is checked out now, not after the run.
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Workdir(_KEEP.value or os.path.join(scratch, "run"))
        arguments = [f"--config={config_path}", f"--workdir={workdir.root}"]
        arguments.append(f"--config.compilation_cache_dir={scratch}/cache")
        train_log = os.path.join(scratch, "train.log")
        evaluations = {"train + evaluation": _evaluation(workdir, task, _run(arguments, train_log))}
        if task == "translation" and _BEAM_SIZE.value > 1:
            beam = _run([*arguments, "--mode=eval", f"--config.eval.beam_size={_BEAM_SIZE.value}"], train_log + "2")
            evaluations[f"evaluation, beam {_BEAM_SIZE.value}"] = _evaluation(workdir, task, beam)
        host_memory = _host_memory(train_log)
    record = records.new(
        f"{config_path} trained from scratch, then the {_SPLIT} split evaluated",
        figures={"evaluations": evaluations, "host_memory": host_memory},
        config=config_path,
        split=_SPLIT,
        **measured_source,
    )
    name = os.path.splitext(os.path.basename(config_path))[0]
    path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"{name}_{record['machine']['cpu_kind']}")
    table = [*_table(evaluations), "", f"Host memory: {host_memory}."]
    print("\n".join(table))
    print("wrote", records.write(record, path, table))


if __name__ == "__main__":
    app.run(main)
