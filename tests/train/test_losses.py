"""train/losses.py: the distribution losses (ce, kl, tv, nla, lk_hybrid) on hand-built p and q, their edges
(alpha = 1, alpha = 0), their gradients, and the Medusa loss with each kind."""

import math

import pytest
import torch

from selfspec.train.losses import (
    DISTRIBUTION_LOSSES,
    IGNORE,
    LK_ETA,
    distribution_loss,
    log_acceptance,
    medusa_loss,
)

P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
# By hand: alpha = min-sum = 0.2 + 0.3 + 0.2 = 0.7; KL(p||q) = 0.5 ln 2.5 + 0.2 ln 0.4 = 0.3 ln 2.5.
ALPHA = 0.7
KL = 0.3 * math.log(2.5)
LAM = math.exp(-3.0 * ALPHA)
HAND = {
    "ce": -math.log(0.2),  # the target's greedy token is id 0, which q gives 0.2
    "kl": KL,
    "tv": 1.0 - ALPHA,
    "nla": -math.log(ALPHA),
    "lk_hybrid": LAM * KL + (1.0 - LAM) * (1.0 - ALPHA),
}


@pytest.mark.parametrize("kind", DISTRIBUTION_LOSSES)
def test_each_loss_equals_its_hand_computed_value(kind):
    got = distribution_loss(Q.log(), P.log(), kind)
    assert got.item() == pytest.approx(HAND[kind], abs=1e-12)
    assert log_acceptance(Q.log(), P.log()).exp().item() == pytest.approx(ALPHA, abs=1e-12)
    assert LK_ETA == 3.0


@pytest.mark.parametrize("kind", ["kl", "tv", "nla", "lk_hybrid"])
def test_alpha_one_edge_every_acceptance_loss_is_zero(kind):
    assert distribution_loss(P.log(), P.log(), kind).item() == pytest.approx(0.0, abs=1e-12)
    assert log_acceptance(P.log(), P.log()).item() == 0.0


def test_alpha_zero_edge_disjoint_supports():
    # p puts all mass on id 0, q on ids 1 and 2 (logit gaps of 1e4: exp(-1e4) is 0 in float64)
    log_p = torch.log_softmax(torch.tensor([0.0, -1e4, -1e4], dtype=torch.float64), -1)
    log_q = torch.log_softmax(torch.tensor([-1e4, 0.0, 0.0], dtype=torch.float64), -1)
    assert log_acceptance(log_q, log_p).exp().item() == 0.0
    assert distribution_loss(log_q, log_p, "tv").item() == pytest.approx(1.0, abs=1e-12)
    # -log alpha stays finite in log space: alpha = q(0) + p(1) + p(2) = exp(-1e4) (1/2 + 1 + 1), so
    # NLA = 1e4 - ln 2.5, as the logits say
    assert distribution_loss(log_q, log_p, "nla").item() == pytest.approx(1e4 - math.log(2.5), rel=1e-12)
    # lambda = exp(0) = 1 at alpha = 0: the hybrid is pure KL there
    kl = distribution_loss(log_q, log_p, "kl")
    assert distribution_loss(log_q, log_p, "lk_hybrid").item() == pytest.approx(kl.item(), rel=1e-12)


def test_batched_shapes_and_bad_input():
    log_q = torch.log_softmax(torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)), -1)
    log_p = torch.log_softmax(torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(1)), -1)
    for kind in DISTRIBUTION_LOSSES:
        out = distribution_loss(log_q, log_p, kind)
        assert out.shape == (2, 5) and bool((out >= -1e-6).all())
    tv = distribution_loss(log_q, log_p, "tv")
    assert torch.allclose(tv, 1 - log_acceptance(log_q, log_p).exp(), atol=1e-6)
    with pytest.raises(ValueError, match="one of ce, kl, tv, nla, lk_hybrid"):
        distribution_loss(log_q, log_p, "mse")
    with pytest.raises(ValueError, match="one shape"):
        distribution_loss(log_q, log_p[..., :3], "kl")


@pytest.mark.parametrize("kind", ["ce", "kl", "tv", "nla"])
def test_gradients_match_finite_differences(kind):
    # lk_hybrid's lambda is detached on purpose (its gradient is checked as the mix below), so finite differences
    # of its value are not its gradient
    g = torch.Generator().manual_seed(3)
    log_p = torch.log_softmax(torch.randn(4, 6, generator=g, dtype=torch.float64), -1)
    z = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: distribution_loss(torch.log_softmax(x, -1), log_p, kind), (z,))


def test_nla_gradient_is_tv_gradient_over_alpha_and_hybrid_mixes_with_detached_lambda():
    g = torch.Generator().manual_seed(4)
    log_p = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    z = torch.randn(6, generator=g, dtype=torch.float64)

    def grad(kind):
        x = z.clone().requires_grad_(True)
        distribution_loss(torch.log_softmax(x, -1), log_p, kind).backward()
        return x.grad

    alpha = log_acceptance(torch.log_softmax(z, -1), log_p).exp()
    assert torch.allclose(grad("nla"), grad("tv") / alpha, atol=1e-12)
    lam = torch.exp(-3.0 * alpha)
    assert torch.allclose(grad("lk_hybrid"), lam * grad("kl") + (1 - lam) * grad("tv"), atol=1e-12)


def test_medusa_loss_with_a_distribution_kind_scores_the_target_distribution():
    logits = torch.stack([Q.log(), P.log()]).unsqueeze(1).float()  # [K=2, P=1, S=3]
    log_p = torch.stack([P.log(), P.log()]).unsqueeze(1).float()
    labels = torch.tensor([[0, 0]])
    loss, per_head = medusa_loss(logits, labels, 0.8, "tv", log_p)
    assert per_head.tolist() == pytest.approx([0.3, 0.0], abs=1e-6)
    assert loss.item() == pytest.approx(0.3, abs=1e-6)
    # a head without a label is not scored; "ce" keeps Medusa's loss against the label
    loss, per_head = medusa_loss(logits, torch.tensor([[IGNORE, 2]]), 0.8, "ce")
    assert per_head.tolist() == pytest.approx([0.0, -math.log(0.2)], abs=1e-6)
    assert loss.item() == pytest.approx(0.8 * -math.log(0.2), abs=1e-6)
    with pytest.raises(ValueError, match="needs log_p"):
        medusa_loss(logits, labels, 0.8, "nla")
