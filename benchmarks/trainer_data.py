"""The reference run's training sequences and target states in other trainers' own offline feature formats, and the
step plans that give each trainer the same number of trained tokens.

What is written comes from selfspec's feature store (:mod:`selfspec.train.feature_store`) of the run: per sequence
the token ids ``x [T]``, the assistant mask ``m [T]`` (True at assistant tokens), the three fused target layers
``g [T, 3D]`` (inputs of ``target_layers``, ``hidden_states[i]``) and the last state after the final norm ``f [T, D]``.
Each trainer gets exactly these tokens, masks and states, in its own layout, and aligns them with its own convention:

* **SpecForge** 0.2.0 offline EAGLE-3 (``specforge/algorithms/eagle3/data.py: normalize_offline_sample``,
  ``specforge/runtime/data_plane/offline_reader.py``): one ``torch.save`` file per sequence holding ``input_ids [T]``,
  ``loss_mask [T]`` (1 at assistant tokens), ``aux_hidden_state [T, 3D]`` (SGLang's capture of layers ``i - 1``'s
  outputs = selfspec's inputs of ``i``) and ``hidden_state [T, D]`` (SGLang's last state after the final norm, which
  SpecForge's ``TargetHead`` turns into logits with the lm_head alone): ``f`` as it is. Files are read in sorted name
  order, so they are named by sequence index.
* **speculators** 0.9.0 (``speculators/train/data.py: ArrowDataset``, ``hs_connectors/transfer.py: FileTransfer``):
  an Arrow dataset (``datasets.save_to_disk``) of ``input_ids``, ``loss_mask``, ``seq_len`` in torch format,
  ``hidden_states/hs_{i}.safetensors`` with ``token_ids [T]`` and ``hidden_states [T, 4, D]`` (the three layers, then
  vLLM's last state *before* the final norm, which its trainer normalises with the verifier's norm,
  ``speculators/models/eagle3/core.py``), and ``token_freq.pt`` (assistant-token counts, as its preprocessing writes).
  The store holds ``f = norm(h)``, not ``h``; :func:`prenorm_states` writes ``f / w`` (``w`` the norm's weight), whose
  RMSNorm is ``f`` again up to float rounding (the norm is scale invariant), so the trainer's targets are selfspec's.

The masks mean the same thing in all three (True at assistant tokens); which pair each trainer scores differs. For
pair t (input ``g_t`` and ``x_{t+1}``, target the distribution of ``x_{t+2}``) selfspec scores ``m_{t+2}`` (the
predicted token is an answer token, :mod:`selfspec.train.eagle_data`), speculators ``m_{t+1}``
(``speculators/models/eagle3/data.py: shift_batch``), SpecForge ``m_t`` (``specforge/algorithms/eagle3/model.py``, the
mask unshifted at step 0): the same answers, their first one or two predictions and the one or two after each answer's
end counted differently.

Trained tokens are counted as selfspec counts them (:class:`~selfspec.train.eagle3.Eagle3Recipe`: ``valid`` pairs):
a sequence of T tokens trains ``T - 1`` pairs (every trainer drops one position in its shift), summed over every
sequence of every step, epochs included. :func:`specforge_plan` and :func:`plan_from_batches` turn a token budget
into the first step count whose tokens reach it, from the trainer's own data order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from selfspec.train.feature_store import FeatureStore


@dataclass(frozen=True)
class StepPlan:
    """How long a trainer runs for a token budget.

    Attributes:
        steps: optimiser steps to run (the trainer's ``max_steps``).
        epochs: epochs the trainer must be allowed (the last one is cut at ``steps``).
        trained_tokens: pairs trained over those steps, counted as selfspec counts them (module docstring).
        tokens_per_step: mean trained pairs per step.
    """

    steps: int
    epochs: int
    trained_tokens: int
    tokens_per_step: float

    def to_dict(self) -> dict[str, float | int]:
        """The plan as a JSON-ready dict."""
        return asdict(self)


def split_states(features: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g [T, 3D], f [T, D])`` of an EAGLE-3 store's features ``[T, 4D]`` (three layers, then the last state).

    Raises:
        ValueError: the width is not ``4 * hidden_size``.
    """
    if features.shape[-1] != 4 * hidden_size:
        raise ValueError(
            f"features are {features.shape[-1]} wide, not 4 x {hidden_size}: not an EAGLE-3 store of three layers "
            "and the last state (train the reference run with head=eagle3)"
        )
    return features[..., : 3 * hidden_size], features[..., 3 * hidden_size :]


def prenorm_states(f: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A state ``x`` whose RMSNorm is ``f``: ``x = f / w`` (float32; 0 where ``w`` is 0, where ``f`` is 0 too).

    For ``f = w * h / sqrt(mean(h^2) + eps)``, ``f / w = h / sqrt(mean(h^2) + eps)`` has a mean square just under 1,
    so ``norm(f / w) = f / sqrt(1 - eps') `` with ``eps'`` of order ``eps / mean(h^2)``: ``f`` within float rounding.

    Args:
        f: ``[..., D]`` states after the final norm.
        weight: ``[D]`` the norm's weight.
    """
    w = weight.float()
    safe = torch.where(w == 0, torch.ones_like(w), w)
    return torch.where(w == 0, torch.zeros_like(w), f.float() / safe)


def sequences(store: FeatureStore) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(tokens [T], features [T, 4D], mask [T])`` of every sequence of ``store``, in order."""
    for i in range(len(store)):
        yield store.sequence(i)


def pair_counts(store: FeatureStore, max_length: int | None = None) -> list[int]:
    """Trained pairs of each sequence, ``min(T, max_length) - 1`` (module docstring)."""
    cap = max_length or 1 << 62
    return [min(int(n), cap) - 1 for n in store.lengths]


def answer_counts(store: FeatureStore) -> Counter:
    """How often each token id is an assistant token over ``store`` (a ``Counter`` of ints), as both trainers count
    tokens for their draft vocabulary."""
    ids, counts = store.tokens[store.loss_mask].unique(return_counts=True)
    return Counter(dict(zip(ids.tolist(), counts.tolist(), strict=True)))


def write_specforge(store: FeatureStore, out_dir: Path, hidden_size: int, dtype: torch.dtype) -> Path:
    """SpecForge's offline EAGLE-3 feature files of ``store`` (module docstring) in ``out_dir``, states in ``dtype``.

    Returns:
        ``out_dir``, holding ``{i:06d}.ckpt`` per sequence.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, (tokens, feats, mask) in enumerate(sequences(store)):
        g, f = split_states(feats, hidden_size)
        sample = {
            "input_ids": tokens.clone(),
            "loss_mask": mask.long(),
            "aux_hidden_state": g.to(dtype).contiguous(),
            "hidden_state": f.to(dtype).contiguous(),
        }
        torch.save(sample, out_dir / f"{i:06d}.ckpt")
    return out_dir


def write_speculators(
    train: FeatureStore,
    held: FeatureStore,
    out_dir: Path,
    hidden_size: int,
    norm_weight: torch.Tensor,
    dtype: torch.dtype,
) -> float:
    """speculators' offline data of ``train`` then ``held`` (module docstring) under ``out_dir``: ``arrow/``,
    ``hidden_states/`` and ``token_freq.pt`` (of the training sequences), states in ``dtype``.

    speculators splits one data set into its training rows and validation rows by a ratio
    (``speculators/train/data.py``: the first ``int(len * train_data_ratio)`` rows train); the returned ratio puts
    exactly the training sequences first and the held-out ones in its validation split.

    Args:
        norm_weight: ``[D]`` the target's final norm weight (:func:`prenorm_states`).

    Returns:
        The ``train_data_ratio`` to pass.
    """
    from datasets import Dataset  # heavy: only when a comparison writes its data

    hs_dir = out_dir / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    everything = [*sequences(train), *sequences(held)]
    for i, (tokens, feats, mask) in enumerate(everything):
        g, f = split_states(feats, hidden_size)
        T = tokens.numel()
        stacked = torch.cat([g.float().reshape(T, 3, hidden_size), prenorm_states(f, norm_weight)[:, None]], dim=1)
        save_file(
            {"token_ids": tokens.clone(), "hidden_states": stacked.to(dtype).contiguous()},
            str(hs_dir / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append(mask.long().tolist())
        rows["seq_len"].append(T)
    data = Dataset.from_dict(rows)
    data.set_format(type="torch")
    data.save_to_disk(str(out_dir / "arrow"))
    torch.save(dict(answer_counts(train)), out_dir / "token_freq.pt")
    return (len(train) + 0.5) / len(everything)


def specforge_plan(pairs: Sequence[int], budget: int, seed: int) -> StepPlan:
    """The steps SpecForge's offline EAGLE-3 run (batch size 1, one process) needs to train ``budget`` pairs.

    Its order is ``DistributedSampler``'s (``specforge/launch.py: _distributed_sampler_indices``): epoch e visits
    ``randperm(n)`` of a ``torch.Generator`` seeded ``seed + e``, one sequence per step.

    Args:
        pairs: trained pairs per sequence (:func:`pair_counts`), in file order.
        budget: tokens to reach.
        seed: the run's ``training.seed``.

    Raises:
        ValueError: no sequence, or a budget under 1.
    """
    if not pairs or budget < 1:
        raise ValueError(f"need sequences and a positive budget, got {len(pairs)} sequences and {budget}")
    done = steps = epoch = 0
    while done < budget:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        for i in torch.randperm(len(pairs), generator=g).tolist():
            done += pairs[i]
            steps += 1
            if done >= budget:
                break
        epoch += 1
    return StepPlan(steps, epoch, done, round(done / steps, 1))


def plan_from_batches(batches_by_epoch: Sequence[Sequence[int]], budget: int) -> StepPlan:
    """The steps a trainer needs to train ``budget`` pairs, from the pairs of each of its steps, epoch by epoch.

    Args:
        batches_by_epoch: per epoch, the trained pairs of each step in order (speculators: each packed row's
            sequences, one pair fewer than tokens each); the last epoch's list repeats if the budget needs more.

    Raises:
        ValueError: no step, or a budget under 1.
    """
    if not batches_by_epoch or not any(batches_by_epoch) or budget < 1:
        raise ValueError("need at least one step and a positive budget")
    done = steps = epoch = 0
    while done < budget:
        for n in batches_by_epoch[min(epoch, len(batches_by_epoch) - 1)]:
            done += n
            steps += 1
            if done >= budget:
                break
        epoch += 1
    return StepPlan(steps, epoch, done, round(done / steps, 1))


def epochs_needed(pairs: Sequence[int], budget: int) -> int:
    """Whole passes over ``pairs`` (trained pairs per sequence) a ``budget`` of tokens takes, rounded up."""
    return max(1, math.ceil(budget / max(1, sum(pairs))))
