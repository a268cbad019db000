"""The packages each export format needs (the `export` extra), checked before any work starts."""

import importlib.util

from common.errors import UserInputError

PACKAGES = {
    "ctranslate2": ("ctranslate2",),
    "huggingface": ("transformers", "tokenizers", "safetensors", "torch"),
}


def check_installed(export_format: str) -> None:
    """Checks that the packages `export_format` writes with can be imported.

    Raises:
        UserInputError: naming the missing packages and the extra that installs them.
    """
    missing = [name for name in PACKAGES.get(export_format, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise UserInputError(
            f"--format={export_format} needs {', '.join(missing)}, not installed: "
            'pip install -e ".[export]" installs the export extra.'
        )
