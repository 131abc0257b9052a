"""Names of the config's keys, and the "did you mean" for a key that is not one of them."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from .errors import join_path, show

_DOCS = "https://www.deepspeed.ai/docs/config-json/"


def model_keys(model: type[BaseModel]) -> set[str]:
    """The keys a section accepts: each field's name and its JSON alias."""
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        if field.alias:
            keys.add(field.alias)
    return keys


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section model inside ``X``, ``X | None`` or ``Annotated[X, ...]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for argument in typing.get_args(annotation):
            found = _nested_model(argument)
            if found is not None:
                return found
    return None


def section_model_at(root: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model reached by following ``loc`` from ``root`` (None if not a section)."""
    model = root
    for key in loc:
        field = next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)
        model = _nested_model(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def model_key_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key path a model and its nested sections accept (for "it belongs under ...")."""
    paths = set()
    for name, field in model.model_fields.items():
        for key in {name, field.alias} - {None}:
            path = f"{prefix}{key}"
            paths.add(path)
            nested = _nested_model(field.annotation)
            if nested is not None:
                paths |= model_key_paths(nested, path + ".")
    return paths


def nearest_key(key: str, candidates: Iterable[str]) -> str | None:
    """The candidate the user most likely meant: same name in another case, or a close spelling."""
    candidates = sorted(set(candidates))
    for candidate in candidates:
        if candidate.lower() == key.lower():
            return candidate
    lowered = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def unknown_key_problem(
    loc: tuple[str, ...], value: Any, candidates: Iterable[str], known_paths: Iterable[str]
) -> str:
    """Words an unknown key: its path, its value, the nearest valid name, where it belongs."""
    candidates = set(candidates)
    key, parent = loc[-1], loc[:-1]
    if key in candidates:
        # A valid name refused all the same: its setting was given under its other name too
        # (DeepSpeed's alias, e.g. the stage3_ spelling), and a field takes one.
        return (
            f"'{join_path(loc)}' (value {show(value)}) is given twice: this setting is also set "
            "under its other name (DeepSpeed's alias) in the same section; give only one"
        )
    message = f"unknown key '{join_path(loc)}' (value {show(value)})"
    hints = []
    close = nearest_key(key, candidates)
    if close is not None:
        hints.append(f"did you mean '{join_path(parent + (close,))}'?")
    elsewhere = sorted(
        path.rpartition(".")[0]
        for path in known_paths
        if path.split(".")[-1] == key and path != join_path(loc)
    )
    if elsewhere:
        places = " or ".join("at the top level" if not p else f"in '{p}'" for p in elsewhere[:3])
        more = f" (and {len(elsewhere) - 3} more sections)" if len(elsewhere) > 3 else ""
        hints.append(f"'{key}' belongs {places}{more}")
    if not hints:
        if 0 < len(candidates) <= 12:
            hints.append("expected one of " + ", ".join(f"'{c}'" for c in sorted(candidates)))
        else:
            hints.append(f"see {_DOCS} for the keys of this section")
    return message + ": " + "; ".join(hints)
