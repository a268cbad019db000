"""Stopping training cleanly on SIGTERM (preemption) or SIGINT (Ctrl-C), in one process or several.

Inside `StopSignals`, neither signal ends the process: the loop asks `requested(step)`
after dispatching each step and, once it answers True, saves a checkpoint of that
step, waits for every save to finish and raises `TrainingStopped`; train.py prints its
one line and exits with status 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT), what a shell reports for a process the signal killed, so job scripts and
schedulers that look for those statuses keep recognizing a stop by signal. Running
the same command again resumes from the saved step exactly. A SIGINT after the first
signal (Ctrl-C twice) ends the process at once with SIGINT's default action; a save cut
short that way is discarded and the run resumes from the checkpoint before it. More
SIGTERMs are the same request: a scheduler may send one to every process of a job
(SLURM's scancel), and sweep.py passes its own on to its train.py.

Several processes (jax.distributed) must stop after the same step, the one whose
checkpoint they save together, even when only one got the signal. JAX's preemption
sync manager does this: `jax.distributed.initialize` installs a SIGTERM handler of its
own that tells the coordination service, which agrees on a step no process has passed
yet, and `multihost_utils.reached_preemption_sync_point(step)` answers True at that
step in every process (Orbax's `CheckpointManager` asks it too, with the same step
numbers). A Python handler for SIGTERM would replace JAX's, so here SIGTERM is left to
it, and SIGINT is passed on to it as a SIGTERM to this process. A SIGTERM during
start-up, before the loop tells JAX its first step, may be missed (the agreement then
picks step 1, which a resumed run never reaches): the run goes on until the
scheduler's SIGKILL, which loses nothing that was saved.
"""

import os
import signal
import types

import jax
from jax.experimental import multihost_utils

from common.errors import TrainingStopped


def exit_status(signal_number: int) -> int:
    """The status of a process stopped by `signal_number`, as a shell reports a process it killed."""
    return 128 + signal_number


class StopSignals:
    """A context in which SIGTERM and SIGINT ask training to stop after the current step.

    The previous handlers come back on leaving it. Use one per training loop:

        with StopSignals(first_step) as stop:
            for step in ...:
                <dispatch step>
                if stop.requested(step):
                    <save step, wait for the save>
                    raise stop.stopped(step, where)

    Args:
        first_step: the step the loop starts after (the restored one), so that with
            several processes a signal during the first step is acted on.
    """

    def __init__(self, first_step: int):
        self.received: int | None = None  # The first signal this process got, if any.
        # One process needs no agreement: its own handlers replace JAX's (if jax.distributed started it).
        self._several = jax.process_count() > 1
        self._first_step = first_step
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for signal_number in (signal.SIGINT,) if self._several else (signal.SIGINT, signal.SIGTERM):
            self._previous[signal_number] = signal.signal(signal_number, self._handle)
        if self._several:
            multihost_utils.reached_preemption_sync_point(self._first_step)  # Where the agreement starts counting.
        return self

    def __exit__(self, *exc_info) -> None:
        for signal_number, handler in self._previous.items():
            signal.signal(signal_number, handler)
        self._previous.clear()

    def _handle(self, signal_number: int, frame: types.FrameType | None) -> None:
        del frame
        if self.received is not None:
            return  # Another SIGTERM: the stop already requested.
        self.received = signal_number
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # A second Ctrl-C ends the process at once.
        if self._several:
            os.kill(os.getpid(), signal.SIGTERM)  # To JAX's handler, which tells the other processes.

    def requested(self, step: int) -> bool:
        """Whether every process stops after `step`; call it once after each step, in order."""
        if self._several:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    def received_unheeded(self) -> bool:
        """Whether this process got a signal after the last `requested` answered False.

        One process only: several processes could not agree on it any more (the steps are over).
        """
        return not self._several and self.received is not None

    def stopped(self, step: int, checkpoint_dir: str) -> TrainingStopped:
        """The exception that ends training once `step` is saved in `checkpoint_dir`."""
        if self.received is not None:
            cause, status = signal.Signals(self.received).name, exit_status(self.received)
        else:  # With several processes, JAX's handler took a SIGTERM to this process or another.
            cause, status = "a stop signal to one of the processes", exit_status(signal.SIGTERM)
        return TrainingStopped(
            f"Stopped by {cause} after step {step}, saved in {checkpoint_dir}; run the same command to resume.",
            status,
        )
