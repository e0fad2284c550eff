"""Tree buffers checked exactly on hand-built trees."""

import pytest
import torch

from selfspec.decode.tree import (
    ancestor_mask,
    greedy_tree_from_accuracy,
    retrieve_paths,
    static_tree,
    tree_attention_bias,
    tree_depths,
    tree_position_ids,
    validate_parents,
)

# root -> a(0,) -> c(0,0) ; root -> b(1,) ; a -> d(0,1)
PATHS = [(1,), (0,), (0, 1), (0, 0)]


def test_static_tree_orders_nodes_and_links_parents():
    t = static_tree(PATHS)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1))
    assert t.parents.tolist() == [-1, 0, 0, 1, 1]
    assert t.depth.tolist() == [0, 1, 1, 2, 2]
    assert t.head_index.tolist() == [-1, 0, 0, 1, 1]
    assert t.rank.tolist() == [-1, 0, 1, 0, 1]
    assert t.topk == 2 and t.max_depth == 2 and t.num_nodes == 5


def test_mask_positions_and_retrieval_exact():
    parents = static_tree(PATHS).parents
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(parents), expected)
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 2]
    assert tree_position_ids(parents, 7).tolist() == [[7, 8, 8, 9, 9]]
    assert retrieve_paths(parents).tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    bias = tree_attention_bias(parents, past_length=3, dtype=torch.float32)
    assert bias.shape == (1, 1, 5, 8)
    assert bool((bias[0, 0, :, :3] == 0).all())
    blocked = torch.finfo(torch.float32).min
    assert torch.equal(bias[0, 0, :, 3:] == blocked, ~expected)


def test_chain_is_lower_triangular():
    parents = torch.arange(-1, 4)
    assert torch.equal(ancestor_mask(parents), torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert retrieve_paths(parents).tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(
    "paths, message",
    [([()], "non-empty"), ([(0,), (0,)], "duplicates"), ([(0, 0)], "no parent"), ([(-1,)], ">= 0")],
)
def test_bad_paths_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        static_tree(paths)


def test_validate_parents():
    validate_parents(torch.tensor([-1, 0, 1]))
    for bad in (torch.tensor([0, 0]), torch.tensor([-1, 1]), torch.tensor([-1.0, 0.0])):
        with pytest.raises(ValueError):
            validate_parents(bad)


def test_greedy_tree_from_accuracy_picks_most_likely_paths():
    # head 0: top1 0.6, top2 0.8 ; head 1: top1 0.5, top2 0.6
    paths = greedy_tree_from_accuracy([[0.6, 0.8], [0.5, 0.6]], num_nodes=5)
    # scores: (0,)=.6 (1,)=.2 (0,0)=.3 (0,1)=.06 (1,0)=.1
    assert paths == [(0,), (0, 0), (1,), (1, 0)]
    static_tree(paths)  # prefix-closed
