"""Engine layouts from TOML: partial configs (preset, file, flags) merged once, validated once.

A file may name a ``preset`` to start from and override any field; ``[[groups]]`` replaces
the preset's groups. Unknown keys are errors (a typo must not silently fall back).

    preset = "gemma3"            # optional
    hash_block_tokens = 16
    num_gpu_blocks = 8192
    num_cpu_blocks = 16384
    speculative = false
    [[groups]]
    kind = "full"                # full | sliding | mamba
    tokens_per_block = 16
    [[groups]]
    kind = "sliding"
    tokens_per_block = 16
    window_tokens = 1024
"""

from __future__ import annotations

import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvcore.presets import preset
from kvcore.spec.errors import ConfigError
from kvcore.spec.types import GroupKind, GroupSpec, OffloadConfig, StoreLevel

_CONFIG_FIELDS = {f.name for f in fields(OffloadConfig)} - {"groups"}
_GROUP_FIELDS = {f.name for f in fields(GroupSpec)}


def _group(i: int, raw: Any) -> GroupSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"groups[{i}]", "each [[groups]] entry must be a table")
    unknown = set(raw) - _GROUP_FIELDS
    if unknown:
        raise ConfigError(f"groups[{i}].{sorted(unknown)[0]}", f"unknown group field; "
                          f"known fields: {', '.join(sorted(_GROUP_FIELDS))}")
    values = dict(raw)
    try:
        values["kind"] = GroupKind(str(values.get("kind", "")).lower())
    except ValueError:
        raise ConfigError(f"groups[{i}].kind", f"kind={raw.get('kind')!r}; use full, sliding "
                          "or mamba") from None
    try:
        return GroupSpec(**values)
    except TypeError as exc:
        raise ConfigError(f"groups[{i}]", str(exc)) from None


def config_from_mapping(raw: dict[str, Any], source: str = "config") -> OffloadConfig:
    """Merge a preset (if named) with the given fields and validate once."""
    raw = dict(raw)
    base_name = raw.pop("preset", None)
    unknown = set(raw) - _CONFIG_FIELDS - {"groups"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown field in {source}; known fields: "
                          f"{', '.join(sorted(_CONFIG_FIELDS | {'groups', 'preset'}))}")
    if "store_level" in raw:
        try:
            raw["store_level"] = StoreLevel(str(raw["store_level"]).lower())
        except ValueError:
            raise ConfigError("store_level", "use 'block' or 'request'") from None
    if "groups" in raw:
        if not isinstance(raw["groups"], list):
            raise ConfigError("groups", "groups must be an array of tables ([[groups]])")
        raw["groups"] = tuple(_group(i, g) for i, g in enumerate(raw["groups"]))
    raw.setdefault("name", Path(source).stem)
    if base_name is not None:
        return replace(preset(str(base_name)), **raw)
    missing = {"groups", "hash_block_tokens", "num_gpu_blocks", "num_cpu_blocks"} - set(raw)
    if missing:
        raise ConfigError(sorted(missing)[0], f"{source} names no preset, so it must set "
                          f"{', '.join(sorted(missing))}")
    return OffloadConfig(**raw)


def load_config(path: str | Path) -> OffloadConfig:
    """Read and validate a TOML layout file."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    return config_from_mapping(raw, str(path))
