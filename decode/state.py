"""Targets whose layers keep a recurrent or convolution state (hybrid models: Qwen3-Next and Qwen3.5 gated delta
nets, LFM2's short convolutions): the one declaration of which layer types those are, their cache layers, and the
chain every draft of such a target is cut to.

A state summarises every earlier token, so it cannot be masked per tree branch, and a rejected draft has already
updated it. Such a target is verified on a chain (the tree's first branch: :func:`first_chain`) and its state is rolled
back to the accepted prefix by ``transformers``' own past recording
(``LinearAttentionCacheLayerMixin.activate_past_recording``): each forward keeps the state before it and after each
of its last :data:`RECORDED_TOKENS` tokens (those tokens run through the layer's recurrent step, one at a time) and the
convolution inputs it saw, and ``crop(-r)`` restores the state of ``r`` tokens before the end, so a rejection costs
no extra pass. The loop asks :attr:`selfspec.decode.masks.AttentionLayout.chains_only`; the load check
(:mod:`selfspec.decode.target_check`) verifies a rolled-back chain against the model's own logits before a target of
these layers is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from selfspec.decode.host import HostTree, to_device
from selfspec.decode.tree import DraftTree

STATE_LAYER_TYPES = ("linear_attention", "conv")
"""The layer types (``transformers``' cache layer types) whose cache is a recurrent and / or convolution state that
past recording rolls back: gated delta nets and Mamba-style layers (``"linear_attention"``), short convolutions
(``"conv"``)."""

MAX_CHAIN = 16
"""Nodes of the longest chain one verification of a state target takes (the root included)."""

RECORDED_TOKENS = 64
"""The last tokens of every forward whose states a state layer records (those run through its recurrent step one at a
time), so a crop of up to that many tokens since the last crop is exact: a verified chain (<= :data:`MAX_CHAIN`) and
the cost measurements' trees (``decode/tuning/costs.py``, up to 48 nodes, cropped after each call)."""


def state_cache_layer() -> Any:
    """A fresh ``transformers`` ``LinearAttentionLayer`` recording the states of the last :data:`RECORDED_TOKENS`
    tokens of every forward, so ``crop(-r)`` (r <= the tokens of the forwards since the last crop, at most
    :data:`RECORDED_TOKENS`) rolls it back exactly."""
    from transformers.cache_utils import LinearAttentionLayer  # heavy import, only when a cache is made

    layer = LinearAttentionLayer()
    layer.activate_past_recording(recurrent_states_to_keep=RECORDED_TOKENS)
    return layer


def is_state_layer(layer: Any) -> bool:
    """Whether a cache layer holds a recurrent / convolution state (``transformers``' linear-attention cache layers)
    rather than keys and values."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def first_chain(tree: DraftTree, host: HostTree, max_nodes: int = MAX_CHAIN) -> tuple[DraftTree, HostTree]:
    """The tree's first branch: the root, its first child, that node's first child, ... (at most ``max_nodes``
    nodes), the chain a state target verifies.

    Exact under sampling too: which nodes stay depends on the tree's structure only, never on the drafted tokens, so
    a node's kept child is still one draft of ``q`` (the first of its i.i.d. children, or its deterministic best).

    Args:
        tree: the step's draft, N nodes (node 0 the root; a parent precedes its children).
        host: its structure on the host (:func:`selfspec.decode.host.read_tree`).
        max_nodes: >= 1.

    Returns:
        ``(tree, host)`` of M <= N nodes in chain order; the same objects when the tree already is such a chain.
    """
    first: dict[int, int] = {}
    for node, parent in enumerate(host.parents):
        if parent >= 0 and parent not in first:
            first[parent] = node
    kept = [0]
    while kept[-1] in first and len(kept) < max_nodes:
        kept.append(first[kept[-1]])
    if kept == list(range(host.num_nodes)):
        return tree, host
    chain = HostTree([host.tokens[i] for i in kept], list(range(-1, len(kept) - 1)), list(range(len(kept))))
    device = tree.tokens.device
    index = to_device(kept, device)
    q = None if tree.q is None else tree.q[index.to(tree.q.device)]
    parents = to_device(chain.parents, tree.parents.device)
    return DraftTree(tokens=tree.tokens[index], parents=parents, q=q), chain


def one_at_a_time(
    decode_rows: Callable[..., list],
    verifier: Any,
    drafters: Sequence[Any],
    prompts: Sequence[Any],
    request: Any,
    streamers: Sequence[Any] | None,
    step_callback: Callable | None,
    tree_policy: Any,
) -> list:
    """A batch of a state target decoded one prompt at a time (each row's state rolls back on its own):
    ``decode_rows`` (:func:`selfspec.decode.loop.decode_rows`) called for each row with its drafter, prompt and
    streamer; ``step_callback`` still hears each row under its index in the batch. Returns the rows' outputs in order.
    """
    outputs = []
    for i, (drafter, prompt) in enumerate(zip(drafters, prompts, strict=True)):
        callback = None if step_callback is None else _RowCallback(step_callback, i)
        streamer = None if streamers is None else [streamers[i]]
        rows = decode_rows(
            verifier, [drafter], [prompt], request, streamers=streamer, step_callback=callback, tree_policy=tree_policy
        )
        outputs.append(rows[0])
    return outputs


class _RowCallback:
    """A step callback for one row decoded alone, reporting under the row's index in its batch."""

    def __init__(self, callback: Callable, row: int) -> None:
        self.callback, self.row = callback, row

    def __call__(self, _: int, tree: DraftTree, result: Any) -> None:
        self.callback(self.row, tree, result)
