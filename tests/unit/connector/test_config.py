"""Connector config: defaults, YAML files, and errors that name the offending key."""

from __future__ import annotations

from typing import Any

import pytest

from himamba.connector.config import ConfigError, HiMambaConfig


def test_defaults_apply_when_no_extra_config_is_given():
    cfg = HiMambaConfig.from_extra_config(None)
    assert cfg.cpu_cache_gb == 8.0
    assert cfg.cpu_cache_bytes == 8 << 30
    assert cfg.store_decode_blocks is True


def test_string_and_int_values_from_json_are_coerced():
    cfg = HiMambaConfig.from_extra_config(
        {"cpu_cache_gb": "2", "min_load_tokens": 256.0, "store_decode_blocks": "false"}
    )
    assert cfg.cpu_cache_gb == 2.0 and cfg.min_load_tokens == 256
    assert cfg.store_decode_blocks is False


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_cache_bg": 8}, "cpu_cache_bg"),
        ({"cpu_cache_gb": 0}, "cpu_cache_gb"),
        ({"cpu_cache_gb": "lots"}, "cpu_cache_gb"),
        ({"mamba_cache_fraction": 1.5}, "mamba_cache_fraction"),
        ({"min_load_tokens": -1}, "min_load_tokens"),
        ({"min_load_tokens": 1.5}, "min_load_tokens"),
        ({"store_decode_blocks": "maybe"}, "store_decode_blocks"),
        ({"storage": "file:///x"}, "storage"),
        # JSON's Infinity, YAML's .inf or a huge number: overflowed a byte count at start-up
        # (OverflowError, no key named) before numbers were bounded.
        ({"cpu_cache_gb": float("inf")}, "cpu_cache_gb: expected a finite"),
        ({"cpu_cache_gb": "1e308"}, "cpu_cache_gb: expected a finite"),
        ({"checkpoint_interval_tokens": float("inf")}, "checkpoint_interval_tokens"),
        ({"min_load_tokens": "-inf"}, "min_load_tokens"),
    ],
)
def test_bad_values_are_rejected_with_the_key_named(extra, key):
    with pytest.raises(ConfigError, match=key):
        HiMambaConfig.from_extra_config(extra)


def test_yaml_config_file_is_read_and_inline_keys_win(tmp_path):
    path = tmp_path / "himamba.yaml"
    path.write_text("cpu_cache_gb: 3\nmin_load_tokens: 512\n")
    cfg = HiMambaConfig.from_extra_config({"config_file": str(path), "min_load_tokens": 128})
    assert cfg.cpu_cache_gb == 3.0
    assert cfg.min_load_tokens == 128


def test_unreadable_or_malformed_config_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config_file"):
        HiMambaConfig.from_extra_config({"config_file": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        HiMambaConfig.from_extra_config({"config_file": str(bad)})
    typo = tmp_path / "typo.yaml"
    typo.write_text("cpu_cache_gbs: 3\n")
    with pytest.raises(ConfigError, match="cpu_cache_gbs"):
        HiMambaConfig.from_extra_config({"config_file": str(typo)})


def test_partial_tails_turn_off_under_speculative_decoding_only(caplog) -> None:
    """Speculative decoding counts unverified drafts: a tail kept at that count would name
    bytes its blocks do not hold, so the option is refused there, with a warning. Async
    scheduling (vLLM's default on GPUs) keeps it: the lifecycle tests run tails under vLLM's
    AsyncScheduler."""
    from types import SimpleNamespace

    from himamba.connector.vllm_fixups.engine_config import partial_tails_allowed

    cfg = HiMambaConfig.from_extra_config({"partial_tail_hits": True})

    def vllm(async_on: bool, spec: object = None) -> Any:
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=async_on), speculative_config=spec
        )

    with caplog.at_level("WARNING", logger="himamba"):
        assert partial_tails_allowed(vllm(False), cfg).partial_tail_hits
        assert partial_tails_allowed(vllm(True), cfg).partial_tail_hits
        assert not partial_tails_allowed(vllm(True, object()), cfg).partial_tail_hits
    assert sum("partial_tail_hits turned off" in r.message for r in caplog.records) == 1
    off = HiMambaConfig.from_extra_config({})
    assert partial_tails_allowed(vllm(True, object()), off) is off


def test_a_config_built_directly_is_bounded_too():
    """Code that builds the dataclass itself skips the parsing: ``validate`` still refuses a
    tier whose byte count would not fit."""
    with pytest.raises(ConfigError, match="cpu_cache_gb"):
        HiMambaConfig(cpu_cache_gb=float("inf")).validate()
    assert HiMambaConfig(cpu_cache_gb=1e9).cpu_cache_bytes == 1_000_000_000 << 30
