"""Fixtures for connector tests (helpers live in ``connector_helpers``)."""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.testing.cluster import make_vllm_objs


@pytest.fixture(scope="session")
def vllm_objs() -> dict[str, Any]:
    return make_vllm_objs()
