"""TensorFlow as if not installed (the `tensorflow` extra left out), for tests where it is installed.

`python tests/without_tensorflow.py SCRIPT ARGS...` runs SCRIPT so; the fixture `without_tensorflow`
(conftest.py) does it within a test.
"""

import os
import runpy
import sys


class _Hiding:
    """An import finder that finds what `finder` finds, but no `tensorflow` (nor any of its submodules)."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            return None  # As where it is missing: `import` fails, `importlib.util.find_spec` gives None.
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self._finder, attribute)  # invalidate_caches(), ...


def finders_without_tensorflow(meta_path: list) -> list:
    """`sys.meta_path`, each finder blind to TensorFlow."""
    return [_Hiding(finder) for finder in meta_path]


if __name__ == "__main__":
    sys.meta_path[:] = finders_without_tensorflow(sys.meta_path)
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # The script's folder, as `python SCRIPT` has it.
    runpy.run_path(sys.argv[0], run_name="__main__")
