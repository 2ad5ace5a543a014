"""Dotted paths into a dataset row's nested fields: ``reward_model.ground_truth``, ``prompt.0.content``.

A path is split at dots; each part indexes a mapping by key, or a list by (possibly negative)
integer. Used for ``task.prompt_key`` / ``task.answer_key`` and for ``{field}`` in templates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


def get_path(row: Any, path: str, default: Any = _MISSING) -> Any:
    """The value at ``path`` in ``row``; KeyError (or ``default``) when a part is absent."""
    node = row
    for part in path.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and _is_int(part) and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            if default is _MISSING:
                raise KeyError(path)
            return default
    return node


def has_path(row: Any, path: str) -> bool:
    absent = object()
    return get_path(row, path, absent) is not absent


def field_names(row: Any, prefix: str = "", depth: int = 3) -> list[str]:
    """Every dotted path of ``row``'s mappings (lists are not expanded), parents before children:
    ``["data_source", "reward_model", "reward_model.ground_truth", ...]``."""
    names: list[str] = []
    if not isinstance(row, Mapping) or depth == 0:
        return names
    for key, value in row.items():
        name = f"{prefix}{key}"
        names.append(name)
        if isinstance(value, Mapping):
            names.extend(field_names(value, name + ".", depth - 1))
    return names


def fields_hint(row: Any, limit: int = 40) -> str:
    """``available fields of the first row: a, b, b.c`` (shortened past ``limit`` names)."""
    names = field_names(row)
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return f"available fields of the first row: {shown or '(none)'}"


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()
