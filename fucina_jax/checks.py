"""Type predicates shared by the argument checks of the public API."""

from __future__ import annotations

import numpy as np

__all__ = ["is_int", "is_real", "undecodable_byte"]


def is_int(v) -> bool:
    """An integer argument: a Python or NumPy int, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real-number argument: a Python or NumPy int or float, not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def undecodable_byte(text: str) -> tuple[int, int] | None:
    """(character index, byte) of the first byte Python could not decode as UTF-8 and kept as a lone surrogate
    (argv and stdin use surrogateescape), or None when the text is clean."""
    i = next((i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"), None)
    return None if i is None else (i, ord(text[i]) - 0xDC00)
