"""Parsing store URLs and their query parameters into typed values, with errors that name the culprit."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from hybridkv.store.base import StoreError

#: The one meaning of a size unit everywhere (URL parameters, ``kv_connector_extra_config``, CLI flags):
#: ``KiB``/``MiB``/``GiB``/``TiB`` are powers of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000 (SI).
#: ``Ki``/``Mi``/... (IEC, as Kubernetes writes them) are binary too. Case does not matter. A bare
#: ``k``/``m``/``g``/``t`` is rejected: half the world reads
#: ``64m`` as 64 MiB, the other half as 64 MB.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "kib": 1 << 10,
    "mb": 1000**2,
    "mib": 1 << 20,
    "gb": 1000**3,
    "gib": 1 << 30,
    "tb": 1000**4,
    "tib": 1 << 40,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
_AMBIGUOUS_UNITS = {"k": "K", "m": "M", "g": "G", "t": "T"}
_N = TypeVar("_N", int, float)

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
#: The largest size anywhere (8 EiB - 1): what a signed 64-bit count holds (torch, Mooncake, the file store's
#: accounting); anything larger is a typo.
MAX_BYTE_SIZE = (1 << 63) - 1
#: The longest deadline or delay a URL parameter may name in milliseconds (about 24.8 days): longer ones
#: overflow the platform's timeouts (``threading``'s waits, ``time.sleep``) when the store uses them.
MAX_DURATION_MS = (1 << 31) - 1


def byte_size(text: str) -> int:
    """Bytes in a human size: the one size parser of the package; raises ``ValueError`` saying why not.

    ``4096``, ``64KiB``, ``1.5GiB`` (binary), ``2GB``, ``8 kb`` (decimal). Fractions must come to whole bytes.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            "expected a number with an optional unit like 64MiB (2**20 bytes) or 64MB (10**6 bytes)"
        )
    number, unit = match.group(1), match.group(2).lower()
    if unit in _AMBIGUOUS_UNITS:
        letter = _AMBIGUOUS_UNITS[unit]
        raise ValueError(
            f"unit {match.group(2)!r} is ambiguous: write {number}{letter}iB (powers of 1024) "
            f"or {number}{letter}B (powers of 1000)"
        )
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"unknown unit {match.group(2)!r} (known: B, KiB, MiB, GiB, TiB, Ki, Mi, Gi, Ti, KB, MB, GB, TB)"
        )
    num_bytes = Fraction(number) * _SIZE_UNITS[unit]
    if num_bytes.denominator != 1:
        raise ValueError(f"{text.strip()} is not a whole number of bytes")
    if num_bytes > MAX_BYTE_SIZE:
        raise ValueError(f"{text.strip()} is more than the largest size, {MAX_BYTE_SIZE} bytes (8 EiB - 1)")
    return int(num_bytes)


def parse_size(text: str, *, what: str = "size") -> int:
    """``byte_size`` raising ``StoreError`` that names ``what`` and the text."""
    try:
        return byte_size(text)
    except ValueError as error:
        raise StoreError(f"bad {what} {text!r}: {error}") from None


def format_size(num_bytes: int) -> str:
    """``1048576`` -> ``1MiB``; exact binary units only, else plain bytes."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


#: Parameters whose value says where a secret is (``hybridkv.store.integrity``: a key file, an environment
#: variable). A wrong value may be the secret itself, typed where its location belongs, so no error repeats
#: it: neither as the parameter's value nor inside the URL (``shown_url``).
SECRET_LOCATION_PARAMS = frozenset({"integrity_key_file", "integrity_key_env"})


def shown_url(url: str) -> str:
    """``url`` as an error message may show it: the value of every ``SECRET_LOCATION_PARAMS`` parameter
    replaced by ``...`` (a name is compared percent-decoded, as ``split_url`` reads it)."""
    base, question_mark, query = url.partition("?")
    if not question_mark:
        return url
    pieces = []
    for piece in query.split("&"):
        name, equals, _value = piece.partition("=")
        pieces.append(f"{name}=..." if equals and unquote_plus(name) in SECRET_LOCATION_PARAMS else piece)
    return f"{base}?{'&'.join(pieces)}"


@dataclass
class ParsedUrl:
    """A store URL split into scheme, location and query parameters (``params`` is consumed by ``Params``)."""

    url: str
    scheme: str
    netloc: str
    path: str
    params: dict[str, str]


def _control_character(text: str) -> str | None:
    """The first ASCII control character (tab, newline, NUL, DEL, ...) in ``text``, or None."""
    return next((char for char in text if ord(char) < 0x20 or ord(char) == 0x7F), None)


def split_url(url: str) -> ParsedUrl:
    """Split ``url``; duplicate or empty-named query parameters, a fragment, a control character or an
    unparsable location raise ``StoreError`` (showing the URL as ``shown_url`` does)."""
    shown = shown_url(url)
    if "://" not in url:
        raise StoreError(f"store URL {shown!r} has no scheme (expected e.g. file:///dir, memory://name)")
    if not url.isascii():
        try:
            url.encode("utf-8")
        except UnicodeEncodeError as error:
            raise StoreError(
                f"store URL {shown!r} is not valid Unicode text: {error.object[error.start : error.end]!r} at "
                f"position {error.start} is a lone surrogate"
            ) from None
    control = _control_character(url)
    if control is not None:
        # ``urlsplit`` silently drops tabs and newlines: the URL would name another store than the one typed.
        raise StoreError(
            f"store URL {shown!r} contains the control character {control!r} (percent-encode it, e.g. %0A)"
        )
    if "#" in url:
        # A fragment is no part of any store's address: ``file:///data/a#b`` would silently open /data/a.
        fragment = shown[shown.index("#") :] if "#" in shown else "#..."  # a '#' in a hidden value: hidden
        raise StoreError(
            f"store URL {shown!r} has a fragment {fragment!r} (a store URL takes none; "
            "percent-encode a '#' in a name or path as %23)"
        )
    try:
        parts = urlsplit(url)
    except ValueError as error:  # e.g. "Invalid IPv6 URL" for an unbalanced '['
        raise StoreError(f"store URL {shown!r} cannot be parsed: {error}") from None
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if not name:
            raise StoreError(f"store URL {shown!r} has a query parameter without a name")
        if name in params:
            raise StoreError(f"store URL {shown!r} repeats parameter {name!r}")
        params[name] = value
    return ParsedUrl(url=url, scheme=parts.scheme, netloc=parts.netloc, path=parts.path, params=params)


class Params:
    """Typed, consumed-once access to a URL's query parameters.

    Every getter removes its parameter; ``finish()`` raises for whatever is left, naming it and the
    parameters the scheme accepts, so a typo never silently falls back to a default.
    """

    def __init__(self, url: str, scheme: str, params: dict[str, str]) -> None:
        #: ``url`` as the errors show it (``shown_url``)
        self._url = shown_url(url)
        self._scheme = scheme
        self._params = dict(params)
        self._known: list[str] = []

    def _take(self, name: str) -> str | None:
        self._known.append(name)
        return self._params.pop(name, None)

    def fail(self, name: str, value: str, expected: str) -> StoreError:
        """The error for parameter ``name=value``, saying what was ``expected``. The value of a
        ``SECRET_LOCATION_PARAMS`` parameter is not repeated (shown as ``...``)."""
        if name in SECRET_LOCATION_PARAMS:
            return StoreError(
                f"store URL {self._url!r}: parameter {name}=... is invalid: {expected} (its value is not "
                "repeated here: it may be a secret typed where its location belongs)"
            )
        return StoreError(f"store URL {self._url!r}: parameter {name}={value!r} is invalid: {expected}")

    def text(self, name: str, default: str) -> str:
        value = self._take(name)
        if value is None:
            return default
        control = _control_character(value)  # percent-decoded: %00, %0A, ...
        if control is not None:
            raise self.fail(name, value, f"contains the control character {control!r}")
        return value

    def optional_text(self, name: str) -> str | None:
        """``text`` without a default: ``None`` when the URL does not name ``name`` (an empty value is ``""``)."""
        if name not in self._params:
            self._known.append(name)
            return None
        return self.text(name, "")

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
            return byte_size(value)
        except ValueError as error:
            raise self.fail(name, value, str(error)) from None

    def _converted(
        self,
        name: str,
        default: _N,
        convert: Callable[[str], _N],
        not_converted: str,
        out_of_range: Callable[[_N], str | None],
    ) -> _N:
        """Parameter ``name`` through ``convert`` (``ValueError``: ``not_converted``), then checked:
        ``out_of_range(number)`` says what is wrong with it, or None."""
        value = self._take(name)
        if value is None:
            return default
        if not value.isascii():  # as sizes: ``int`` and ``float`` would also read other scripts' digits
            raise self.fail(name, value, not_converted)
        try:
            number = convert(value)
        except ValueError:
            raise self.fail(name, value, not_converted) from None
        problem = out_of_range(number)
        if problem is not None:
            raise self.fail(name, value, problem)
        return number

    def integer(self, name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        def out_of_range(number: int) -> str | None:
            if number < minimum:
                return f"must be >= {minimum}"
            return f"must be <= {maximum}" if maximum is not None and number > maximum else None

        return self._converted(name, default, int, "expected an integer", out_of_range)

    def optional_integer(self, name: str, *, minimum: int = 0, maximum: int | None = None) -> int | None:
        """``integer`` without a default: ``None`` when the URL does not name ``name`` (for parameters whose
        default depends on something else)."""
        if name not in self._params:
            self._known.append(name)
            return None
        return self.integer(name, 0, minimum=minimum, maximum=maximum)

    def number(self, name: str, default: float, *, minimum: float = 0.0, maximum: float = math.inf) -> float:
        def out_of_range(number: float) -> str | None:
            if not math.isfinite(number):  # NaN, ``inf``, ``1e999``
                return "expected a finite number"
            if number < minimum:
                return f"must be >= {minimum}"
            return f"must be <= {maximum}" if number > maximum else None

        return self._converted(name, default, float, "expected a number", out_of_range)

    def probability(self, name: str, default: float = 0.0) -> float:
        return self._converted(
            name,
            default,
            float,
            "expected a probability in [0, 1]",
            lambda number: None if 0.0 <= number <= 1.0 else "probability outside [0, 1]",
        )

    def finish(self) -> None:
        """Raise ``StoreError`` if any parameter was not consumed, naming it, the known ones, and the known
        one a near-miss was probably meant to be ("did you mean 'capacity'?")."""
        if self._params:
            unknown = ", ".join(sorted(self._params))
            known = sorted(set(self._known))
            raise StoreError(
                f"store URL {self._url!r}: unknown parameter(s) {unknown} for {self._scheme}:// "
                f"(known: {', '.join(known) or 'none'}){did_you_mean(sorted(self._params), known)}"
            )


def did_you_mean(unknown: list[str], known: Sequence[str]) -> str:
    """``; did you mean 'capacity'?`` for the known names closest to the ``unknown`` ones (one per unknown
    name with a close match, ``difflib``'s), or ``""`` when none is close: the tail of an error message."""
    guesses = [
        f"{name!r} for {wrong!r}" if len(unknown) > 1 else repr(name)
        for wrong in unknown
        for name in difflib.get_close_matches(wrong, known, n=1)
    ]
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""
