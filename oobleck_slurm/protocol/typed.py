"""JSON objects to frozen dataclasses and back, checked field by field: the one decoder of every value
that crosses a process boundary (control messages, store records).

Field types are checked from the annotations: str, int (not bool), float (an int is taken), bool,
`X | None`, `tuple[X, ...]` (a JSON list), fixed `tuple[A, B]` (a list of that length),
`dict[str, X]` (an object), a nested dataclass (an object) and `Any` (a value that its own reader
checks, such as an ExecPlan's JSON); nothing else is used. A value that does
not fit is a ProtocolError naming where (the message type or store key) and the field.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, TypeVar, Union

from oobleck_slurm.protocol.wire import ProtocolError

T = TypeVar("T")
_HINTS: dict[type, dict[str, Any]] = {}


def decode(cls: type[T], data: Any, where: str, finite: bool = True) -> T:
    """`data` (a JSON object) as a `cls`, or ProtocolError naming `where` and the field. `finite=False`
    lets NaN and infinities through (a diverged loss is a value, not a broken peer)."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{where} must be a JSON object, got {json_name(data)}")
    hints = _hints(cls)
    unknown = sorted(str(k) for k in data if k not in hints)
    if unknown:
        raise ProtocolError(f"{where}: unknown field {unknown[0][:50]!r}")
    values = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            values[f.name] = _check(data[f.name], hints[f.name], f"{where}: field {f.name!r}", finite)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ProtocolError(f"{where}: missing field {f.name!r}")
    return cls(**values)


def encode(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON has them (tuples as lists, nested dataclasses as objects)."""
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}


def json_name(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def short(number: float) -> str:
    try:
        return str(number)[:50]
    except ValueError:  # an integer of more digits than Python converts to text
        return "a number too large to print"


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = {f.name: typing.get_type_hints(cls)[f.name] for f in fields(cls)}
    return _HINTS[cls]


def _check(value: Any, annotation: Any, where: str, finite: bool = True) -> Any:
    """`value` as `annotation` says (JSON lists become tuples), or ProtocolError saying `where`."""
    if annotation is Any:  # a value with its own reader (an ExecPlan's JSON)
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is used
        return _check(value, inner, where, finite)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return decode(annotation, value, where, finite)
    if annotation is str and isinstance(value, str):
        return value
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if finite and not math.isfinite(number):
            raise ProtocolError(f"{where} must be a finite number, got {short(value)}")
        return number
    if origin is tuple and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(v, args[0], f"{where}[{i}]", finite) for i, v in enumerate(value))
        if len(value) == len(args):
            return tuple(_check(v, a, f"{where}[{i}]", finite) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict and isinstance(value, dict):
        checked = {}
        for key, item in value.items():
            if not isinstance(key, str):  # never from JSON; a caller's dict may hold anything
                raise ProtocolError(f"{where} must have string keys, got {json_name(key)}")
            checked[key] = _check(item, args[1], f"{where}[{key[:50]!r}]", finite)
        return checked
    raise ProtocolError(f"{where} must be {_type_name(annotation)}, got {json_name(value)}")


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return "a list" if len(args) == 2 and args[1] is Ellipsis else f"a list of {len(args)}"
    if origin is dict or dataclasses.is_dataclass(annotation):
        return "an object"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}[annotation]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
