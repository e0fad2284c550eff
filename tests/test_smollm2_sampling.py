"""Seeded statistical test on the real SmolLM2 target: with speculation, the first two sampled tokens
follow the target's own sampling distribution (temperature 0.7, top-p 0.9).

The target-alone distribution is computed exactly (p(x1) from the prompt, p(x2 | x1) for every x1 in
its support, processed exactly as ``generate`` processes them), so only the speculative side is sampled.
The drafter proposes a tree of the target's own top candidates for x2 and x3 (3 children under the root,
2 under the first), so drafts are accepted often and rejected often: both the acceptance and the
residual path of multi-candidate rejection sampling are exercised.

Test: Pearson chi-square goodness of fit over (x1, x2) pairs with expected count >= 5 (the rest pooled
into one bin), N = 600 samples, alpha = 0.001 (critical value from the Wilson-Hilferty approximation).
"""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.drafters import Drafter, DrafterInfo, DraftTree
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig, probs_from_logits, process_logits
from tests.helpers.stats import chi2_critical, pooled_chi2

pytestmark = pytest.mark.slow

N_SAMPLES = 600
SAMPLING = SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9)


def processed_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, -1:].float()
    return probs_from_logits(process_logits(logits, ids[None], SAMPLING))[0]


class TargetTopKDrafter(Drafter):
    """Drafts the target's own top candidates (deterministic top-k: verified with one-hot q)."""

    def __init__(self, model):
        self.model = model
        self.trees: dict[tuple[int, ...], DraftTree] = {}  # a context's tree, computed once (it is deterministic)

    def info(self):
        return DrafterInfo(name="target_topk", max_depth=2)

    def propose(self, context, sampling, generator, limit):
        key = tuple(context.tolist())
        if key not in self.trees:
            first = processed_probs(self.model, context).topk(3).indices
            second = processed_probs(self.model, torch.cat([context, first[:1]])).topk(2).indices
            tokens = torch.cat([context[-1:], first, second])
            self.trees[key] = DraftTree(tokens, torch.tensor([-1, 0, 0, 0, 1, 1]))
        return self.trees[key]


def test_first_two_tokens_follow_target_distribution(smollm2):
    model, tok = smollm2
    ids = torch.tensor(tok("The best thing about summer is", add_special_tokens=False)["input_ids"])
    p1 = processed_probs(model, ids)
    expected: dict[tuple[int, int], float] = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(model, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    assert abs(sum(expected.values()) - 1.0) < 1e-4

    gen = torch.Generator().manual_seed(1234)
    drafter = TargetTopKDrafter(model)
    counts: dict[tuple[int, int], int] = {}
    steps_with_acceptance = 0
    for _ in range(N_SAMPLES):
        out = speculative_generate(model, drafter, ids, max_new_tokens=2, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected  # never a pair the target cannot produce (top-p respected)
        counts[key] = counts.get(key, 0) + 1
        steps_with_acceptance += out.stats.accepted_per_step[0] > 1

    chi2, dof = pooled_chi2(counts, expected, N_SAMPLES)
    assert dof >= 2
    assert chi2 < chi2_critical(dof), (chi2, dof)
    # both paths were taken: in some samples a draft was accepted, in others every candidate was rejected
    assert 0 < steps_with_acceptance < N_SAMPLES
