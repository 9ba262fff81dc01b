"""Checks that a value can be stored in a JSON column of both SQLite and PostgreSQL.

``NaN``/``Infinity`` are not JSON (SQLite's ``JSON_VALID`` and PostgreSQL's ``json`` reject
them) and PostgreSQL cannot store ``\\u0000`` in text or JSON. Values are checked before they
reach a transaction, so a bad value fails the command (or the stage) with a clear error instead
of a database error on every retry.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder


def storable_json_error(value: Any) -> str | None:
    """``None`` when ``value`` can be stored as JSON, else why not (naming the path)."""
    try:
        json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except ValueError as exc:
        return f"{exc} (NaN and Infinity are not JSON)"
    except TypeError as exc:
        return str(exc)
    path = _nul_path(value, "")
    if path is not None:
        where = f"{path} " if path else ""
        return f"{where}contains a NUL character (\\u0000), which cannot be stored"
    return None


def _nul_path(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return sub
            found = _nul_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _nul_path(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def storable_text(text: str) -> str:
    """``text`` with NUL characters made visible, so it can be stored in a text column."""
    return text.replace("\x00", "\\x00")


def json_type(value: Any) -> str:
    """The JSON name of a Python value's type (``null``, ``boolean``, ``number``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
