"""Conversations and questions for the data, bench and training tests (no download)."""

from __future__ import annotations

from tests.helpers.tokenizers import WORDS

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem about tea.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Describe a cat."]},
    {"question_id": 101, "category": "math", "turns": ["What is 12 * 12?"]},
]


CONVS = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": "a"},
        ],
    }
    for i in range(200)
]


TOPICS = ("sea", "moon", "bread", "river", "music", "winter", "train", "mountain")


def conversations(n: int) -> list[dict]:
    """``n`` short conversations; the last one's prompt is longer than the runs' ``max_length``."""
    convs = []
    for i in range(n):
        topic, other = TOPICS[i % len(TOPICS)], TOPICS[(i * 3 + 1) % len(TOPICS)]
        user = f"tell me about the {topic} please"
        if i == n - 1:
            user = " ".join(["tell me about the", topic, "and the", other] * 6)
        answer = f"the {topic} is {WORDS[20 + i % 9]} and the {other} was {WORDS[22 + i % 7]} in the night"
        convs.append(
            {"id": f"c{i}", "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        )
    return convs


def qa_conversations(n: int) -> list[dict]:
    """``n`` two-turn English questions and answers, for real tokenizers (ids past the tiny vocabulary)."""
    answers = ["The answer is four, because two plus two is four.", "Paris is the capital of France."]
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question number {i}?"},
                {"role": "assistant", "content": answers[i % 2] + f" Note {i % 3}."},
            ],
        }
        for i in range(n)
    ]
