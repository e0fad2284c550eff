"""Export to the ``speculators`` format, the one vLLM serves directly (``vllm serve DIR``).

The contract, read from the ``speculators`` package 0.9.0 (``speculators/models/eagle3/config.py``,
``core.py``, ``model_definitions.py``, ``model.py``; the config below is what its own ``save_pretrained`` writes)
and from vLLM (``vllm/transformers_utils/configs/speculators/base.py`` and ``algos.py``: ``update_eagle3``; the
aux layers in ``vllm/v1/worker/gpu_model_runner.py``):

* ``config.json``: ``architectures: ["Eagle3DraftModel"]``, ``speculators_model_type: "eagle3"``,
  ``speculators_version``, ``transformer_layer_config`` (a one-layer Llama config, ``vocab_size`` = the target's),
  ``draft_vocab_size`` S, ``eagle_aux_hidden_state_layer_ids`` (the target layers whose INPUT hidden states are
  fused: vLLM captures ``hidden_states + residual`` before layer ``idx`` for each id, the same convention as
  selfspec's ``target_layers``), ``norm_before_residual: false`` (written: vLLM defaults a missing one to
  ``true``), the EAGLE-3.1 flags (below), and
  ``speculators_config`` = ``{algorithm: "eagle3", proposal_methods: [{proposal_type: "greedy",
  speculative_tokens, verifier_accept_k: 1, accept_tolerance: 0.0}], default_proposal_method: "greedy",
  verifier: {name_or_path, architectures}}``.
* ``model.safetensors``: ``fc.weight [D, 3D]``, ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}
  .weight``, ``layers.0.self_attn.{q,k,v}_proj.weight [., 2D]``, ``layers.0.self_attn.o_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [S, D]`` and, only with a reduced
  vocabulary (S < V; speculators registers them as None buffers otherwise), ``d2t`` int64 ``[S]`` and ``t2d`` bool
  ``[V]``, and ``embed_tokens.weight [V, D]``, a copy of the target's embedding. speculators lists that tensor in
  ``_keys_to_ignore_on_load_missing``, but with transformers 5.19 a missing one is left as uninitialised memory that
  ``load_verifier_weights`` (which refills only NaN) keeps: measured here, a checkpoint without it gave draft logits
  off by up to 0.64 on the tiny Llama target. vLLM's ``llama_eagle3.py`` loads the draft's embedding when present.

EAGLE-3.1 (arXiv:2605.09992): ``fc_norm`` and ``norm_output`` are the head's own
(:class:`~selfspec.heads.eagle3.Eagle3Config`), ``norm_before_fc`` is ``false``. In speculators' ``Eagle3DraftModel``
(``core.py``: ``__init__`` builds ``fc_norm`` as a ``ModuleList`` of one ``norm_class(hidden_size,
eps=rms_norm_eps)`` per aux layer; ``forward`` norms each ``chunk`` of the fused states before ``fc``, and with
``norm_output`` sets ``hidden_states = self.norm(hidden_states)`` before ``lm_head`` and the next step) these are
selfspec's functions exactly; their tensors are ``fc_norm.{0,1,2}.weight [D]``. vLLM takes the same config fields
from a speculators config since vllm-project/vllm#46488 ("Propagate norm_output and fc_norm config for Eagle3
speculators"); an older ``llama_eagle3.py`` reads neither (its ``LlamaModel.forward`` returns the pre-norm state for
the next step, ``combine_hidden_states`` applies ``fc`` alone), so serve an EAGLE-3.1 head with a vLLM after it.

DFlash and DSpark heads (``dflash``, ``dspark``) are written by :mod:`selfspec.export.speculators_block`.

EAGLE-1 is not a speculators 0.9.0 family (its ``EagleSpeculator`` was removed before 0.5.0): an EAGLE-1 head is
refused here and exports with ``--format sglang``.

The proof is speculators' own code: ``tests/export/test_speculators.py`` loads an export with
``Eagle3DraftModel.from_pretrained`` in a separate environment (:mod:`selfspec.engine_envs`) and compares
its draft logits with selfspec's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfspec.export.common import ExportError, Head, family_name, llama_config_dict, target_embedding, write_export
from selfspec.export.sglang import eagle3_names, layer_tensors
from selfspec.export.speculators_block import SPECULATORS_VERSION
from selfspec.heads.eagle3 import Eagle3Head

__all__ = ["SPECULATORS_VERSION", "export_speculators", "speculators_names"]

FORMAT = "speculators"


def speculators_names(fc_norm: bool) -> dict[str, str]:
    """selfspec :class:`Eagle3Head` module names -> speculators tensor names: the EAGLE-3 layout with the layer under
    ``layers.0.`` and, for an EAGLE-3.1 head with ``fc_norm``, ``fc_norm.{0,1,2}.weight`` (the same names)."""
    names = eagle3_names("layers.0.")
    if fc_norm:
        names.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(3)})
    return names


def _layer_config(head: Eagle3Head) -> dict[str, Any]:
    cfg = llama_config_dict(head)
    cfg.pop("torch_dtype", None)
    if "rope_parameters" in cfg:  # speculators runs transformers 5, which reads RoPE from rope_parameters only
        cfg.pop("rope_theta", None)
        cfg.pop("rope_scaling", None)
    cfg["architectures"] = list(head.arch_config.architectures or ["LlamaForCausalLM"])
    cfg["tie_word_embeddings"] = False
    return cfg


def export_speculators(
    head: Head, out_dir: str | Path, *, target_name_or_path: str, speculative_tokens: int = 3
) -> Path:
    """Write ``head`` in the speculators format (see the module docstring), atomically.

    Args:
        head: an :class:`Eagle3Head` (EAGLE-3 or EAGLE-3.1) whose decoder layer is Llama's, any float dtype (written
            as it is); a DFlash / DSpark head's layout is
            :func:`~selfspec.export.speculators_block.export_speculators_block` (each family's record names its own).
        out_dir: the directory to write (created, or replaced as a whole).
        target_name_or_path: the verifier (target) Hub id or directory, written as
            ``speculators_config.verifier.name_or_path``; vLLM and speculators read the target's config from it.
        speculative_tokens: draft tokens per step that ``vllm serve`` proposes (``proposal_methods[0]``).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ExportError: a head without its target attached (the embedding is written), a head that is not EAGLE-3,
            a non-Llama decoder layer, a tensor the layout does not name,
            repeated target layers (speculators requires distinct ids), ``speculative_tokens < 1``.
    """
    if not isinstance(head, Eagle3Head):  # the family records send the others to their own layouts
        raise ExportError(
            f"export_speculators writes EAGLE-3 heads, not {family_name(head)}: export through "
            "selfspec.export.cli.export_heads, which takes each family's layout"
        )
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    layers = list(head.config.target_layers)
    if len(set(layers)) != len(layers):
        raise ExportError(
            f"target_layers {layers} repeat a layer; speculators requires distinct eagle_aux_hidden_state_layer_ids "
            "(a target of at least 3 layers gives distinct defaults)"
        )
    tensors = layer_tensors(head, speculators_names(head.config.fc_norm), FORMAT)
    if head.config.draft_vocab_size == head.config.vocab_size:
        del tensors["d2t"], tensors["t2d"]
    tensors["embed_tokens.weight"] = target_embedding(head).to(head.fc.weight.dtype)
    layer_cfg = _layer_config(head)
    verifier_arch = list(head.arch_config.architectures or ["LlamaForCausalLM"])
    cfg = {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": head.config.draft_vocab_size,
        "dtype": layer_cfg["dtype"],
        "eagle_aux_hidden_state_layer_ids": layers,
        "embed_requires_grad": False,
        "fc_norm": head.config.fc_norm,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": head.config.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": verifier_arch, "name_or_path": target_name_or_path},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer_cfg,
        "selfspec_target_fingerprint": head.config.target_fingerprint,
    }
    return write_export(out_dir, cfg, tensors)
