"""The errors the lifecycle's machines raise when a trigger does not happen."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["GuardRejected", "IllegalTransition"]


class IllegalTransition(RuntimeError):
    """A trigger fired from a state the table does not allow it from."""

    def __init__(self, request_id: str, trigger: str, src: str, dsts: Sequence[str]) -> None:
        self.request_id, self.trigger, self.src, self.dsts = request_id, trigger, src, tuple(dsts)
        super().__init__(
            f"request {request_id!r}: trigger {trigger!r} is illegal in state {src} "
            f"(it leads to {'/'.join(dsts) or 'nothing'} only from other states). "
            "This indicates a bug in the connector's use of the lifecycle."
        )


class GuardRejected(RuntimeError):
    """A legal trigger whose condition refused the transition (e.g. no retry budget left)."""

    def __init__(self, request_id: str, trigger: str, src: str, dst: str, conditions: Sequence[str]) -> None:
        self.request_id = request_id
        super().__init__(
            f"request {request_id!r}: {trigger!r} from {src} to {dst} refused by {', '.join(conditions)}"
        )
