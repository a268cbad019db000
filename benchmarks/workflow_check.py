r"""The README's workflow on an accelerator, run as a user runs it: attention, train, beam, translate, export.

  python -m benchmarks.workflow_check   # 6 minutes on one H100, compiles included (docs/results/workflow_check_gpu.md)

docs/accelerator_check.md#the-workflow-check says what each phase runs and when it fails. Each
phase is a subprocess started from the repository's root, timed from its start to its exit; the
phases after train need its workdir and are not run where it failed. `--config.FIELD=VALUE`
flags go through to train.py (`--config.nonfinite=stop` goes last, so that no non-finite step is
skipped unnoticed). After every phase the record (common/records.py) is written again; the
script exits 1 where any phase failed.
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

from common import records
from common.workdir import Workdir

records.define_software_note_flag()

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "The config train.py trains.")
_WORKDIR = flags.DEFINE_string("workdir", "", "An empty folder to train in, kept (default: a temporary one).")
_PHASES = flags.DEFINE_list("phases", None, "Phases to run, in the module docstring's order (default: all).")
_ATTENTION_SIZE = flags.DEFINE_string("attention_size", "base", "The accelerator check's size for attention.")
_OUTPUT = flags.DEFINE_string(
    "output", "", "Record path without suffix (default: docs/results/workflow_check_<platform>)."
)

PHASES = ("attention", "train", "beam", "translate", "export_huggingface", "export_ctranslate2")
ATTENTION_LENGTH = 64  # The quick-start's rows; key lengths of 64 mod 128 are where cuDNN's backward failed.
NONFINITE_EXIT_STATUS = 3  # train.py's (training/divergence.py): a step whose loss or gradients were not finite.
BEAM = ("--config.eval.beam_size=4", "--config.eval.length_penalty=0.6")
SPLIT = "test"
SENTENCES = (
    "Click the OK button to close the dialog.",
    "Select the cells you want to delete.",
    "Enter the formula in the cell and press Enter.",
)
_LOG_TAIL_LINES = 20


def run(arguments: list[str], log_path: str) -> dict:
    """Runs `python arguments` from the repository's root, output to `log_path`: command, wall time, exit status.

    A failed command's figures add its error (the last `error:` line, else the last line) and the log's last lines.
    """
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        command = [sys.executable, *arguments]
        status = subprocess.run(command, cwd=records.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    figures = {
        "command": shlex.join(["python", *arguments]),
        "wall_seconds": round(time.monotonic() - start, 1),
        "exit_status": status,
    }
    if status:
        with open(log_path, encoding="utf-8", errors="replace") as log:
            lines = [line.rstrip() for line in log.read().replace("\r", "\n").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        cause = "a non-finite step, " if status == NONFINITE_EXIT_STATUS and "train.py" in arguments[0] else ""
        figures["error"] = f"exit status {status} ({cause}{(errors or lines or ['no output'])[-1]})"
        figures["log_tail"] = lines[-_LOG_TAIL_LINES:]
    return figures


def _with_scores(figures: dict, workdir: Workdir) -> dict:
    """An evaluating command's `figures` with the split's scores; an error where one is not finite."""
    with open(workdir.scores(SPLIT), encoding="utf-8") as file:
        scores = json.load(file)
    figures[SPLIT] = {key: scores.get(key) for key in ("bleu", "chrf", "loss", "decoding", "num_sentences")}
    if scores.get("not_finite"):
        figures["error"] = f"{workdir.scores(SPLIT)}: not finite: {', '.join(scores['not_finite'])}"
    return figures


def _validation_bleu(workdir: Workdir) -> dict | None:
    """The last validation during training: its step and BLEU (None where none ran)."""
    path = workdir.metrics("valid")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as file:
        last = [json.loads(line) for line in file if line.strip()][-1]
    return {"step": last["step"], "bleu": last.get("bleu")}


class Workflow:
    """The phases' commands over one workdir and a scratch folder (logs, compilation cache, exports)."""

    def __init__(self, workdir: str, scratch: str, config_path: str, overrides: list[str], attention_size: str):
        self.workdir = Workdir(workdir)
        self.scratch = scratch
        self.train_arguments = [
            "train.py",
            f"--config={config_path}",
            f"--workdir={workdir}",
            f"--config.compilation_cache_dir={os.path.join(scratch, 'cache')}",  # Empty: compiles are counted.
            *overrides,
            "--config.nonfinite=stop",
        ]
        self.attention_size = attention_size
        self.accelerator = None  # The device, as the attention phase's record describes it.

    def _log(self, phase: str) -> str:
        return os.path.join(self.scratch, f"{phase}.log")

    def attention(self) -> dict:
        output = os.path.join(self.scratch, "attention")
        arguments = [
            "-m",
            "benchmarks.accelerator_check",
            f"--sizes={self.attention_size}",
            "--sections=attention",
            f"--attention_length={ATTENTION_LENGTH}",
            f"--output={output}",
        ]
        figures = run(arguments, self._log("attention"))
        if figures["exit_status"]:
            return figures
        with open(output + ".json", encoding="utf-8") as file:
            record = json.load(file)
        self.accelerator = record["accelerator"]
        section = record["figures"][self.attention_size]["attention"]
        if "error" in section:
            return {**figures, "error": section["error"]}
        keys = ("compared", "length", "loss_relative_difference", "grad_norm_relative_difference")
        figures.update({key: section[key] for key in (*keys, "grad_difference_norm_relative", "bars", "agree")})
        if not section["agree"]:  # NaN differences too: a NaN is within no bar.
            figures["error"] = f"{section['compared']} differ beyond the bars (or are not finite)"
        return figures

    def train(self) -> dict:
        figures = run(self.train_arguments, self._log("train"))
        if figures["exit_status"]:
            return figures
        figures["valid"] = _validation_bleu(self.workdir)
        return _with_scores(figures, self.workdir)

    def beam(self) -> dict:
        figures = run([*self.train_arguments, "--mode=eval", *BEAM], self._log("beam"))
        return figures if figures["exit_status"] else _with_scores(figures, self.workdir)

    def translate(self) -> dict:
        source, target = (os.path.join(self.scratch, name) for name in ("sentences.en", "sentences.de"))
        with open(source, "w", encoding="utf-8") as file:
            file.write("\n".join(SENTENCES) + "\n")
        arguments = ["translate.py", f"--workdir={self.workdir.root}", f"--input={source}", f"--output={target}"]
        figures = run(arguments, self._log("translate"))
        if figures["exit_status"]:
            return figures
        with open(target, encoding="utf-8") as file:
            translations = file.read().splitlines()
        figures["translations"] = dict(zip(SENTENCES, translations, strict=False))
        if len(translations) != len(SENTENCES):
            figures["error"] = f"{len(translations)} lines for {len(SENTENCES)} sentences"
        return figures

    def export(self, export_format: str) -> dict:
        output = os.path.join(self.scratch, "exported", export_format)
        arguments = ["export.py", f"--workdir={self.workdir.root}", f"--format={export_format}", f"--output={output}"]
        return run(arguments, self._log(f"export_{export_format}"))

    def phase(self, name: str) -> dict:
        """Runs phase `name` (PHASES)."""
        if name.startswith("export_"):
            return self.export(name.removeprefix("export_"))
        return getattr(self, name)()


def summary(figures: dict) -> str:
    """One line of a phase's main figures."""
    if "skipped" in figures:
        return f"FAILED, not run: {figures['skipped']}"
    if "error" in figures:
        return f"FAILED: {figures['error'][:300]}"
    parts = []
    if "agree" in figures:
        differences = (figures["loss_relative_difference"], figures["grad_difference_norm_relative"])
        parts.append(
            f"{figures['compared']} at length {figures['length']}: agree; loss rel diff {differences[0]:.1e}, "
            f"grad diff / norm {differences[1]:.1e}"
        )
    if figures.get("valid"):
        parts.append(f"valid BLEU {figures['valid']['bleu']:.2f} (step {figures['valid']['step']})")
    if SPLIT in figures:
        scores = figures[SPLIT]
        parts.append(
            f"{SPLIT} BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.1f} ({scores['decoding']}, "
            f"{scores['num_sentences']:,} sentences)"
        )
    if "translations" in figures:
        parts.append(f"{len(figures['translations'])} lines translated")
    return "; ".join(parts) or "done"


def table(record: dict) -> list[str]:
    """The record's page: the device, then one row per phase."""
    devices = record.get("accelerator") or {}
    rows = [
        f"| {name} | {figures.get('wall_seconds', 0):.0f} s | {summary(figures).replace('|', '/')} |"
        for name, figures in record["figures"]["phases"].items()
    ]
    return [
        f"Device: {devices.get('device_kind', 'unknown')} ({devices.get('platform', 'unknown')}); "
        f"CUDA: {devices.get('cuda')}. Overrides: {' '.join(record['overrides']) or 'none'}.",
        "",
        "| phase | wall time | result |",
        "|---|---|---|",
        *rows,
        f"| all | {record['figures']['wall_seconds']:.0f} s | "
        + ("PASS" if record["figures"]["passed"] else "FAIL")
        + " |",
    ]


def _overrides(argv: list[str]) -> list[str]:
    """The `--config.FIELD=VALUE` flags of the command line, for train.py."""
    overrides = [argument for argument in argv if argument.startswith("--config.")]
    if spaced := [argument for argument in overrides if "=" not in argument]:
        raise app.UsageError(f"write {spaced[0]}=VALUE: config overrides go to train.py with '='.")
    return overrides


def _failed(figures: dict) -> bool:
    return "error" in figures or "skipped" in figures


def main(argv):
    del argv
    phases = [name for name in PHASES if name in (_PHASES.value or PHASES)]
    if unknown := set(_PHASES.value or ()) - set(PHASES):
        raise app.UsageError(f"--phases: unknown {sorted(unknown)}; choose from {', '.join(PHASES)}.")
    if "train" not in phases and set(phases) - {"attention"}:
        raise app.UsageError("--phases: the phases after train need its workdir: add train.")
    if _WORKDIR.value and os.path.isdir(_WORKDIR.value) and os.listdir(_WORKDIR.value):
        raise app.UsageError(f"--workdir={_WORKDIR.value} is not empty: the workflow starts from an empty workdir.")
    config_path = config_flags.get_config_filename(flags.FLAGS["config"])
    overrides = _overrides(sys.argv[1:])
    record = records.new(
        "the README's workflow on an accelerator: attention at length 64, train, beam, translate, export",
        figures={"phases": {}, "wall_seconds": 0.0, "passed": False},
        packages=(*records.DEFAULT_PACKAGES, "sentencepiece", "sacrebleu", "grain", "transformers", "ctranslate2"),
        config=config_path,
        overrides=overrides,
        accelerator=None,
    )
    results = record["figures"]["phases"]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = os.path.abspath(_WORKDIR.value or os.path.join(scratch, "run"))
        workflow = Workflow(workdir, scratch, config_path, overrides, _ATTENTION_SIZE.value)
        for phase in phases:
            if phase not in ("attention", "train") and _failed(results["train"]):
                results[phase] = {"skipped": "train failed"}
            else:
                results[phase] = workflow.phase(phase)
            if workflow.accelerator and not record["accelerator"]:
                records.add_accelerator(record, workflow.accelerator)
            record["figures"]["wall_seconds"] = sum(figures.get("wall_seconds", 0) for figures in results.values())
            record["figures"]["passed"] = not any(_failed(figures) for figures in results.values())
            print(f"{phase:<18} {results[phase].get('wall_seconds', 0):6.0f} s  {summary(results[phase])}", flush=True)
            platform = (record["accelerator"] or {}).get("platform", "unknown")
            path = _OUTPUT.value or os.path.join(records.RESULTS_DIR, f"workflow_check_{platform}")
            records.write(record, path, table(record))
    print("\n".join(table(record)))
    print("wrote", path + ".json")
    if not record["figures"]["passed"]:
        failed = [name for name, figures in results.items() if _failed(figures)]
        print(f"workflow check FAILED: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
