"""Exact JSON round-trip for frozen dataclasses (tuples, optionals, nested dataclasses, dicts)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from .errors import ArtifactError


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, fixed separators, so equal objects give equal bytes."""
    return json.dumps(to_jsonable(obj), sort_keys=True, indent=1, separators=(",", ": ")) + "\n"


def from_jsonable(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return from_jsonable(non_none[0], data, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: expected an object, got {type(data).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = from_jsonable(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ArtifactError(f"{where}: missing field '{f.name}'")
        unknown = set(data) - {f.name for f in dataclasses.fields(tp)}
        if unknown:
            raise ArtifactError(f"{where}: unknown fields {sorted(unknown)}")
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(data, list):
            raise ArtifactError(f"{where}: expected a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], x, f"{where}[{i}]") for i, x in enumerate(data))
        if len(data) != len(args):     # (zip would cut a longer list short and leave a shorter one so)
            raise ArtifactError(f"{where}: expected a list of {len(args)}, got {len(data)}")
        return tuple(from_jsonable(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, data)))
    if origin is dict:
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: expected an object, got {type(data).__name__}")
        return {k: from_jsonable(args[1], v, f"{where}.{k}") for k, v in data.items()}
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    if tp in (int, float, str, bool) and not isinstance(data, tp):
        raise ArtifactError(f"{where}: expected {tp.__name__}, got {data!r}")
    if tp is int and isinstance(data, bool):
        raise ArtifactError(f"{where}: expected int, got {data!r}")
    return data


def loads(tp: Any, text: str, where: str) -> Any:
    try:
        data = json.loads(text)
    except ValueError as e:            # (a JSONDecodeError, or an integer past int()'s 4300 digits)
        raise ArtifactError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise ArtifactError(f"{where}: nested too deeply") from None
    return from_jsonable(tp, data, where)
