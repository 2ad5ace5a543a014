"""Bounded readers for the YAML and JSON files masktrl reads: configs, ``run.yaml``, manifests,
summaries, warm-start records. Whatever a file holds, reading it ends in a value or in one
``MasktrlError`` line naming the file, never in a traceback, a hang or a silently changed value.

YAML (``load_yaml``, ``read_yaml``) is read with a ``yaml.SafeLoader`` that also refuses

* a key given twice in one mapping (PyYAML keeps the last one silently); a key that overrides
  one brought in by a merge key (``<<: *base``) is allowed, as YAML says;
* nesting deeper than ``MAX_DEPTH`` levels (PyYAML's composer recursed until Python's limit);
* a recursive alias (``&a [*a]``: a value that contains itself);
* a document whose aliases expand to more than ``MAX_NODES`` nodes (an "alias bomb": a few
  lines that, expanded by any later copy, dump or hash, hold billions of values).

JSON (``load_json``, ``read_json``) refuses nesting deeper than ``MAX_DEPTH`` and, unless
``finite=False``, ``NaN``, ``Infinity`` and numbers too large for a float (Python's ``json``
reads them as nan and inf).

Both read the text as UTF-8 (a byte-order mark is allowed) and name the line of a byte that is
not UTF-8.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from masktrl.errors import ConfigError, DataError, MasktrlError

MAX_DEPTH = 64
"""Deepest nesting (mappings and lists inside each other) a YAML or JSON file may have."""
MAX_NODES = 100_000
"""Most values a YAML document may hold once its aliases are expanded."""
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(Exception):
    """A limit of the bounded loader, with the line it was found on."""


def decode_text(data: bytes | str, source: str | Path, error: type[MasktrlError] = DataError) -> str:
    """``data`` as text: UTF-8 (a leading byte-order mark dropped), else ``error`` naming the
    line and the byte that is not UTF-8."""
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise error(f"{source}: not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})") from None


# --------------------------------------------------------------------------- YAML


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the limits of the module doc (``max_depth``, ``max_nodes``)."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._open = 0  # nodes being composed (the current depth)
        self._size: dict[int, tuple[int, int]] = {}  # id(node) -> (values once expanded, height)

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._size:
                raise _Refused(
                    f"recursive alias *{event.anchor} (line {event.start_mark.line + 1}): a value cannot contain itself"
                )
            node = super().compose_node(parent, index)
            self._check(node, self._size[id(node)], event.start_mark)
            return node
        mark = self.peek_event().start_mark
        self._open += 1
        if self._open > self.max_depth:
            raise _Refused(f"nested deeper than {self.max_depth} levels (line {mark.line + 1})")
        node = super().compose_node(parent, index)
        self._open -= 1
        if isinstance(node, SequenceNode):
            children = [self._size[id(c)] for c in node.value]
        elif isinstance(node, MappingNode):
            children = [self._size[id(c)] for pair in node.value for c in pair]
        else:
            children = []
        size = (1 + sum(c[0] for c in children), 1 + max((c[1] for c in children), default=0))
        self._size[id(node)] = size
        self._check(node, size, mark)
        return node

    def _check(self, node, size: tuple[int, int], mark) -> None:
        values, height = size
        if values > self.max_nodes:
            raise _Refused(
                f"its aliases expand to more than {self.max_nodes:,} values (line {mark.line + 1}): "
                "an alias bomb, or a file that is not a config"
            )
        if self._open + height > self.max_depth:
            raise _Refused(
                f"nested deeper than {self.max_depth} levels once its aliases are expanded (line {mark.line + 1})"
            )

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    where = f"lines {seen[key]} and {line}" if seen[key] != line else f"twice on line {line}"
                    raise _Refused(f"duplicate key {key!r} ({where}): give each key once")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str | bytes, source: str | Path, *, error: type[MasktrlError] = ConfigError) -> Any:
    """The one YAML document of ``text`` (None when empty), read with ``BoundedLoader``;
    ``error`` (one line, starting with ``source``) for anything it refuses or cannot parse."""
    try:
        return _load(decode_text(text, source, error))
    except _Refused as exc:
        raise error(f"{source}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise error(f"cannot parse {source}: {exc.problem or exc.context}{where}") from None
    except yaml.YAMLError as exc:
        raise error(f"cannot parse {source}: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None


def yaml_value(text: str, source: str, *, error: type[MasktrlError] = ConfigError) -> Any:
    """A command-line value read as YAML (``--set key=VALUE``): the value, or ``text`` itself
    when it is not YAML (``{prompt}: x``); ``error`` for what ``BoundedLoader`` refuses."""
    try:
        return _load(text)
    except _Refused as exc:
        raise error(f"{source}: {exc}") from None
    except yaml.YAMLError:
        return text


def _load(text: str) -> Any:
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:  # a limit of the loader always comes first; never a traceback
        raise _Refused("nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path, *, error: type[MasktrlError] = ConfigError) -> Any:
    """``load_yaml`` of the file at ``path`` (an OSError reading it is raised as it is)."""
    return load_yaml(Path(path).read_bytes(), path, error=error)


# --------------------------------------------------------------------------- JSON


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is too large for a float")
    return value


def _no_constant(name: str) -> float:
    raise _Refused(f"{name} is not a finite number")


def load_json(
    text: str | bytes,
    source: str | Path,
    *,
    error: type[MasktrlError] = DataError,
    finite: bool = True,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """The JSON value of ``text``; ``error`` (one line, starting with ``source``) for text that is
    not UTF-8 or not JSON, nesting deeper than ``max_depth``, and with ``finite`` a number that is
    not finite."""
    text = decode_text(text, source, error)
    hooks = {"parse_float": _finite_float, "parse_constant": _no_constant} if finite else {}
    try:
        value = json.loads(text, **hooks)
    except _Refused as exc:
        raise error(f"{source}: {exc}") from None
    except RecursionError:
        raise error(f"{source}: JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise error(f"{source}: not valid JSON ({(str(exc).splitlines() or ['?'])[0][:120]})") from None
    if json_depth(value) > max_depth:
        raise error(f"{source}: JSON nested deeper than {max_depth} levels")
    return value


def read_json(
    path: str | Path, *, error: type[MasktrlError] = DataError, finite: bool = True, max_depth: int = MAX_DEPTH
) -> Any:
    """``load_json`` of the file at ``path`` (an OSError reading it is raised as it is)."""
    return load_json(Path(path).read_bytes(), path, error=error, finite=finite, max_depth=max_depth)


def json_depth(value: Any) -> int:
    """How deeply lists and mappings nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        todo.extend((c, depth + 1) for c in children)
    return deepest
