"""A drafter of known acceptance, for measuring what the decode loop costs around the target's forward.

:class:`RiggedDrafter` proposes a fixed tree whose main path holds the target's own greedy continuation up to a
depth chosen per step, so the acceptance per depth is set by the caller rather than by a head's quality. Used
by :mod:`benchmarks.gpu_cycle`.
"""

from __future__ import annotations

import torch

from benchmarks.host_syncs import Probe
from selfspec.decode.drafters.base import AcceptedPath, Drafter, DrafterInfo, DraftLimit
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree, greedy_tree_from_accuracy, static_tree, tree_depths

# Cumulative top-1..top-8 accuracies of a 6-deep EAGLE-like drafter: only the *shape* of the trees built
# from them matters (Medusa's greedy construction, as EAGLE-2's global reranking keeps the N best paths).
TREE_ACCURACY = [[0.5, 0.7, 0.8, 0.86, 0.9, 0.92, 0.94, 0.95]] * 6


def tree_parents(num_nodes: int, shape: str) -> torch.Tensor:
    """Parents ``[N]`` (CPU LongTensor) of the measured tree: ``"tree"`` the EAGLE-like shape of
    :data:`TREE_ACCURACY` at N nodes (root included), ``"chain"`` N nodes in a line."""
    if num_nodes == 1:
        return torch.tensor([-1])
    if shape == "chain":
        return torch.arange(-1, num_nodes - 1)
    return static_tree(greedy_tree_from_accuracy(TREE_ACCURACY, num_nodes)).parents


class RiggedDrafter(Drafter):
    """A drafter of known acceptance: a fixed tree whose main path (each node's first child, from the root)
    holds the target's greedy continuation up to a depth k chosen per step with ``P(k >= d) = a^d``
    (``d <= D``, the main path's depth) and a wrong token after it; every other node is wrong too. Under
    greedy verification the step then accepts exactly k drafts, so ``a`` is the acceptance rate per depth
    and tau = ``1 + sum_{d=1..D} a^d``. Everything per step runs on the device: no host synchronisation.

    Args:
        reference: LongTensor ``[L]`` on the target's device, the target's greedy continuation of the
            prompt (``reference[0]`` is the first new token); ``L`` at least the new tokens plus ``D``.
        parents: LongTensor ``[N]`` (CPU), the tree.
        acceptance: a in [0, 1].
        vocab_size: V, for the wrong tokens (``(right + 1 + sibling rank) % V``).
        probe: told when the steps begin.

    Raises:
        ValueError: ``acceptance`` outside [0, 1].
    """

    def __init__(
        self,
        reference: torch.Tensor,
        parents: torch.Tensor,
        acceptance: float,
        vocab_size: int,
        probe: Probe | None = None,
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
        parent_list = parents.tolist()
        n = len(parent_list)
        rank, children = [0] * n, [0] * n
        for i in range(1, n):
            rank[i] = children[parent_list[i]]
            children[parent_list[i]] += 1
        main = [0]
        while True:
            first = next((i for i in range(1, n) if parent_list[i] == main[-1]), None)
            if first is None:
                break
            main.append(first)
        self.main_depth = len(main) - 1
        correct = torch.zeros(self.main_depth + 1, n, dtype=torch.bool)
        for k in range(1, self.main_depth + 1):
            correct[k, main[1 : k + 1]] = True
        device = reference.device
        self._reference = reference
        self._parents = parents.to(device)
        depths = tree_depths(parents)
        self._max_depth = int(depths.max())
        self._depth = depths.to(device)
        self._offset = (torch.tensor(rank) + 1).to(device)
        self._correct = correct.to(device)
        self._vocab = vocab_size
        self.probe = probe
        self._acceptance = acceptance
        self.expected_tau = 1.0 + sum(acceptance**d for d in range(1, self.main_depth + 1))
        self._prompt_len = 0
        self._step = 0

    def info(self) -> DrafterInfo:
        """Name ``"rigged"``, the tree's depth, the target's vocabulary; deterministic, not a head."""
        return DrafterInfo(name="rigged", max_depth=self._max_depth, vocab_size=self._vocab)

    def accepted_depth(self, step: int) -> int:
        """k of step ``step`` (0-based): ``#{d in 1..D: u < a^d}`` for u of a golden-ratio sequence in (0, 1),
        so ``P(k >= d) = a^d`` and even a short run's mean k is close to its expectation."""
        u = (0.5 + step * 0.6180339887498949) % 1.0
        return sum(u < self._acceptance**d for d in range(1, self.main_depth + 1))

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Start a sequence: ``prompt_ids`` ``[T]``; the hidden states are not used. The steps start here (the
        probe counts from now): a one-node tree declares ``max_depth`` 0, and the loop then never calls
        :meth:`propose`."""
        self._prompt_len = prompt_ids.numel()
        self._step = 0
        if self.probe is not None:
            self.probe.in_steps = True

    def propose(
        self,
        context: torch.Tensor,
        sampling: SamplingConfig | None,
        generator: torch.Generator | None,
        limit: DraftLimit,
    ) -> DraftTree:
        """The rigged tree for this step, whole (the loop cuts it to ``limit``); ``context`` ``[T + m]`` (the
        prompt and the m tokens decided since)."""
        k = self.accepted_depth(self._step)
        self._step += 1
        m = context.numel() - self._prompt_len  # tokens decided after the prompt, the root included
        right = self._reference[m - 1 + self._depth]  # [N]: the greedy token at each node's position
        tokens = torch.where(self._correct[k], right, (right + self._offset) % self._vocab)
        return DraftTree(tokens=torch.cat([context[-1:], tokens[1:]]), parents=self._parents)

    def accept(self, accepted: AcceptedPath) -> None:
        """Nothing to update: the tree is fixed."""
