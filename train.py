r"""Trains or evaluates the Transformer.

  python train.py --config=configs/quickstart.py --workdir=runs/quickstart
  python train.py --config=configs/quickstart.py --workdir=runs/quickstart --mode=eval --checkpoint=best
  python train.py --config=configs/quickstart.py --workdir=runs/quickstart --mode=prepare  # data and tokenizer

Any config field can be overridden, e.g. --config.model.num_layers=2.

On several hosts, run the same command on each, with the workdir on storage they
all see, adding --coordinator_address=HOST0:PORT --num_processes=N --process_id=I
(or nothing under SLURM or Open MPI; --distributed=on on a Cloud TPU pod).
"""

import contextlib
import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from common import io_errors, processes, workdir
from common.errors import TrainingStopped, UserInputError
from common.workdir import Workdir
from training.config_checks import validate_config
from training.reporting.logs import quiet_library_logs
from training.runtime import compilation_cache, distributed, host_memory

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
_MODE = flags.DEFINE_enum(
    "mode",
    "train",
    ["train", "eval", "prepare"],
    "train: train (resuming), then evaluate config.eval.split; eval: evaluate a checkpoint; prepare: prepare "
    "the dataset and train the tokenizer in the workdir (what a first training run does first), then stop.",
)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint",
    "latest",
    "With --mode=eval: the parameters to evaluate. latest; best (the best validation score during training: BLEU, "
    "or accuracy for classification); "
    "average:N (the mean of the last N checkpoints); or a step number.",
)
_SAVE_AVERAGE = flags.DEFINE_bool(
    "save_average", False, "With --mode=eval --checkpoint=average:N: also save the mean in <workdir>/averaged/."
)
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "Several processes: HOST:PORT of process 0, the same on every process."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Several processes: how many.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Several processes: this one's index, from 0.", lower_bound=0)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    list(distributed.MODES),
    "auto: join other processes when the three flags above are given or SLURM/Open MPI started several; "
    "on: always (JAX finds the processes of a Cloud TPU pod, SLURM, Open MPI, Kubernetes); off: one process.",
)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds",
    30,
    "Several processes: when one stops responding for this long, the others stop with an error.",
    lower_bound=1,
)
flags.mark_flags_as_required(["config", "workdir"])


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, but an unknown --config.* field is one `error:` line, not a traceback.

    ml_collections raises a bare KeyError/AttributeError for an override of a
    field the config does not have; every other flag error keeps absl's message.
    """
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError) as e:
        overrides = [arg[2:].split("=", 1)[0] for arg in argv[1:] if arg.startswith("--config.")]
        if not overrides:
            raise
        detail = e
        while isinstance(detail, BaseException) and detail.args:
            detail = detail.args[0]
        lines = [line.strip() for line in str(detail).splitlines() if line.strip()]
        field = lines[0].strip("'\"") if lines else ""
        bad = [o for o in overrides if field in o.split(".")]
        if bad:
            hint = f" ({'; '.join(lines[1:])})" if len(lines) > 1 else ""
            problem = f"the config has no field {field!r}{hint}"
        else:
            bad, problem = overrides, "; ".join(lines)
        print(
            f"error: --{', --'.join(bad)}: {problem}; only existing fields can be overridden (see the config file).",
            file=sys.stderr,
        )
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    try:
        logging.info("Host memory: %s.", host_memory.set_up())  # Before JAX starts its threads.
        quiet_library_logs()
        # Before anything compiles (connecting several processes does).
        compilation_cache.enable(config.compilation_cache_dir)
        distributed.initialize(  # Before anything starts a JAX backend (the config check counts devices).
            _COORDINATOR_ADDRESS.value,
            _NUM_PROCESSES.value,
            _PROCESS_ID.value,
            mode=_DISTRIBUTED.value,
            heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value,
        )
        validate_config(config)
        _run(config)
    except TrainingStopped as e:  # A stop signal or a diverged run: what could be saved is saved.
        # Every process stops after the same step, so JAX's orderly shutdown waits for no one.
        _exit(str(e), e.exit_status, others_may_wait=False)
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (start-up, evaluation): nothing unsaved.
        _exit("Interrupted by SIGINT; the checkpoints saved so far are intact.", 130)
    except Exception as e:  # pylint: disable=broad-except
        if (message := io_errors.user_error_message(e, _WORKDIR.value)) is None:
            raise
        if not isinstance(e, UserInputError):  # A storage failure.
            message += _intact_checkpoints(_WORKDIR.value)
        _exit(f"error: {message}", 2)


def _intact_checkpoints(workdir_path: str) -> str:
    """'; checkpoints up to step N are intact', for a storage error during training."""

    try:
        import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

        steps = ocp.path.step.checkpoint_steps(Workdir(workdir_path).checkpoints)
    except OSError:
        return ""
    return f"; checkpoints up to step {max(steps)} are intact" if steps else ""


def _exit(message: str, status: int, *, others_may_wait: bool = True) -> None:
    """Prints `message` on stderr and exits with `status`."""
    print(message, file=sys.stderr)
    if others_may_wait and distributed.is_connected():
        # The others may be waiting for this process in a collective. JAX's orderly
        # shutdown at exit would wait for them in turn (minutes); leaving at once
        # makes them stop with an error within the heartbeat timeout.
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _run(config) -> None:
    if not processes.is_main_process():
        logging.set_verbosity(logging.WARNING)  # One log for the run: process 0's.
    # One training run per workdir, checked before any data is prepared; evaluation may
    # run beside training. Process 0 holds the lock for all processes of the run.
    training = _MODE.value in ("train", "prepare")
    lock = workdir.training_lock(_WORKDIR.value) if training and processes.is_main_process() else None
    with lock or contextlib.nullcontext():
        logging.info("JAX devices: %s", jax.devices())

        from training import loop  # pylint: disable=g-import-not-at-top

        if _MODE.value == "prepare":
            loop.prepare_data(config, _WORKDIR.value)
        elif training:
            loop.train_and_evaluate(config, _WORKDIR.value)
        else:
            loop.evaluate_checkpoint(config, _WORKDIR.value, _CHECKPOINT.value, save_average=_SAVE_AVERAGE.value)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
