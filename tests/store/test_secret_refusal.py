"""A secret typed where its location belongs is refused without being repeated (issue 34, item 8a).

``integrity_key_env=NAME`` and ``integrity_key_file=/ABS/PATH`` name where a store's integrity secret is. An
operator who types the secret itself there gets an error that names the parameter -- like ``integrity_key=``,
refused without repeating the URL -- but neither the value nor the URL holding it, on every way the URL is
checked: ``open_store``, ``check_store_url``, a ``faulty+`` view whose own parameter fails first, and the
connector's config.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hybridkv.connector.config import ConnectorConfig
from hybridkv.store import StoreError, open_store
from hybridkv.store.url import check_store_url

#: What an operator pastes: a secret (``openssl rand -hex 32`` style), never set as a variable's name.
SECRET = "7f3a9c0e5b2d4f6a8c1e3b5d7f9a0c2e4b6d8f1a3c5e7b9d0f2a4c6e8b1d3f5a"

#: (the URL, the parameter its error must name)
URLS = [
    (f"memory://secret-refusal?integrity_key_env={SECRET}", "integrity_key_env"),
    (f"memory://secret-refusal?integrity_key_file={SECRET}", "integrity_key_file"),
    (f"memory://secret-refusal?integrity_key_file=/{SECRET}", "integrity_key_file"),  # absolute, no file
    (f"memory://secret-refusal?integrity_key_env={SECRET}&integrity_key_file=/k", "integrity_key_env"),
    (f"faulty+memory://secret-refusal?seed=1&integrity_key_env={SECRET}", "integrity_key_env"),
    # The view's own parameter fails first on some paths: its error must not show the secret either.
    (f"faulty+memory://secret-refusal?get_fail=2&integrity_key_env={SECRET}", None),
    # A name percent-encoded is the same parameter.
    (f"memory://secret-refusal?integrity%5Fkey%5Fenv={SECRET}", "integrity_key_env"),
]


def _connector_config(url: str) -> None:
    ConnectorConfig.from_extra_config({"store": url}, model="m")


@pytest.mark.parametrize(("url", "name"), URLS, ids=[f"url{i}" for i in range(len(URLS))])
@pytest.mark.parametrize("check", [open_store, check_store_url, _connector_config])
def test_a_secret_where_its_location_belongs_is_refused_without_repeating_it(
    url: str, name: str | None, check: Callable[[str], object]
) -> None:
    with pytest.raises((StoreError, ValueError)) as refused:
        check(url)
    message = str(refused.value)
    assert SECRET not in message, f"{check.__name__}: the error repeats the secret: {message}"
    assert SECRET[:16] not in message, f"{check.__name__}: the error repeats part of the secret: {message}"
    if name is not None:
        assert f"parameter {name}=" in message, f"{check.__name__}: the error names no parameter: {message}"


def test_the_url_shown_hides_only_the_values_of_secret_locations() -> None:
    from hybridkv.store.params import shown_url

    url = "file:///data/kv?capacity=1GiB&integrity_key_file=/etc/hybridkv/key&checksum=crc32"
    assert shown_url(url) == "file:///data/kv?capacity=1GiB&integrity_key_file=...&checksum=crc32"
    assert shown_url("memory://name?seed=1") == "memory://name?seed=1"
    assert shown_url("memory://name") == "memory://name"
