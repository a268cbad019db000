"""The training loop and checkpoint evaluation, as called by train.py, for any task (`training.tasks`)."""

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
from absl import logging
from tqdm import tqdm

from common import processes, records
from common.errors import TrainingStopped, UserInputError
from common.workdir import Workdir
from models.build import compute_dtype, is_classification
from models.classifier import Classifier
from models.transformer import TransformerConfig
from training import divergence, flops, preemption
from training.checkpoints.checkpointer import Checkpointer, save_params
from training.inference import load_trained_model, save_config
from training.optimizer import make_optimizer
from training.phases import PhaseClock, process_age_seconds
from training.reporting import attempts, metric_log
from training.reporting.metrics_writer import MetricWriter
from training.runtime import sharding
from training.state import TrainState, abstract_state, initial_state, state_shardings
from training.steps import configured_train_step
from training.tasks import base, classification, translation


def make_task(config: ml_collections.ConfigDict) -> base.Task:
    """The task config.task names: 'translation' (the default) or 'classification'."""
    return classification.ClassificationTask() if is_classification(config) else translation.TranslationTask()


def prepare_data(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Prepares the run's dataset (config.dataset.data_dir) and trains its tokenizer into `workdir`, as
    `train_and_evaluate` does first; a sweep does it once for all its runs (sweeps/train_processes.py).

    Logs an attempt (<workdir>/attempts.jsonl): the code, platform, devices and dtype a run would train with.
    """
    clock = PhaseClock()
    with clock.counting_compiles(), _attempt_logged(config, clock, workdir), clock.phase("setup"):
        make_task(config).load_data(config, workdir, _splits(config), allow_training_tokenizer=True)


def _splits(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The splits a training run reads: train, validation and the evaluated one."""
    dataset = config.dataset
    return tuple(dict.fromkeys((dataset.train_split, dataset.valid_split, config.eval.split)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains (resuming from the workdir's latest checkpoint), then evaluates config.eval.split.

    The attempt (its code, devices and seconds per phase) is appended to <workdir>/attempts.jsonl.

    Returns:
        The evaluation scores (also in <workdir>/eval/<split>/scores.json).

    Raises:
        TrainingStopped: SIGTERM or SIGINT came (the step reached is saved first:
            training/preemption.py), or a step was not finite (config.nonfinite:
            training/divergence.py).
    """
    clock = PhaseClock()
    with clock.counting_compiles(), _attempt_logged(config, clock, workdir):
        with clock.phase("setup"):
            task = make_task(config)
            corpus = task.load_data(config, workdir, _splits(config), allow_training_tokenizer=True)
            mesh = sharding.make_mesh(config.mesh)
            logging.info("Mesh %s, %s step.", dict(mesh.shape), config.step_compilation)
            model = task.make_model(config, corpus)
            throughput = _Throughput.of(config, model)  # Before the data stream takes CPU from a measured peak.
            tx, learning_rate_fn = make_optimizer(config.optimizer, d_model=config.model.d_model)
            shardings = state_shardings(config, model, tx, mesh)
            checkpointer = Checkpointer(workdir, keep=config.keep_checkpoints)
            if (restored := restore_latest_checkpoint(checkpointer, config, model, tx, mesh)) is not None:
                state, position = restored
                logging.info("Resumed from step %d (data position %s).", int(state.step), position)
            else:
                state, position = initial_state(config, model, tx, shardings), None
            # Only once the tokenizer and the checkpoint have been found to fit: a rejected restart
            # leaves the config.json that translate.py reads as it was.
            if jax.process_index() == 0:
                save_config(config, workdir)  # For translate.py and evaluation without the config file.

            train_batches = task.train_batches(config, corpus, mesh, position, int(state.step))
            loss_fn = task.loss_fn(config, model)
            train_step = configured_train_step(config, loss_fn, tx, learning_rate_fn, mesh, shardings)
            evaluator = task.evaluator(config, model, corpus, mesh)
            writers = {name: MetricWriter(workdir, name) for name in ("train", "valid")}
            if int(state.step) == 0:
                writers["train"].write(0, {"num_params": sum(x.size for x in jax.tree.leaves(state.params))})
        with contextlib.closing(train_batches), clock.phase("train"):
            state = _train(
                config,
                state,
                train_step,
                train_batches,
                evaluator,
                task.keep_best_metric,
                checkpointer,
                writers,
                throughput,
                clock,
                validate_first=_validation_missed(config, workdir, int(state.step)),
            )
        with clock.phase("evaluation"):
            scores = evaluator.evaluate(state.params, int(state.step), f"step {int(state.step)}", workdir)
        for writer in writers.values():
            writer.close()
        checkpointer.close()
    return scores


def _train(
    config: ml_collections.ConfigDict,
    state: TrainState,
    train_step,
    train_batches: base.TrainBatchIterator,
    evaluator: base.Evaluator,
    keep_best_metric: str,
    checkpointer: Checkpointer,
    writers: dict[str, MetricWriter],
    throughput: "_Throughput",
    clock: PhaseClock,
    validate_first: bool = False,
) -> TrainState:
    """Runs the steps from state.step to config.num_train_steps: logs, validates, saves, stops on a signal.

    clock: times validation as the 'evaluation' phase.
    validate_first: validate state.step before the first step (`_validation_missed`).

    Returns:
        The final state, its last save complete.

    Raises:
        TrainingStopped: as `train_and_evaluate`.
    """
    first_step = int(state.step)
    base_rng = state.rng.copy()  # Step keys fold in from it; the state's own buffers are donated.
    guard = divergence.NonFiniteGuard(
        config.nonfinite, config.max_nonfinite_in_a_row, functools.partial(_latest_checkpoint, checkpointer)
    )
    pending, interval_start = [], time.perf_counter()
    progress = tqdm(
        total=config.num_train_steps,
        initial=first_step,
        unit="step",
        dynamic_ncols=True,
        disable=jax.process_index() != 0,
    )
    with progress, preemption.StopSignals(first_step) as stop_signals, _saves_finished_when_stopped(checkpointer):
        if validate_first:  # Inside StopSignals: a signal now stops the run after its next step, saved.
            logging.info("Step %d was saved by a stop signal before its validation: validating it now.", first_step)
            with clock.phase("evaluation"):
                writers["valid"].write(first_step, _validate(evaluator, state, keep_best_metric, checkpointer))
            interval_start = time.perf_counter()  # Evaluation is not training time.
        step_state = train_step.enter(state)
        for step in range(first_step + 1, config.num_train_steps + 1):
            batch = train_step.place_batch(next(train_batches))
            step_state, metrics = train_step.run(step_state, batch, jax.random.fold_in(base_rng, step))
            guard.record(step, metrics["finite"])
            metrics = {**metrics, "model_flops": throughput.step_flops(batch)}
            if "targets" in batch:  # The target positions of the global batch, real or padding.
                metrics = {**metrics, "target_positions": batch["targets"].size}
            pending.append(metrics)
            progress.update()
            stopping = stop_signals.requested(step)  # Every process gives the same answer.
            last = step == config.num_train_steps
            log = step % config.log_every_steps == 0 or last or stopping
            evaluate = (step % config.eval_every_steps == 0 or last) and not stopping
            save = step % config.checkpoint_every_steps == 0 or last or stopping

            if log or evaluate or save:
                guard.check()  # Where the loop waits for the device anyway; always before evaluating or saving.
            if log:
                summary = _summarize(jax.device_get(pending), time.perf_counter() - interval_start, throughput.peak)
                writers["train"].write(step, summary)
                if "loss" in summary:
                    progress.set_postfix(
                        loss=f"{summary['loss']:.3f}",
                        tok_s=f"{summary['target_tokens_per_second']:.0f}",
                        **({"mfu": f"{summary['mfu']:.1%}"} if "mfu" in summary else {}),
                    )
                pending, interval_start = [], time.perf_counter()
            if evaluate or save:
                state = train_step.leave(step_state)
            if evaluate:
                jax.block_until_ready(state)  # Steps still running count as training time.
                eval_start = time.perf_counter()
                with clock.phase("evaluation"):
                    writers["valid"].write(step, _validate(evaluator, state, keep_best_metric, checkpointer))
                interval_start += time.perf_counter() - eval_start  # Evaluation is not training time.
            if save:
                checkpointer.save(state, train_batches.get_state())
            if stopping:
                raise stop_signals.stopped(step, checkpointer.directory)
        # Still inside StopSignals: a signal now cannot cut the last save short, and one that came
        # during the last step stops the run before the final evaluation (the step is saved).
        checkpointer.wait_until_finished()
        if stop_signals.received_unheeded():
            raise stop_signals.stopped(config.num_train_steps, checkpointer.directory)
    return train_step.leave(step_state)


def _validation_missed(config: ml_collections.ConfigDict, workdir: str, step: int) -> bool:
    """Whether the restored `step` is one to validate but has no validation record.

    A stop signal during such a step saves it without validating it, to be quick (a
    preemption's grace period is short): the resumed run validates it first, so that
    its scores are logged and its parameters can still become the best checkpoint.
    """
    if step == 0 or (step % config.eval_every_steps != 0 and step != config.num_train_steps):
        return False
    return processes.main_process_answer(processes.is_main_process() and step not in metric_log.read(workdir, "valid"))


def _validate(evaluator: base.Evaluator, state: TrainState, metric: str, checkpointer: Checkpointer) -> dict:
    """The validation scores of `state`; its parameters are kept apart if their `metric` is the best so far."""
    valid = evaluator.validate(state.params)
    step = int(state.step)
    # Finite parameters can still give a non-finite loss (the skipped steps of a diverging run).
    if (
        metric in valid
        and math.isfinite(valid["loss"])
        and checkpointer.save_if_best(step, state.params, valid[metric], metric)
    ):
        logging.info("Step %d has the best validation %s so far (%.4g): kept apart.", step, metric, valid[metric])
    return valid


def restore_latest_checkpoint(
    checkpointer: Checkpointer, config: ml_collections.ConfigDict, model, tx, mesh: jax.sharding.Mesh
) -> tuple[TrainState, dict | None] | None:
    """The newest intact step's train state, sharded on `mesh` as config.mesh.rules say, and this process's
    data position (None: none for this process count); None if there is no checkpoint.

    Damaged later steps are skipped, and moved aside where the checkpointer may write
    (`Checkpointer.restore_latest`). The checkpoint may come from
    any mesh: Orbax reads each device's shards. `model`, `tx` and the config's seed give the state's
    structure, without computing it.
    """
    return checkpointer.restore_latest(abstract_state(config, model, tx, mesh))


@contextlib.contextmanager
def _attempt_logged(config: ml_collections.ConfigDict, clock: PhaseClock, workdir: str) -> Iterator[None]:
    """Appends the attempt to <workdir>/attempts.jsonl when it ends, trained or stopped (`_attempt`)."""
    try:
        yield
    except TrainingStopped:
        _log_attempt(config, clock, workdir)
        raise
    _log_attempt(config, clock, workdir)


def _log_attempt(config: ml_collections.ConfigDict, clock: PhaseClock, workdir: str) -> None:
    """What ran the attempt and how long each phase took, as one line: the code commit, the machine, the
    devices and compute dtype, the last step logged, seconds since the process started and per phase.

    A run's time is the sum of its attempts' (sweeps/ledger.py). Process 0 writes.
    """
    if not processes.is_main_process():
        return
    device, host = jax.devices()[0], records.machine()
    attempt = {
        **records.source(warn=False),
        "step": max(metric_log.read(workdir, "train"), default=0),
        **{key: host[key] for key in ("cpu_model", "cpu_kind", "cores")},
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "dtype": compute_dtype(config.model.dtype),
        "software": records.software(),
        "wall_seconds": process_age_seconds(),
        "seconds": dict(clock.seconds),
    }
    attempts.append(Workdir(workdir).attempts, attempt)


@contextlib.contextmanager
def _saves_finished_when_stopped(checkpointer: Checkpointer) -> Iterator[None]:
    """Lets the saves in flight (all of good states) complete when training stops early, before the process ends."""
    try:
        yield
    except TrainingStopped:
        checkpointer.wait_until_finished()
        raise


def _latest_checkpoint(checkpointer: Checkpointer) -> str | None:
    """'step 300 in <workdir>/checkpoints', or None before the first save."""
    step = checkpointer.latest_step()
    return None if step is None else f"step {step} in {checkpointer.directory}"


@dataclasses.dataclass(frozen=True)
class _Throughput:
    """What turns a step's batch into model FLOPs, and the peak FLOP/s of all the run's devices."""

    model_config: TransformerConfig  # The encoder-decoder's, or the classifier's encoder's.
    peak: float | None  # FLOP/s of all devices together; None: not known (config.peak_flops_per_device < 0), no MFU.

    @classmethod
    def of(cls, config: ml_collections.ConfigDict, model) -> "_Throughput":
        model_config = model.config.encoder if isinstance(model, Classifier) else model.config
        if config.peak_flops_per_device < 0:
            logging.info("Compute dtype %s (model.dtype=%r); no MFU.", model_config.dtype, config.model.dtype)
            return cls(model_config, None)
        per_device, source = flops.peak_flops_per_device(model_config.dtype, config.peak_flops_per_device)
        logging.info(
            "Compute dtype %s (model.dtype=%r); MFU is model FLOP/s over %s devices x %.1f TFLOP/s (%s matmul peak).",
            model_config.dtype,
            config.model.dtype,
            jax.device_count(),
            per_device / 1e12,
            source,
        )
        return cls(model_config, per_device * jax.device_count())

    def step_flops(self, batch: dict) -> int:
        """Model FLOPs of a train step on the global `batch` ('inputs' and, when translating, 'targets').

        Arrays are [rows, length], or [devices, rows per device, length] under pmap.
        """
        *row_dims, source_length = batch["inputs"].shape
        rows = math.prod(row_dims)
        target_length = batch["targets"].shape[-1] if "targets" in batch else 0
        return flops.train_step_flops(self.model_config, rows, source_length, target_length)


def _summarize(metrics: list[dict[str, np.ndarray]], seconds: float, peak_flops: float | None) -> dict[str, float]:
    """Means over an interval's applied steps (token-weighted), skipped steps, real target tokens/s, MFU, and
    the interval's `seconds` of training (validation excluded; summed over the intervals of a run: its train time).

    Translation also gets 'real_token_fraction': the real (non-pad) share of the batches' target positions.
    'model_flops_per_second' counts every step's matmuls (training/flops.py); 'mfu' is it over `peak_flops` (if known).
    """
    tokens = np.array([m["tokens"] for m in metrics], np.float64)
    summary = {}
    if applied := [m for m in metrics if m["finite"]]:  # Skipped steps have non-finite losses.
        weights = np.array([m["tokens"] for m in applied], np.float64)
        for key in ("loss", "nll", "accuracy"):
            summary[key] = float(np.average([m[key] for m in applied], weights=weights))
        summary["grad_norm"] = float(np.mean([m["grad_norm"] for m in applied]))
    summary["learning_rate"] = float(metrics[-1]["learning_rate"])
    summary["seconds"] = seconds
    summary["steps_per_second"] = len(metrics) / seconds
    summary["target_tokens_per_second"] = float(tokens.sum()) / seconds
    summary["skipped_steps"] = float(len(metrics) - len(applied))
    summary["model_flops_per_second"] = sum(float(m["model_flops"]) for m in metrics) / seconds
    if peak_flops is not None:
        summary["mfu"] = summary["model_flops_per_second"] / peak_flops
    if "target_positions" in metrics[0]:
        summary["real_token_fraction"] = float(tokens.sum()) / sum(m["target_positions"] for m in metrics)
    return summary


def evaluate_checkpoint(
    config: ml_collections.ConfigDict, workdir: str, checkpoint: str = "latest", *, save_average: bool = False
) -> dict:
    """Evaluates a checkpoint of `workdir` on config.eval.split.

    Args:
        config: the run's config.
        workdir: the run's workdir.
        checkpoint: 'latest', 'best' (the best validation score during training), 'average:N' (the
            mean of the parameters of the last N checkpoints) or a step.
        save_average: with 'average:N', also save the mean parameters in <workdir>/averaged/<N>_<step>/.

    Returns:
        The scores (also in <workdir>/eval/<split>/scores.json), with 'checkpoint' describing the parameters.

    Raises:
        UserInputError: the workdir holds no checkpoint (nothing is written then), the choice is
            malformed or names checkpoints the workdir lacks, or a checkpoint does not fit the config's model.
    """
    task = make_task(config)
    if save_average and not checkpoint.strip().lower().startswith("average:"):
        raise UserInputError(f"Saving an average needs the checkpoint choice 'average:N', not {checkpoint!r}.")
    trained = load_trained_model(config, workdir, checkpoint)  # Before the corpus is read: errors come fast.
    selection = trained.selection
    if save_average:
        path = Workdir(workdir).averaged(selection.steps)
        save_params(path, trained.params, selection.steps)
        logging.info("Saved the %s in %s.", selection.description, path)
    corpus = task.load_data(config, workdir, (config.eval.split,), allow_training_tokenizer=False)
    evaluator = task.evaluator(config, trained.model, corpus, trained.mesh)
    return evaluator.evaluate(trained.params, selection.step, selection.description, workdir)
