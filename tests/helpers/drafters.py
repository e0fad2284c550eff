"""Scripted drafters for the decode tests: trees that hold the true continuation (oracle), the target's own
top candidates, fixed junk, and a hybrid EAGLE drafter with a made-up cost profile."""

from __future__ import annotations

import torch

from selfspec.decode.drafters import Drafter, DrafterInfo, DraftLimit, DraftTree
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.drafters.hybrid import HybridDrafter
from selfspec.decode.tuning.costs import CostProfile
from selfspec.heads.eagle import EagleConfig, EagleHead
from tests.helpers.sampling import processed_probs

V = 96  # the vocabulary of every tiny target (tests/helpers/archs.py)

# A draft limit that limits nothing: the drafter drafts its own tree (direct propose calls in tests).
NO_LIMIT = DraftLimit(useful_depth=10**6)


class OracleDrafter(Drafter):
    """Random trees that contain the true greedy continuation at random branches (and junk elsewhere),
    so long, non-contiguous accepted paths exercise the KV compaction."""

    def __init__(self, prompt_len: int, reference: list[int], seed: int, nodes: int = 12, hit_rate: float = 0.8):
        self.prompt_len, self.ref, self.nodes, self.hit = prompt_len, reference, nodes, hit_rate
        self.g = torch.Generator().manual_seed(seed)

    def info(self):
        return DrafterInfo(name="oracle", max_depth=self.nodes - 1)

    def propose(self, context, sampling, generator, limit):
        pos = context.numel() - self.prompt_len  # index in ref of the next token
        parents, tokens, on_path = [-1], [int(context[-1])], {0: pos}
        for i in range(1, self.nodes):
            parent = int(torch.randint(0, i, (1,), generator=self.g))
            parents.append(parent)
            want = on_path.get(parent)
            right = want is not None and want < len(self.ref) and float(torch.rand(1, generator=self.g)) < self.hit
            if right and self.ref[want] not in [tokens[j] for j in range(1, i) if parents[j] == parent]:
                tokens.append(self.ref[want])
                on_path[i] = want + 1
            else:
                tokens.append(int(torch.randint(3, V, (1,), generator=self.g)))
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


class TargetTopKDrafter(Drafter):
    """The target's own top candidates for the next two tokens (deterministic: one-hot q), in a tree of
    three children under the root and two under the first."""

    def __init__(self, model) -> None:
        self.model = model

    def info(self):
        return DrafterInfo(name="target_topk", max_depth=2, head=True)

    def propose(self, context, sampling, generator, limit):
        first = processed_probs(self.model, context).topk(3).indices
        second = processed_probs(self.model, torch.cat([context, first[:1]])).topk(2).indices
        return DraftTree(torch.cat([context[-1:], first, second]), torch.tensor([-1, 0, 0, 0, 1, 1]))


def cost(per_node: float = 0.05) -> CostProfile:
    sizes = (1, 2, 4, 8, 16, 32, 64)
    return CostProfile(
        target_fingerprint="x",
        device="cpu",
        dtype="float32",
        threads=2,
        torch="2",
        context_length=128,
        node_counts=sizes,
        verify_ms=tuple(10.0 * (1 + per_node * (n - 1)) for n in sizes),
    )


def eagle_hybrid(t, per_node=0.05):
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    return HybridDrafter(EagleDrafter(head, t, depth=3, top_k=2, total_tokens=5), cost(per_node).verify_cost_ms)


class Rigged(Drafter):
    """A head drafter with a fixed 5-node tree of junk tokens (never accepted)."""

    def info(self):
        return DrafterInfo(name="rigged", max_depth=3, head=True)

    def propose(self, context, sampling, generator, limit):
        return DraftTree(torch.cat([context[-1:], torch.tensor([1, 1, 2, 2])]), torch.tensor([-1, 0, 1, 0, 3]))
