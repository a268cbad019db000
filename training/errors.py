"""The one exception type for mistakes a user can fix (bad config, data, workdir)."""


class UserInputError(Exception):
    """A problem with the user's input, reported as one line naming the fix.

    `train.py` turns it into a message on stderr and a non-zero exit status, with
    no traceback; anything else is a bug and keeps its traceback.
    """
