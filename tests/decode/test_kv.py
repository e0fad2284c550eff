"""decode/kv.py: weight-first linears (W @ x^T) for small trees: same products, scoped to the call,
restored afterwards, and greedy decoding stays identical to the target's with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec.decode import kv
from selfspec.decode.drafters import MedusaDrafter
from selfspec.decode.eagle import EagleDrafter
from selfspec.decode.generate import speculative_generate
from selfspec.decode.tree import static_tree
from tests.conftest import tiny_llama
from tests.decode.test_eagle_decode import prompts, reference

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_SIZES = range(2, kv.WEIGHT_FIRST_MAX_ROWS + 1)


@pytest.fixture
def target():
    t = tiny_llama(seed=5)
    yield t
    kv.set_weight_first_sizes(t, ())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 24), (1, 5, 24), (2, 4, 24)])
def test_weight_first_forward_equals_linear(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    got = kv._weight_first_forward(lin, x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def _own_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def test_weight_first_linears_only_at_installed_sizes_and_always_restored(target):
    assert kv.weight_first_sizes(target) == frozenset()
    with kv.weight_first_linears(target, 3) as used:
        assert not used and not _own_forwards(target)  # nothing installed: nothing changes
    kv.set_weight_first_sizes(target, [3, 1, 40, 5])  # 1 and 40 are outside 2..32: ignored
    assert kv.weight_first_sizes(target) == {3, 5}
    n_linear = sum(type(m) is torch.nn.Linear for m in kv.backbone(target).modules())
    assert n_linear == 2 * 7  # q, k, v, o, gate, up, down per layer
    with kv.weight_first_linears(target, 3) as used:
        swapped = _own_forwards(target)
        assert used and len(swapped) == n_linear and all(name.startswith("model.layers.") for name in swapped)
        assert "forward" not in target.lm_head.__dict__  # only the backbone
    assert not _own_forwards(target)
    with kv.weight_first_linears(target, 4) as used:
        assert not used and not _own_forwards(target)
    with pytest.raises(RuntimeError, match="boom"):
        with kv.weight_first_linears(target, 5):
            raise RuntimeError("boom")
    assert not _own_forwards(target)
    # a module that already has a forward of its own (e.g. an offloading hook) is left alone
    q_proj = target.model.layers[0].self_attn.q_proj
    own = q_proj.forward = lambda x: F.linear(x, q_proj.weight)
    with kv.weight_first_linears(target, 3):
        assert q_proj.forward is own
    assert q_proj.forward is own
    with pytest.raises(ValueError, match="integers"):
        kv.set_weight_first_sizes(target, ["3"])


def test_forward_tree_hidden_states_unchanged_by_weight_first(target):
    ids = prompts(1, length=12, seed=3)[0]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.randint(3, target.config.vocab_size, (parents.numel(),), generator=torch.Generator().manual_seed(1))
    cache = kv.new_cache(target)
    with torch.inference_mode():
        kv.prefill(target, ids, cache)
        plain = kv.forward_tree(target, tokens, parents, cache, ids.numel())
        kv.crop_cache(cache, ids.numel())
        kv.set_weight_first_sizes(target, [parents.numel()])
        first = kv.forward_tree(target, tokens, parents, cache, ids.numel())
    torch.testing.assert_close(first, plain, rtol=1e-5, atol=1e-5)
    assert not _own_forwards(target)


@pytest.mark.parametrize("sizes", [(), tuple(ALL_SIZES)])
def test_greedy_exact_with_weight_first_at_every_size(target, oracle, sizes):
    """Medusa static trees of 4 and 8 nodes and EAGLE-2 dynamic trees (random heads, and the oracle head
    whose long paths are accepted), with every tree size verified by weight-first linears (or none):
    output identical to the target's greedy generate."""
    from tests.decode.test_eagle_decode import random_head
    from tests.decode.test_generate import random_heads

    trees = [[(0,), (1,), (0, 0)], [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]]
    o_target, o_head = oracle
    runs = [(target, MedusaDrafter(random_heads(target), static_tree(tree))) for tree in trees]
    runs += [(target, EagleDrafter(random_head(target), target, 3, 2, total)) for total in (3, 7, 12)]
    runs += [(o_target, EagleDrafter(o_head, o_target, depth, 2, total)) for depth, total in ((3, 3), (4, 7))]
    taus = []
    try:
        for t, drafter in runs:
            kv.set_weight_first_sizes(t, sizes)
            for ids in prompts(2, seed=21):
                out = speculative_generate(t, drafter, ids, max_new_tokens=24)
                assert out.tokens == reference(t, ids, 24)
                if t is o_target:
                    taus.append(out.stats.mean_accepted_tokens)
    finally:
        kv.set_weight_first_sizes(o_target, ())
    assert min(taus) > 2.0, taus  # the oracle's multi-token paths went through weight-first verification
