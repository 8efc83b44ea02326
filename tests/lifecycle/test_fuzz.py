"""The lifecycle fuzzer (hybridkv.testing.lifecycle_fuzz) under the active Hypothesis profile.

The lifecycle is pure logic and cheap to drive, so the CI profile runs it several times deeper than the
store fuzzers (at least 400 examples); ``--hypothesis-profile=long`` goes deeper still.
"""

from __future__ import annotations

from hybridkv.testing.lifecycle_fuzz import LifecycleFuzzMachine
from hypothesis import settings

TestLifecycleFuzz = LifecycleFuzzMachine.TestCase
TestLifecycleFuzz.settings = settings(settings.default, max_examples=max(400, settings.default.max_examples))
