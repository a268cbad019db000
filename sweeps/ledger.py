"""A sweep's ledger: each finished (variant, seed) run, small, in a folder kept in the repository.

A sweep spread over machines that each start from a fresh clone (preemptible jobs, allocations
that end, short-lived VMs) keeps its finished runs here, committed as they land; every machine
skips what the ledger holds, and the table is made from the ledger alone. The ledger pins what
makes its runs comparable (`Pins`): the code commit that trains them, the platform and number of
devices, the compute dtype and the tokenizer. A run that differs is refused, naming the difference.

    <ledger>/ledger.json             the pins, from the first run added
    <ledger>/tokenizer.model         the sweep's one SentencePiece model, given to every run
    <ledger>/references.txt.gz       the evaluated split's references, once
    <ledger>/<variant>/seed_<k>/     an entry: config.json, eval/<split>/scores.json and
                                     hypotheses.txt.gz, metrics/{train,valid}.jsonl, run.json

An entry is laid out as the workdir it came from, less its checkpoints and tokenizer (~50 KB), so
its results are read as the run's own are (sweeps/report.py). It is written into a hidden folder
and renamed into place, so a sweep killed while copying leaves no half-written entry.
"""

import collections
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Sequence

from common import records
from common.errors import UserInputError
from common.workdir import Workdir
from sweeps.runner import REPOSITORY, Run, seeds_present
from training.reporting import attempts as attempts_log
from training.reporting import metric_log

PINS_FILE = "ledger.json"
RUN_FILE = "run.json"
_INCOMING = ".incoming-"  # An entry being written: <ledger>/<variant>/.incoming-seed_<k>-<random>.
_SHA_SHOWN = 12  # Hex digits of a commit or fingerprint shown in messages.
_UNCOMMITTED = "+uncommitted"  # After a commit whose checkout had changes.


class LedgerMismatch(UserInputError):
    """A run, or the machine about to train runs, differs from what the ledger pins."""


@dataclasses.dataclass(frozen=True)
class Pins:
    """What every run of a ledger shares: code, platform, devices, compute dtype and tokenizer."""

    commit: str  # With '+uncommitted' where the working tree differed from it.
    platform: str  # 'cpu', 'gpu', 'tpu': a GPU sweep is a ledger of its own.
    device_count: int
    dtype: str  # The compute dtype the runs trained in, 'auto' resolved.
    tokenizer_sha256: str

    @classmethod
    def of_attempt(cls, attempt: dict, tokenizer_sha256: str) -> "Pins":
        """The pins of a training attempt (a line of <workdir>/attempts.jsonl: training/loop.py)."""
        commit = str(attempt.get("commit"))
        if attempt.get("uncommitted_changes") is not False:
            commit += _UNCOMMITTED
        return cls(commit, attempt["platform"], int(attempt["device_count"]), attempt["dtype"], tokenizer_sha256)

    def differences(self, other: "Pins") -> list[str]:
        """'dtype bfloat16 here, float32 in the ledger', one per field that differs from `other`."""
        return [
            f"{field.name} {_short(getattr(self, field.name))} here, {_short(getattr(other, field.name))} in the ledger"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]


def _short(value) -> str:
    text = str(value)
    return text[:_SHA_SHOWN] + text[40:] if len(text) >= 40 else text  # A commit or a sha256, and '+uncommitted'.


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Ledger:
    """The ledger folder at `path`; see the module docstring."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    @property
    def tokenizer(self) -> str:
        return os.path.join(self.path, "tokenizer.model")

    @property
    def references(self) -> str:
        return os.path.join(self.path, "references.txt.gz")

    def pins(self) -> Pins | None:
        """What the ledger pins; None before its first run."""
        try:
            with open(os.path.join(self.path, PINS_FILE), encoding="utf-8") as f:
                return Pins(**json.load(f))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, TypeError) as e:
            raise UserInputError(f"{self.path}/{PINS_FILE} is damaged ({e}); restore it from git.") from None

    def check(self, pins: Pins, what: str) -> None:
        """Raises LedgerMismatch, one line, if `pins` (of `what`: 'This machine', a run) differ from the ledger's,
        or come from uncommitted code (a ledger's runs name the commit that trained them)."""
        pinned = self.pins()
        if pinned is not None and (found := pins.differences(pinned)):
            raise LedgerMismatch(
                f"{what} differs from the ledger {self.path} ({'; '.join(found)}): a ledger holds runs of one "
                f"commit, platform, device count, dtype and tokenizer. Run the sweep from a worktree of commit "
                f"{pinned.commit} (git worktree add ../aiayn-sweep {pinned.commit}; docs/ablations.md) on "
                f"{pinned.device_count} {pinned.platform} device(s), or start another ledger (--ledger)."
            )
        if pins.commit.endswith(_UNCOMMITTED):
            raise LedgerMismatch(
                f"{what} runs uncommitted code (the checkout of {pins.commit.removesuffix(_UNCOMMITTED)} has changes): "
                f"a ledger's runs name the commit that trained them; commit first, or run from a clean worktree."
            )

    def entry(self, variant: str, seed: int) -> str:
        return os.path.join(self.path, variant, f"seed_{seed}")

    def has(self, run: Run) -> bool:
        return os.path.isfile(os.path.join(self.entry(run.variant, run.seed), RUN_FILE))

    def runs(self, variants: Sequence[str], num_seeds: int) -> list[Run]:
        """Every (variant, seed) as read from the ledger, seed by seed: Runs whose workdir is their entry."""
        return [
            Run(variant, seed, self.entry(variant, seed), references=self.references)
            for seed in range(num_seeds)
            for variant in variants
        ]

    def seeds_present(self, variants: Sequence[str]) -> int:
        """1 + the highest seed of `variants` in the ledger (0 if none): its entries are laid out as a sweep's root."""
        return seeds_present(self.path, variants)

    def wall_seconds_per_flop(self, cpu_kind: str) -> list[float]:
        """Each entry's wall seconds per training FLOP, of the runs trained on `cpu_kind` alone (sweeps/budget.py)."""
        rates = []
        for path in glob.glob(os.path.join(glob.escape(self.path), "*", "seed_*", RUN_FILE)):
            with open(path, encoding="utf-8") as f:
                summary = json.load(f)
            if summary.get("cpu_kinds") == [cpu_kind] and summary.get("model_flops"):
                rates.append(summary["seconds"]["wall"] / summary["model_flops"])
        return rates

    def add(self, run: Run, split: str) -> dict:
        """Copies the finished `run` (its workdir) into the ledger; returns its run.json.

        The first run added pins the ledger (its commit, platform, devices, dtype, tokenizer) and
        gives it its references; later runs must match both.

        Raises:
            LedgerMismatch: the run differs from the ledger's pins or references, or has no attempts
                recorded (trained by code older than the ledger).
        """
        workdir = Workdir(run.workdir)
        attempts = attempts_log.read(workdir.attempts)
        if not attempts:
            raise LedgerMismatch(f"{run.label} in {run.workdir} records no attempt (older code): train it again.")
        tokenizer_sha256 = file_sha256(workdir.tokenizer)
        for attempt in attempts:
            self.check(Pins.of_attempt(attempt, tokenizer_sha256), f"{run.label} (trained in {run.workdir})")
        references = _read_gzipped_or_plain(os.path.join(workdir.evaluation(split), "references.txt"))
        if os.path.exists(self.references) and _read_gzipped_or_plain(self.references) != references:
            raise LedgerMismatch(f"{run.label} was evaluated on other references than the ledger {self.path}'s.")
        summary = run_summary(run, attempts, tokenizer_sha256, metric_log.read(run.workdir, "train"))
        self._write_pins(Pins.of_attempt(attempts[-1], tokenizer_sha256))
        if not os.path.exists(self.references):
            _write_atomically(self.references, _gzip(references))
        self._write_entry(run, split, summary)
        return summary

    def store_tokenizer(self, path: str) -> None:
        """Keeps `path` as the ledger's tokenizer, if it has none yet."""
        if not os.path.exists(self.tokenizer):
            with open(path, "rb") as f:
                _write_atomically(self.tokenizer, f.read())

    def _write_pins(self, pins: Pins) -> None:
        if self.pins() is None:
            text = json.dumps(dataclasses.asdict(pins), indent=2, sort_keys=True) + "\n"
            _write_atomically(os.path.join(self.path, PINS_FILE), text.encode())

    def _write_entry(self, run: Run, split: str, summary: dict) -> None:
        """The entry, written whole into a hidden folder beside its place, then renamed there."""
        final = self.entry(run.variant, run.seed)
        variant_folder = os.path.dirname(final)
        os.makedirs(variant_folder, exist_ok=True)
        for stale in glob.glob(os.path.join(glob.escape(variant_folder), f"{_INCOMING}seed_{run.seed}-*")):
            shutil.rmtree(stale)  # Left by a sweep killed while copying.
        incoming = os.path.join(variant_folder, f"{_INCOMING}seed_{run.seed}-{uuid.uuid4().hex[:8]}")
        source, target = Workdir(run.workdir), Workdir(incoming)
        for name in ("train", "valid"):
            _copy(source.metrics(name), target.metrics(name))
        _copy(source.config, target.config)
        _copy(source.scores(split), target.scores(split))
        with open(os.path.join(source.evaluation(split), "hypotheses.txt"), "rb") as f:
            _write(os.path.join(target.evaluation(split), "hypotheses.txt.gz"), _gzip(f.read()))
        _write(os.path.join(incoming, RUN_FILE), (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode())
        if os.path.exists(final):  # Added meanwhile by another sweep on the same ledger: keep the first.
            shutil.rmtree(incoming)
            return
        os.rename(incoming, final)


def run_summary(run: Run, attempts: Sequence[dict], tokenizer_sha256: str, train_log: dict[int, dict]) -> dict:
    """run.json: what trained the run and where its wall time went, over all its attempts.

    `seconds` splits the wall time into compile (XLA's compiling and tracing), train (the steps),
    evaluation (validation and the final test) and start_up: the rest, that is the imports, data,
    tokenizer, model set-up and checkpoint restore, and the saves (training/phases.py). Attempts
    killed outright write no line: their seconds are missing.
    """
    last = attempts[-1]
    phases = ("compile", "train", "evaluation")
    seconds = {phase: sum(a["seconds"].get(phase, 0.0) for a in attempts) for phase in phases}
    wall = sum(a.get("wall_seconds") or 0.0 for a in attempts)
    seconds = {"wall": wall, "start_up": max(0.0, wall - sum(seconds.values())), **seconds}
    model_flops = sum((m.get("model_flops_per_second") or 0.0) * (m.get("seconds") or 0.0) for m in train_log.values())
    return {
        "variant": run.variant,
        "seed": run.seed,
        "commit": last.get("commit"),
        "platform": last["platform"],
        "device_kind": last.get("device_kind"),
        "device_count": last["device_count"],
        "dtype": last["dtype"],
        "tokenizer_sha256": tokenizer_sha256,
        "steps": last.get("step"),
        "machines": sorted({_machine(a) for a in attempts}),
        "cpu_models": sorted({a.get("cpu_model") or "unknown" for a in attempts}),
        "cpu_kinds": sorted({a.get("cpu_kind") or "unknown" for a in attempts}),
        "cores": sorted({a.get("cores") or 0 for a in attempts}),
        "software": last.get("software"),
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "model_flops": model_flops,
        "attempts": len(attempts),
    }


def _machine(attempt: dict) -> str:
    """'Intel(R) Xeon(R) Processor (cpu-amx), 2 cores'."""
    model, kind = attempt.get("cpu_model", "unknown CPU"), attempt.get("cpu_kind", "unknown")
    return f"{model} ({kind}), {attempt.get('cores')} cores"


def ledger_record_fields(ledger: Ledger, collected, collected_by: dict) -> dict:
    """The fields of a record of results collected from `ledger` (for common.records' `new`): the commit that
    trained the runs (not `collected_by`, the checkout that collected them), their machines, software and count.

    Raises:
        UserInputError: the ledger holds no run yet.
    """
    if (pins := ledger.pins()) is None:
        raise UserInputError(f"The ledger {ledger.path} holds no run yet: nothing to record.")
    summaries = []
    for summary in collected.summaries:
        for result in summary.results:
            with open(os.path.join(result.run.workdir, RUN_FILE), encoding="utf-8") as f:
                summaries.append(json.load(f))
    machines = collections.Counter(machine for s in summaries for machine in s["machines"])
    kinds = collections.Counter(kind for s in summaries for kind in s["cpu_kinds"])
    software = collections.Counter(json.dumps(s["software"], sort_keys=True) for s in summaries).most_common(1)
    cores = sorted({n for s in summaries for n in s["cores"]})
    return {
        "commit": pins.commit,
        "uncommitted_changes": False,  # The ledger takes runs of a clean commit only (`Ledger.check`).
        "collected_by": collected_by,
        "ledger": {"path": os.path.relpath(ledger.path, REPOSITORY), **dataclasses.asdict(pins)},
        "machine": {
            "cpu_model": "; ".join(sorted({model for s in summaries for model in s["cpu_models"]})),
            "cpu_kind": "/".join(sorted(kinds)),
            "cores": cores[0] if len(cores) == 1 else cores,  # A number where the machines agree, as records.machine.
            "runs_by_machine": dict(machines),
        },
        "software": {**(json.loads(software[0][0]) if software else {}), **records.software(("sacrebleu",))},
        "load_average": None,  # The runs' machines', unknown; not the collecting machine's.
        "runs": {
            "in_ledger": len(summaries),
            "planned": len(summaries) + len(collected.unfinished),
            "unfinished": [run.label for run in collected.unfinished],
            "wall_hours": round(sum(s["seconds"]["wall"] for s in summaries) / 3600, 2),
        },
    }


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)  # The same bytes for the same text: no timestamp.


def _read_gzipped_or_plain(path: str) -> bytes:
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def _copy(source: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(source, target)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _write_atomically(path: str, data: bytes) -> None:
    incoming = f"{os.path.dirname(path)}/{_INCOMING}{os.path.basename(path)}-{uuid.uuid4().hex[:8]}"
    _write(incoming, data)
    os.replace(incoming, path)
