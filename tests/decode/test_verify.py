"""decode/verify.py: greedy exactness, typical acceptance, and the tree checks every verifier makes."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.decode.rejection import verify_chain_sampling, verify_tree_sampling
from selfspec.decode.verify import VerifyResult, verify_greedy, verify_greedy_chain, verify_typical
from tests.helpers.lossless import tree_paths

F64 = torch.float64


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------------------------------------------
# Greedy.


def test_greedy_tree_known_answer():
    """Root argmax 5 -> node 2 (token 5) -> node 5 (token 1): path [0, 2, 5], bonus argmax(logits[5]) = 4.

    Node 1's branch is deeper (nodes 3, 6) but starts with a token the target does not pick."""
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([9, 3, 5, 2, 0, 1, 6])
    logits = torch.zeros(7, 8)
    argmax = {0: 5, 1: 2, 2: 1, 3: 6, 4: 0, 5: 4, 6: 7}
    for node, x in argmax.items():
        logits[node, x] = 3.0
    result = verify_greedy(logits, tokens, parents)
    assert isinstance(result, VerifyResult)
    assert result.accepted_nodes.tolist() == [0, 2, 5] and result.accepted_nodes.dtype == torch.long
    assert result.next_token == 4 and result.num_accepted == 2
    none = verify_greedy(logits, torch.tensor([9, 3, 4, 2, 0, 1, 6]), parents)
    assert none.accepted_nodes.tolist() == [0] and none.next_token == 5 and none.num_accepted == 0


def test_greedy_exact_tie_takes_lower_index_like_argmax():
    """Equal max logits at 2 and 4: the target's choice is 2 (torch.argmax, used by plain generate)."""
    row = torch.tensor([0.0, 1.0, 7.5, -1.0, 7.5, 3.0])
    assert int(torch.argmax(row)) == 2
    logits = torch.stack([row, row, row])
    parents = torch.tensor([-1, 0, 0])
    result = verify_greedy(logits, torch.tensor([0, 4, 2]), parents)  # node 1 (token 4) must lose
    assert result.accepted_nodes.tolist() == [0, 2] and result.next_token == 2
    assert verify_greedy_chain(logits[:2], torch.tensor([4])) == (0, 2)
    assert verify_greedy_chain(logits[:2], torch.tensor([2])) == (1, 2)


def _brute_force_greedy(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    best: list[int] = [0]
    for path in tree_paths(parents):
        if all(tokens[b] == int(torch.argmax(logits[a])) for a, b in zip(path, path[1:], strict=False)) and len(
            path
        ) > len(best):
            best = path
    return best, int(torch.argmax(logits[best[-1]]))


def test_greedy_matches_brute_force_on_random_trees():
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        n, v = 12, 3  # small V so that many drafts match
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, v, (n,), generator=g).tolist()
        logits = torch.randn(n, v, generator=g)
        result = verify_greedy(logits, torch.tensor(tokens), torch.tensor(parents))
        path, bonus = _brute_force_greedy(logits, tokens, parents)
        assert len(result.accepted_nodes) == len(path), trial
        assert [tokens[i] for i in result.accepted_nodes.tolist()] == [tokens[i] for i in path]
        assert result.next_token == bonus
        chain = torch.tensor(tokens[1:5])
        k, nxt = verify_greedy_chain(logits[:5], chain)
        ref = verify_greedy(logits[:5], torch.tensor(tokens[:5]), torch.arange(-1, 4))
        assert (k, nxt) == (ref.num_accepted, ref.next_token)


# ------------------------------------------------------------------------------------------------
# Typical acceptance (lossy, opt-in).


def test_typical_acceptance_thresholds():
    """Node 0 has a peaked p (low entropy): threshold = min(0.09, 0.3 exp(-H)) = 0.09 -> token 1 (0.1) is
    kept, token 2 (0.05) not. Node 1 has a uniform p over 8 (H = ln 8): threshold = 0.3/8 = 0.0375 <
    1/8, so its child is kept; the deeper path wins, tie among depth-2 paths goes to the likelier one."""
    v = 8
    peaked = t64([0.8, 0.1, 0.05, 0.05, 0, 0, 0, 0])
    uniform = torch.full((v,), 1.0 / v, dtype=F64)
    p = torch.stack([peaked, uniform, peaked, uniform, uniform])
    parents = torch.tensor([-1, 0, 0, 1, 1])
    tokens = torch.tensor([0, 1, 2, 6, 7])
    result = verify_typical(p, tokens, parents, torch.Generator().manual_seed(0))
    assert result.accepted_nodes.tolist() == [0, 1, 3]  # node 4 ties with 3 on depth and likelihood
    assert 0 <= result.next_token < v
    entropy = -(peaked[:4] * peaked[:4].log()).sum()
    assert 0.3 * math.exp(-float(entropy)) > 0.09  # the hard threshold is the binding one at node 0
    p2 = p.clone()
    p2[1] = t64([0.5, 0.5, 0, 0, 0, 0, 0, 0])  # token 6 now has p = 0 at node 1
    assert verify_typical(p2, tokens, parents).accepted_nodes.tolist() == [0, 1]
    with pytest.raises(ValueError, match="Medusa uses 0.09 and 0.3"):
        verify_typical(p, tokens, parents, posterior_threshold=1.5)


# ------------------------------------------------------------------------------------------------
# Errors and reproducibility.


def test_bad_inputs_raise():
    p = torch.full((3, 4), 0.25)
    tokens, parents = torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 0])
    with pytest.raises(ValueError, match=r"parents\[0\] must be -1"):
        verify_greedy(p, tokens, torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        verify_tree_sampling(p, tokens, torch.tensor([-1, 0, 2]), None)
    with pytest.raises(ValueError, match=r"tree_tokens must be"):
        verify_tree_sampling(p, tokens[:2], parents, None)
    with pytest.raises(ValueError, match=r"p must be a float tensor \[3, V\]"):
        verify_tree_sampling(p[:2], tokens, parents, None)
    with pytest.raises(ValueError, match=r"same vocabulary size"):
        verify_tree_sampling(p, tokens, parents, torch.full((3, 5), 0.2))
    with pytest.raises(ValueError, match=r"q must be a float tensor \[2, V\]"):
        verify_chain_sampling(p, p, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"logits must be a float tensor \[3, V\]"):
        verify_greedy_chain(p[:2], torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="RandomSource"):
        verify_tree_sampling(p, tokens, parents, None, generator=123)
