"""The namespace gate: whether entries of this deployment's namespace may be served or published.

A reset (``reset_prefix_cache(reset_connector=True)``) closes the gate; it opens again when the namespace
removal returned, and stays closed after a removal that raised (entries from before the reset may remain)
until a later reset succeeds. While it is closed lookups miss and nothing is saved. The reset epoch itself
is the lifecycle machine's (``LifecycleMachine.epoch``): one counter for answers and save jobs alike.

The gate's state is the engine's (``hybridkv.lifecycle.machine.EngineLifecycle``, the table's
``ENGINE_TRANSITIONS``): ``OPEN`` -> (``begin_reset``) ``RESETTING`` -> (``end_reset``) ``OPEN`` | ``FAILED``;
``FAILED`` -> (``begin_reset``) ``RESETTING``; a reset's weights tag (``rotate_weights``) changes the
fingerprint only while ``RESETTING``. Every change is an audit record of the engine. Thread-safe (resets
end on the maintenance thread): one lock around every call into the engine's lifecycle, which takes none
itself (``hybridkv.lifecycle`` stays free of threads and locks).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from hybridkv.lifecycle.machine import EngineLifecycle
from hybridkv.lifecycle.table import EngineState

if TYPE_CHECKING:
    from hybridkv.lifecycle.keys import KeyScheme
    from hybridkv.lifecycle.machine import LifecycleMachine

__all__ = ["GateState", "NamespaceGate"]

#: The gate's states are the engine's (``STARTING`` is never observed: the gate starts the engine).
GateState = EngineState


class NamespaceGate:
    """The gate resets close (see the module docstring), over the engine's lifecycle.

    Args:
        machine: the requests' lifecycle machine: its epoch is the reset epoch, its scheme the keys in
            force, its sink where the engine's records go.
        weights_source: what names the weights at start (``"checkpoint"``, or ``"declared"``: the
            ``weights_version`` key); the ``engine_started`` record carries it.
    """

    def __init__(self, machine: LifecycleMachine, *, weights_source: str = "checkpoint") -> None:
        self._lock = threading.Lock()
        self.engine = EngineLifecycle(machine, weights_source=weights_source)

    @property
    def state(self) -> GateState:
        with self._lock:
            return self.engine.current

    @property
    def closed(self) -> bool:
        """Lookups miss and nothing is saved (a removal runs, or the last one raised)."""
        return self.state is not EngineState.OPEN

    def begin_reset(self) -> int:
        """Close the gate for a new reset and start a new reset epoch (returned)."""
        with self._lock:
            return self.engine.begin_reset()

    def rotate_weights(self, scheme: KeyScheme, *, weights_source: str, reason: str) -> None:
        """The keys from now on use ``scheme`` (during a reset; see ``EngineLifecycle.rotate_weights``)."""
        with self._lock:
            self.engine.rotate_weights(scheme, weights_source=weights_source, reason=reason)

    def end_reset(self, *, ok: bool) -> None:
        """A reset's removal returned (``ok``) or raised / could not be queued."""
        with self._lock:
            self.engine.end_reset(ok=ok)
