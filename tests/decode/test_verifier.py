"""decode/verifier.py and base/cpu_linear.py: the CPU linear kernels (W @ x^T, oneDNN on packed weights)
compute the same products, a plan applies only at its sizes, the target is never modified, and greedy
decoding stays identical to the target's with each kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec.base import cpu_linear
from selfspec.decode.drafters import MedusaDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.tree import static_tree
from selfspec.decode.verifier import Verifier
from tests.helpers.archs import tiny_llama
from tests.helpers.decoding import prompts, reference

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_SIZES = range(1, 65)
needs_packed = pytest.mark.skipif(not cpu_linear.packed_available(), reason="torch without oneDNN")


def snapshot(model) -> dict:
    """Every module's ``__dict__`` keys and values by identity (what selfspec must never change)."""
    return {name: {k: id(v) for k, v in m.__dict__.items()} for name, m in model.named_modules()}


@pytest.fixture
def target():
    return tiny_llama(seed=5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 24), (1, 5, 24), (2, 4, 24)])
def test_weight_first_equals_linear(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape)
    got = cpu_linear.weight_first_linear(x, lin.weight, lin.bias)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    module = cpu_linear.WeightFirstLinear(lin)
    assert module.weight is lin.weight and module.bias is lin.bias
    torch.testing.assert_close(module(x), got)


@needs_packed
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (1, 5, 24), (2, 4, 24)])
def test_packed_equals_linear(bias, shape):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=bias)
    packed = cpu_linear.pack_weight(lin.weight)
    x = torch.randn(*shape)
    got = cpu_linear.packed_linear(x, packed, lin.bias)
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x_t = torch.randn(24, 3).T  # a non-contiguous input
    torch.testing.assert_close(
        cpu_linear.packed_linear(x_t, packed, lin.bias), F.linear(x_t, lin.weight, lin.bias), rtol=1e-5, atol=1e-5
    )
    module = cpu_linear.PackedLinear(lin, packed)
    assert module.weight is lin.weight and module.bias is lin.bias
    torch.testing.assert_close(module(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_plan_validation_and_kernel_choice(target):
    v = Verifier(target)
    assert v.plan == {} and v.kernel_for(3) == "linear"
    # "linear" entries are dropped; weight-first only inside 2..32 rows
    v.set_plan({3: "weight_first", 1: "weight_first", 40: "weight_first", 5: "weight_first", 6: "linear"})
    assert v.plan == {3: "weight_first", 5: "weight_first"}
    assert v.kernel_for(3) == "weight_first" and v.kernel_for(4) == "linear"
    with pytest.raises(ValueError, match="positive integers"):
        v.set_plan({"3": "weight_first"})
    with pytest.raises(ValueError, match="unknown linear kernel"):
        v.set_plan({3: "fast"})


@needs_packed
def test_packed_weights_made_once_freed_and_held_by_the_verifier(target):
    before = snapshot(target)
    v = Verifier(target, {2: "packed", 4: "weight_first"})
    assert v.packed_bytes == v.linear_weight_bytes() > 0
    first = dict(v._packed)
    v.set_plan({2: "packed", 8: "packed"})
    assert all(v._packed[k][1] is first[k][1] for k in first)  # not packed again
    v.set_plan({4: "weight_first"}, keep_packed=True)
    assert v.packed_bytes > 0
    v.set_plan({4: "weight_first"})
    assert v.packed_bytes == 0
    assert snapshot(target) == before
    t16 = tiny_llama(seed=5).to(torch.bfloat16)
    assert not Verifier(t16).packed_available()
    with pytest.raises(RuntimeError, match="float32 model on a CPU"):
        Verifier(t16, {2: "packed"})


@pytest.mark.parametrize("kernel", ["weight_first", pytest.param("packed", marks=needs_packed)])
def test_forward_tree_and_logits_unchanged_by_kernel(target, kernel):
    ids = prompts(1, length=12, seed=3)[0]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.randint(3, target.config.vocab_size, (parents.numel(),), generator=torch.Generator().manual_seed(1))
    plain_v, other_v = Verifier(target), Verifier(target, {parents.numel(): kernel})
    before = snapshot(target)
    cache = plain_v.new_cache()
    with torch.inference_mode():
        plain_v.prefill(ids, cache)
        plain = plain_v.forward_tree(tokens, parents, cache, ids.numel())
        plain_logits = plain_v.lm_logits(plain)
        from selfspec.decode.kv import crop_cache

        crop_cache(cache, ids.numel())
        other = other_v.forward_tree(tokens, parents, cache, ids.numel())
        other_logits = other_v.lm_logits(other)
    torch.testing.assert_close(other, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert other_logits.dtype == torch.float32 and other_logits.shape == (7, target.config.vocab_size)
    assert snapshot(target) == before


def test_forward_tree_equals_each_branch_alone(target):
    """Tree attention: the hidden state of every node equals running its root-to-node branch alone
    through the stock model (public forward, fresh cache). fp32; tolerance 1e-5 (other summation order
    of the attention over masked-out positions)."""
    ids = prompts(1, length=10, seed=8)[0]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 5, 3])
    tokens = torch.randint(3, target.config.vocab_size, (parents.numel(),), generator=torch.Generator().manual_seed(2))
    v = Verifier(target)
    with torch.inference_mode():
        cache = v.new_cache()
        v.prefill(ids, cache)
        tree_hidden = v.forward_tree(tokens, parents, cache, ids.numel())
        tree_logits = v.lm_logits(tree_hidden)
        for node in range(parents.numel()):
            branch = [node]
            while parents[branch[-1]] >= 0:
                branch.append(int(parents[branch[-1]]))
            seq = torch.cat([ids, tokens[branch[::-1]]])
            alone = target(input_ids=seq.unsqueeze(0)).logits[0, -1].float()
            torch.testing.assert_close(tree_logits[node], alone, rtol=1e-5, atol=1e-5)


def test_target_untouched_by_load_and_generate(target):
    """selfspec stores nothing on the target: after load (with tuning) and generate, every module's
    ``__dict__`` holds the same objects and no module has a forward of its own."""
    import selfspec
    from tests.helpers.heads import random_heads

    heads = random_heads(target)
    before = snapshot(target)
    spec = selfspec.load(target, heads, tree_nodes=5, tune="auto")
    ids = prompts(1, seed=6)[0]
    assert spec.generate(ids, max_new_tokens=12, eos_token_id=[]).tokens == reference(target, ids, 12)
    assert snapshot(target) == before
    assert not any("forward" in m.__dict__ for m in target.modules())


def test_tune_off_skips_measuring_and_packing(target, monkeypatch, tmp_path):
    import selfspec
    from selfspec.decode.tuning import costs
    from tests.helpers.heads import random_heads

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    measured = []
    real = costs.measure_cost_profile
    monkeypatch.setattr(costs, "measure_cost_profile", lambda *a, **k: measured.append(1) or real(*a, **k))
    heads = random_heads(target)
    off = selfspec.load(target, heads, tune="off")
    assert measured == [] and off.verifier.plan == {} and off.verifier.packed_bytes == 0
    assert not costs.cost_profile_path(target).exists()
    auto = selfspec.load(target, heads, tune="auto")
    assert measured == [1] and auto.verifier.plan == costs.get_cost_profile(target).kernel_plan()
    with pytest.raises(ValueError, match="tune"):
        selfspec.load(target, heads, tune="fast")


def test_measurement_is_announced(target, monkeypatch, tmp_path, caplog):
    import logging

    from selfspec.decode.tuning import costs

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="selfspec.decode.tuning.costs"):
        costs.get_cost_profile(target, node_counts=(1, 2, 4))
    assert "measuring this target's verification cost once" in caplog.text and "about" in caplog.text
    assert "tune='off'" in caplog.text


@pytest.mark.parametrize("kernel", [None, "weight_first", pytest.param("packed", marks=needs_packed)])
def test_greedy_exact_with_each_kernel_at_every_size(target, oracle, kernel):
    """Medusa static trees of 4 and 8 nodes and EAGLE-2 dynamic trees (random heads, and the oracle head
    whose long paths are accepted), with every tree size verified by one kernel (or plain linear):
    output identical to the target's greedy generate."""
    from tests.helpers.heads import random_head, random_heads

    plan = {} if kernel is None else {n: kernel for n in ALL_SIZES}
    trees = [[(0,), (1,), (0, 0)], [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]]
    o_target, o_head = oracle
    runs = [(target, MedusaDrafter(random_heads(target), static_tree(tree))) for tree in trees]
    runs += [(target, EagleDrafter(random_head(target), target, 3, 2, total)) for total in (3, 7, 12)]
    runs += [(o_target, EagleDrafter(o_head, o_target, depth, 2, total)) for depth, total in ((3, 3), (4, 7))]
    verifiers = {id(target): Verifier(target, plan), id(o_target): Verifier(o_target, plan)}
    taus = []
    for t, drafter in runs:
        for ids in prompts(2, seed=21):
            out = speculative_generate(verifiers[id(t)], drafter, ids, max_new_tokens=24)
            assert out.tokens == reference(t, ids, 24)
            if t is o_target:
                taus.append(out.stats.mean_accepted_tokens)
    assert min(taus) > 2.0, taus  # the oracle's multi-token paths went through the kernel's verification


@needs_packed
def test_packed_plan_ignored_after_a_cast(target):
    """A model cast after planning verifies with plain linear instead of the stale float32 copies."""
    v = Verifier(target, {3: "packed"})
    assert v.kernel_for(3) == "packed"
    target.to(torch.float64)
    assert v.kernel_for(3) == "linear"


@pytest.mark.parametrize("kernel", ["weight_first", pytest.param("packed", marks=needs_packed)])
def test_twin_shares_every_tensor_with_the_target(target, kernel):
    """The planned kernel runs in a twin of the backbone that copies no tensor: each of its parameters
    and buffers is the target's own (same object, same storage), and its linears are ours."""
    from selfspec.decode.kv import backbone

    before = snapshot(target)
    v = Verifier(target, {4: kernel})
    twin, model = v._twins[kernel], backbone(target)
    assert twin is not model and type(twin) is type(model)
    ours = dict(twin.named_parameters(remove_duplicate=False))
    theirs = dict(model.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    assert all(ours[k] is theirs[k] and ours[k].data_ptr() == theirs[k].data_ptr() for k in theirs)
    bufs, target_bufs = dict(twin.named_buffers()), dict(model.named_buffers())
    assert bufs.keys() == target_bufs.keys() and all(bufs[k].data_ptr() == target_bufs[k].data_ptr() for k in bufs)
    stand_in = cpu_linear.PackedLinear if kernel == "packed" else cpu_linear.WeightFirstLinear
    assert not any(type(m) is torch.nn.Linear for m in twin.modules())
    assert sum(type(m) is stand_in for m in twin.modules()) == len(v._linears) > 0
    assert type(model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert snapshot(target) == before


def test_new_tensors_on_the_target_make_the_twin_stale(target):
    """A target given new parameter tensors after planning (``load_state_dict(assign=True)``) verifies
    with plain linear (the twin holds the old ones) until planned again, which builds a new twin."""
    v = Verifier(target, {3: "weight_first"})
    assert v.kernel_for(3) == "weight_first"
    state = {k: t.clone() for k, t in target.state_dict().items()}
    target.load_state_dict(state, assign=True)
    assert v.kernel_for(3) == "linear"
    old = v._twins["weight_first"]
    v.set_plan({3: "weight_first"})
    assert v.kernel_for(3) == "weight_first" and v._twins["weight_first"] is not old
    w = target.model.layers[0].self_attn.q_proj.weight
    assert v._twins["weight_first"].layers[0].self_attn.q_proj.weight is w


@pytest.mark.parametrize("kernel", ["weight_first", pytest.param("packed", marks=needs_packed)])
def test_twin_of_every_family_verifies_like_the_target(kernel):
    """For every family of tests/archs.py (sliding windows, soft-capping, fused projections): the twin
    shares every parameter's storage with the target, and a tree verified with the planned kernel gives
    plain linear's logits (fp32, 1e-5: another summation order)."""
    from selfspec.decode.kv import backbone, crop_cache
    from tests.helpers.archs import ARCHS, tiny_target

    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 5, 3])
    for arch in ARCHS:
        t = tiny_target(arch)
        before = snapshot(t)
        plain, planned = Verifier(t), Verifier(t, {parents.numel(): kernel})
        assert planned.kernel_for(parents.numel()) == kernel, arch
        twin_params = list(planned._twins[kernel].parameters())
        assert [p.data_ptr() for p in twin_params] == [p.data_ptr() for p in backbone(t).parameters()], arch
        g = torch.Generator().manual_seed(4)
        ids = torch.randint(3, t.config.vocab_size, (12,), generator=g)
        tokens = torch.randint(3, t.config.vocab_size, (parents.numel(),), generator=g)
        with torch.inference_mode():
            cache = plain.new_cache()
            plain.prefill(ids, cache)
            want = plain.lm_logits(plain.forward_tree(tokens, parents, cache, ids.numel()))
            crop_cache(cache, ids.numel())
            got = planned.lm_logits(planned.forward_tree(tokens, parents, cache, ids.numel()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=arch)
        assert snapshot(t) == before, arch
