"""URLs of ``secondary_tiers`` entries: every error about one names it redacted, never with a parser's
message (which may quote part of a password), and :func:`redact_url` hides whatever lies between
``//`` and the last ``@``, whatever the password holds."""

from __future__ import annotations

import pytest

from kvtier.core.tier_config import parse_secondary_tiers, redact_url
from kvtier.core.values import ConfigError

SECRET = "S3cr3tPW"


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}/x@127.0.0.1:6379/0",  # an unescaped / ? # in the password ends the authority early
    f"redis://:{SECRET}#x@127.0.0.1:6379/0",
    f"redis://:{SECRET}?x@127.0.0.1:6379/0",
    f"redis://:123/{SECRET}@127.0.0.1:6379/0",  # ... and a parser finds no password at all
    f"redis://user:123?{SECRET}@127.0.0.1:6379/0",  # ... or a host "user", port 123
    f"redis://user:{SECRET}@127.0.0.1:notaport/0",  # a bare ValueError before
    f"redis://:{SECRET}@[::1/0",
    f"http://user:{SECRET}@127.0.0.1:6379/0",
    f"user:{SECRET}@127.0.0.1:6379",
    f"REDIS://:{SECRET}@127.0.0.1:6379/0",  # redis-py takes the scheme as written
])
def test_a_redis_url_refused_is_named_redacted_never_with_the_parsers_message(url: str) -> None:
    with pytest.raises(ConfigError) as exc:  # before: the password in the message (or a ValueError)
        parse_secondary_tiers([{"type": "redis", "url": url}])
    assert SECRET not in str(exc.value) and "***@" in str(exc.value), str(exc.value)
    assert "could not be cast" not in str(exc.value)


@pytest.mark.parametrize("entry", [
    {"url": f"s3://AKIAEXAMPLE:{SECRET}@bucket/kv"},
    {"url": "s3://bucket/kv", "endpoint": f"https://key:{SECRET}@minio:9000"},
    {"url": "s3://bucket/kv", "endpoint": f"https://key:{SECRET}/x@minio:9000"},
    {"url": f"s3://key:{SECRET}@[bucket/kv"},  # a ValueError before
])
def test_an_s3_url_or_endpoint_with_credentials_is_refused_redacted(entry: dict) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_secondary_tiers([{"type": "s3", **entry}])
    assert SECRET not in str(exc.value), str(exc.value)


@pytest.mark.parametrize(("url", "shown"), [
    (f"redis://user:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
    (f"redis://:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
    (f"redis://:123/{SECRET}@h:6379/0", "redis://***@h:6379/0"),
    (f"redis://:a@b#{SECRET}@h:6379/0", "redis://***@h:6379/0"),
    (f"rediss://h:6380/0?ssl_cert_reqs=none&password={SECRET}", "rediss://h:6380/0?ssl_cert_reqs=none&password=***"),
    (f"unix://user:{SECRET}@/run/redis.sock?db=0", "unix://***@/run/redis.sock?db=0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("unix:///run/redis.sock", "unix:///run/redis.sock"),
    (f"user:{SECRET}@h:6379", "***@h:6379"),
    ("", ""),
])
def test_redact_url_hides_everything_before_the_last_at(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_valid_urls_still_parse_and_show_redacted() -> None:
    urls = [f"redis://user:{SECRET}@127.0.0.1:6379/0", "rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem",
            "unix:///run/redis.sock", f"redis://:a%2Fb%40{SECRET}@h:6379/0", "redis://[::1]:6379/0"]
    for url in urls:
        (config,) = parse_secondary_tiers([{"type": "redis", "url": url}])
        assert config.url == url and SECRET not in repr(config)
