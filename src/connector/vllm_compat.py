"""What the installed vLLM release offers a connector: one place for the checks of later releases' names.

hybridkv supports vLLM 0.32, 0.33 and 0.34 (``pyproject.toml``). A hook a release added to the connector base
class is simply never called by an older one, so the connector defines it unconditionally; only names that
exist in a later release alone are imported here, behind a check, so that importing hybridkv never fails on an
older vLLM.

- 0.33: sleep mode (``supports_sleep_mode``, ``unregister_kv_caches``, ``restore_kv_caches``).
- 0.34: ``may_load_async`` (``--max-num-inflight-kv-loads``), ``kv_cache_access`` (``KVCacheAccess`` flags in
  ``vllm.config.kv_transfer``; the extensible KV cache calls the sleep hooks around a weight update too),
  ``supports_lookahead_block_hashes``.
"""

from __future__ import annotations

import enum
import functools

__all__ = ["in_process_kv_cache_access", "vllm_release"]


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
