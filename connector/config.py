"""Connector configuration: one dataclass, every tunable with its default and why.

Read from ``kv_connector_extra_config`` (and optionally a YAML file named by
``config_file``). Unknown keys are rejected: a typo such as ``cpu_cache_bg``
silently falling back to a default is how production caches end up disabled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from himamba.tiers.config_fields import LARGEST, flag, number

_GIB = 1 << 30


class ConfigError(ValueError):
    """A bad himamba config value; the message names the key."""


@dataclass(frozen=True)
class HiMambaConfig:
    # Pinned-CPU tier size. 8 GiB holds ~130k blocks of a small hybrid model;
    # big enough to matter, small enough to coexist with vLLM's own host use.
    cpu_cache_gb: float = 8.0
    # Share of the CPU tier reserved for Mamba state snapshots. A prefix is only
    # hittable where a state exists, but states are stored once per boundary
    # while KV is stored per block, so a quarter keeps both pools busy.
    mamba_cache_fraction: float = 0.25
    # Skip loads shorter than this many tokens: tiny hits cost a transfer and a
    # scheduling round-trip for little saved compute. 0 = any block-sized hit.
    min_load_tokens: int = 0
    # Also keep KV of decode-phase blocks, so a follow-up turn that extends
    # this conversation can hit beyond the original prompt.
    store_decode_blocks: bool = True
    # Keep Mamba states through generated output so a conversation's next turn hits past its
    # previous prompt. vLLM hands connectors states only where its GPU prefix cache retains
    # them; at its default (prefix_cache_retention_interval=0: prompt ends and junctions) no
    # state inside an output survives, so himamba sets the interval to the block size at
    # start-up (logged). False leaves vLLM's setting alone.
    keep_decode_states: bool = True
    # Besides each request's prompt-end state and its latest decode-boundary state, keep a
    # checkpoint every this many tokens (rounded up to whole blocks): a prompt that shares
    # only the first part of an earlier one hits at the last checkpoint before they diverge.
    # 1024: sharing the first 3,000 of 4,000 tokens hits 2,048+, for ~4 states per 4k tokens.
    checkpoint_interval_tokens: int = 1024
    # Keep a finished request's partly filled last block and its final Mamba state, so the
    # next turn of a conversation hits through the whole previous answer, not only to its
    # last full block (``scheduler.tails``). Copied at the start of the next step (V1: its
    # first worker hook; V2: himamba's step-start hook), before vLLM reuses the blocks; each
    # tail takes host slots: for conversations.
    partial_tail_hits: bool = False
    # vLLM's default kv_load_failure_policy "fail" fails a user request whenever a cache load
    # fails; himamba switches it to "recompute" at start-up unless this is true.
    respect_fail_policy: bool = False
    # Storage tier (LMCache adapters); None = CPU tier only. Parsed by
    # himamba.tiers.storage_config when present.
    storage: dict[str, Any] | None = None
    # Where the settings came from, for error messages and logs.
    source: str = field(default="kv_connector_extra_config", compare=False)

    @property
    def cpu_cache_bytes(self) -> int:
        return int(self.cpu_cache_gb * _GIB)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiMambaConfig:
        """Build and validate from vLLM's ``kv_connector_extra_config``."""
        extra = dict(extra or {})
        source = "kv_connector_extra_config"
        config_file = extra.pop("config_file", None)
        if config_file is not None:
            file_values = _load_yaml(config_file)
            # Inline keys win over the file, so one deployment can override one knob.
            extra = {**file_values, **extra}
            source = f"{config_file} + kv_connector_extra_config"
        known = {f.name for f in fields(cls)} - {"source"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"himamba: unknown config key(s) {unknown} in {source}; known keys: {sorted(known)}"
            )
        values = {k: _coerce(k, v) for k, v in extra.items()}
        cfg = cls(**values, source=source)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not 0 < self.cpu_cache_gb <= LARGEST:  # also when built directly, not parsed
            raise ConfigError(
                f"himamba: cpu_cache_gb must be > 0 and <= 1e9, got {self.cpu_cache_gb!r}"
            )
        if not 0.0 < self.mamba_cache_fraction < 1.0:
            raise ConfigError(
                "himamba: mamba_cache_fraction must be in (0, 1), "
                f"got {self.mamba_cache_fraction!r}"
            )
        if self.checkpoint_interval_tokens < 1:
            raise ConfigError(
                "himamba: checkpoint_interval_tokens must be >= 1, "
                f"got {self.checkpoint_interval_tokens!r}"
            )
        if self.min_load_tokens < 0:
            raise ConfigError(
                f"himamba: min_load_tokens must be >= 0, got {self.min_load_tokens!r}"
            )
        if self.storage is not None and not isinstance(self.storage, dict):
            raise ConfigError(
                f"himamba: storage must be a mapping, got {type(self.storage).__name__}"
            )


_TYPES: dict[str, type] = {
    "cpu_cache_gb": float,
    "mamba_cache_fraction": float,
    "min_load_tokens": int,
    "store_decode_blocks": bool,
    "respect_fail_policy": bool,
    "keep_decode_states": bool,
    "checkpoint_interval_tokens": int,
    "partial_tail_hits": bool,
}


def _coerce(key: str, value: Any) -> Any:
    """Convert JSON/YAML scalars to the declared type, naming the key on failure."""
    want = _TYPES.get(key)
    try:
        if want is bool:
            return flag("", key, value)
        if want is not None:
            return number("", key, value, whole=want is int)
    except ValueError as exc:
        raise ConfigError(f"himamba: {exc}") from None
    return value


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    path = os.path.expanduser(str(path))
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"himamba: config_file {path!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"himamba: config_file {path!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"himamba: config_file {path!r} must hold a mapping at top level")
    return data
