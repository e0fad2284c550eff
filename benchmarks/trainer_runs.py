"""How SpecForge's and speculators' EAGLE-3 trainers are run on the reference run's data: their inputs, their
command lines and the options chosen for a 2-core CPU, one :class:`TrainerJob` each.

Every option left out is the trainer's own default (its recipe: learning rate, optimiser, schedule, training-time
test length, batch shape, seed). The options set, and why:

* both: the draft vocabulary size of the reference run (a head shape, so the three heads are the same size; each
  trainer picks its own tokens from the assistant-token counts of the same data); the fused layers of the reference
  run; no data-loader worker processes (they exist to feed a GPU; on 2 cores they compete with the trainer, and
  selfspec's loop loads its batches in-process too); the run stops at the first optimiser step whose trained tokens
  reach the budget (:mod:`benchmarks.trainer_data`), the schedule sized to those steps as each trainer sizes it
  to ``max_steps``.
* SpecForge 0.2.0 (``specforge train --config``, offline mode from feature files): ``attention_backend: sdpa``
  (its default ``flex_attention`` compiles a GPU kernel), ``fsdp_sharding: NO_SHARD`` (FSDP refuses a CPU; with
  ``NO_SHARD`` it wraps the draft in DDP, which runs on one CPU process). Its default dtype, bf16, is kept: its
  ``TargetHead`` always holds the lm_head in bf16 (``specforge/modeling/target/target_head.py``) and the draft's
  ``fc`` takes the stored states as they are, so the features are written in bf16, as its capture writes them (a
  float32 draft fails on them). On a CPU without bf16 units bf16 is about 3x slower than float32.
  The target directory it reads gets a weight index file, which its ``TargetHead`` requires; the tied lm_head is read
  as ``model.embed_tokens.weight`` (its ``model.lm_head_key`` option). The head is exported with its own exporter
  (``specforge export --to sglang``) and read with ``selfspec import --format sglang``.
* speculators 0.9.0 (``python -m speculators.train``, offline mode from cached hidden-state files):
  ``--draft-attn-impl sdpa`` and ``--loss-implementation eager`` (its defaults are a compiled flex-attention kernel
  and a Triton loss), ``--train-data-ratio`` so that its training split is exactly the reference run's training
  sequences and its validation split (it requires one) the held-out ones, ``--on-missing raise`` (no vLLM server to
  generate missing states), ``--no-norm-before-residual --no-norm-before-fc``: its EAGLE-3 defaults add a norm before
  the residual and one over the concatenated target states before ``fc``, which selfspec's head does not compute (and
  ``selfspec import`` refuses); its third default, ``norm_output`` (EAGLE-3.1), selfspec computes and keeps. Its
  default ``--hidden-states-dtype bfloat16`` (bf16 autocast, float32 master weights) is
  kept; the states are written in float32 and it casts them. Its last checkpoint is read with
  ``selfspec import --format speculators``.

``--ttt-steps`` of the comparison replaces both trainers' training-time-test length (SpecForge 7, speculators 3,
selfspec's quickstart 2), the one recipe setting a 2-core CPU may not afford; the report records it.

The patches to their code (device names and GPU kernels only) are :mod:`benchmarks.trainer_patches`.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.trainer_data import (
    StepPlan,
    epochs_needed,
    pair_counts,
    plan_from_batches,
    specforge_plan,
    write_specforge,
    write_speculators,
)
from selfspec.base.files import write_json
from selfspec.engine_envs import env_python
from selfspec.train.feature_store import FeatureStore

SPECFORGE_SEED = 42
"""``training.seed``'s default in SpecForge 0.2.0 (``specforge/config/schema.py``): its data order."""
SPECULATORS_SEED = 42
"""``--seed``'s default in speculators 0.9.0 (``speculators/train/config/schema.py``): its packing order."""
SPECULATORS_ROW_TOKENS = 8192
"""``--total-seq-len``'s default in speculators 0.9.0: tokens packed into one training row (one step)."""


@dataclass(frozen=True)
class ReferenceData:
    """What every trainer gets from the reference run.

    Attributes:
        train, held: the run's training and held-out feature stores (EAGLE-3: three layers and the last state).
        target_dir: the target's local directory (config, weights, tokenizer).
        hidden_size: D.
        norm_weight: ``[D]`` the target's final norm weight.
        draft_vocab_size: the reference head's draft vocabulary size.
        target_layers: the three fused layers (inputs, as selfspec names them).
        max_length: the run's sequence length cap.
    """

    train: FeatureStore
    held: FeatureStore
    target_dir: Path
    hidden_size: int
    norm_weight: torch.Tensor
    draft_vocab_size: int
    target_layers: tuple[int, ...]
    max_length: int


@dataclass(frozen=True)
class TrainerJob:
    """One trainer's run, ready to start.

    Attributes:
        name: ``specforge`` or ``speculators`` (its venv too).
        work: its working directory.
        train: the training command (run with ``env``).
        export: a command run after training that writes the head directory (SpecForge's exporter), or None.
        head_format: the ``selfspec import`` format of the head it writes.
        plan: steps, epochs and trained tokens.
        settings: the options chosen (module docstring), for the report.
        env: environment variables added for both commands.
    """

    name: str
    work: Path
    train: list[str]
    export: list[str] | None
    head_format: str
    plan: StepPlan
    settings: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


def thread_env(threads: int, patched: Path) -> dict[str, str]:
    """Environment for a trainer process: ``threads`` intra-op threads (OpenMP, MKL, OpenBLAS) and the patched
    package copy first on ``PYTHONPATH``."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "PYTHONPATH": str(patched)}


def specforge_target(target_dir: Path, out: Path) -> Path:
    """A view of ``target_dir`` for SpecForge: links to its files plus ``model.safetensors.index.json`` mapping
    every tensor to ``model.safetensors`` (SpecForge's ``TargetHead`` reads the lm_head through an index file)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    with safe_open(str(target_dir / "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    write_json(out / "model.safetensors.index.json", index)
    return out


def specforge_job(
    ref: ReferenceData, work: Path, budget: int, threads: int, patched: Path, ttt_steps: int | None = None
) -> TrainerJob:
    """Write SpecForge's inputs under ``work`` and return its job (module docstring); ``ttt_steps`` replaces its
    training-time-test length (``training.ttt_length``, default 7) when given."""
    target = specforge_target(ref.target_dir, work / "target")
    config = json.loads((ref.target_dir / "config.json").read_text())
    draft = {
        **{k: v for k, v in config.items() if k not in ("architectures", "auto_map", "torch_dtype", "dtype")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "draft_vocab_size": ref.draft_vocab_size,
    }
    draft_config = work / "draft_config.json"
    write_json(draft_config, draft)
    features = write_specforge(ref.train, work / "features", ref.hidden_size, torch.bfloat16)
    plan = specforge_plan(pair_counts(ref.train, ref.max_length), budget, SPECFORGE_SEED)
    settings = {
        "model": {
            "target_model_path": str(target),
            "draft_model_config": str(draft_config),
            "lm_head_key": "model.embed_tokens.weight",
            "aux_hidden_state_layer_ids": [i - 1 for i in ref.target_layers],
            "cache_dir": str(work / "cache"),
        },
        "data": {
            "hidden_states_path": str(features),
            "max_length": ref.max_length,
            "dataloader_num_workers": 0,
            "cache_dir": str(work / "cache"),
        },
        "training": {
            "attention_backend": "sdpa",
            "fsdp_sharding": "NO_SHARD",
            "max_steps": plan.steps,
            "num_epochs": plan.epochs,
            **({"ttt_length": ttt_steps} if ttt_steps else {}),
        },
        "output_dir": str(work / "run"),
    }
    config_path = work / "specforge.yaml"
    write_json(config_path, settings)  # JSON is YAML
    python = str(env_python("specforge"))
    export_dir = work / "export"
    return TrainerJob(
        name="specforge",
        work=work,
        train=[python, "-m", "specforge.cli", "train", "--config", str(config_path)],
        export=[
            python,
            *("-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(work / "run")),
            *("--draft-config", str(draft_config), "--output-dir", str(export_dir)),
        ],
        head_format="sglang",
        plan=plan,
        settings=settings,
        env={**thread_env(threads, patched), "SPECFORGE_DEVICE": "cpu"},
    )


_SPECULATORS_BATCHES = """
import json, sys
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler
a = json.load(sys.stdin)
s = Sampler(batch_max_length=a["row"], lengths=a["lengths"], num_replicas=1, rank=0, seed=a["seed"])
out = []
for e in range(a["epochs"]):
    s.set_epoch(e)
    out.append([[int(i) for i in b] for b in s])
print(json.dumps(out))
"""


def speculators_batches(lengths: list[int], epochs: int, env: dict[str, str]) -> list[list[list[int]]]:
    """speculators' own packing of sequences of ``lengths`` tokens into training rows, per epoch (its
    ``MultipackDistributedBatchSamplerV2`` with its default seed and row length, run in its venv): lists of
    sequence indices per step.

    Raises:
        RuntimeError: the sampler failed to run (the message holds its error).
    """
    payload = {"row": SPECULATORS_ROW_TOKENS, "lengths": lengths, "seed": SPECULATORS_SEED, "epochs": epochs}
    done = subprocess.run(
        [str(env_python("speculators")), "-c", _SPECULATORS_BATCHES],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    if done.returncode != 0:
        raise RuntimeError(f"speculators' batch sampler failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def speculators_job(
    ref: ReferenceData, work: Path, budget: int, threads: int, patched: Path, ttt_steps: int | None = None
) -> TrainerJob:
    """Write speculators' inputs under ``work`` and return its job (module docstring); ``ttt_steps`` replaces its
    training-time-test length (``--ttt-steps``, default 3) when given."""
    data = work / "data"
    ratio = write_speculators(ref.train, ref.held, data, ref.hidden_size, ref.norm_weight, torch.float32)
    env = thread_env(threads, patched)
    pairs = pair_counts(ref.train)
    lengths = [int(n) for n in ref.train.lengths]
    batches = speculators_batches(lengths, epochs_needed(pairs, budget) + 1, env)
    plan = plan_from_batches([[sum(pairs[i] for i in b) for b in epoch] for epoch in batches], budget)
    settings = {
        "verifier-name-or-path": str(ref.target_dir),
        "data-path": str(data / "arrow"),
        "hidden-states-path": str(data / "hidden_states"),
        "token-freq-path": str(data / "token_freq.pt"),
        "draft-vocab-size": ref.draft_vocab_size,
        "target-layer-ids": list(ref.target_layers),
        "train-data-ratio": ratio,
        "num-workers": 0,
        "loss-implementation": "eager",
        "draft-attn-impl": "sdpa",
        "on-missing": "raise",
        "norm-before-residual": False,
        "norm-before-fc": False,
        "max-steps": plan.steps,
        "epochs": plan.epochs,
        "save-path": str(work / "checkpoints"),
        "log-dir": str(work / "logs"),
        **({"ttt-steps": ttt_steps} if ttt_steps else {}),
    }
    args = []
    for key, value in settings.items():
        if isinstance(value, bool):
            args.append(f"--{key}" if value else f"--no-{key}")
        else:
            args += [f"--{key}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
    return TrainerJob(
        name="speculators",
        work=work,
        train=[str(env_python("speculators")), "-m", "speculators.train", *args],
        export=None,
        head_format="speculators",
        plan=plan,
        settings=settings,
        env=env,
    )


def head_directory(job: TrainerJob) -> Path:
    """Where ``job``'s trained head lies in its trainer's own layout, once it ran (and exported).

    Raises:
        FileNotFoundError: no head was written (the message names the directory looked in).
    """
    if job.name == "specforge":
        found = job.work / "export"
        if (found / "config.json").is_file():
            return found
        raise FileNotFoundError(f"SpecForge's exporter wrote no config.json under {found}")
    root = job.work / "checkpoints"
    epochs = sorted((int(p.name), p) for p in root.glob("*") if p.name.isdigit() and (p / "config.json").is_file())
    if not epochs:
        raise FileNotFoundError(f"speculators saved no checkpoint with a config.json under {root}")
    return epochs[-1][1]
