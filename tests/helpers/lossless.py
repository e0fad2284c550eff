"""Exact losslessness by enumeration, for the verifier tests.

The verifiers take their randomness from a RandomSource. ``_Replay`` is one that follows a scripted
sequence of choices and multiplies up the exact probability of each choice it makes (accept: prob,
reject: 1 - prob, a token: its normalised probability). ``enumerate_law`` runs the production function
again and again with every possible script (depth-first: when the script runs out, the source
raises ``_Branch`` listing the options, and each extension is queued). So every accept/reject outcome
and every residual/bonus draw of the real code is visited once, with its exact probability; the draft
draws (x ~ q) are enumerated outside, over q's support. Everything is float64.

``target`` and ``draft`` are context-dependent laws p(. | prefix) and adversarial q(. | prefix) over a small
vocabulary; ``assert_lossless`` compares an emitted law with prod p over every sequence of a given length.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Hashable

import torch

from selfspec.decode.rejection import RandomSource

F64 = torch.float64


class _Branch(Exception):
    def __init__(self, count: int) -> None:
        self.count = count


class _Replay:
    def __init__(self, script: tuple[int, ...]) -> None:
        self.script, self.pos, self.weight = script, 0, 1.0

    def _choose(self, options: list[tuple[object, float]]):
        options = [(value, w) for value, w in options if w > 0]
        if self.pos == len(self.script):
            raise _Branch(len(options))
        value, w = options[self.script[self.pos]]
        self.pos += 1
        self.weight *= w
        return value

    def accept(self, node: int, probability: float) -> bool:
        return self._choose([(True, probability), (False, 1.0 - probability)])

    def categorical(self, probs: torch.Tensor) -> int:
        probs = probs.to(F64) / probs.to(F64).sum()
        return self._choose(list(enumerate(probs.tolist())))


def enumerate_law(run: Callable[[RandomSource], Hashable]) -> dict[Hashable, float]:
    dist: dict[Hashable, float] = defaultdict(float)
    stack: list[tuple[int, ...]] = [()]
    while stack:
        script = stack.pop()
        source = _Replay(script)
        assert isinstance(source, RandomSource)
        try:
            outcome = run(source)
        except _Branch as branch:
            stack.extend(script + (k,) for k in range(branch.count))
            continue
        dist[outcome] += source.weight
    return dist


def _seeded_dist(prefix: tuple[int, ...], v: int, salt: int, zeros: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (2**31))
    d = torch.rand(v, generator=g, dtype=F64) ** 2 + 0.01
    if zeros:
        d[torch.randperm(v, generator=g)[:zeros]] = 0.0
    return d / d.sum()


@functools.cache
def target(prefix: tuple[int, ...], v: int) -> torch.Tensor:
    """Context-dependent target p(. | prefix), with one forbidden token per context (cached: do not modify)."""
    return _seeded_dist(prefix, v, salt=1, zeros=1)


@functools.cache
def draft(prefix: tuple[int, ...], v: int, kind: str) -> torch.Tensor:
    """Adversarial drafts q(. | prefix)."""
    p = target(prefix, v)
    if kind == "mixed":  # a different adversary per context
        kind = ("far", "zeros", "onehot")[hash(prefix) % 3]
    if kind == "far":  # mass where p has little
        q = (p.max() - p) + 1e-3
    elif kind == "zeros":  # no mass on the target's two likeliest tokens
        q = _seeded_dist(prefix, v, salt=2, zeros=0)
        q[torch.topk(p, 2).indices] = 0.0
    elif kind == "onehot_bad":  # always the token the target forbids
        q = (p == 0).to(F64)
    elif kind == "onehot":
        q = torch.zeros(v, dtype=F64)
        q[int(torch.argmax(p))] = 1.0
    else:
        raise ValueError(kind)
    return q / q.sum()


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = [[0]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [i])
    return paths


def _completed(dist: dict[tuple[int, ...], float], prefix0: tuple[int, ...], v: int, length: int):
    """Complete each emitted sequence to `length` tokens with the target: the law of the first `length` tokens."""
    completed: dict[tuple[int, ...], float] = defaultdict(float)
    for seq, prob in dist.items():
        assert 1 <= len(seq) <= length
        stack = [(seq, prob)]
        while stack:
            s, w = stack.pop()
            if len(s) == length:
                completed[s] += w
                continue
            for x, px in enumerate(target(prefix0 + s, v).tolist()):
                if px > 0:
                    stack.append((s + (x,), w * px))
    return completed


def _expected(seq: tuple[int, ...], prefix0: tuple[int, ...], v: int) -> float:
    expected = 1.0
    for t in range(len(seq)):
        expected *= float(target(prefix0 + seq[:t], v)[seq[t]])
    return expected


def lossless_error(dist: dict[tuple[int, ...], float], prefix0: tuple[int, ...], v: int, length: int) -> float:
    """The largest deviation of the completed law from prod p over all V^length sequences, or of the total
    mass from 1."""
    completed = _completed(dist, prefix0, v, length)
    sequences = itertools.product(range(v), repeat=length)
    errors = [abs(completed.get(seq, 0.0) - _expected(seq, prefix0, v)) for seq in sequences]
    return max([abs(sum(dist.values()) - 1.0), *errors])


def assert_lossless(
    dist: dict[tuple[int, ...], float], prefix0: tuple[int, ...], v: int, length: int, expect_longest: int
) -> None:
    """Complete each emitted sequence to `length` tokens with the target; compare to prod p exactly.

    `expect_longest` guards against a vacuous pass: the longest emitted sequence (length when some
    draw accepts every draft on a deepest path; 1 when drafts can never be accepted)."""
    assert abs(sum(dist.values()) - 1.0) < 1e-12
    completed = _completed(dist, prefix0, v, length)
    for seq in itertools.product(range(v), repeat=length):
        expected = _expected(seq, prefix0, v)
        assert abs(completed.get(seq, 0.0) - expected) < 1e-9, (seq, completed.get(seq, 0.0), expected)
    longest = max(len(s) for s in dist)
    assert longest == expect_longest, f"longest emitted sequence {longest}, expected {expect_longest}"


def tree_case(parents: list[int], tokens: list[int], prefix0: tuple[int, ...], v: int, kind: str | None):
    """p (and q) for a tree whose draft tokens are `tokens` (tokens[0] = root, part of prefix0)."""
    contexts = [prefix0 + tuple(tokens[j] for j in path[1:]) for path in tree_paths(parents)]
    p = torch.stack([target(c, v) for c in contexts])
    q = None if kind is None else torch.stack([draft(c, v, kind) for c in contexts])
    return contexts, p, q
