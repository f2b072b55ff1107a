"""One check per kind of config field, shared by the connector's section and the storage
section, so both read numbers and flags the same way and name the key the same way.

Values come from JSON (``--kv-transfer-config``), YAML (``config_file``) or the control RPC
(strings only over HTTP), so a number may arrive as ``"8"`` and a flag as ``"true"``; a bool
is never a number. Errors are ``ValueError("<where><key>: <what>")``: ``where`` is how the user
spells the section (``"storage."``, or ``""`` for the top level).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a config check at start-up
    names the missing extra instead of a store failing later)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses the module, a broken install
        return False


# No field means more than this (GiB, seconds, tokens, counts): a larger value would overflow
# a byte count (int(inf)) or a thread's timeout (threading.TIMEOUT_MAX ~9.2e9 s) later, far
# from the key that caused it.
LARGEST = 1e9


def _fail(where: str, key: str, what: str) -> ValueError:
    return ValueError(f"{where}{key}: {what}")


def number(
    where: str,
    key: str,
    value: Any,
    *,
    whole: bool = False,
    minimum: float | None = None,
    positive: bool = False,
) -> float | int:
    """``value`` as a float (or an int with ``whole``), within the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(where, key, f"expected {'an integer' if whole else 'a number'}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise _fail(where, key, f"expected a number, got {value!r}") from None
    if math.isnan(number):
        raise _fail(where, key, f"expected a number, got {value!r}")
    if not -LARGEST <= number <= LARGEST:  # inf ("Infinity" in JSON, ".inf" in YAML) too
        raise _fail(where, key, f"expected a finite number between -1e9 and 1e9, got {value!r}")
    if whole:
        if number != int(number):
            raise _fail(where, key, f"expected an integer, got {value!r}")
        number = int(number)
    if positive and number <= 0:
        raise _fail(where, key, f"must be > 0, got {value!r}")
    if minimum is not None and number < minimum:
        shown = int(minimum) if whole else minimum
        raise _fail(where, key, f"must be >= {shown}, got {value!r}")
    return number


def flag(where: str, key: str, value: Any) -> bool:
    """``value`` as a bool: true/false (also as text, or 1/0 as text)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise _fail(where, key, f"expected true or false, got {value!r}")
