"""``hybridkv bench serve``'s workload and command line, without a server."""

from __future__ import annotations

import itertools

import pytest
from hybridkv.bench.serve import RequestRecord, Workload, conversation_messages, divergence
from hybridkv.cli import EXIT_USAGE, main


def test_each_turn_resends_the_conversation_so_far() -> None:
    workload = Workload(num_sessions=3, num_turns=3, num_system_prompts=2)
    answers = ["first answer", "second answer"]
    turns = [conversation_messages(workload, 2, answers[:n]) for n in range(3)]
    for earlier, later in itertools.pairwise(turns):
        # The previous request, its answer, then one new user turn.
        assert later[: len(earlier)] == earlier
        assert later[len(earlier)]["role"] == "assistant" and later[-1]["role"] == "user"
    assert [m["content"] for m in turns[2] if m["role"] == "assistant"] == answers
    # Sessions 0 and 2 share a system prompt; session 1 has the other one; user turns are per session.
    assert conversation_messages(workload, 0, [])[0] == turns[0][0]
    assert conversation_messages(workload, 1, [])[0] != turns[0][0]
    assert conversation_messages(workload, 0, [])[1] != turns[0][1]


def test_bad_workload_is_refused_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--configs", "none,vllm-magic"]) == EXIT_USAGE
    assert "vllm-magic" in capsys.readouterr().err
    assert main(["bench", "serve", "--concurrency", "0"]) == EXIT_USAGE
    assert "concurrency" in capsys.readouterr().err
    assert main(["bench", "serve", "--serial-sessions", "-1"]) == EXIT_USAGE
    assert "--serial-sessions" in capsys.readouterr().err
    assert main(["bench", "serve", "--reserved-cpus", "-2"]) == EXIT_USAGE
    assert "--reserved-cpus" in capsys.readouterr().err
    for flag in ("--max-model-len", "--max-num-batched-tokens"):
        assert main(["bench", "serve", flag, "0"]) == EXIT_USAGE
        assert flag in capsys.readouterr().err


def _record(session: int, turn: int, tokens: list[int], gaps: list[float]) -> RequestRecord:
    return RequestRecord(
        phase="turn",
        session=session,
        turn=turn,
        ok=True,
        error=None,
        ttft_s=0.1,
        latency_s=0.2,
        prompt_tokens=100,
        completion_tokens=len(tokens),
        token_ids=tokens,
        text=" ".join(map(str, tokens)),
        top2_gaps=gaps,
    )


def test_divergence_compares_only_identical_conversations_and_reports_the_reference_gap() -> None:
    reference = [
        _record(0, 0, [5, 6, 7], [0.5, 0.0, 0.2]),
        _record(0, 1, [8, 9], [0.3, 0.3]),
        _record(1, 0, [1, 2], [0.4, 0.4]),
        _record(1, 1, [3, 4], [0.4, 0.4]),
    ]
    other = [
        _record(0, 0, [5, 9, 7], [0.5, 0.0, 0.2]),  # differs at token 1, a tie in the reference
        _record(0, 1, [8, 9], [0.3, 0.3]),  # its conversation already differs: not compared
        _record(1, 0, [1, 2], [0.4, 0.4]),
        _record(1, 1, [3, 5], [0.4, 0.4]),  # differs at token 1, where the reference was clear
    ]
    d = divergence(other, reference)
    assert (d.num_compared, d.num_equal, d.num_diverged_conversations) == (3, 1, 1)
    assert d.differing == (("turn", 0, 0, 1, 0.0), ("turn", 1, 1, 1, 0.4))
    assert d.agreement == 1 / 3
    assert d.max_reference_gap == 0.4
    assert divergence(reference, reference).agreement == 1.0
    assert divergence(reference, reference).differing == ()
