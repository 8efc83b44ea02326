"""Parsing store URLs and their query parameters into typed values, with errors that name the culprit."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

from hybridkv.store.base import StoreError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_N = TypeVar("_N", int, float)

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes in a human size: ``4096``, ``64KiB``, ``1.5GiB``, ``2GB`` (decimal units are powers of 1000).

    Raises ``StoreError`` naming ``what`` when the text is not a size.
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise StoreError(f"bad {what} {text!r}: expected a number with an optional unit like 64MiB or 2GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: int) -> str:
    """``1048576`` -> ``1MiB``; exact binary units only, else plain bytes."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


@dataclass
class ParsedUrl:
    """A store URL split into scheme, location and query parameters (``params`` is consumed by ``Params``)."""

    url: str
    scheme: str
    netloc: str
    path: str
    params: dict[str, str]


def split_url(url: str) -> ParsedUrl:
    """Split ``url``; duplicate or empty-named query parameters raise ``StoreError``."""
    if "://" not in url:
        raise StoreError(f"store URL {url!r} has no scheme (expected e.g. file:///dir, memory://name)")
    parts = urlsplit(url)
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if not name:
            raise StoreError(f"store URL {url!r} has a query parameter without a name")
        if name in params:
            raise StoreError(f"store URL {url!r} repeats parameter {name!r}")
        params[name] = value
    return ParsedUrl(url=url, scheme=parts.scheme, netloc=parts.netloc, path=parts.path, params=params)


class Params:
    """Typed, consumed-once access to a URL's query parameters.

    Every getter removes its parameter; ``finish()`` raises for whatever is left, naming it and the
    parameters the scheme accepts, so a typo never silently falls back to a default.
    """

    def __init__(self, url: str, scheme: str, params: dict[str, str]) -> None:
        self._url = url
        self._scheme = scheme
        self._params = dict(params)
        self._known: list[str] = []

    def _take(self, name: str) -> str | None:
        self._known.append(name)
        return self._params.pop(name, None)

    def fail(self, name: str, value: str, expected: str) -> StoreError:
        """The error for parameter ``name=value``, saying what was ``expected``."""
        return StoreError(f"store URL {self._url!r}: parameter {name}={value!r} is invalid: {expected}")

    def text(self, name: str, default: str) -> str:
        value = self._take(name)
        return default if value is None else value

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self._take(name)
        if value is None:
            return default
        if value not in choices:
            raise self.fail(name, value, f"expected one of {', '.join(choices)}")
        return value

    def size(self, name: str, default: int) -> int:
        value = self._take(name)
        if value is None:
            return default
        try:
            return parse_size(value, what=f"{name}")
        except StoreError as error:
            raise self.fail(name, value, str(error)) from None

    def _converted(
        self,
        name: str,
        default: _N,
        convert: Callable[[str], _N],
        not_converted: str,
        in_range: Callable[[_N], bool],
        out_of_range: str,
    ) -> _N:
        """Parameter ``name`` through ``convert`` (``ValueError``: ``not_converted``), checked by ``in_range``."""
        value = self._take(name)
        if value is None:
            return default
        try:
            number = convert(value)
        except ValueError:
            raise self.fail(name, value, not_converted) from None
        if not in_range(number):
            raise self.fail(name, value, out_of_range)
        return number

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        return self._converted(
            name, default, int, "expected an integer", lambda number: number >= minimum, f"must be >= {minimum}"
        )

    def number(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        # ``number >= minimum`` is also False for NaN, which is rejected.
        return self._converted(
            name, default, float, "expected a number", lambda number: number >= minimum, f"must be >= {minimum}"
        )

    def probability(self, name: str, default: float = 0.0) -> float:
        return self._converted(
            name,
            default,
            float,
            "expected a probability in [0, 1]",
            lambda number: 0.0 <= number <= 1.0,
            "probability outside [0, 1]",
        )

    def finish(self) -> None:
        """Raise ``StoreError`` if any parameter was not consumed."""
        if self._params:
            unknown = ", ".join(sorted(self._params))
            known = ", ".join(sorted(set(self._known))) or "none"
            raise StoreError(
                f"store URL {self._url!r}: unknown parameter(s) {unknown} for {self._scheme}:// (known: {known})"
            )
