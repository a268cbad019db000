"""A sweep: every (variant, seed) of a sweep file trained by its own train.py process, resumably.

Each run is the command `train.py --config=<sweep file>:<variant> --config.seed=<seed>
--workdir=<root>/<variant>/seed_<seed>`, so a run of the sweep is an ordinary training
run: train.py resumes it from its latest checkpoint, and it can be run by hand or
submitted to a cluster as it is (`commands`). A run is finished when its workdir holds
the final evaluation's scores (`is_finished`); `run_all` skips those, starts the others
one at a time, writes each one's output to <workdir>/train.log, and goes on past a run
that fails. A run trained with another config than its variant's now (the sweep file
was edited: `config_changes`) fails, named with the changes: neither its scores nor a
resume would be the variant's. A stop signal to the sweep is passed to the run in
progress, which saves a checkpoint and stops (training/preemption.py); running the sweep
again continues it.
"""

import ctypes
import dataclasses
import datetime
import functools
import importlib.machinery
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Sequence

import ml_collections

from common.decoding_names import describe_decoding
from common.errors import UserInputError
from common.workdir import Workdir
from configs.sweeps import Variant

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPOSITORY, "train.py")
LOG_NAME = "train.log"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # A folder name, and no ':' (the config flag's separator).


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A loaded sweep file: its absolute path, its variants (the first is the reference row) and configs."""

    path: str
    variants: tuple[Variant, ...]
    get_config: Callable[[str], ml_collections.ConfigDict]

    def variant(self, name: str) -> Variant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise UserInputError(f"No variant {name!r} in {self.path}; its variants: {', '.join(self.names())}.")

    def names(self) -> list[str]:
        return [variant.name for variant in self.variants]

    def run_config(self, run: "Run") -> ml_collections.ConfigDict:
        """The config `run` trains with: its variant's, with its seed (`command` passes it as a flag)."""
        config = self.get_config(run.variant)
        config.seed = run.seed
        return config


@dataclasses.dataclass(frozen=True)
class Run:
    """One (variant, seed) of a sweep and where it trains."""

    variant: str
    seed: int
    workdir: str

    @property
    def label(self) -> str:
        return f"{self.variant}/seed_{self.seed}"


def load_sweep(path: str) -> Sweep:
    """Reads a sweep file (see configs/sweeps/__init__.py): its VARIANTS and get_config.

    Raises:
        UserInputError: the file is missing, or lacks VARIANTS or get_config, or its variant names
            are repeated or not usable as folder names.
    """
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise UserInputError(f"No sweep file {path}; give --sweep=configs/sweeps/<name>.py.")
    if ":" in path:  # train.py's --config=<file>:<variant> ends the file at the first ':'.
        raise UserInputError(
            f"The sweep file's path {path} holds a ':', which train.py cannot read; rename or move it."
        )
    module = types.ModuleType("sweep_file")
    module.__file__ = path
    importlib.machinery.SourceFileLoader("sweep_file", path).exec_module(module)
    variants, get_config = getattr(module, "VARIANTS", None), getattr(module, "get_config", None)
    if not variants or not callable(get_config) or not all(isinstance(variant, Variant) for variant in variants):
        raise UserInputError(f"{path} is not a sweep file: it needs VARIANTS (a sequence of Variant) and get_config.")
    try:
        inspect.signature(get_config).bind("base")
    except TypeError:
        raise UserInputError(
            f"{path}: get_config must take the variant's name, as get_config(variant='base')."
        ) from None
    names = [variant.name for variant in variants]
    if len(set(names)) != len(names):
        raise UserInputError(f"{path}: variant names repeat: {', '.join(names)}.")
    if bad := [name for name in names if not _NAME.fullmatch(name)]:
        raise UserInputError(f"{path}: variant names must be letters, digits, '_', '.' or '-': {', '.join(bad)}.")
    return Sweep(path, tuple(variants), get_config)


def select_variants(sweep: Sweep, only: Sequence[str] | None) -> list[str]:
    """The variants to run: those named in `only` (in the sweep's order), or all.

    Raises:
        UserInputError: `only` names a variant the sweep does not have.
    """
    if not only:
        return sweep.names()
    for name in only:
        sweep.variant(name)
    return [name for name in sweep.names() if name in only]


def plan_runs(root: str, variants: Sequence[str], num_seeds: int) -> list[Run]:
    """Every (variant, seed), seed by seed: a sweep stopped early has seed 0 of every variant first."""
    root = os.path.abspath(root)
    return [
        Run(variant, seed, os.path.join(root, variant, f"seed_{seed}"))
        for seed in range(num_seeds)
        for variant in variants
    ]


def seeds_present(root: str, variants: Sequence[str]) -> int:
    """1 + the highest seed any of `variants` has a run folder for under `root` (0 if none)."""
    seeds = [
        int(match[1])
        for variant in variants
        if os.path.isdir(os.path.join(root, variant))
        for name in os.listdir(os.path.join(root, variant))
        if (match := re.fullmatch(r"seed_(\d+)", name))
    ]
    return max(seeds, default=-1) + 1


def command(sweep: Sweep, run: Run) -> list[str]:
    """The train.py command of `run`, with absolute paths: it runs as it is from any folder."""
    return [
        sys.executable,
        TRAIN_SCRIPT,
        f"--config={sweep.path}:{run.variant}",
        f"--config.seed={run.seed}",
        f"--workdir={run.workdir}",
    ]


def pending_commands(sweep: Sweep, runs: Sequence[Run]) -> tuple[list[str], list[tuple[Run, str]]]:
    """The shell command lines of the runs not finished yet, one per run (for a job array), and the runs
    left out, with why: their config cannot be built, or they were trained with another config."""
    lines, left_out = [], []
    for run in runs:
        try:
            config = sweep.run_config(run)
        except UserInputError as e:
            left_out.append((run, f"its config cannot be built: {e}"))
            continue
        if changes := config_changes(config, run.workdir):
            left_out.append((run, _changed_config(sweep, run, changes)))
        elif not is_finished(config, run.workdir):
            lines.append(shlex.join(command(sweep, run)))
    return lines, left_out


# Fields a run may change without changing what it trains (so its results still stand for its
# variant): when and how it logs, saves, evaluates and compiles. Not the mesh (its batch shards
# set the global batch) nor the stream's workers (a new number restarts the data order). The
# number of steps may grow (the run resumes); the final scores say how far it got.
_FREE_TO_CHANGE = (
    "log_every_steps",
    "eval_every_steps",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "compilation_cache_dir",
    "peak_flops_per_device",
    "step_compilation",
    "dataset.data_dir",
    "model.attention_implementation",
    "eval.",
)


def config_changes(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
    """How `config` differs from the config the run in `workdir` saved when it last started.

    Only fields that change what is trained count (not `_FREE_TO_CHANGE`, nor more steps), and
    only fields both configs have: a field added to the code since keeps the behaviour it replaced.
    A path into this checkout that named the same file in the checkout the run started from (the
    bundled corpus, after the checkout moved) is no change (`_moved_with_the_checkout`).

    Returns:
        e.g. ['model.dropout_rate: 0.1 → 0.3']; [] if nothing changed or the run has not started.
    """

    try:
        with open(Workdir(workdir).config, encoding="utf-8") as f:
            saved = _flat(json.load(f))
    except FileNotFoundError:
        return []
    current = _flat(json.loads(config.to_json_best_effort(sort_keys=True)))  # Tuples as lists, as saved.
    return [
        f"{name}: {saved[name]!r} → {current[name]!r}"
        for name in sorted(saved.keys() & current.keys())
        if saved[name] != current[name]
        and not name.startswith(_FREE_TO_CHANGE)
        and not (name == "num_train_steps" and current[name] > saved[name])
        and not _moved_with_the_checkout(saved[name], current[name])
    ]


def _moved_with_the_checkout(saved, current) -> bool:
    """Whether `current`, an absolute path into this checkout, is `saved` with another checkout's folder before it.

    Configs name the bundled corpus by its absolute path (configs/quickstart.py): a checkout moved or
    renamed between a run's start and now gives another spelling of the same file. The training run
    itself checks that it resumes on the same records (input_pipeline/streaming.records_digest).
    """
    if not (isinstance(saved, str) and isinstance(current, str) and os.path.isabs(current)):
        return False
    inside = os.path.relpath(current, REPOSITORY)
    return not inside.startswith(os.pardir) and saved.endswith(os.sep + inside)


def _flat(tree: dict, prefix: str = "") -> dict:
    """{'model.d_model': 512, ...} of a nested dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _changed_config(sweep: Sweep, run: Run, changes: Sequence[str]) -> str:
    return (
        f"trained with another config than {sweep.path} gives now ({'; '.join(changes)}): "
        f"move {run.workdir} away to train it again"
    )


def scores_path(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Where training's final evaluation writes its scores."""
    return Workdir(workdir).scores(config.eval.split)


def final_scores(config: ml_collections.ConfigDict, workdir: str) -> dict | None:
    """The scores of the evaluation after the last step config asks for; None if the run has not got there.

    Scores of an earlier step (a run whose sweep file now asks for more steps) do not count, nor
    those a later `train.py --mode=eval` wrote over them for other parameters (best, an average)
    or another decoding: a sweep's table compares runs evaluated alike. Nor do the scores of a
    run trained with another config (`config_changes`).
    """

    if config_changes(config, workdir):
        return None  # Trained as another variant.
    try:
        with open(scores_path(config, workdir), encoding="utf-8") as f:
            scores = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    expected = {
        "step": config.num_train_steps,
        "checkpoint": f"step {config.num_train_steps}",
        "decoding": describe_decoding(config.eval),
        "max_decode_length": config.eval.max_decode_length,
    }
    return scores if scores.items() >= expected.items() else None


def is_finished(config: ml_collections.ConfigDict, workdir: str) -> bool:
    """Whether the run in `workdir` trained all of config's steps and evaluated the result."""
    return final_scores(config, workdir) is not None


class SweepStopped(Exception):
    """A stop signal came; the run in progress saved its step (train.py) and the sweep stops."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


@dataclasses.dataclass
class Outcome:
    """What `run_all` did: runs trained to the end, skipped as finished, and failed (with why)."""

    finished: list[Run] = dataclasses.field(default_factory=list)
    skipped: list[Run] = dataclasses.field(default_factory=list)
    failed: list[tuple[Run, str]] = dataclasses.field(default_factory=list)


def run_all(sweep: Sweep, runs: Sequence[Run], *, echo: Callable[[str], None] = print) -> Outcome:
    """Trains every unfinished run, one train.py process at a time; see the module docstring.

    Raises:
        SweepStopped: SIGINT or SIGTERM came; it was passed on to the run in progress, which saved its step.
    """
    outcome = Outcome()
    with _ForwardedSignals() as signals:
        for index, run in enumerate(runs, 1):
            if signals.received is not None:  # Between two runs.
                raise signals.stopped(f"before {run.label}")
            try:
                config = sweep.run_config(run)
            except UserInputError as e:
                outcome.failed.append((run, f"its config cannot be built: {e}"))
                echo(f"[{index}/{len(runs)}] {run.label}: FAILED, its config cannot be built: {e}")
                continue
            if changes := config_changes(config, run.workdir):
                outcome.failed.append((run, _changed_config(sweep, run, changes)))
                echo(f"[{index}/{len(runs)}] {run.label}: FAILED, {outcome.failed[-1][1]}")
                continue
            if is_finished(config, run.workdir):
                outcome.skipped.append(run)
                echo(f"[{index}/{len(runs)}] {run.label}: finished before, skipped.")
                continue
            echo(f"[{index}/{len(runs)}] {run.label}: training in {run.workdir} (log: {_log_path(run)})")
            status = _train(sweep, run, signals)
            if signals.received is not None:
                raise signals.stopped(f"during {run.label} (train.py: {_describe(status)}; log: {_log_path(run)})")
            if status == 0 and is_finished(config, run.workdir):
                outcome.finished.append(run)
                echo(f"[{index}/{len(runs)}] {run.label}: finished.")
                continue
            why = _describe(status) if status else "exit status 0 but no final scores"
            outcome.failed.append((run, f"{why}: {_last_error(_log_path(run))}; log: {_log_path(run)}"))
            echo(f"[{index}/{len(runs)}] {run.label}: FAILED ({outcome.failed[-1][1]})")
    return outcome


_LOG_HEADER = "# sweep.py, "  # Opens each attempt's part of a run's log.
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _log_path(run: Run) -> str:
    return os.path.join(run.workdir, LOG_NAME)


def _train(sweep: Sweep, run: Run, signals: "_ForwardedSignals") -> int:
    """Runs train.py for `run`, its output appended to its log; returns its exit status."""
    os.makedirs(run.workdir, exist_ok=True)
    args = command(sweep, run)
    with open(_log_path(run), "a", encoding="utf-8") as log:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        log.write(f"{_LOG_HEADER}{started}: {shlex.join(args)}\n")
        log.flush()
        # Its own session: a Ctrl-C in the terminal reaches the sweep only, which passes it on
        # once (a second Ctrl-C would end train.py at once, without saving). Progress bars
        # every 30 s: the log is a file.
        child = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_stop_when_parent_dies, os.getpid()),
            env={**os.environ, "TQDM_MININTERVAL": "30"},
        )
        signals.child = child
        if signals.received is not None and not signals.forwarded:  # It came while train.py was starting.
            child.send_signal(signals.received)
            signals.forwarded = True
        try:
            return child.wait()
        finally:
            signals.child = None


def _stop_when_parent_dies(parent: int) -> None:
    """In train.py's process before it starts: SIGTERM it (a clean stop) if the sweep dies.

    Else a sweep killed outright (SIGKILL, the out-of-memory killer) would leave train.py
    training, its workdir locked against the same sweep command run again. Linux only.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # Not Linux.
        return
    if os.getppid() != parent:  # The sweep died before prctl: no signal will come.
        os.kill(os.getpid(), signal.SIGTERM)


def _describe(status: int) -> str:
    """'exit status 2', or 'killed by SIGKILL' (Popen's negative status)."""
    return f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"


def _last_error(log_path: str) -> str:
    """The log's last `error:` line, or else its last line: why a run failed, in a line."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    except OSError:
        return "no log"
    # The log holds every attempt of the run, each after its '# sweep.py' header: only the last one's lines count.
    lines = lines[max((i for i, line in enumerate(lines) if line.startswith(_LOG_HEADER)), default=0) :]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["empty log"])[-1]


class _ForwardedSignals:
    """A context in which SIGINT and SIGTERM are passed on to the train.py process in progress.

    train.py saves its step and stops on the first signal and ends at once on a second one,
    so each signal the sweep gets is passed on once. The previous handlers come back on leaving.
    """

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.received: int | None = None
        self.forwarded = False  # Whether the train.py in progress has been sent the signal.
        self._previous = {}

    def __enter__(self) -> "_ForwardedSignals":
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            self._previous[signal_number] = signal.signal(signal_number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signal_number, handler in self._previous.items():
            signal.signal(signal_number, handler)

    def stopped(self, where: str) -> SweepStopped:
        """The exception that stops the sweep after the signal received; `where`: 'during heads_1/seed_0 (...)'."""
        name = signal.Signals(self.received).name
        return SweepStopped(f"Stopped by {name} {where}; run the same command to continue.", 128 + self.received)

    def _handle(self, signal_number: int, frame) -> None:
        del frame
        self.received = self.received or signal_number
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal_number)
            self.forwarded = True
