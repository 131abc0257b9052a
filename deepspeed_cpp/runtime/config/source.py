"""Where the config comes from: a dict, a JSON file, base64 JSON, or ``args.deepspeed_config``.

DeepSpeed reads files with hjson, so configs in the wild carry comments and trailing commas;
those two are accepted here (with a warning), other hjson extensions are not. Duplicate keys are
an error, as in DeepSpeed: JSON would silently keep the last one.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from typing import Any

from .errors import DeepSpeedConfigError


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"duplicate keys {duplicates}: expected each key once per object")
    return dict(pairs)


def _scan_outside_strings(text: str, handle) -> str:
    """Copies ``text``, letting ``handle(text, i)`` treat each position outside strings: it
    returns the next position to look at (dropping what lies between), or None to copy."""
    out: list[str] = []
    i, n, in_string = 0, len(text), False
    while i < n:
        char = text[i]
        if in_string:
            out.append(char)
            if char == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            out.append(char)
        else:
            next_position = handle(text, i)
            if next_position is not None:
                i = next_position
                continue
            out.append(char)
        i += 1
    return "".join(out)


def _skip_comment(text: str, i: int) -> int | None:
    if text.startswith("//", i) or text[i] == "#":
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        end = text.find("*/", i + 2)
        return len(text) if end < 0 else end + 2
    return None


def _skip_trailing_comma(text: str, i: int) -> int | None:
    if text[i] != ",":
        return None
    following = text[i + 1 :].lstrip()
    return i + 1 if following[:1] in ("}", "]") else None


def _without_comments_and_trailing_commas(text: str) -> str:
    """Drops ``//``, ``#`` and ``/* */`` comments, then commas before ``}``/``]``."""
    return _scan_outside_strings(_scan_outside_strings(text, _skip_comment), _skip_trailing_comma)


def _parse_json_text(text: str, label: str, warnings: list[str]) -> dict:
    try:
        data = json.loads(text, object_pairs_hook=_object_without_duplicates)
    except json.JSONDecodeError as strict_error:
        try:
            data = json.loads(
                _without_comments_and_trailing_commas(text),
                object_pairs_hook=_object_without_duplicates,
            )
        except (json.JSONDecodeError, ValueError):
            raise DeepSpeedConfigError(
                [
                    f"not valid JSON: {strict_error.msg} at line {strict_error.lineno} column "
                    f"{strict_error.colno}"
                ],
                label,
            ) from None
        warnings.append(
            f"{label} has comments or trailing commas, which JSON does not allow; accepted as "
            "DeepSpeed's hjson reader accepts them"
        )
    except ValueError as error:  # duplicate keys
        raise DeepSpeedConfigError([str(error)], label) from None
    if not isinstance(data, dict):
        raise DeepSpeedConfigError(
            [f"the top level is {type(data).__name__}: expected a JSON object {{...}}"], label
        )
    return data


def _decode_base64_json(text: str) -> str | None:
    """DeepSpeed also takes the config as URL-safe base64 of its JSON text (its launcher does)."""
    try:
        return base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None


def read_config(config: Any) -> tuple[dict, str, list[str]]:
    """(a private copy of the config dict, a label for messages, warnings about the source)."""
    warnings: list[str] = []
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)), "dict", warnings
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                return _parse_json_text(file.read(), path, warnings), path, warnings
        decoded = _decode_base64_json(path) if isinstance(config, str) else None
        if decoded is not None and decoded.lstrip().startswith("{"):
            return _parse_json_text(decoded, "base64 config", warnings), "base64", warnings
        raise DeepSpeedConfigError(
            [
                f"config = {path!r}: no such file; expected the path of a JSON file, a dict, or "
                "base64-encoded JSON"
            ]
        )
    raise DeepSpeedConfigError(
        [
            f"config = {config!r} ({type(config).__name__}): expected the path of a JSON file, "
            "a dict, or base64-encoded JSON"
        ]
    )


def choose_config(config: Any, args: Any) -> tuple[Any, list[str]]:
    """The config given either directly or as ``args.deepspeed_config`` (never both)."""
    warnings: list[str] = []
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None and getattr(args, "deepscale_config", None) is not None:
        from_args = args.deepscale_config
        warnings.append("args.deepscale_config is deprecated in DeepSpeed: use --deepspeed_config")
    if config is not None and from_args is not None:
        raise DeepSpeedConfigError(
            [
                f"the config is given twice, as config={_label(config)} and as "
                f"args.deepspeed_config = {from_args!r}: expected only one of them"
            ]
        )
    chosen = config if config is not None else from_args
    if chosen is None:
        raise DeepSpeedConfigError(
            [
                "no config given: expected config= (a JSON file path or a dict) or "
                "args.deepspeed_config (--deepspeed_config on the command line)"
            ]
        )
    return chosen, warnings


def _label(config: Any) -> str:
    if isinstance(config, Mapping):
        return "a dict"
    return repr(os.fspath(config)) if isinstance(config, (str, os.PathLike)) else repr(config)
