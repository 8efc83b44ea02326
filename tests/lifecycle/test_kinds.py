"""The per-kind rules table, and the layering of the pure lifecycle package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hybridkv
import pytest
from hybridkv.lifecycle import KIND_RULES, NAMESPACE_RE, Geometry, GroupKind, GroupSpec, KeyScheme, Topology
from hybridkv.lifecycle.kinds import KindRules

SRC = Path(hybridkv.__file__).resolve().parent


def test_every_kind_has_exactly_its_rules() -> None:
    assert set(KIND_RULES) == set(GroupKind)
    for kind, rules in KIND_RULES.items():
        assert isinstance(rules, KindRules) and rules.kind is kind
    # The one left-contiguous kind is what vLLM looks up first (full attention).
    geometry = Geometry(groups=(GroupSpec.mamba(64), GroupSpec.full(16)))
    assert geometry.lookup_units == ((1,), (0,))


def test_kind_branches_live_in_the_rules_objects() -> None:
    """Lifecycle and connector code asks a group's rules; only ``kinds.py`` says what a kind does.

    (``hybridkv.testing.lifecycle_fuzz`` keeps its own per-kind branches on purpose: it is the
    independent oracle the rules are checked against.)
    """
    branch = re.compile(r"\bkind\s+(is|is not|==|!=|in|not in)\b|GroupKind\.(FULL|SLIDING_WINDOW|MAMBA)")
    offenders = []
    for path in sorted([*(SRC / "lifecycle").glob("*.py"), *(SRC / "connector").glob("*.py")]):
        if path.name == "kinds.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


def test_lifecycle_imports_neither_vllm_nor_torch() -> None:
    code = "import sys, hybridkv.lifecycle; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("namespace", ["", "-lead", "a/b", "x" * 65, "spa ce"])
def test_one_namespace_rule_for_keys_and_config(namespace: str) -> None:
    from hybridkv.connector.config import ConnectorConfig

    assert not NAMESPACE_RE.match(namespace)
    geometry = Geometry(groups=(GroupSpec.full(16),), topology=Topology())
    with pytest.raises(AssertionError, match="namespace"):
        KeyScheme(namespace=namespace, model="m", geometry=geometry)
    with pytest.raises(ValueError, match="namespace"):
        ConnectorConfig.from_extra_config({"store": "memory://ns-rule", "namespace": namespace}, model="m")
