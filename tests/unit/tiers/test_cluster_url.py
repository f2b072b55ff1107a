"""Cluster URLs -> LMCache `valkey` adapter specs (tiers/cluster_url.py): parsing, errors that
name the field, passwords that never reach a message."""

from __future__ import annotations

import logging

import pytest

from himamba.tiers import cluster_url
from himamba.tiers.cluster_url import (
    cluster_adapter_spec,
    is_cluster_url,
    require_cluster_client,
)
from himamba.tiers.storage_config import StorageConfig, redacted_adapter, redacted_url

SECRET = "s3cr3t-pw"


def spec(url: str, **kw):
    return cluster_adapter_spec(url, require_client=False, **kw)


@pytest.mark.parametrize(
    "url",
    ["redis+cluster://h:1", "VALKEY+CLUSTER://h", "rediss+cluster://h", "valkeys+cluster://h"],
)
def test_cluster_schemes_are_recognised(url):
    assert is_cluster_url(url)


@pytest.mark.parametrize("url", ["redis://h:1", "file:///x", "/x", "", None, 3, "redis+cluster:h"])
def test_other_urls_are_not_cluster_urls(url):
    assert not is_cluster_url(url)


def test_seed_list_maps_to_valkey_adapter_in_cluster_mode():
    got = spec("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3", num_workers=6)
    assert got == {
        "type": "valkey",
        "startup_nodes": "10.0.0.1:7000,10.0.0.2:7001,10.0.0.3:6379",
        "cluster_mode": True,
        "num_workers": 6,
    }


def test_valkey_scheme_trailing_slash_db0_and_duplicate_seeds():
    got = spec("valkey+cluster://a:1,a:1, b:2/0")
    assert got["startup_nodes"] == "a:1,b:2" and got["cluster_mode"] is True
    assert spec("valkey+cluster://a:1/")["startup_nodes"] == "a:1"


def test_tls_schemes_enable_tls():
    assert spec("rediss+cluster://a:1")["tls_enable"] is True
    assert "tls_enable" not in spec("redis+cluster://a:1")


def test_bracketed_ipv6_seed_keeps_the_last_colon_as_port_separator():
    assert spec("redis+cluster://[::1]:7000,[fe80::2]")["startup_nodes"] == (
        "::1:7000,fe80::2:6379"
    )


def test_user_and_percent_encoded_password_are_decoded_into_the_spec():
    got = spec(f"redis+cluster://alice:{SECRET}%40%2F@a:1,b:2")
    assert got["username"] == "alice" and got["password"] == SECRET + "@/"
    got = spec(f"redis+cluster://:{SECRET}@a:1")
    assert "username" not in got and got["password"] == SECRET


def test_spec_parses_as_lmcache_valkey_config():
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.l2_adapters.valkey_l2_adapter import ValkeyL2AdapterConfig

    cfg = ValkeyL2AdapterConfig.from_dict(spec(f"redis+cluster://u:{SECRET}@a:1,[::1]:2"))
    assert cfg.cluster_mode and cfg.startup_nodes == [("a", 1), ("::1", 2)]
    assert cfg.password == SECRET and cfg.username == "u"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("redis+cluster://", "seeds"),
        ("redis+cluster://a:1,,b:2", "seeds"),
        ("redis+cluster://a:x", "bad port"),
        ("redis+cluster://a:0", "bad port"),
        ("redis+cluster://a:70000", "bad port"),
        ("redis+cluster://:7000", "no host"),
        ("redis+cluster://::1:7000", "brackets"),
        ("redis+cluster://[::1:7000", "IPv6"),
        ("redis+cluster://a:1/2", "database 0"),
        ("redis+cluster://a:1?tls=1", "query"),
        ("redis+cluster://a:1#x", "fragment"),
        ("redis://a:1", "not a cluster URL"),
    ],
)
def test_bad_urls_fail_naming_the_field(url, needle):
    with pytest.raises(ValueError, match=r"^storage\.url: ") as e:
        spec(url)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "url",
    [
        f"redis+cluster://u:{SECRET}@a:x",
        f"redis+cluster://u:{SECRET}@a:1/5",
        f"redis+cluster://u:{SECRET}@",
        f"redis+cluster://u:{SECRET}/x@a:1",
        f"redis+cluster://u:{SECRET}@a:1?x=1",
    ],
)
def test_errors_never_echo_the_password(url):
    with pytest.raises(ValueError) as e:
        spec(url)
    assert SECRET not in str(e.value)
    assert "***" in str(e.value) or "@" not in str(e.value)


def test_empty_password_after_colon_is_an_error():
    with pytest.raises(ValueError, match="empty password"):
        spec("redis+cluster://u:@a:1")


def test_redaction_hides_only_the_password():
    url = f"redis+cluster://alice:{SECRET}@a:1,b:2"
    assert redacted_url(url) == "redis+cluster://alice:***@a:1,b:2"
    # The storage tier's own URL redaction (logs, status) agrees on a multi-host netloc.
    assert redacted_url(url) == "redis+cluster://alice:***@a:1,b:2"
    assert redacted_url("redis+cluster://alice@a:1") == "redis+cluster://alice@a:1"


def test_config_repr_target_and_log_lines_hide_the_password(caplog):
    url = f"redis+cluster://alice:{SECRET}@a:1,b:2"
    adapter = spec(url)
    cfg = StorageConfig.from_dict({"adapter": adapter})
    assert cfg.adapter["password"] == SECRET  # the adapter still gets it
    shown = StorageConfig(adapter=adapter, url=url)
    with caplog.at_level(logging.INFO):
        logging.getLogger("himamba.test").info("storage: %r -> %s", shown, shown.target)
    for text in (repr(cfg), cfg.target, repr(shown), shown.target, caplog.text):
        assert SECRET not in text
    assert "***" in repr(shown) and "alice" in shown.target
    assert redacted_adapter(adapter)["password"] == "***"


def test_missing_glide_client_fails_naming_the_cluster_extra(monkeypatch):
    monkeypatch.setattr(cluster_url, "GLIDE_MODULE", "himamba_no_such_module_xyz")
    with pytest.raises(ValueError, match=r"storage\.url: .*himamba\[cluster\]"):
        cluster_adapter_spec("redis+cluster://a:1")
    with pytest.raises(ValueError, match=r"himamba\[cluster\]"):
        require_cluster_client()


def test_url_form_in_storage_config_when_the_hook_is_wired():
    """`storage.url: redis+cluster://...` goes through StorageConfig once storage_config.py
    routes cluster URLs here (skipped until then)."""
    pytest.importorskip("glide_sync")
    try:
        cfg = StorageConfig.from_dict({"url": f"redis+cluster://u:{SECRET}@a:1,b:2"})
    except ValueError as e:
        if "unsupported scheme" in str(e):
            pytest.skip("storage_config.py does not route cluster URLs yet")
        raise
    assert cfg.adapter["type"] == "valkey" and cfg.adapter["cluster_mode"] is True
    assert cfg.adapter["password"] == SECRET and SECRET not in repr(cfg) + cfg.target
