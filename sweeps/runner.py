"""A sweep's runs: every (variant, seed) of a sweep file, where it trains, its command, and whether it is done.

Each run is the command `train.py --config=<sweep file>:<variant> --config.seed=<seed>
--workdir=<root>/<variant>/seed_<seed>`, so a run of the sweep is an ordinary training
run: train.py resumes it from its latest checkpoint, and it can be run by hand or
submitted to a cluster as it is (`pending_commands`). A run is finished when its workdir
holds the final evaluation's scores (`is_finished`). A run trained with another config
than its variant's now (the sweep file was edited: `config_changes`) is not trained on,
named with the changes: neither its scores nor a resume would be the variant's.
sweeps/train_processes.py trains the unfinished runs, one train.py process at a time.
"""

import dataclasses
import importlib.machinery
import inspect
import json
import os
import re
import shlex
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
    """One (variant, seed) of a sweep and where it trains (or, read from a ledger, its entry: sweeps/ledger.py)."""

    variant: str
    seed: int
    workdir: str
    references: str | None = None  # The test references where they are not beside the hypotheses (a ledger's).

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


def prepared_folder(root: str) -> str:
    """Where a sweep prepares its dataset and trains its tokenizer once, for all its runs (`prepare_command`)."""
    return os.path.join(os.path.abspath(root), "prepared")


def prepare_command(sweep: Sweep, root: str) -> list[str]:
    """The train.py command that prepares the dataset and trains the tokenizer of the sweep's first variant."""
    return [
        sys.executable,
        TRAIN_SCRIPT,
        f"--config={sweep.path}:{sweep.variants[0].name}",
        "--mode=prepare",
        f"--workdir={prepared_folder(root)}",
    ]


def command(sweep: Sweep, run: Run, root: str) -> list[str]:
    """The train.py command of `run`, with absolute paths: it runs as it is from any folder.

    A dataset prepared in the workdir (config.dataset.data_dir '') is read where the sweep prepared it
    once, under `root`; the tokenizer the sweep trained once is in the workdir before it starts.
    """
    shared_data = []
    if not sweep.run_config(run).dataset.data_dir:
        shared_data = [f"--config.dataset.data_dir={Workdir(prepared_folder(root)).tfds}"]
    return [
        sys.executable,
        TRAIN_SCRIPT,
        f"--config={sweep.path}:{run.variant}",
        f"--config.seed={run.seed}",
        *shared_data,
        f"--workdir={run.workdir}",
    ]


def pending_commands(sweep: Sweep, runs: Sequence[Run], root: str) -> tuple[list[str], list[tuple[Run, str]]]:
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
            left_out.append((run, changed_config(sweep, run, changes)))
        elif not is_finished(config, run.workdir):
            lines.append(shlex.join(command(sweep, run, root)))
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
    "loss_chunks",
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


def changed_config(sweep: Sweep, run: Run, changes: Sequence[str]) -> str:
    """Why `run` is not trained on: its workdir holds a run of another config (`config_changes`)."""
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
