"""Engine layouts from TOML: partial configs (preset, file, flags) merged once, validated once.

A file may name a ``preset`` to start from and override any field; ``[[groups]]`` replaces
the preset's groups. Unknown keys are errors (a typo must not silently fall back).

    preset = "gemma3"            # optional
    hash_block_tokens = 16
    num_gpu_blocks = 8192
    num_cpu_blocks = 16384
    speculative = false          # booleans are TOML true/false, never "false" or 0
    [[groups]]
    kind = "full"                # full | sliding | mamba
    tokens_per_block = 16
    [[groups]]
    kind = "sliding"
    tokens_per_block = 16
    window_tokens = 1024
"""

from __future__ import annotations

import os
import re
import reprlib
import stat
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvcore.presets import preset
from kvcore.spec.errors import ConfigError
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, StoreLevel

_CONFIG_FIELDS = {f.name for f in fields(OffloadConfig)} - {"groups"}
_GROUP_FIELDS = {f.name for f in fields(GroupSpec)}
# A layout file is a few hundred bytes; refusing anything over 1 MiB keeps a wrong path
# (a model checkpoint, /dev/zero) from being read into memory.
MAX_CONFIG_BYTES = 1 << 20
# Field names and values echoed in an error: one line, a screenful at most, whatever the
# file holds (a key with a newline read as two fields; a 200 KB key made a 200 KB error).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SHOWN = reprlib.Repr()  # Python 3.11's Repr takes no arguments: set its limits after
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxdict = 6
_SHOWN.maxlevel = 2


def _key(key: object) -> str:
    """A key as an error names it: as written when it is a plain name, else escaped."""
    return key if isinstance(key, str) and _NAME.fullmatch(key) else _SHOWN.repr(key)


def _enum(field: str, value: object, kind: type[GroupKind] | type[StoreLevel]) -> Any:
    """An enum member from its documented TOML name: a string, any case, nothing else."""
    names = ", ".join(repr(m.value) for m in kind)
    if not isinstance(value, str):
        raise ConfigError(field, f"{field}={_SHOWN.repr(value)} ({type(value).__name__}) "
                          f"is not a string; write one of {names} as a TOML string")
    try:
        return kind(value.lower())
    except ValueError:
        raise ConfigError(field, f"{field}={_SHOWN.repr(value)} is unknown; use one of "
                          f"{names}") from None


def _group(i: int, raw: Any) -> GroupSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"groups[{i}]", "each [[groups]] entry must be a table")
    unknown = set(raw) - _GROUP_FIELDS
    if unknown:
        raise ConfigError(f"groups[{i}].{_key(sorted(unknown)[0])}", "unknown group "
                          f"field; known fields: {', '.join(sorted(_GROUP_FIELDS))}")
    for required in ("kind", "tokens_per_block"):
        if required not in raw:
            raise ConfigError(f"groups[{i}].{required}", "missing; every [[groups]] entry "
                              "sets kind (full, sliding or mamba) and tokens_per_block")
    values = dict(raw)
    values["kind"] = _enum(f"groups[{i}].kind", raw["kind"], GroupKind)
    # Every other field's type and range is checked once, by OffloadConfig's validation,
    # which names the same groups[i].<field>.
    return GroupSpec(**values)


def config_from_mapping(raw: dict[str, Any], source: str = "config") -> OffloadConfig:
    """Merge a preset (if named) with the given fields and validate once."""
    raw = dict(raw)
    base_name = raw.pop("preset", None)
    if base_name is not None and not isinstance(base_name, str):
        raise ConfigError("preset", f"preset={_SHOWN.repr(base_name)} must be a TOML "
                          "string, e.g. "
                          '"gemma3"')
    unknown = set(raw) - _CONFIG_FIELDS - {"groups"}
    if unknown:
        raise ConfigError(_key(sorted(unknown)[0]), f"unknown field in {source}; known "
                          f"fields: {', '.join(sorted(_CONFIG_FIELDS | {'groups', 'preset'}))}")
    if "store_level" in raw:
        raw["store_level"] = _enum("store_level", raw["store_level"], StoreLevel)
    if "groups" in raw:
        if not isinstance(raw["groups"], list):
            raise ConfigError("groups", "groups must be an array of tables ([[groups]])")
        raw["groups"] = tuple(_group(i, g) for i, g in enumerate(raw["groups"]))
    raw.setdefault("name", Path(source).stem)
    if base_name is not None:
        return replace(preset(base_name), **raw)
    missing = {"groups", "hash_block_tokens", "num_gpu_blocks", "num_cpu_blocks"} - set(raw)
    if missing:
        raise ConfigError(sorted(missing)[0], f"{source} names no preset, so it must set "
                          f"{', '.join(sorted(missing))}")
    return OffloadConfig(**raw)


def load_config(path: str | Path) -> OffloadConfig:
    """Read and validate a TOML layout file."""
    if not isinstance(path, str | os.PathLike) or \
            not isinstance(fspath := os.fspath(path), str):
        raise ConfigError("config", f"the path is a {type(path).__name__}; name a TOML "
                          "layout file as a str or a path object (an int would be read as "
                          "a file descriptor)")
    path = fspath
    if str(path) == "":
        raise ConfigError("config", "the path is empty; name a TOML layout file (an unset "
                          "variable in `--config $LAYOUT`?)")
    if "\0" in str(path):
        raise ConfigError("config", f"the path {str(path)!r} holds a NUL byte; no file is "
                          "named that")
    try:
        # A FIFO or a device would block the read or never end: only a regular file.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError("config", f"{path} is not a regular file; name a TOML file")
        with Path(path).open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is over {MAX_CONFIG_BYTES} bytes; a layout file "
                          "is a few hundred (is this the right file?)")
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not TOML's business.
        raw = tomllib.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ConfigError("config", f"{path} is not UTF-8 text; a layout is a TOML file") \
            from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # An integer of thousands of digits (Python's int-to-str limit) or arrays nested
        # thousands deep: valid TOML to the grammar, no layout.
        raise ConfigError("config", f"{path} is not a layout: {type(exc).__name__}: "
                          f"{str(exc)[:200]}") from None
    return config_from_mapping(raw, str(path))
