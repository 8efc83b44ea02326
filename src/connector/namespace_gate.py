"""The namespace gate: whether entries of this deployment's namespace may be served or published.

A reset (``reset_prefix_cache(reset_connector=True)``) closes the gate; it opens again when the namespace
removal returned, and stays closed after a removal that raised (entries from before the reset may remain)
until a later reset succeeds. While it is closed lookups miss and nothing is saved. The reset epoch itself
is the lifecycle machine's (``LifecycleMachine.epoch``): one counter for answers and save jobs alike.

States: ``OPEN`` -> (``begin_reset``) ``RESETTING`` -> (``end_reset``) ``OPEN`` | ``FAILED``;
``FAILED`` -> (``begin_reset``) ``RESETTING``. Thread-safe: resets end on the maintenance thread.
"""

from __future__ import annotations

import enum
import threading

__all__ = ["GateState", "NamespaceGate"]


class GateState(enum.Enum):
    OPEN = "OPEN"
    RESETTING = "RESETTING"
    FAILED = "FAILED"


class NamespaceGate:
    """The gate resets close (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_pending = 0
        self._failed = False

    @property
    def state(self) -> GateState:
        with self._lock:
            if self._num_pending:
                return GateState.RESETTING
            return GateState.FAILED if self._failed else GateState.OPEN

    @property
    def closed(self) -> bool:
        """Lookups miss and nothing is saved (a removal runs, or the last one raised)."""
        return self.state is not GateState.OPEN

    def begin_reset(self) -> None:
        """Close the gate for a new reset."""
        with self._lock:
            self._num_pending += 1

    def end_reset(self, *, ok: bool) -> None:
        """A reset's removal returned (``ok``) or raised / could not be queued."""
        with self._lock:
            assert self._num_pending > 0, "NamespaceGate.end_reset without a reset in progress"
            self._num_pending -= 1
            self._failed = not ok
