"""Process roles: which process writes the run's files, and waiting for the others.

With one process (the usual case on one host) every function here is trivial. With
several (training/runtime/distributed.py connects them), process 0 prepares what all of them
read (a dataset, a tokenizer) while the others wait at a barrier.
"""

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils


def is_main_process() -> bool:
    """Whether this process writes the run's files (logs, summaries, evaluation output, tokenizer)."""
    return jax.process_index() == 0


def main_process_answer(answer: bool) -> bool:
    """Process 0's `answer`, in every process: for a choice all of them must make alike from files only it reads."""
    if jax.process_count() == 1:
        return answer
    return bool(multihost_utils.broadcast_one_to_all(np.bool_(answer)))


def every_process_answer(answer: bool) -> bool:
    """Whether `answer` is True in every process, in every process: for a choice all of them must make alike from
    what each reads alone. Every process must call it."""
    if jax.process_count() == 1:
        return answer
    return bool(np.all(multihost_utils.process_allgather(np.bool_(answer))))


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier `name` (a no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def main_process_first(name: str) -> Iterator[None]:
    """Runs the block on process 0 first, then on the others.

    For work whose files the other processes then read instead of writing them
    again (a prepared dataset, a trained tokenizer). `name` names the barrier.
    """
    if not is_main_process():
        barrier(name)
    yield
    if is_main_process():
        barrier(name)
