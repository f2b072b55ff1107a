"""Storage configuration: every bad value names its key, URLs resolve to LMCache adapter specs,
prefetch deadlines follow the policy. No adapter is opened here."""

from __future__ import annotations

import pytest

from himamba.tiers.storage_config import StorageConfig, prefetch_deadline_s


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"url": "ftp://host/x"}, "storage.url: unsupported scheme 'ftp'"),
        ({"url": "redis://h:6379/3"}, "storage.url: redis database '3'"),
        ({"url": "file://relative"}, "storage.url:"),
        ({}, "storage.url: required"),
        ({"url": "/x", "adapter": {"type": "s3"}}, "storage.adapter:"),
        ({"adapter": {"bucket": "b"}}, "storage.adapter.type: required"),
        ({"adapter": "{not json"}, "storage.adapter: not valid JSON"),
        ({"url": "/x", "prefetch_policy": "eager"}, "storage.prefetch_policy:"),
        ({"url": "/x", "write_through": "yes"}, "storage.write_through:"),
        ({"url": "/x", "breaker_failures": 0}, "storage.breaker_failures: must be >= 1"),
        ({"url": "/x", "op_deadline_s": 0}, "storage.op_deadline_s: must be > 0"),
        ({"url": "/x", "capacity_gb": -1}, "storage.capacity_gb:"),
        ({"url": "/x", "prefetch_timeout_max_s": 1.0}, "storage.prefetch_timeout_max_s:"),
        ({"url": "/x", "num_wokers": 4}, "storage.num_wokers: unknown key"),
        ({"url": "/x", "write_buffer_mb": 0}, "storage.write_buffer_mb: must be >= 1"),
        ({"url": "/x", "adapter_put_depth": 0}, "storage.adapter_put_depth: must be >= 1"),
        ({"url": "/x", "thread_nice": -5}, "storage.thread_nice: must be >= 0"),
        ({"url": "/x", "thread_nice": 20}, "storage.thread_nice: must be <= 19"),
        (
            {"url": "/x", "prefetch_threshold_tokens": -1},
            "storage.prefetch_threshold_tokens: must be >= 0",
        ),
        # Infinite or huge numbers (JSON "Infinity", YAML ".inf", "1e999" over the control RPC)
        # would overflow a byte count or a thread's timeout later, away from their key.
        ({"url": "/x", "capacity_gb": float("inf")}, "storage.capacity_gb: expected a finite"),
        ({"url": "/x", "op_deadline_s": "inf"}, "storage.op_deadline_s: expected a finite"),
        ({"url": "/x", "probe_interval_s": 1e10}, "storage.probe_interval_s: expected a finite"),
        ({"url": "/x", "write_threshold": "1e999"}, "storage.write_threshold: expected a finite"),
        ({"url": "/x", "checksum": "xxh3"}, "storage.checksum: 'xxh3' is not one of xxh3_128"),
        ({"url": "/x", "checksum": None}, "storage.checksum: None is not one of"),
        (
            {"url": "/x", "breaker_cooldown_s": 5, "breaker_max_cooldown_s": 1},
            "storage.breaker_max_cooldown_s: must be >= breaker_cooldown_s",
        ),
    ],
)
def test_config_errors_name_the_offending_key(cfg, message):
    with pytest.raises(ValueError) as e:
        StorageConfig.from_dict(cfg)
    assert str(e.value).startswith(message)


def test_config_resolves_urls_and_passes_adapter_json_through():
    fs = StorageConfig.from_dict({"url": "file:///var/cache/himamba", "io_workers": 3}).adapter
    assert fs == {"type": "fs_native", "base_path": "/var/cache/himamba", "num_workers": 3,
                  "relative_tmp_dir": "tmp"}  # fmt: skip
    assert StorageConfig.from_dict({"url": "/var/cache/himamba"}).adapter["type"] == "fs_native"
    r = StorageConfig.from_dict({"url": "redis://:pw@10.0.0.5:6380"}).adapter
    assert (r["type"], r["host"], r["port"], r["password"]) == ("resp", "10.0.0.5", 6380, "pw")
    assert StorageConfig.from_dict({"url": "redis://10.0.0.5"}).adapter["port"] == 6379
    s3 = {"type": "s3", "bucket": "b", "region": "r"}
    assert StorageConfig.from_dict({"adapter": s3}).adapter == s3
    assert (
        StorageConfig.from_dict({"adapter": '{"type": "s3", "bucket": "b"}'}).adapter["type"]
        == "s3"
    )


def test_prefetch_deadline_is_linear_capped_and_policy_aware():
    c = StorageConfig.from_dict({"url": "/x"})
    assert (
        c.prefetch_timeout_base_s,
        c.prefetch_timeout_per_ki_token_s,
        c.prefetch_timeout_max_s,
    ) == (2.0, 0.1, 30.0)
    assert prefetch_deadline_s(c, 0) == 2.0
    assert prefetch_deadline_s(c, 10240) == pytest.approx(3.0)
    assert prefetch_deadline_s(c, 10**7) == 30.0
    assert (
        prefetch_deadline_s(
            StorageConfig.from_dict({"url": "/x", "prefetch_policy": "best_effort"}), 4096
        )
        == 0.0
    )
    assert prefetch_deadline_s(
        StorageConfig.from_dict({"url": "/x", "prefetch_policy": "wait_complete"}), 1
    ) == float("inf")


def test_write_policy_and_its_older_spelling() -> None:
    assert StorageConfig.from_dict({"url": "/x"}).write_policy == "write_through"
    assert StorageConfig.from_dict({"url": "/x", "write_through": False}).write_policy == "none"
    cfg = StorageConfig.from_dict({"url": "/x", "write_policy": "write_back"})
    assert cfg.write_policy == "write_back" and cfg.write_threshold == 2
    with pytest.raises(ValueError, match="storage.write_policy"):
        StorageConfig.from_dict({"url": "/x", "write_policy": "sometimes"})
    with pytest.raises(ValueError, match="storage.write_through"):
        StorageConfig.from_dict({"url": "/x", "write_through": True, "write_policy": "none"})
