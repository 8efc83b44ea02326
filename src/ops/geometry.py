"""The geometry vLLM resolves for a model, read from an in-process engine (the ``geometry`` of a describe report).

Contracts:

- The engine runs on a private ``memory://`` store, so the store being described is never touched, and
  without the config's ``audit_log``.
- What the engine prints (vLLM's logger handlers and anything written to fd 1) goes to stderr while it runs:
  ``hybridkv describe --json | jq`` sees only the JSON.
- vLLM is imported only inside the functions (the CPU build works).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["describe_model_geometry", "stdout_to_stderr"]


def describe_model_geometry(
    model: str,
    extra: dict[str, Any],
    *,
    dtype: str,
    max_model_len: int,
    attention_backend: str | None = None,
) -> dict[str, Any]:
    """Start an in-process engine on ``model`` with the connector on a private ``memory://`` store (so the
    described store is never touched) and resolve the geometry from vLLM's own ``kv_cache_config``; also
    whether that engine's connector loads (``loads``, ``loads_off_reason``) and whether the model identity
    found the weights (``weights``, ``weights_resolved``, ``weights_unresolved``).

    Returns ``model``, ``namespace``, ``fingerprint``, ``key_prefix``, ``hash_unit``, ``hit_alignment``,
    ``scheduler_block``, ``tp``, ``dcp``, the fields above and ``groups`` (one dict per store group: ``group``,
    ``vllm_group``, ``kind``, ``spec``, ``block``, ``span``, ``dcp_sharded``, ``layers``, ``entry_bytes``).
    Whatever the engine raises (``ValueError`` for a config vLLM refuses) propagates."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from hybridkv.connector.capabilities import load_disabled_reason
    from hybridkv.connector.identity import UNRESOLVED_DETAIL
    from hybridkv.ops import inprocess

    engine_extra = {k: v for k, v in extra.items() if k != "audit_log"}
    engine_extra["store"] = f"memory://hybridkv-describe-{secrets.token_hex(4)}"
    transfer = inprocess.connector_transfer_config(engine_extra)
    kwargs = inprocess.engine_kwargs(
        max_model_len=max_model_len, kv_cache_bytes=64 << 20, dtype=dtype, max_num_seqs=1
    )
    if attention_backend is not None:
        kwargs["attention_backend"] = attention_backend
    # vLLM logs to stdout; `describe --json | jq` must see only the JSON.
    with (
        stdout_to_stderr(),
        inprocess.inprocess_engine(Path(model), transfer, use_tqdm_on_load=False, **kwargs) as llm,
    ):
        # The serving connector resolved the geometry from vLLM's own kv_cache_config at start.
        scheduler_connector, _ = inprocess.connector_halves(llm)
        side = scheduler_connector.scheduler_side
        geo = side.geo
        # The engine's config after vLLM's fix-ups: what the connector itself judged at start.
        loads_off_reason = load_disabled_reason(llm.llm_engine.vllm_config)
        kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        geometry = geo.geometry
        groups = []
        for info, spec in zip(geo.groups, geometry.groups, strict=True):
            vllm_group = kv_cache_config.kv_cache_groups[info.vllm_group_index]
            groups.append(
                {
                    "group": info.group_index,
                    "vllm_group": info.vllm_group_index,
                    "kind": info.kind.value,
                    "spec": info.spec_name,
                    "block": spec.block_size,
                    "span": info.span,
                    "dcp_sharded": spec.dcp_sharded,
                    "layers": len(info.layer_names),
                    "entry_bytes": _entry_bytes(info.group_index, vllm_group),
                }
            )
        return {
            "model": model,
            "namespace": geo.scheme.namespace,
            "fingerprint": geo.scheme.fingerprint,
            "key_prefix": geo.scheme.geometry_prefix,
            "hash_unit": geometry.hash_unit,
            "hit_alignment": geometry.hit_alignment,
            "scheduler_block": geometry.scheduler_block_size,
            "tp": geometry.topology.tp_size,
            "dcp": geometry.topology.dcp_size,
            "loads": side.can_load,
            "loads_off_reason": None if side.can_load else loads_off_reason,
            "weights": geo.identity.weights,
            "weights_resolved": geo.identity.resolved,
            "weights_unresolved": None if geo.identity.resolved else UNRESOLVED_DETAIL,
            "groups": groups,
        }


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what the engine prints -- vLLM's logger handlers and anything written to fd 1 -- to stderr; on
    exit fd 1, the handlers' streams and ``VLLM_LOGGING_STREAM`` are as they were."""
    swapped: list[tuple[logging.StreamHandler[Any], Any]] = [
        (handler, handler.setStream(sys.stderr))
        for handler in logging.getLogger("vllm").handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr
    ]
    saved_stream = os.environ.get("VLLM_LOGGING_STREAM")
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # a handler vLLM configures meanwhile
    sys.stdout.flush()
    saved_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        for handler, stream in swapped:
            handler.setStream(stream)
        if saved_stream is None:
            os.environ.pop("VLLM_LOGGING_STREAM", None)
        else:
            os.environ["VLLM_LOGGING_STREAM"] = saved_stream


def _entry_bytes(group_index: int, vllm_group: Any) -> int:
    """Payload bytes of one entry on one rank: what the engine's worker connector moves per block of the
    group (its registered KV-cache views); from vLLM's unpadded page sizes if that is not reachable."""
    from hybridkv.connector.vllm_compat import this_process_connector

    worker_side = getattr(this_process_connector(), "worker_side", None)
    if worker_side is not None and hasattr(worker_side, "block_nbytes"):
        return int(worker_side.block_nbytes(group_index))
    spec = vllm_group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    specs = (
        [per_layer[name] for name in vllm_group.layer_names]
        if isinstance(per_layer, dict)
        else [spec] * len(vllm_group.layer_names)
    )
    return sum(int(getattr(s, "real_page_size_bytes", s.page_size_bytes)) for s in specs)
