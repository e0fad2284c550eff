"""The OpenVINO bench's pure parts (selfspec/engines/openvino/bench.py): acceptance per draft position from OpenVINO
GenAI's tokens per iteration, and a worker reply as a report result."""

from __future__ import annotations

import pytest

from selfspec.engines.openvino.bench import per_position, result_of


def test_per_position_reads_accepted_drafts_per_step():
    # prefill 1 token, then steps of 1 + accepted with num_assistant_tokens 3, max 10 tokens
    steps, accepted, drafted = per_position([1, 4, 2, 1, 2], 3, 10)
    assert steps == [4, 2, 1, 2]
    assert accepted == [3, 1, 1]  # depth 1 reached by 3 steps, depth 2 and 3 by the first only
    # generated before each step: 1, 5, 7, 8 -> drafts min(3, 10 - g - 1): 3, 3, 2, 1
    assert drafted == [4, 3, 2]


def test_per_position_drafts_nothing_once_one_token_is_left():
    assert per_position([1, 1, 1], 2, 3) == ([1, 1], [0, 0], [1, 0])


def test_a_step_past_the_draft_length_is_an_error():
    with pytest.raises(RuntimeError, match="num_assistant_tokens 1"):
        per_position([1, 3], 1, 10)


def test_result_of_a_speculative_reply():
    reply = {"tokens": [5, 6, 7, 8, 2], "wall_s": 0.5, "batch_sizes": [1, 3, 1], "accepted": 2, "drafted": 4}
    r = result_of(reply, 2, 8, {2})
    assert (r.new_tokens, r.tokens_per_s, r.finish_reason) == (5, 10.0, "stop")
    assert (r.steps, r.tau, r.accepted_by_depth, r.drafted_by_depth) == (2, 2.0, [1, 1], [2, 2])
    plain = result_of({"tokens": [5, 6], "wall_s": 1.0}, None, 2, {2})
    assert (plain.steps, plain.tau, plain.finish_reason) == (None, None, "length")
