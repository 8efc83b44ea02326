"""hybridkv.lifecycle: pure logic (no vLLM, no torch) for what happens to a request.

- ``geometry``: group specs, spans, hash unit, store keys, the agreed boundary, load/save plans, truncation.
- ``machine``: the transition table (data) and the shared ``transitions`` driver.
- ``audit``: sinks for the one-record-per-transition audit trail, and the replay checker.
- ``diagram``: Mermaid / DOT rendered from the table.
"""

from hybridkv.lifecycle.audit import (
    AuditReport,
    AuditSink,
    JsonLinesAuditSink,
    MemoryAuditSink,
    audit_file,
    replay_records,
)
from hybridkv.lifecycle.geometry import (
    BlockLoad,
    EntryId,
    Geometry,
    GroupKind,
    GroupSpec,
    KeyScheme,
    LoadOutcome,
    LoadPlan,
    LoadResolution,
    LookupCandidates,
    LookupResult,
    Rank,
    SaveBlock,
    SavePlan,
    Topology,
    plan_lookup,
    plan_save,
    retry_cap,
)
from hybridkv.lifecycle.machine import (
    TRANSITIONS,
    GuardRejected,
    IllegalTransition,
    LifecycleMachine,
    RequestLifecycle,
    SaveWave,
    State,
)

__all__ = [
    "TRANSITIONS",
    "AuditReport",
    "AuditSink",
    "BlockLoad",
    "EntryId",
    "Geometry",
    "GroupKind",
    "GroupSpec",
    "GuardRejected",
    "IllegalTransition",
    "JsonLinesAuditSink",
    "KeyScheme",
    "LifecycleMachine",
    "LoadOutcome",
    "LoadPlan",
    "LoadResolution",
    "LookupCandidates",
    "LookupResult",
    "MemoryAuditSink",
    "Rank",
    "RequestLifecycle",
    "SaveBlock",
    "SavePlan",
    "SaveWave",
    "State",
    "Topology",
    "audit_file",
    "plan_lookup",
    "plan_save",
    "replay_records",
    "retry_cap",
]
