"""Training run configuration: frozen dataclasses hold every default; YAML files hold values only.

``TrainConfig`` holds the options every recipe shares; the options of one head family sit in a nested
dataclass (``TrainConfig.eagle``: :class:`EagleOptions`, ``TrainConfig.medusa``: :class:`MedusaOptions`),
written in YAML as a nested mapping (``eagle: {ttt_steps: 2}``) and on the command line with a dotted key
(``eagle.ttt_steps=2``). ``load_config(path, overrides)`` reads a YAML mapping, applies ``key=value``
overrides (values parsed as YAML scalars), and refuses unknown keys, nested ones included, with the list of
valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from selfspec.base.errors import UserError
from selfspec.base.files import in_range, read_dataclass
from selfspec.base.target_shards import check_target_parallel
from selfspec.heads.config import check_layer_ids
from selfspec.heads.families import head_families
from selfspec.train.chat_format import check_template_kwargs
from selfspec.train.losses import check_loss_kind


@dataclass(frozen=True)
class EagleOptions:
    """EAGLE-1 recipe knobs (Li et al. 2024, arXiv:2401.15077), YAML ``eagle: {...}``.

    Attributes:
        ce_weight: weight of the token CE against the target distribution (EAGLE: 0.1).
        feature_weight: weight of the SmoothL1 feature regression (EAGLE: 1.0).
        noise: half-width ``a`` of the uniform noise ``U(-a, a)`` on input features, in feature units.
        batch_tokens: head positions (pairs) per optimiser step, packed in rows of ``max_length``.
        fc_bias: bias on the head's input projection.
        init_from_target_layer: start the decoder layer from the target's last layer instead of random.
        ttt_steps: training-time test depth, unrolled drafting steps per position (1 = plain EAGLE-1).
        ttt_decay: loss weight of unrolled step j is ``ttt_decay ** j``.
        score_prompt: also score pairs whose drafted token is a prompt token (more data, same cost).
        loss: the token term, a :func:`~selfspec.train.losses.distribution_loss` kind: ``"kl"`` (the gradient of
            EAGLE's soft-label cross entropy), ``"ce"`` (against the target's greedy token), or the acceptance
            losses ``"tv"``, ``"nla"``, ``"lk_hybrid"`` (arXiv:2602.23881).
    """

    ce_weight: float = 0.1
    feature_weight: float = 1.0
    noise: float = in_range(0.1, ge=0)
    batch_tokens: int = in_range(2048, ge=1)
    fc_bias: bool = True
    init_from_target_layer: bool = False
    ttt_steps: int = 1
    ttt_decay: float = in_range(0.8, gt=0)
    score_prompt: bool = False
    loss: str = "kl"

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"eagle.ttt_steps must be >= 1, got {self.ttt_steps}")
        check_loss_kind(self.loss, "eagle.loss")


@dataclass(frozen=True)
class Eagle3Options:
    """EAGLE-3 recipe knobs (Li et al. 2025, arXiv:2503.01840), YAML ``eagle3: {...}``.

    Attributes:
        target_layers: the three target layers fused by the head (None: ``(2, L // 2, L - 3)`` clamped, see
            :func:`selfspec.heads.eagle3.default_target_layers`).
        ttt_steps: training-time test depth: step i feeds the head's own step-(i-1) outputs.
        ttt_decay: loss weight of step i is ``ttt_decay ** i`` (summed, not normalised).
        loss: per draft step, a :func:`~selfspec.train.losses.distribution_loss` kind over the draft vocabulary:
            ``"kl"`` (forward KL to the target's distribution), ``"ce"`` (cross entropy against the target's
            greedy token), or the acceptance losses ``"tv"`` (1 - alpha), ``"nla"`` (-log alpha) and
            ``"lk_hybrid"`` (LK losses, arXiv:2602.23881).
        init_layer: start the decoder layer from this target layer (negative: from the end); None: random.
        init_lm_head: start the lm_head from the target's rows of the draft vocabulary (and the final norm
            from the target's).
        batch_tokens: head positions per optimiser step, packed in rows of ``max_length``.
        score_prompt: also score positions whose drafted token is a prompt token.
        fc_norm / norm_output: the EAGLE-3.1 head (arXiv:2605.09992; :class:`selfspec.heads.eagle3.Eagle3Config`):
            a norm on each fused target layer before ``fc``; the post-norm output fed to the next draft step.
    """

    target_layers: tuple[int, ...] | None = None
    ttt_steps: int = 7
    ttt_decay: float = in_range(0.8, gt=0)
    loss: str = "kl"
    init_layer: int | None = -1
    init_lm_head: bool = True
    batch_tokens: int = in_range(2048, ge=1)
    score_prompt: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"eagle3.ttt_steps must be >= 1, got {self.ttt_steps}")
        check_loss_kind(self.loss, "eagle3.loss")
        if self.target_layers is not None:
            layers = check_layer_ids("eagle3.target_layers", self.target_layers, 0, count=3)
            object.__setattr__(self, "target_layers", layers)


@dataclass(frozen=True)
class BlockOptions:
    """DFlash / DSpark recipe knobs (arXiv:2602.06036, arXiv:2607.05147), YAML ``block: {...}`` (``head: dflash`` or
    ``head: dspark``).

    Attributes:
        block_size: B, the block's slots with the anchor (DFlash drafts B - 1 tokens, DSpark B).
        num_layers: the head's Qwen3-style decoder layers (1 .. 8).
        target_layer_ids: the target layers whose outputs are fused (None: three spread from layer 1 to L - 3,
            :func:`selfspec.heads.dflash.default_target_layer_ids`).
        mask_token_id: the target id marking slots to predict (None: the tokenizer's mask token, else the highest
            id that no training sequence holds).
        anchors: blocks per sequence in a training batch, anchored at random assistant positions (fewer when the
            sequence has fewer).
        loss: per draft, a :func:`~selfspec.train.losses.distribution_loss` kind over the draft vocabulary (``"ce"``
            against the target's greedy token, ``"kl"``, ``"tv"``, ``"nla"``, ``"lk_hybrid"``), or ``"dspark"``
            (DSpark's ``0.1 CE + 0.9 TV``, plus the confidence head's BCE); ``"auto"``: ``ce`` for DFlash,
            ``dspark`` for DSpark. The confidence head trains (BCE) whatever the loss when the head has one.
        decay: position weights ``exp(-(k - 1) / decay)`` for the k-th draft of a block (DFlash: 7 at B = 16).
        weights: ``"decay"`` (the weights above) or ``"confidence"``: draft-confidence weights after D-PACE
            (arXiv:2605.18810, as the issue describes it): the k-th draft weighs ``prod_{j<k} q_j(y_j)``, the head's
            own (detached) probability that its earlier drafts all equal the target's greedy tokens ``y``, so the
            positions a block is likely to reach count, and the weights move with training.
        markov_rank: R of DSpark's Markov head.
        confidence: DSpark: train a confidence head (BCE against each slot's survival under greedy verification).
        batch_tokens: sequence tokens per optimiser step (whole sequences of up to ``max_length``).
        init_layer: start every draft layer from this target layer's attention and MLP weights where the shapes
            match (negative: from the end); None: random.
    """

    block_size: int = 8
    num_layers: int = 1
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    anchors: int = 32
    loss: str = "auto"
    decay: float = 4.0
    weights: str = "decay"
    markov_rank: int = 64
    confidence: bool = True
    batch_tokens: int = in_range(2048, ge=1)
    init_layer: int | None = -1

    def __post_init__(self) -> None:
        check_loss_kind(self.loss, "block.loss", extra=("auto", "dspark"))
        if not 2 <= self.block_size <= 64 or not 1 <= self.num_layers <= 8:
            raise ValueError("block.block_size must be in [2, 64] and block.num_layers in [1, 8]")
        if self.weights not in ("decay", "confidence"):
            raise ValueError(f"block.weights must be 'decay' or 'confidence', got {self.weights!r}")
        if self.anchors < 1 or self.decay <= 0 or self.markov_rank < 1:
            raise ValueError("block.anchors and block.markov_rank must be >= 1, block.decay > 0")
        if self.target_layer_ids is not None:
            layers = check_layer_ids("block.target_layer_ids", self.target_layer_ids, 0)
            object.__setattr__(self, "target_layer_ids", layers)


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa-1 recipe knobs (Cai et al. 2024, arXiv:2401.10774), YAML ``medusa: {...}``.

    Attributes:
        num_heads / num_layers / own_lm_head: head shape (see :class:`~selfspec.heads.medusa.MedusaConfig`).
        batch_positions: training positions per optimiser step (heads see one position at a time).
        head_decay: loss weight of head k is ``head_decay ** k``.
        loss: ``"ce"`` (Medusa's: cross entropy against the sequence's token ``x_{t+2+k}``, which self-distilled
            answers make the target's greedy token), or a :func:`~selfspec.train.losses.distribution_loss` kind
            scored against the target's distribution at that position (``"kl"``, ``"tv"``, ``"nla"``,
            ``"lk_hybrid"``; heads only, not with ``joint``).
        joint: Medusa-2 (:mod:`selfspec.train.medusa2`): train the heads jointly with a LoRA adapter on the
            target, the adapted target kept close to the frozen base by ``kl_weight * KL(p_base || p_adapted)``;
            the adapter is saved with the heads and decoding is exact with respect to the adapted target.
        lora_rank / lora_alpha: the adapter's rank r and scale alpha (``peft.LoraConfig``).
        lora_modules: module names the adapter wraps (None: peft's default for the target's architecture).
        kl_weight: weight of the KL term; heads_weight: weight of the heads' loss in the joint loss.
        batch_tokens: tokens per optimiser step of joint training (whole sequences, padded per batch).
    """

    num_heads: int = in_range(4, ge=1)
    num_layers: int = 1
    own_lm_head: bool = True
    batch_positions: int = in_range(256, ge=1)
    head_decay: float = in_range(0.8, gt=0)
    joint: bool = False
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_modules: tuple[str, ...] | None = None
    kl_weight: float = 1.0
    heads_weight: float = 1.0
    batch_tokens: int = in_range(1024, ge=1)
    loss: str = "ce"

    def __post_init__(self) -> None:
        check_loss_kind(self.loss, "medusa.loss")
        if self.joint and self.loss != "ce":
            raise ValueError("medusa.loss other than 'ce' trains Medusa-1 heads: drop it or set medusa.joint: false")
        if self.lora_rank < 1:
            raise ValueError(f"medusa.lora_rank must be >= 1, got {self.lora_rank}")
        if self.kl_weight < 0 or self.heads_weight <= 0:
            raise ValueError("medusa.kl_weight must be >= 0 and medusa.heads_weight > 0")
        if self.lora_modules is not None:
            if isinstance(self.lora_modules, str) or not all(isinstance(m, str) for m in self.lora_modules):
                raise ValueError(f"medusa.lora_modules must be a list of module names, got {self.lora_modules!r}")
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a head-training run.

    Attributes (units in names where they have one):
        head: head family, a registered one (:func:`selfspec.heads.families.head_families`: ``medusa``, ``eagle``,
            ``eagle3``, ``dflash``, ``dspark``, and any family registered since).
        target: target name (local dir, Hub id or alias, see :func:`selfspec.target.resolve_target`).
        target_adapter: a PEFT adapter directory (``PeftModel.save_pretrained``) merged into ``target``
            (:mod:`selfspec.base.adapter`); the heads are trained on, and fingerprinted as, the adapted target.
        init_heads: heads (a directory or Hub id, only read) of this run's family and target to start from
            (:mod:`selfspec.train.warm_start`): their shape options replace the config's, every tensor is copied, and
            they are evaluated before the first step; Medusa-2 (``medusa.joint``) starts from Medusa-1 heads.
        data: ``"sharegpt"`` (packaged), a local .json/.jsonl path, or a Hub dataset id.
        max_conversations: conversations read from ``data`` (before the split).
        eval_fraction: held-out share, split by a hash of the conversation id.
        max_length: tokens per rendered conversation (also the packed row length of EAGLE batches).
        self_distill: regenerate the assistant answers with the target (greedy) before training.
        distill_conversations: how many training conversations to regenerate.
        distill_eval_conversations: how many held-out conversations to regenerate (None:
            ``max(8, distill_conversations // 10)``); ``selfspec adapt`` answers every held-out prompt.
        distill_max_new_tokens / distill_batch_size: the answer cap (tokens per assistant turn) and the prompts per
            ``generate`` call. distill_max_prompt_tokens: longer prompts (the history included) are not answered;
            None: ``max_length - distill_max_new_tokens``.
        distill_turns: ``"first"``: the first assistant answer of each conversation (the rest dropped); ``"all"``:
            every assistant turn, each on the regenerated history (:func:`selfspec.train.features.self_distill`).
        distill_temperature / distill_top_p: sampling: temperature 0 is greedy (the only setting whose features are
            captured). distill_system_prompt: a system message for every conversation that has none.
        distill_engine: what writes the answers: ``"hf"`` (the target's ``generate`` in the training processes) or
            ``"vllm"`` (vLLM in the environment ``python -m selfspec.engine_envs vllm`` builds, run by ``selfspec
            distill`` and ``selfspec train``: :mod:`selfspec.distill`); never a silent fall back between them.
        target_parallel: ``"none"`` (each process holds the whole target) or ``"fsdp"`` (each decoder layer sharded
            across the processes, :mod:`selfspec.base.target_shards`, which says what it allows).
        distill_tensor_parallel_size / distill_data_parallel_size: vLLM's ``tensor_parallel_size`` and
            ``data_parallel_size`` (GPUs per replica, replicas), passed through.
        original_conversations: with ``self_distill``, also train on this many further training
            conversations as written (not regenerated; they come after the distilled ones). Target features
            of written text cost about a fifth of a regenerated token each, so they stretch a time budget.
        chat_template: a Jinja template file replacing the target's for every rendering of the run; and
            chat_template_kwargs (``{enable_thinking: false}``): variables bound into it, so prompts, training text
            and loss masks render alike (:mod:`selfspec.train.chat_format`; a template that does not render is refused).
        reasoning: ``"keep"`` or ``"drop"`` reasoning traces (``reasoning_content``, ``<think>`` spans) of the data and
            of the regenerated answers; a kept trace is in the loss mask.
        distill_dir: where regenerated answers are cached (JSONL per rank); default ``<output_dir>/distill``.
            Point several runs at one directory to train different heads on the same answers.
        distill_capture_gb: memory (GiB) for the target features self-distillation captures while it generates
            (:mod:`selfspec.train.distill_states`), so the feature store does not run the target over those
            conversations again; capture stops when this is full, and 0 turns it off. Not used by Medusa-2 (its
            target changes) or by EAGLE-3 with ``features: online``.
        features: where the target's states come from: ``"store"`` (computed once into shards on disk, read per
            sequence as batches are built, :mod:`selfspec.train.feature_store`), ``"online"`` (computed with the
            target as each batch is built, never stored; EAGLE, EAGLE-3, DFlash and DSpark), or ``"auto"``: the
            store unless it would not fit on disk or the run reads fewer tokens than it holds
            (:func:`selfspec.train.online_features.feature_source`, said in the log).
        feature_shard_mb: a store shard is written (and a stopped run resumes after it) every this many MiB of
            features.
        activation_checkpointing: recompute the draft's layers in the backward pass instead of keeping their
            activations (``torch.utils.checkpoint``), for long rows: DFlash and DSpark heads. EAGLE heads refuse it
            (their training-time test grows one KV cache through its steps, which a recomputation would extend
            twice), and Medusa's have no layer to recompute.
        dtype: target compute dtype for features and distillation (``"bfloat16"`` or ``"float32"``).
        feature_batch_tokens: padded tokens per target forward when the feature store is computed (examples
            sorted by length, :func:`selfspec.train.features.hidden_features`); 0 runs one example at a time.
        draft_vocab_size: size S of the reduced draft vocabulary (the most frequent answer tokens); None or
            at least V: the full vocabulary.
        lr, weight_decay, betas, warmup_steps, grad_clip: AdamW + linear warmup + cosine decay.
        mixed_precision: ``"no"`` (float32) or ``"bf16"``: the head's forward and loss under bf16 autocast
            (``accelerate``'s ``mixed_precision``; the weights and the optimiser stay float32).
        grad_accum_steps: recipe batches whose gradients are summed into one optimiser step (the global batch is
            processes x grad_accum_steps x the recipe's batch); steps, schedule and cadence count optimiser steps.
        epochs: passes over the cached features; ``max_steps`` caps the total if set.
        max_train_tokens: stop once the head has trained on this many tokens (each recipe's ``train_tokens``
            count, all processes); the cosine decay follows the count when it is further along. The budget of
            a run whose head must not depend on the machine's speed (the quickstart's).
        max_train_minutes: stop the optimisation loop after this wall time (features excluded); the cosine
            decay then follows the clock when it is further along. With ``max_train_tokens``, a cap: the
            summary's ``stopped_by`` says ``"clock"`` when it cut training short.
        eval_every / save_every: in optimiser steps.
        select_head: ``"tau"``: the head saved is the evaluated one (every ``eval_every`` steps and the last)
            of the highest held-out chain tau estimate (:func:`selfspec.train.loop.chain_tau`); ``"last"``: the
            last one.
        eval_topk: top-k accuracies recorded (per head for Medusa; used to build the static tree).
        output_dir: checkpoints, features and the final ``heads/`` directory go here.
        seed: all randomness.
        report_to: the tracker logged to through ``accelerate`` (:mod:`selfspec.train.tracking`): ``"tensorboard"``,
            ``"wandb"``, ``"mlflow"``, ``"trackio"`` (optional extras: ``pip install 'selfspec[wandb]'``); None: none.
        threads: torch intra-op threads (None: torch's default).
        calibrate_prompts / calibrate_max_new_tokens: after training an EAGLE head, decode this many
            held-out prompts (the last ones of the held-out split) greedily with a large draft tree and save
            the acceptance profile next to the head, from which decoding sizes its tree to the machine; 0
            prompts skips it.
        eagle: :class:`EagleOptions`. eagle3: :class:`Eagle3Options`. medusa: :class:`MedusaOptions`.
        block: :class:`BlockOptions` (DFlash and DSpark).
    """

    head: str = "medusa"
    target: str = "smollm2-135m-instruct"
    target_adapter: str | None = None
    init_heads: str | None = None
    data: str = "sharegpt"
    max_conversations: int = in_range(3000, ge=0)
    eval_fraction: float = 0.05
    max_length: int = in_range(512, ge=1)
    self_distill: bool = True
    distill_conversations: int = in_range(320, ge=0)
    distill_eval_conversations: int | None = None
    distill_max_new_tokens: int = in_range(160, ge=1)
    distill_batch_size: int = in_range(16, ge=1)
    distill_max_prompt_tokens: int | None = in_range(None, ge=1, unset="max_length - distill_max_new_tokens")
    distill_turns: Literal["first", "all"] = "first"
    distill_temperature: float = in_range(0.0, ge=0)
    distill_top_p: float = in_range(1.0, gt=0, le=1)
    distill_system_prompt: str | None = None
    distill_engine: Literal["hf", "vllm"] = "hf"
    target_parallel: Literal["none", "fsdp"] = "none"
    distill_tensor_parallel_size: int = in_range(1, ge=1)
    distill_data_parallel_size: int = in_range(1, ge=1)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: Literal["keep", "drop"] = "keep"
    distill_dir: str | None = None
    distill_capture_gb: float = 4.0
    original_conversations: int = in_range(0, ge=0)
    dtype: str = "float32"
    feature_batch_tokens: int = 4096
    features: str = "auto"
    feature_shard_mb: float = 256.0
    activation_checkpointing: bool = False
    draft_vocab_size: int | None = in_range(8192, ge=1, unset="the full vocabulary")
    lr: float = in_range(1e-3, gt=0)
    weight_decay: float = in_range(0.0, ge=0)
    betas: tuple[float, float] = in_range((0.9, 0.95), ge=0, lt=1)
    warmup_steps: int = in_range(30, ge=0)
    grad_clip: float = in_range(1.0, ge=0)  # 0: no clipping
    mixed_precision: str = "no"
    grad_accum_steps: int = 1
    epochs: int = in_range(4, ge=1)
    max_steps: int | None = in_range(None, ge=1, unset="epochs decide")
    max_train_tokens: int | None = None
    max_train_minutes: float | None = in_range(None, gt=0, unset="no clock")
    eval_every: int = in_range(100, ge=1)
    save_every: int = in_range(100, ge=1)
    select_head: str = "tau"
    eval_topk: int = in_range(8, ge=1)
    output_dir: str = "runs/medusa-smollm2"
    seed: int = 0
    report_to: Literal["none", "tensorboard", "wandb", "mlflow", "trackio"] | None = None
    threads: int | None = in_range(None, ge=1, unset="torch's default")
    calibrate_prompts: int = in_range(8, ge=0)
    calibrate_max_new_tokens: int = in_range(48, ge=1)
    eagle: EagleOptions = field(default_factory=EagleOptions)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    medusa: MedusaOptions = field(default_factory=MedusaOptions)
    block: BlockOptions = field(default_factory=BlockOptions)

    def __post_init__(self) -> None:
        if self.head not in head_families():
            raise ValueError(f"head must be one of {head_families()}, got {self.head!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError("dtype must be 'bfloat16' or 'float32'")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {self.mixed_precision!r}")
        if self.select_head not in ("tau", "last"):
            raise ValueError(f"select_head must be 'tau' or 'last', got {self.select_head!r}")
        if self.feature_batch_tokens < 0:
            raise ValueError(f"feature_batch_tokens must be >= 0 (0: one at a time), got {self.feature_batch_tokens}")
        if self.features not in ("auto", "store", "online"):
            raise ValueError(f"features must be 'auto', 'store' or 'online', got {self.features!r}")
        if self.feature_shard_mb <= 0:
            raise ValueError(f"feature_shard_mb must be > 0, got {self.feature_shard_mb}")
        if self.chat_template_kwargs is not None:
            check_template_kwargs(self.chat_template_kwargs)
        if self.distill_capture_gb < 0:
            raise ValueError(f"distill_capture_gb must be >= 0 (0: no capture), got {self.distill_capture_gb}")
        if self.max_train_tokens is not None and self.max_train_tokens < 1:
            raise ValueError(f"max_train_tokens must be >= 1 (null: no token budget), got {self.max_train_tokens}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in (0, 1)")
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, _read(cls, value, root=name))
            elif not isinstance(value, cls):
                raise ValueError(f"{name} must be a mapping of {cls.__name__} fields, got {value!r}")
        check_target_parallel(self.target_parallel, self.features, self.medusa.joint)
        if self.medusa.joint and self.target_adapter:  # the option asks for Medusa-2 and its own adapter
            raise ValueError(
                "medusa.joint (Medusa-2) trains its own LoRA adapter on the base target: drop target_adapter, or "
                "merge that adapter into a saved model first and pass that directory as the target"
            )

    def distill_prompt_cap(self) -> int:
        """Self-distillation's prompt cap in tokens: ``distill_max_prompt_tokens``, else
        ``max_length - distill_max_new_tokens`` (the room a rendered conversation leaves for the answer)."""
        if self.distill_max_prompt_tokens is not None:
            return self.distill_max_prompt_tokens
        return self.max_length - self.distill_max_new_tokens


# The per-family option sections (``eagle: {...}``): every TrainConfig field built by an options dataclass.
_NESTED: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if f.default_factory is not dataclasses.MISSING
}


# Flat names of nested options, refused with their new place in the message ("eagle_ttt_steps is now eagle.ttt_steps").
_MOVED = [
    (old, f"{s}.{f.name}")
    for s, c in _NESTED.items()
    for f in dataclasses.fields(c)
    for old in (f"{s}_{f.name}", f.name)
]
_RENAMED = {old: " or ".join(new for o, new in _MOVED if o == old) for old, _ in _MOVED if old != "init_heads"}
# Medusa-2's medusa.init_heads became the one warm start of every family
_RENAMED["medusa.init_heads"] = "the top-level init_heads"
# EAGLE-3's eagle3.features became the one feature source of every family
_RENAMED["eagle3.features"] = "the top-level features"


def _read(cls: type, data: Mapping[str, Any], where: str = "", root: str = "") -> Any:
    """``cls`` from a mapping of YAML values, by the one strict reader (:func:`selfspec.base.files.read_dataclass`):
    unknown keys (nested ones too) are refused with the valid ones, missing ones take their defaults, and every
    value is checked against its field's type; numbers written either way are read for number fields (YAML
    reads ``3e-4``, with no dot, as a string)."""
    return read_dataclass(
        cls, data, where, root=root, label="config", defaults=True, lenient_numbers=True, renamed=_RENAMED
    )


class ConfigError(UserError):
    """A config that cannot be used (missing file, bad YAML, unknown key, wrong or out-of-range value)."""


def _yaml_problem(err: yaml.YAMLError) -> str:
    """Where YAML parsing stopped and why, on one line (``line 2, column 1: expected ',' or ']'``)."""
    mark = err.problem_mark if isinstance(err, yaml.MarkedYAMLError) and err.problem else None
    return f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}" if mark else str(err).splitlines()[0]


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value")
    key, value = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r} is not YAML ({_yaml_problem(err)}): fix its brackets or quotes") from err


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config and apply ``key=value`` overrides (``eagle.ttt_steps=2`` for a nested field);
    every value is checked against its field's type (:func:`_read`).

    Raises:
        ConfigError: (a ``ValueError``) ``path`` does not exist or is not YAML (the message gives the line), unknown
            keys, top-level or nested (the message lists the valid keys), malformed overrides, values of the wrong
            type, out of their range (the message gives the range) or otherwise invalid.
    """
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} does not exist: pass a YAML file (see configs/) or only key=value")
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML at {_yaml_problem(err)}: fix that line") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a YAML mapping of TrainConfig fields")
        data.update(loaded)
    for item in overrides:
        key, value = _parse_override(item)
        section, dot, name = key.partition(".")
        if dot:
            if section not in _NESTED:
                raise ConfigError(f"unknown config section {section!r} in {key!r}; sections: {sorted(_NESTED)}")
            if not isinstance(data.get(section, {}), dict):
                raise ConfigError(f"{section} must be a mapping of {_NESTED[section].__name__} fields")
            data[section] = {**data.get(section, {}), name: value}
        else:
            data[key] = value
    try:
        return _read(TrainConfig, data, str(path) if path is not None else "")
    except ValueError as err:  # the reader's and the dataclasses' checks: all of them about the values given
        raise ConfigError(str(err)) from err
