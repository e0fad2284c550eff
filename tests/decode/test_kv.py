"""decode/kv.py: the linear kernels of tree verification (W @ x^T, oneDNN on packed weights): same
products, scoped to the call, restored afterwards, and greedy decoding stays identical to the target's
with each of them."""

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

ALL_SIZES = range(1, 65)
needs_packed = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def target():
    t = tiny_llama(seed=5)
    yield t
    kv.set_linear_kernels(t, {})


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


@needs_packed
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (1, 5, 24), (2, 4, 24)])
def test_packed_forward_equals_linear(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    lin.selfspec_packed = kv._pack(lin.weight)
    x = torch.randn(*shape)
    got = kv._packed_forward(lin, x)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x_t = torch.randn(24, 3).T  # a non-contiguous input
    torch.testing.assert_close(kv._packed_forward(lin, x_t), F.linear(x_t, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def _own_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def _packed_modules(model) -> list[str]:
    return [name for name, m in model.named_modules() if "selfspec_packed" in m.__dict__]


def test_tree_linears_only_at_installed_sizes_and_always_restored(target):
    assert kv.linear_kernels(target) == {}
    with kv.tree_linears(target, 3) as used:
        assert used == "linear" and not _own_forwards(target)  # nothing installed: nothing changes
    # "linear" entries are dropped; weight-first only inside 2..32 rows
    kv.set_linear_kernels(target, {3: "weight_first", 1: "weight_first", 40: "weight_first", 5: "weight_first",
                                   6: "linear"})
    assert kv.linear_kernels(target) == {3: "weight_first", 5: "weight_first"}
    n_linear = sum(type(m) is torch.nn.Linear for m in kv.backbone(target).modules())
    assert n_linear == 2 * 7  # q, k, v, o, gate, up, down per layer
    with kv.tree_linears(target, 3) as used:
        swapped = _own_forwards(target)
        assert used == "weight_first" and len(swapped) == n_linear
        assert all(name.startswith("model.layers.") for name in swapped)
        assert "forward" not in target.lm_head.__dict__  # only the backbone
    assert not _own_forwards(target)
    with kv.tree_linears(target, 4) as used:
        assert used == "linear" and not _own_forwards(target)
    with pytest.raises(RuntimeError, match="boom"):
        with kv.tree_linears(target, 5):
            raise RuntimeError("boom")
    assert not _own_forwards(target)
    # a module that already has a forward of its own (e.g. an offloading hook) is left alone
    q_proj = target.model.layers[0].self_attn.q_proj
    own = q_proj.forward = lambda x: F.linear(x, q_proj.weight)
    with kv.tree_linears(target, 3):
        assert q_proj.forward is own
    assert q_proj.forward is own
    del q_proj.forward
    with pytest.raises(ValueError, match="positive integers"):
        kv.set_linear_kernels(target, {"3": "weight_first"})
    with pytest.raises(ValueError, match="unknown linear kernel"):
        kv.set_linear_kernels(target, {3: "fast"})


@needs_packed
def test_packed_weights_made_once_and_freed(target):
    assert kv.packed_linears_available(target)
    kv.set_linear_kernels(target, {2: "packed", 4: "weight_first"})
    packed = _packed_modules(target)
    assert len(packed) == 14 and all(name.startswith("model.layers.") for name in packed)
    first = target.model.layers[0].mlp.down_proj.selfspec_packed
    kv.set_linear_kernels(target, {2: "packed", 8: "packed"})
    assert target.model.layers[0].mlp.down_proj.selfspec_packed is first  # not packed again
    with kv.tree_linears(target, 8) as used:
        assert used == "packed" and len(_own_forwards(target)) == 14
    kv.set_linear_kernels(target, {4: "weight_first"}, keep_packed=True)
    assert len(_packed_modules(target)) == 14
    kv.set_linear_kernels(target, {4: "weight_first"})
    assert _packed_modules(target) == [] and getattr(target, kv._PACKED_ATTR) is None
    # not where oneDNN cannot serve: another dtype
    t16 = tiny_llama(seed=5).to(torch.bfloat16)
    assert not kv.packed_linears_available(t16)
    with pytest.raises(RuntimeError, match="float32 model on a CPU"):
        kv.set_linear_kernels(t16, {2: "packed"})


@pytest.mark.parametrize("kernel", ["weight_first", pytest.param("packed", marks=needs_packed)])
def test_forward_tree_and_logits_unchanged_by_kernel(target, kernel):
    ids = prompts(1, length=12, seed=3)[0]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.randint(3, target.config.vocab_size, (parents.numel(),), generator=torch.Generator().manual_seed(1))
    cache = kv.new_cache(target)
    with torch.inference_mode():
        kv.prefill(target, ids, cache)
        plain = kv.forward_tree(target, tokens, parents, cache, ids.numel())
        plain_logits = kv.lm_logits(target, plain)
        kv.crop_cache(cache, ids.numel())
        kv.set_linear_kernels(target, {parents.numel(): kernel})
        other = kv.forward_tree(target, tokens, parents, cache, ids.numel())
        other_logits = kv.lm_logits(target, other)
    torch.testing.assert_close(other, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert other_logits.dtype == torch.float32 and other_logits.shape == (7, target.config.vocab_size)
    assert not _own_forwards(target)


@pytest.mark.parametrize("kernel", [None, "weight_first", pytest.param("packed", marks=needs_packed)])
def test_greedy_exact_with_each_kernel_at_every_size(target, oracle, kernel):
    """Medusa static trees of 4 and 8 nodes and EAGLE-2 dynamic trees (random heads, and the oracle head
    whose long paths are accepted), with every tree size verified by one kernel (or plain linear):
    output identical to the target's greedy generate."""
    from tests.decode.test_eagle_decode import random_head
    from tests.decode.test_generate import random_heads

    plan = {} if kernel is None else {n: kernel for n in ALL_SIZES}
    trees = [[(0,), (1,), (0, 0)], [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]]
    o_target, o_head = oracle
    runs = [(target, MedusaDrafter(random_heads(target), static_tree(tree))) for tree in trees]
    runs += [(target, EagleDrafter(random_head(target), target, 3, 2, total)) for total in (3, 7, 12)]
    runs += [(o_target, EagleDrafter(o_head, o_target, depth, 2, total)) for depth, total in ((3, 3), (4, 7))]
    taus = []
    try:
        for t, drafter in runs:
            kv.set_linear_kernels(t, plan)
            for ids in prompts(2, seed=21):
                out = speculative_generate(t, drafter, ids, max_new_tokens=24)
                assert out.tokens == reference(t, ids, 24)
                if t is o_target:
                    taus.append(out.stats.mean_accepted_tokens)
    finally:
        kv.set_linear_kernels(o_target, {})
    assert min(taus) > 2.0, taus  # the oracle's multi-token paths went through the kernel's verification


@needs_packed
def test_packed_plan_ignored_after_a_cast(target):
    """A model cast after planning verifies with plain linear instead of the stale float32 copies."""
    kv.set_linear_kernels(target, {3: "packed"})
    with kv.tree_linears(target, 3) as used:
        assert used == "packed"
    target.to(torch.float64)
    with kv.tree_linears(target, 3) as used:
        assert used == "linear" and not _own_forwards(target)
