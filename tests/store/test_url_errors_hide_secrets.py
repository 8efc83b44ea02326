"""Every error of a store URL's shape shows the URL as ``shown_url`` does (issue 37, leftover of issue 34's
item 8a): an unknown scheme, a ``faulty+`` without a store URL, and the ``memory://``, ``file://`` and
``mooncake://`` shape errors never repeat the value of ``integrity_key_file=`` / ``integrity_key_env=`` (it
may be a secret typed where its location belongs); nor does the connector's "got <store>" for an unknown
scheme.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hybridkv.connector.config import ConnectorConfig
from hybridkv.store import StoreError, open_store
from hybridkv.store.url import check_store_url

#: An environment variable holding a valid integrity key, so that the key check passes and the URL's shape
#: is what fails. Its name stands in for the value no error may repeat.
KEY_ENV = "HYBRIDKV_TEST_KEY_7f3a9c0e5b2d4f6a8c1e3b5d7f9a0c2e"

#: (URL, a part of the message its error must hold)
SHAPES = [
    (f"memry://name?integrity_key_env={KEY_ENV}", "unknown scheme"),
    (f"faulty+nothing?integrity_key_env={KEY_ENV}", "wraps another store URL"),
    (f"faulty+memry://name?integrity_key_env={KEY_ENV}", "unknown scheme"),
    (f"memory://?integrity_key_env={KEY_ENV}", "needs a name"),
    (f"memory://name/path?integrity_key_env={KEY_ENV}", "takes a name, not a path"),
    (f"file://host/dir?integrity_key_env={KEY_ENV}", "need an absolute directory"),
    (f"file:///?integrity_key_env={KEY_ENV}", "missing directory"),
    (f"file:///tmp/x?capacity=0&integrity_key_env={KEY_ENV}", "capacity must be > 0"),
    (f"mooncake://nohostport?integrity_key_env={KEY_ENV}", "needs the master as HOST:PORT"),
]


def _connector_config(url: str) -> None:
    ConnectorConfig.from_extra_config({"store": url}, model="m")


@pytest.mark.parametrize(("url", "problem"), SHAPES, ids=[problem for _url, problem in SHAPES])
@pytest.mark.parametrize("check", [open_store, check_store_url, _connector_config])
def test_a_shape_error_shows_no_secret_location(
    monkeypatch: pytest.MonkeyPatch, url: str, problem: str, check: Callable[[str], object]
) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    with pytest.raises((StoreError, ValueError)) as refused:
        check(url)
    message = str(refused.value)
    # The connector refuses an unknown scheme itself, before the store URL's own check.
    assert problem in message or (
        check is _connector_config and "expected a URL starting with one of" in message
    ), message
    assert KEY_ENV not in message, f"{check.__name__}: the error repeats the value: {message}"
    assert "integrity_key_env=..." in message, message
