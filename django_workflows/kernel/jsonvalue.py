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

#: Why a value nested deeper than Python's recursion allows cannot be stored.
TOO_DEEP = "is nested too deeply to store (more than about 900 levels of arrays and objects)"


def storable_json_error(value: Any) -> str | None:
    """``None`` when ``value`` can be stored as JSON, else why not (naming the path).

    Never raises: a value nested too deeply to encode is reported (:data:`TOO_DEEP`) instead
    of raising ``RecursionError`` out of the command or the stage's error handling.
    """
    try:
        json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except ValueError as exc:
        return f"{exc} (NaN and Infinity are not JSON)"
    except TypeError as exc:
        return str(exc)
    except RecursionError:
        return TOO_DEEP
    try:
        found = _bad_text(value, "")
    except RecursionError:
        return TOO_DEEP
    if found is not None:
        path, problem = found
        where = f"{storable_text(path)} " if path else ""
        return f"{where}contains {problem}, which cannot be stored"
    return None


_NUL = "a NUL character (\\u0000)"
_SURROGATE = "a lone UTF-16 surrogate (such as \\ud800)"


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return _NUL
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE
    return None


def _bad_text(value: Any, path: str) -> tuple[str, str] | None:
    """The path of the first string (or key) a text column cannot hold, and why."""
    if isinstance(value, str):
        problem = _text_problem(value)
        return (path, problem) if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            problem = _text_problem(str(key))
            if problem:
                return sub, problem
            found = _bad_text(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _bad_text(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def storable_text(text: str) -> str:
    """``text`` with NUL characters and lone surrogates made visible, so it can be stored in a
    text column (and sent as UTF-8).
    """
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


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


def loads_json(text: str) -> Any:
    """``json.loads(text)`` for text a person typed (a CLI option, an admin form field).

    Raises:
        json.JSONDecodeError: not JSON, or nested too deeply for Python's parser (which
            would otherwise raise ``RecursionError`` and show a traceback or a 500 page).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(
            "nested too deeply (more than about 900 levels of arrays and objects)", text, 0
        ) from None
