"""Checks of one config field that every part's config checks share, each naming the field.

`field` is the field's dotted path below `config` ('model.d_model'); the error says what to fix.
"""

from collections.abc import Sequence
from typing import Any

from common.errors import UserInputError


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive(field: str, value: Any) -> None:
    if not value > 0:
        raise UserInputError(f"config.{field} is {value!r}; it must be positive.")


def require_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise UserInputError(f"config.{field} is {value!r}; choose one of {choices}.")


def require_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserInputError(f"config.{field} is {value!r}; it must be True or False.")
