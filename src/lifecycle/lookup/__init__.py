"""A lookup in a bounded number of batched existence checks: probe, confirm, and (rarely) scan.

``plan_lookup(...) -> LookupCandidates`` (``scan.py``) lists every key a lookup may need -- every
candidate boundary x every group x every rank -- for ONE ``store.exists``;
``LookupCandidates.resolve(exists)`` gives the agreed boundary (the same fixed point as vLLM's
``HybridKVCacheCoordinator.find_longest_cache_hit``, each group's contribution by its kind's rules; it is
computed in ``agreement.py``) and the exact ``LoadPlan``. At production geometry (a 128K-token prompt, hash
unit 64, DCP 8, two groups) that is ~32K keys. ``LookupSearch`` finds the same
agreed boundary and the same load plan from far fewer keys, in a few rounds (``search.py``):

1. **probe** (one round): one key per (lookup unit, candidate boundary) -- the unit's first group on
   rank 0. Entries are saved on every rank by the same wave, so a probe is a good guess of "exists on
   every rank"; it is never trusted for a load.
2. **confirm** (usually one round): the agreed boundary under the guessed availability is computed with
   the same fixed point as vLLM's coordinator; then every key of its load plan (every group the plan
   loads, on every rank) is checked. All present: that is the answer. The first confirm also checks the
   few probed Mamba states just below that boundary (``MAX_STEP_BACK_STATES``), so a step back -- or the
   retry of a truncated load -- usually needs no further round trip.
3. **step back** (bounded): a confirm that finds a hole (an entry evicted on some rank, a wave stored on
   some ranks only) turns those keys into known facts and recomputes -- the boundary can only shrink.
   After ``max_confirm_rounds`` confirms, one **scan** checks every candidate key at or below the current
   boundary that is still unknown, which makes every fact the fixed point can look at exact.

Contract: the answer equals the full scan's answer over the same store contents (the fixed point only
shrinks as availability shrinks, and every key of the returned plan was seen present on every rank);
round trips: 2 when the store holds a clean prefix (or nothing), at most ``max_confirm_rounds + 2``
otherwise, plus one per extra scan in the (theoretical) case a scan uncovers a longer boundary.

``known`` (key -> present) may be shared by several searches of one request: a prefetch started when
the request was queued (local hit unknown, so 0) answers a later ask with the real local hit without
another round trip when it already covers that plan.

Modules: ``agreement`` (the fixed point and the load plan of an answer, shared by both), ``scan`` (the full
scan, the search's oracle), ``search`` (the search the connector runs), ``portable`` (an answer as plain
data, for a search run in another process).
"""

from hybridkv.lifecycle.lookup.agreement import PAUSE_EVERY, LookupQuery, LookupResult, key_cap, lookup_cap
from hybridkv.lifecycle.lookup.portable import PortableResult, portable_result, result_from_portable
from hybridkv.lifecycle.lookup.scan import LookupCandidates, plan_lookup
from hybridkv.lifecycle.lookup.search import (
    DEFAULT_MAX_CONFIRM_ROUNDS,
    MAX_STEP_BACK_STATES,
    ExistsFn,
    LookupSearch,
)

__all__ = [
    "DEFAULT_MAX_CONFIRM_ROUNDS",
    "MAX_STEP_BACK_STATES",
    "PAUSE_EVERY",
    "ExistsFn",
    "LookupCandidates",
    "LookupQuery",
    "LookupResult",
    "LookupSearch",
    "PortableResult",
    "key_cap",
    "lookup_cap",
    "plan_lookup",
    "portable_result",
    "result_from_portable",
]
