"""What the installed vLLM release offers a connector: one place for the checks of later releases' names.

hybridkv supports vLLM 0.32, 0.33 and 0.34 (``pyproject.toml``). A hook a release added to the connector base
class is simply never called by an older one, so the connector defines it unconditionally; only names that
exist in a later release alone are imported here, behind a check, so that importing hybridkv never fails on an
older vLLM.

- 0.33: sleep mode (``supports_sleep_mode``, ``unregister_kv_caches``, ``restore_kv_caches``).
- 0.34: ``may_load_async`` (``--max-num-inflight-kv-loads``), ``kv_cache_access`` (``KVCacheAccess`` flags in
  ``vllm.config.kv_transfer``; the extensible KV cache calls the sleep hooks around a weight update too),
  ``supports_lookahead_block_hashes``.

The two places where the connector goes around vLLM's connector interface live here too, each with why and what
would retire it: :func:`settle_before_prefix_cache_reset` (no hook runs before ``reset_prefix_cache``'s check
in any supported release) and :func:`this_process_connector` (vLLM's process-global connector group: the
scheduler half reaches its own process's worker half to settle saves).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

__all__ = [
    "in_process_kv_cache_access",
    "settle_before_prefix_cache_reset",
    "this_process_connector",
    "vllm_release",
]


@functools.cache
def vllm_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed vLLM (``vllm.__version__``; a dev build counts as its release)."""
    import vllm

    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def in_process_kv_cache_access() -> enum.IntFlag:
    """vLLM 0.34's ``KVCacheAccess.IN_PROCESS``: the connector's workers reach the device KV cache only with
    in-process copies (torch ops on the registered tensors), so any allocation of the KV cache works,
    the extensible one included. Only vLLM 0.34 and later call ``kv_cache_access``, and only they have
    the flag (``ImportError`` on older releases)."""
    from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined,unused-ignore]  # 0.34+

    access: enum.IntFlag = KVCacheAccess.IN_PROCESS
    return access


def settle_before_prefix_cache_reset(kv_cache_manager: KVCacheManager, settle: Callable[[], object]) -> None:
    """Make ``kv_cache_manager.reset_prefix_cache()`` call ``settle()`` first (the only vLLM method hybridkv
    replaces, and only on the manager vLLM bound the connector to).

    Why: vLLM's ``reset_prefix_cache()`` succeeds only when no block is referenced, and the connector pins the
    source blocks of its in-flight saves until every worker reported them, which normally happens inside a
    later engine step -- one an idle engine never takes, so the reset would fail for as long as the engine
    stays idle. vLLM 0.32, 0.33 and 0.34 run the connector's ``reset_cache`` only after that check and offer
    no hook before it. Retire this when a release calls the connector before the check.
    """
    reset = kv_cache_manager.reset_prefix_cache

    def reset_prefix_cache() -> bool:
        settle()
        done: bool = reset()
        return done

    kv_cache_manager.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]


def this_process_connector() -> object | None:
    """vLLM's connector of the worker role in this process (``get_kv_transfer_group()``), or None.

    Only a worker in the scheduler's own process is found (TP 1 with the in-process or uniprocess executor):
    elsewhere the caller falls back to vLLM's own path (the engine keeps stepping while
    ``has_pending_push_work()``), so this is a shortcut, never a requirement.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    group: object = get_kv_transfer_group()
    return group
