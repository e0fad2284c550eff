"""Load-time check that a target can be verified exactly: a target this code cannot handle is refused
with the reason, never decoded inexactly.

Two checks, both cheap:

1. The config's attention layers (:func:`selfspec.decode.masks.attention_layout`): only full and sliding
   attention layers have a cache of keys and values that can be cropped and reordered by position and a
   tree mask this project builds; linear or recurrent attention, KV-sharing layers and chunked attention
   are refused.
2. A probe through the very calls a decode makes: a :data:`PROBE_PREFIX`-token prefix, then a two-branch
   tree verified in one forward (a 4-D mask per layer type, depth-based positions), the cache compacted
   to the second branch, then a two-token chain (the model's own mask); every node's logits
   (:meth:`~selfspec.decode.verifier.Verifier.lm_logits`) must equal the model's own logits for that
   branch run alone. A forward that ignores a custom 4-D mask or explicit position ids, a cache the model
   does not read by position, or logits the model computes differently (scaling, soft-capping) fail it.
   Six forwards of at most 11 tokens: milliseconds on tiny models, under a second for a 135M model on
   a CPU.

A target with recurrent or convolution state layers (:mod:`selfspec.decode.state`) is verified on chains only; its
probe is a chain verified, rolled back to its first two nodes as after a rejection, and continued: every node's
logits must equal the model's own, or the target is refused naming its state layer types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.decode.kv import compact_cache
from selfspec.decode.masks import UnsupportedLayoutError, attention_layout
from selfspec.decode.state import STATE_LAYER_TYPES
from selfspec.decode.verifier import Verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROBE_PREFIX = 6
# Two branches under the root: nodes 1-2 (depth 1, 2) and nodes 3-5 (depth 1, 2, 3).
PROBE_PARENTS = (-1, 0, 1, 0, 3, 4)
PROBE_ACCEPTED = (0, 3, 4)  # the path the cache is compacted to (not the first nodes: entries move)
PROBE_CHAIN = 2
PROBE_CHAIN_DRAFTS = 4  # the chain a target with state layers verifies before its rollback (module docstring)


class UnsupportedTargetError(ValueError):
    """A target whose speculative decoding would not be exactly its own decoding."""


def probe_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``max |tree - alone| / (1 + max |alone|)`` of the probe's logits: 1e-3 for 32/64-bit
    floats (measured differences are ~1e-7 relative: another summation order), 5e-2 for 16-bit floats. A
    mask or position that is not applied changes logits by a large fraction of their range."""
    return 1e-3 if torch.finfo(dtype).bits >= 32 else 5e-2


def _branch(parents: tuple[int, ...], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _refuse(target: PreTrainedModel, why: str) -> UnsupportedTargetError:
    return UnsupportedTargetError(
        f"{type(target).__name__} cannot be a speculative-decoding target here: {why}. Its decoding would not "
        "be exactly its own, so it is refused; decode it with its own generate()."
    )


@torch.inference_mode()
def check_target(target: PreTrainedModel) -> None:
    """Refuse a target whose tree verification would not reproduce its own forward (see module docstring).

    The target is not modified; the probe runs its public forward on fixed token ids (seeded).

    Args:
        target: a ``transformers`` causal LM.

    Raises:
        UnsupportedTargetError: (a ``ValueError``) naming the model class and the reason: an encoder-decoder,
            an unsupported attention-layer type, a forward that fails on the decode's inputs, or probe
            logits that differ from the model's own.
    """
    config = target.config
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(target, "it is an encoder-decoder model (only decoder-only causal LMs are verified)")
    try:
        layout = attention_layout(config)
    except UnsupportedLayoutError as err:
        raise _refuse(target, f"it has {err}") from err
    if target.get_output_embeddings() is None:
        raise _refuse(target, "it has no output embeddings (lm_head) to compute logits from")
    probe = _chain_probe_error if layout.chains_only else _probe_error
    try:
        error = probe(target)
    except Exception as err:  # any failure of the model's forward on the decode's inputs is a refusal
        raise _refuse(target, f"its forward fails on a tree verification ({type(err).__name__}: {err})") from err
    dtype = next(target.parameters()).dtype
    if layout.chains_only and error > probe_tolerance(dtype):
        states = sorted({t for t in layout.layer_types if t in STATE_LAYER_TYPES})
        raise _refuse(
            target,
            f"its {states} layers' state, rolled back after a rejected chain, gives other logits than running the "
            f"accepted tokens alone (relative error {error:.2g} > {probe_tolerance(dtype):.0e}): the state cannot be "
            "rolled back exactly",
        )
    if error > probe_tolerance(dtype):
        raise _refuse(
            target,
            f"verifying a small tree in one forward gives other logits than running each branch alone (relative "
            f"error {error:.2g} > {probe_tolerance(dtype):.0e}): its forward does not apply a custom 4-D attention "
            "mask, explicit position ids or its cache by position as the decode needs, or computes its logits "
            "differently from its lm_head",
        )


def _chain_probe_error(target: PreTrainedModel) -> float:
    """The probe of a target with state layers (:attr:`~selfspec.decode.masks.AttentionLayout.chains_only`): a
    :data:`PROBE_PREFIX`-token prefix, a chain of :data:`PROBE_CHAIN_DRAFTS` nodes verified in one forward, the cache
    rolled back to its first two nodes (a rejection), then a :data:`PROBE_CHAIN`-token chain; the largest relative
    difference of every node's logits from the model's own for the same tokens run alone."""
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    n, kept = PROBE_CHAIN_DRAFTS, 2
    ids = torch.randint(0, vocab, (PROBE_PREFIX + n + PROBE_CHAIN,), generator=g).to(device)
    prefix, chain, more = ids[:PROBE_PREFIX], ids[PROBE_PREFIX : PROBE_PREFIX + n], ids[PROBE_PREFIX + n :]
    verifier = Verifier(target)
    cache = verifier.new_cache()
    verifier.prefill(prefix, cache)
    got = [
        verifier.lm_logits(verifier.forward_tree(chain, torch.arange(-1, n - 1, device=device), cache, PROBE_PREFIX))
    ]
    want = [target(input_ids=ids[None, : PROBE_PREFIX + n]).logits[0, PROBE_PREFIX:].float()]
    compact_cache(cache, PROBE_PREFIX, torch.arange(kept, device=device), list(range(kept)))
    past = PROBE_PREFIX + kept
    got.append(
        verifier.lm_logits(verifier.forward_tree(more, torch.arange(-1, PROBE_CHAIN - 1, device=device), cache, past))
    )
    seq = torch.cat([prefix, chain[:kept], more])
    want.append(target(input_ids=seq.unsqueeze(0)).logits[0, -PROBE_CHAIN:].float())
    got_all, want_all = torch.cat(got), torch.cat(want)
    return float((got_all - want_all).abs().max() / (1.0 + want_all.abs().max()))


def _probe_error(target: PreTrainedModel) -> float:
    """Largest relative difference between the probe's decode logits and the model's own (module docstring)."""
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    n = len(PROBE_PARENTS)
    ids = torch.randint(0, vocab, (PROBE_PREFIX + n + PROBE_CHAIN,), generator=g).to(device)
    prefix, tree, chain = ids[:PROBE_PREFIX], ids[PROBE_PREFIX : PROBE_PREFIX + n], ids[PROBE_PREFIX + n :]
    verifier = Verifier(target)
    cache = verifier.new_cache()
    verifier.prefill(prefix, cache)
    parents = torch.tensor(PROBE_PARENTS, device=device)
    tree_logits = verifier.lm_logits(verifier.forward_tree(tree, parents, cache, PROBE_PREFIX))
    got, want = [], []
    for leaf in sorted(set(range(n)) - set(PROBE_PARENTS)):  # each leaf's branch alone gives all its nodes
        path = _branch(PROBE_PARENTS, leaf)
        seq = torch.cat([prefix, tree[path]])
        got.append(tree_logits[path])
        want.append(target(input_ids=seq.unsqueeze(0)).logits[0, -len(path) :].float())
    accepted = torch.tensor(PROBE_ACCEPTED, device=device)
    compact_cache(cache, PROBE_PREFIX, accepted)
    past = PROBE_PREFIX + len(PROBE_ACCEPTED)
    chain_parents = torch.arange(-1, PROBE_CHAIN - 1, device=device)
    got.append(verifier.lm_logits(verifier.forward_tree(chain, chain_parents, cache, past)))
    seq = torch.cat([prefix, tree[accepted], chain])
    want.append(target(input_ids=seq.unsqueeze(0)).logits[0, -PROBE_CHAIN:].float())
    got_all, want_all = torch.cat(got), torch.cat(want)
    return float((got_all - want_all).abs().max() / (1.0 + want_all.abs().max()))
