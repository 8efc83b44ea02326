"""The seed scenario, end to end, on a real vLLM engine: ``hybridkv demo``.

``run_demo(options)`` builds a tiny random-weight model (no download), starts vLLM (CPU build, in-process)
with ``HybridStoreConnector`` on a store, and runs five phases:

1. ``cold``     -- prompt A on an empty store (a fresh namespace): computed, then saved to the store.
2. ``shared``   -- prompt B, which shares A's prefix up to A's last hit boundary: a prefix-cache hit.
3. ``external`` -- vLLM's local prefix cache is dropped (``reset_prefix_cache``; the store is kept), A is
   sent again: its prefix comes from the store, the tokens equal the cold run's.
4. ``restart``  -- a fresh engine on the same store, A again: the same, across a process-level restart.
5. ``chaos``    -- a fresh engine on the same bytes behind the ``faulty+`` wrapper (failed and corrupt
   reads): loads truncate, vLLM recomputes, the tokens are still identical.

Every number comes from the running system: ``cached`` is vLLM's ``RequestOutput.num_cached_tokens``;
``external`` is what the connector loaded and verified for that request (its audit log: ``load_verified``
records, boundary minus the local hit it was asked with); ``local = cached - external``; loaded / saved
bytes and failed keys are the worker's counters; truncations are the audit log's ``load_failed`` records.
The audit log is replayed at the end (``hybridkv.audit.replay``).

Contracts:

- vLLM must run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the demo reads the connector's
  counters from the engine objects. ``run_demo`` raises ``RuntimeError`` otherwise.
- ``run_demo`` never raises for a misbehaving engine, connector or store: the failure is recorded in the
  report (``DemoReport.error`` and a failed check) and ``DemoReport.ok`` is False. Bad options raise
  ``ValueError`` before anything starts.
- This module never configures logging; progress goes through ``DemoOptions.progress``.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.demo.engine import DemoEngine, RequestResult
from hybridkv.demo.tiny_models import FAMILIES, build_tiny_model

__all__ = [
    "DEFAULT_CHAOS",
    "Check",
    "DemoOptions",
    "DemoReport",
    "PhaseResult",
    "RequestResult",
    "run_demo",
]

#: Fault parameters of the chaos phase (``faulty+`` URL query), see ``hybridkv.store.faulty``.
DEFAULT_CHAOS = "get_fail=0.5&corrupt=0.2&seed=7"
#: Prompt tokens are drawn from this range (the tiny models' vocabulary is 512; 0-2 are special).
_TOKEN_RANGE = (3, 500)


def _ignore(_message: str) -> None:
    return None


@dataclass(frozen=True)
class DemoOptions:
    """What to run. ``store=None``: a file store under ``workdir``; ``workdir=None``: a fresh temp dir;
    ``models_dir=None``: ``workdir/models``. ``chaos`` is the ``faulty+`` query (probabilities, seed)."""

    model_family: str = "qwen3_next"
    store: str | None = None
    prompt_tokens: int = 1200
    max_tokens: int = 16
    workdir: Path | None = None
    models_dir: Path | None = None
    chaos: str = DEFAULT_CHAOS
    chaos_rounds: int = 2
    seed: int = 1
    progress: Callable[[str], None] = _ignore

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad option."""
        if self.model_family not in FAMILIES:
            raise ValueError(f"model family {self.model_family!r}: expected one of {list(FAMILIES)}")
        if self.prompt_tokens < 2 or self.prompt_tokens > 3000:
            raise ValueError(f"prompt tokens {self.prompt_tokens}: expected 2..3000")
        if not 1 <= self.max_tokens <= 256:
            raise ValueError(f"max tokens {self.max_tokens}: expected 1..256")
        if self.chaos_rounds < 1:
            raise ValueError(f"chaos rounds {self.chaos_rounds}: expected >= 1")
        if self.store is not None and self.store.startswith("faulty+"):
            raise ValueError(
                f"store {self.store!r}: give the plain URL; the chaos phase wraps it in faulty+ itself"
            )
        if self.store is not None and not self.store.startswith(("file://", "memory://", "mooncake://")):
            raise ValueError(f"store {self.store!r}: expected a file://, memory:// or mooncake:// URL")


@dataclass
class Check:
    """One expectation of a phase; ``detail`` says what was seen."""

    name: str
    ok: bool
    detail: str


@dataclass
class PhaseResult:
    name: str
    title: str
    store: str
    requests: list[RequestResult] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)


@dataclass
class DemoReport:
    """Everything the demo saw. ``ok``: every phase passed and the audit log replayed clean."""

    model_family: str
    model_dir: str | None
    workdir: str
    store: str
    chaos_store: str
    namespace: str
    audit_log: str
    geometry: dict[str, Any] = field(default_factory=dict)
    phases: list[PhaseResult] = field(default_factory=list)
    audit: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def audit_ok(self) -> bool:
        return self.audit is not None and bool(self.audit.get("ok"))

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.phases) and all(p.ok for p in self.phases) and self.audit_ok

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (output token lists included)."""
        out = asdict(self)
        for phase, raw in zip(self.phases, out["phases"], strict=True):
            raw["ok"] = phase.ok
        out["audit_ok"] = self.audit_ok
        out["ok"] = self.ok
        return out


# -- prompts ----------------------------------------------------------------------------------------


def make_prompt(length: int, seed: int) -> list[int]:
    """``length`` token ids drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(length)]


def shared_prefix_length(prompt_tokens: int, alignment: int) -> int:
    """The longest prefix of a ``prompt_tokens`` prompt that ends on a hit boundary (``alignment``) and
    leaves at least one token to compute; 0 if there is none."""
    return ((prompt_tokens - 1) // alignment) * alignment


def chaos_url(store: str, chaos: str) -> str:
    """``store`` wrapped in the chaos store with the fault parameters ``chaos`` (a URL query)."""
    query = chaos.lstrip("?&")
    if not query:
        return f"faulty+{store}"
    return f"faulty+{store}{'&' if '?' in store else '?'}{query}"


# -- the scenario ----------------------------------------------------------------------------------


def _require_inprocess() -> None:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") not in ("0", "false", "False"):
        raise RuntimeError(
            "hybridkv demo needs the in-process vLLM engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "(the `hybridkv demo` command does this)"
        )


def _max_model_len(options: DemoOptions) -> int:
    needed = options.prompt_tokens + max(64, options.prompt_tokens // 8) + options.max_tokens + 1
    return 2048 if needed <= 2048 else 4096


def _check(name: str, ok: bool, detail: str) -> Check:
    return Check(name=name, ok=bool(ok), detail=detail)


def _match_check(requests: list[RequestResult]) -> Check:
    compared = [r for r in requests if r.tokens_match is not None]
    bad = [r.label for r in compared if not r.tokens_match]
    return _check(
        "tokens identical to the cold run",
        bool(compared) and not bad,
        f"{len(compared) - len(bad)}/{len(compared)} identical"
        + (f"; differ: {', '.join(bad)}" if bad else ""),
    )


@contextlib.contextmanager
def _phase(report: DemoReport, name: str, title: str, store: str) -> Iterator[PhaseResult]:
    """Record a phase; an exception inside it becomes a failed check and ``report.error``."""
    phase = PhaseResult(name=name, title=title, store=store)
    report.phases.append(phase)
    try:
        yield phase
    except Exception as exc:  # noqa: BLE001 -- a misbehaving engine/connector is a demo finding, not a crash
        phase.error = f"{type(exc).__name__}: {exc}"
        phase.traceback = traceback.format_exc()
        phase.checks.append(_check("phase ran", False, phase.error))
        report.error = report.error or f"phase {name}: {phase.error}"


def _close(engine: DemoEngine | None, report: DemoReport) -> None:
    """Shut ``engine`` down; a failure is recorded in ``report.error``."""
    if engine is None:
        return
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001
        report.error = report.error or f"engine shutdown: {type(exc).__name__}: {exc}"


@dataclass
class _Run:
    """What the phases share: the options, the report they fill, the model and the reference output."""

    options: DemoOptions
    report: DemoReport
    model_dir: Path
    max_model_len: int
    prompt_a: list[int]
    #: output of the cold run of prompt A (the reference); None until the cold phase produced it
    cold_a: list[int] | None = None

    def start(self, url: str, why: str) -> DemoEngine:
        """A fresh engine on ``url``; its start time is reported as ``engine_start_<why>_s``."""
        progress = self.options.progress
        progress(f"starting vLLM engine ({why}; store {url})")
        t = time.monotonic()
        engine = DemoEngine(
            self.model_dir, url, self.report.namespace, Path(self.report.audit_log), self.max_model_len
        )
        seconds = round(time.monotonic() - t, 2)
        self.report.timings[f"engine_start_{why}_s"] = seconds
        progress(f"engine ready in {seconds:.1f}s")
        return engine


def phase_cold(run: _Run) -> DemoEngine | None:
    """Phase 1: prompt A on a fresh namespace is computed and saved. Returns the engine for phases 2-3."""
    engine: DemoEngine | None = None
    report, options = run.report, run.options
    with _phase(
        report, "cold", "cold: prompt A computed and saved to the external tier", report.store
    ) as phase:
        engine = run.start(report.store, "main")
        report.geometry = engine.geometry()
        options.progress("phase 1/5 cold")
        r = engine.send("A", run.prompt_a, options.max_tokens, None)
        run.cold_a = r.output_tokens
        phase.requests.append(r)
        phase.checks.append(
            _check("nothing cached (cold)", r.cached_tokens == 0, f"cached {r.cached_tokens}")
        )
        phase.checks.append(_check("saved to the store", r.saved_bytes > 0, f"saved {r.saved_bytes} bytes"))
    return engine


def phase_shared(run: _Run, engine: DemoEngine) -> None:
    """Phase 2: prompt B shares A's prefix up to A's last hit boundary: a prefix-cache hit."""
    report, options = run.report, run.options
    with _phase(report, "shared", "shared prefix: prompt B reuses A's prefix", report.store) as phase:
        options.progress("phase 2/5 shared prefix")
        shared = shared_prefix_length(options.prompt_tokens, engine.hit_alignment)
        suffix = make_prompt(max(64, options.prompt_tokens // 8), options.seed + 1000)
        prompt_b = run.prompt_a[:shared] + suffix
        if shared == 0:
            raise ValueError(
                f"prompt A ({options.prompt_tokens} tokens) has no full hit block: the model's hits "
                f"align to {engine.hit_alignment} tokens; use --prompt-tokens > {engine.hit_alignment}"
            )
        r = engine.send("B", prompt_b, options.max_tokens, None)
        phase.requests.append(r)
        phase.checks.append(
            _check(
                "prefix reused",
                r.cached_tokens > 0,
                f"B shares A's first {shared} tokens; cached {r.cached_tokens} "
                f"(local {r.local_hit_tokens}, external {r.external_hit_tokens})",
            )
        )


def phase_external(run: _Run, engine: DemoEngine) -> None:
    """Phase 3: vLLM's local prefix cache is dropped (the store kept); A's prefix comes from the store."""
    report, options = run.report, run.options
    with _phase(
        report, "external", "local prefix cache dropped: A comes back from the store", report.store
    ) as phase:
        options.progress("phase 3/5 local cache dropped, resend A")
        engine.drop_local_cache()
        r = engine.send("A again", run.prompt_a, options.max_tokens, run.cold_a)
        phase.requests.append(r)
        phase.checks.append(
            _check("external hits", r.external_hit_tokens > 0, f"external {r.external_hit_tokens} tokens")
        )
        phase.checks.append(
            _check("no local hits", r.local_hit_tokens == 0, f"local {r.local_hit_tokens} tokens")
        )
        phase.checks.append(_match_check(phase.requests))


def phase_restart(run: _Run) -> None:
    """Phase 4: a fresh engine on the same store; A's prefix comes from the store across the restart."""
    report, options = run.report, run.options
    engine: DemoEngine | None = None
    with _phase(
        report, "restart", "fresh engine, same store: A comes back from the store", report.store
    ) as phase:
        engine = run.start(report.store, "restart")
        options.progress("phase 4/5 fresh engine, resend A")
        r = engine.send("A (new engine)", run.prompt_a, options.max_tokens, run.cold_a)
        phase.requests.append(r)
        phase.checks.append(
            _check("external hits", r.external_hit_tokens > 0, f"external {r.external_hit_tokens} tokens")
        )
        phase.checks.append(_match_check(phase.requests))
    _close(engine, report)


def phase_chaos(run: _Run) -> None:
    """Phase 5: a fresh engine on the same bytes behind the ``faulty+`` wrapper: loads fail or are corrupt,
    vLLM recomputes, the tokens are still identical."""
    report, options = run.report, run.options
    engine: DemoEngine | None = None
    chaos_store = report.chaos_store
    with _phase(report, "chaos", "chaos store: failed and corrupt reads, exact tokens", chaos_store) as phase:
        engine = run.start(chaos_store, "chaos")
        options.progress("the chaos store fails and corrupts reads on purpose: expect load warnings below")
        for i in range(options.chaos_rounds):
            options.progress(f"phase 5/5 chaos, round {i + 1}/{options.chaos_rounds}")
            if i:
                engine.drop_local_cache()
            r = engine.send(f"A chaos #{i + 1}", run.prompt_a, options.max_tokens, run.cold_a)
            phase.requests.append(r)
        truncations = sum(r.truncations for r in phase.requests)
        failed = sum(r.failed_keys for r in phase.requests)
        phase.checks.append(
            _check(
                "faults seen",
                truncations + failed > 0,
                f"{truncations} truncated loads, {failed} failed keys",
            )
        )
        phase.checks.append(_match_check(phase.requests))
    _close(engine, report)


def audit_phase(report: DemoReport) -> None:
    """Replay the connector's audit log (``hybridkv.audit.replay``) into ``report.audit``."""
    from hybridkv.audit.replay import audit_file

    try:
        report.audit = audit_file(Path(report.audit_log)).to_dict()
    except OSError as exc:
        report.audit = {"ok": False, "error": f"cannot read {report.audit_log}: {exc}"}


def run_demo(options: DemoOptions) -> DemoReport:
    """Run the five phases (module docstring) and replay the audit log; see the module contracts."""
    options.validate()
    _require_inprocess()
    progress = options.progress
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="hybridkv-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    models_dir = Path(options.models_dir) if options.models_dir else workdir / "models"
    store = options.store or f"file://{workdir / 'store'}?capacity=1GiB"
    namespace = f"demo-{secrets.token_hex(4)}"  # every run starts cold, even on a reused store
    audit_log = workdir / f"audit-{namespace}.jsonl"
    report = DemoReport(
        model_family=options.model_family,
        model_dir=None,
        workdir=str(workdir),
        store=store,
        chaos_store=chaos_url(store, options.chaos),
        namespace=namespace,
        audit_log=str(audit_log),
    )
    started = time.monotonic()

    progress(f"building tiny random-weight {options.model_family} model")
    t0 = time.monotonic()
    try:
        model_dir = build_tiny_model(options.model_family, models_dir)
    except Exception as exc:  # noqa: BLE001
        report.error = f"model build failed: {type(exc).__name__}: {exc}"
        return report
    report.model_dir = str(model_dir)
    report.timings["build_model_s"] = round(time.monotonic() - t0, 2)

    progress("importing vLLM")
    t0 = time.monotonic()
    try:
        import vllm  # noqa: F401 -- imported here so its import time is reported as its own stage
    except Exception as exc:  # noqa: BLE001
        report.error = f"cannot import vLLM: {type(exc).__name__}: {exc}"
        return report
    report.timings["import_vllm_s"] = round(time.monotonic() - t0, 2)

    run = _Run(
        options=options,
        report=report,
        model_dir=model_dir,
        max_model_len=_max_model_len(options),
        prompt_a=make_prompt(options.prompt_tokens, options.seed),
    )
    # Engine 1: phases cold, shared, external.
    engine = phase_cold(run)
    if engine is not None and run.cold_a is not None:
        phase_shared(run, engine)
        phase_external(run, engine)
    _close(engine, report)
    if run.cold_a is not None:
        phase_restart(run)
        phase_chaos(run)

    progress(f"auditing {audit_log}")
    audit_phase(report)
    report.timings["total_s"] = round(time.monotonic() - started, 2)
    return report
