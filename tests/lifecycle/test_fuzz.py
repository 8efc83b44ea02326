"""The lifecycle fuzzer (hybridkv.testing.lifecycle_fuzz) under the active Hypothesis profile."""

from __future__ import annotations

from hybridkv.testing.lifecycle_fuzz import LifecycleFuzzMachine

TestLifecycleFuzz = LifecycleFuzzMachine.TestCase
