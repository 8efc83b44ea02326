"""``hybridkv bench serve``'s workload and command line, without a server."""

from __future__ import annotations

import itertools

import pytest
from hybridkv.bench.serve import Workload, conversation_messages
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
