"""hybridkv.lifecycle: pure logic (no vLLM, no torch, no threads, no files) for what happens to a request.

- ``kinds``: one rules object per cache kind (full attention, sliding window, Mamba) in ``KIND_RULES``.
- ``geometry``: the groups, the TP/DCP topology, spans, hash unit, scheduler block and hit alignment.
- ``keys``: store keys and fingerprints, the namespace rule, the entry types plans share.
- ``lookup``: the agreed boundary (vLLM's fixed point) from one batch of keys, or a bounded search (a
  package: the fixed point, the full scan, the search, an answer as plain data).
- ``load``: load plans, load outcomes, the verdict of a finished load and the retry cap.
- ``save``: save plans and which blocks count as stored.
- ``table``: the transition table (data): states, triggers, ``TRANSITIONS``, ``TRIGGERS``.
- ``machine``: the shared ``transitions`` driver that runs the table, and the per-request models.
- ``ask``: one ask of vLLM's decided (``decide_ask``): the ask sub-state, the answer, the wait's bound,
  and what the connector does about it.
- ``engine``: the engine's own lifecycle (namespace gate, reset epochs, weights tag) on the engine table.
- ``errors``: what both machines raise when a trigger does not happen.
- ``sink``: what the machine emits its one-record-per-transition audit trail to (``AuditSink``), and an
  in-memory sink. The file sink, the replay checker, the trace export and the diagrams are tools over the
  table and live in ``hybridkv.audit``.
"""

from hybridkv.lifecycle.geometry import Geometry, Rank, Topology
from hybridkv.lifecycle.keys import KEY_VERSION, NAMESPACE_RE, EntryId, KeyScheme, PlannedBlock
from hybridkv.lifecycle.kinds import KIND_RULES, GroupKind, GroupSpec, KindRules
from hybridkv.lifecycle.load import LoadOutcome, LoadPlan, LoadResolution, retry_cap
from hybridkv.lifecycle.lookup import LookupCandidates, LookupResult, LookupSearch, plan_lookup
from hybridkv.lifecycle.machine import (
    GuardRejected,
    IllegalTransition,
    LifecycleMachine,
    RequestLifecycle,
    SaveWave,
)
from hybridkv.lifecycle.save import SavePlan, plan_save
from hybridkv.lifecycle.sink import AuditSink, MemoryAuditSink
from hybridkv.lifecycle.table import TRANSITIONS, State

__all__ = [
    "KEY_VERSION",
    "KIND_RULES",
    "NAMESPACE_RE",
    "TRANSITIONS",
    "AuditSink",
    "EntryId",
    "Geometry",
    "GroupKind",
    "GroupSpec",
    "GuardRejected",
    "IllegalTransition",
    "KeyScheme",
    "KindRules",
    "LifecycleMachine",
    "LoadOutcome",
    "LoadPlan",
    "LoadResolution",
    "LookupCandidates",
    "LookupResult",
    "LookupSearch",
    "MemoryAuditSink",
    "PlannedBlock",
    "Rank",
    "RequestLifecycle",
    "SavePlan",
    "SaveWave",
    "State",
    "Topology",
    "plan_lookup",
    "plan_save",
    "retry_cap",
]
