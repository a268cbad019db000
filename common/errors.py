"""The one exception type for mistakes a user can fix (bad config, data, workdir)."""


class UserInputError(Exception):
    """A problem with the user's input, reported as one line naming the fix.

    `train.py` turns it into a message on stderr and a non-zero exit status, with
    no traceback; anything else is a bug and keeps its traceback.
    """


class TrainingStopped(Exception):
    """Training stopped before its last step, on purpose: a stop signal, or values that are not finite.

    `train.py` prints the message (one line) and exits with `exit_status`, with no
    traceback; what could be saved has been saved.
    """

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status
