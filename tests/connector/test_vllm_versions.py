"""The connector's hooks against the installed vLLM's connector base class (0.32, 0.33 and 0.34 alike).

`make test` runs this file under every release: vLLM's CPU build 0.32 and vLLM 0.33's and 0.34's Python code
(`make test-vllm033`, `make test-vllm034`). A hook whose parameters drift from the base class vLLM calls it through would only
fail on a real engine of that release; these checks fail at test time instead.
"""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.vllm

# Sleep mode: vLLM 0.33 added these hooks to the connector base class; 0.32 never calls them.
SLEEP_HOOKS = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
# vLLM 0.34 added these; 0.32 and 0.33 never call them (tests/connector/test_vllm034_hooks.py).
VLLM034_HOOKS = ("may_load_async", "kv_cache_access")


def _vllm_release() -> tuple[int, int]:
    import vllm

    major, minor = (int(part) for part in vllm.__version__.split(".")[:2])
    return major, minor


def _parameters(function: object) -> list[tuple[str, inspect._ParameterKind]]:
    """Names and kinds, not annotations: vLLM annotates with names hybridkv does not import."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def _is_method(attribute: object) -> bool:
    # A classmethod object itself is not callable; supports_sleep_mode and build_*_stats are classmethods.
    return isinstance(attribute, classmethod | staticmethod) or callable(attribute)


def test_every_overridden_hook_keeps_the_base_class_parameters() -> None:
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    overridden = sorted(
        name
        for name in vars(HybridStoreConnector)
        if not name.startswith("__") and _is_method(inspect.getattr_static(KVConnectorBase_V1, name, None))
    )
    assert "build_kv_connector_stats" in overridden, f"classmethod hooks missing from {overridden}"
    assert len(overridden) >= 20, f"only {overridden} found: is HybridStoreConnector still a connector?"
    for name in overridden:
        ours = inspect.getattr_static(HybridStoreConnector, name)
        theirs = inspect.getattr_static(KVConnectorBase_V1, name)
        assert type(ours) is type(theirs), (
            f"{name}: {type(ours).__name__} here, {type(theirs).__name__} in vLLM's KVConnectorBase_V1"
        )
        assert _parameters(getattr(HybridStoreConnector, name)) == _parameters(
            getattr(KVConnectorBase_V1, name)
        ), f"{name}: parameters differ from vLLM's KVConnectorBase_V1.{name}"


def test_sleep_hooks_are_the_connectors_own_where_vllm_calls_them() -> None:
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    declared = [name for name in SLEEP_HOOKS if hasattr(KVConnectorBase_V1, name)]
    if _vllm_release() >= (0, 33):
        # 0.33's default supports_sleep_mode() is True: inheriting it would promise a drain nobody does.
        assert declared == list(SLEEP_HOOKS)
        for name in SLEEP_HOOKS:
            assert name in vars(HybridStoreConnector), f"{name} is inherited from vLLM's default"
    else:
        assert declared == [], f"vLLM {_vllm_release()} already declares {declared}"
    assert HybridStoreConnector.supports_sleep_mode(None) is True


def test_vllm034_hooks_are_the_connectors_own_where_vllm_calls_them() -> None:
    """0.34's defaults would answer for hybridkv: ``may_load_async`` False for every store hit (the P/D
    flag only), ``kv_cache_access`` IN_PROCESS without hybridkv saying so."""
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    declared = [name for name in VLLM034_HOOKS if hasattr(KVConnectorBase_V1, name)]
    assert declared == (list(VLLM034_HOOKS) if _vllm_release() >= (0, 34) else []), declared
    for name in VLLM034_HOOKS:
        assert name in vars(HybridStoreConnector), f"{name} is not the connector's own"
