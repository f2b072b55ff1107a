"""`s3://` URLs: the LMCache `s3` adapter spec a user's URL becomes, and an error naming
`storage.url` (never echoing a secret) for every URL it cannot honour. No adapter is opened."""

from __future__ import annotations

import pytest

from himamba.tiers.s3_url import is_s3_url, s3_adapter_spec
from himamba.tiers.storage_config import StorageConfig


def test_aws_and_s3_compatible_urls_become_virtual_hosted_endpoints(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    aws = StorageConfig.from_dict({"url": "s3://kv-cache?region=eu-west-1", "io_workers": 3})
    assert aws.adapter == {
        "type": "s3",
        "s3_endpoint": "kv-cache.s3.eu-west-1.amazonaws.com",
        "s3_region": "eu-west-1",
        "s3_num_io_threads": 3,
        "disable_tls": False,
    }
    local = s3_adapter_spec("s3://kv-cache/?region=us-east-1&endpoint=http://localhost:9000")
    assert local["s3_endpoint"] == "kv-cache.localhost:9000" and local["disable_tls"] is True
    tls = s3_adapter_spec("S3://kvc?region=r1&endpoint=https://minio.internal&io_threads=8")
    assert (tls["s3_endpoint"], tls["disable_tls"], tls["s3_num_io_threads"]) == (
        "kvc.minio.internal",
        False,
        8,
    )
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    assert s3_adapter_spec("s3://kv-cache")["s3_region"] == "ap-south-1"
    assert is_s3_url("s3://x") and not is_s3_url("redis://x") and not is_s3_url(None)


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3://kv-cache", "needs ?region="),
        ("s3://KV?region=r", "bad bucket name 'KV'"),
        ("s3://k?region=r", "bad bucket name 'k'"),
        ("s3://kv-cache:9000?region=r", "bad bucket name"),
        ("s3://kv-cache/team-a?region=r", "key prefixes are unsupported"),
        ("s3://kv-cache?region=r&endpoint=localhost:9000", "endpoint must be http://"),
        ("s3://kv-cache?region=r&endpoint=http://h/path", "endpoint takes only"),
        ("s3://kv-cache?region=r&endpoint=http://h:99999", "bad port in endpoint"),
        ("s3://kv-cache?region=r&bucket=x", "unknown s3 URL parameter(s) bucket"),
        ("s3://kv-cache?region=r&region=s", "give region= once"),
        ("s3://kv-cache?region=r&io_threads=0", "io_threads must be a positive integer"),
    ],
)
def test_bad_s3_urls_name_the_key_and_the_problem(url, message, monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with pytest.raises(ValueError) as e:
        StorageConfig.from_dict({"url": url})
    assert str(e.value).startswith("storage.url: ") and message in str(e.value)


def test_credentials_in_the_url_are_refused_without_being_echoed():
    with pytest.raises(ValueError) as e:
        StorageConfig.from_dict({"url": "s3://AKIAXXX:s3cr3t@kv-cache?region=r"})
    assert "credentials do not belong in the URL" in str(e.value)
    assert "s3cr3t" not in str(e.value) and "AKIAXXX" not in str(e.value)
    with pytest.raises(ValueError) as e:
        StorageConfig.from_dict({"url": "s3://kv-cache?region=r&endpoint=http://u:s3cr3t@h:9000"})
    assert "credentials do not belong in the endpoint" in str(e.value)
    assert "s3cr3t" not in str(e.value)


def test_a_missing_client_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"needs the boto3 package.*himamba\[s3\]"):
        s3_adapter_spec("s3://kv-cache?region=r")
