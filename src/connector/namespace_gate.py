"""The namespace gate: whether entries of this deployment's namespace may be served or published.

A reset (``reset_prefix_cache(reset_connector=True)``) closes the gate and starts a new reset epoch; the
gate opens again when the namespace removal returned, and stays closed after a removal that raised (entries
from before the reset may remain) until a later reset succeeds. While it is closed lookups miss and nothing
is saved; a save job remembers the epoch it was created in and publishes ``BlockStored`` only if no reset
came since (``is_current``).

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
    """Reset epochs and the gate they close (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._num_pending = 0
        self._failed = False

    @property
    def epoch(self) -> int:
        """Resets begun so far."""
        return self._epoch

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

    def begin_reset(self) -> int:
        """Close the gate for a new reset; returns its epoch."""
        with self._lock:
            self._epoch += 1
            self._num_pending += 1
            return self._epoch

    def end_reset(self, *, ok: bool) -> None:
        """A reset's removal returned (``ok``) or raised / could not be queued."""
        with self._lock:
            assert self._num_pending > 0, "NamespaceGate.end_reset without a reset in progress"
            self._num_pending -= 1
            self._failed = not ok

    def is_current(self, epoch: int) -> bool:
        """No reset since ``epoch`` and the gate is open: what was stored then may be published."""
        with self._lock:
            return epoch == self._epoch and not self._num_pending and not self._failed
