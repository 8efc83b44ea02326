"""Stores of other packages: the ``hybridkv.stores`` entry-point group.

A package adds a URL scheme by naming, under the group ``hybridkv.stores``, an entry point whose name is the
scheme and whose object is a ``hybridkv.store.kinds.StoreKind`` for it (or a callable without arguments that
returns one)::

    [project.entry-points."hybridkv.stores"]
    dirstore = "my_store:STORE_KIND"

The kind states the same facts a built-in row does (opener, tier, process-local, parameters, ...), and its
backend implements ``hybridkv.store.framed.Backend``. From then on its URLs are opened, checked at engine start,
wrapped in the ``faulty+`` view and described exactly like the built-in ones (``hybridkv.store.url``).

Plug-ins are found when a URL's scheme is not a built-in one and once per process (``plugin_kinds``). One that
cannot be loaded, states another scheme than its name, is no ``StoreKind``, or takes a built-in scheme is not
served: a URL of its scheme raises ``StoreError`` naming the entry point and why, and every other scheme keeps
working.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from hybridkv.store.kinds import StoreKind

__all__ = ["ENTRY_POINT_GROUP", "PluginKinds", "plugin_kinds"]

#: The entry-point group a store package registers its kinds in.
ENTRY_POINT_GROUP = "hybridkv.stores"
#: A URL scheme (RFC 3986: a letter, then letters, digits, ``+``, ``-``, ``.``), lowercase as URLs are read.
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


@dataclass(frozen=True)
class PluginKinds:
    """The store kinds of installed plug-ins: the ones served, and why each refused one is not."""

    scheme_to_kind: Mapping[str, StoreKind]
    #: scheme -> why its entry point is not served (the message names the entry point).
    scheme_to_refusal: Mapping[str, str]


def _describe(entry_point: EntryPoint) -> str:
    dist = entry_point.dist
    origin = f" (distribution {dist.name} {dist.version})" if dist is not None else ""
    return f"store plug-in {entry_point.name} = {entry_point.value}{origin}"


def _load(entry_point: EntryPoint, builtin_schemes: frozenset[str]) -> StoreKind | str:
    """The kind ``entry_point`` registers, or why it cannot be served."""
    name = entry_point.name
    if not _SCHEME.fullmatch(name) or name.startswith("faulty"):
        return f"its name {name!r} is not a URL scheme hybridkv can serve (lowercase letters, digits, + - .; not faulty*)"
    if name in builtin_schemes:
        return f"it takes the built-in scheme {name!r}"
    try:
        loaded = entry_point.load()
        kind = loaded() if callable(loaded) and not isinstance(loaded, StoreKind) else loaded
    except Exception as error:  # noqa: BLE001 -- any failure of a third party's import is reported, never raised
        return f"it failed to load: {type(error).__name__}: {error}"
    if not isinstance(kind, StoreKind):
        return f"it is a {type(kind).__name__}, not a hybridkv.store.kinds.StoreKind"
    if kind.scheme != name:
        return f"its StoreKind states the scheme {kind.scheme!r}, not its name {name!r}"
    return kind


@functools.cache
def plugin_kinds(builtin_schemes: frozenset[str]) -> PluginKinds:
    """Every ``hybridkv.stores`` entry point of the installed distributions, loaded once per process.
    Two entry points of one scheme are both refused (which one a URL means would depend on install order)."""
    scheme_to_kind: dict[str, StoreKind] = {}
    scheme_to_refusal: dict[str, str] = {}
    found = entry_points(group=ENTRY_POINT_GROUP)
    names = [entry_point.name for entry_point in found]
    for entry_point in found:
        where = _describe(entry_point)
        if names.count(entry_point.name) > 1:
            others = [_describe(other) for other in found if other.name == entry_point.name]
            scheme_to_refusal[entry_point.name] = (
                f"{len(others)} store plug-ins claim it: {'; '.join(others)}"
            )
            continue
        loaded = _load(entry_point, builtin_schemes)
        if isinstance(loaded, str):
            scheme_to_refusal[entry_point.name] = f"{where} is not served: {loaded}"
        else:
            scheme_to_kind[entry_point.name] = loaded
    return PluginKinds(scheme_to_kind, scheme_to_refusal)
