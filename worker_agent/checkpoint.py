"""Model and optimizer files: safetensors only (tensors + JSON metadata, never pickle).

- ``save_model`` writes a module's state dict (parameters and buffers) with metadata
  (epoch, global step, reason, ...); ``load_model`` loads it back strictly.
- ``save_optimizer`` flattens an optimizer's state dict: every tensor under
  ``state.<param index>.<name>``, everything else (param groups, non-tensor state such as a
  plain-int step) as JSON in the metadata; ``load_optimizer`` rebuilds it.

Writes are atomic (temporary file, then rename), so a crash mid-write leaves the previous
file intact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ddpbus.codecs.errors import DdpbusError


class CheckpointError(DdpbusError, OSError):
    """A model or optimizer file could not be written or read back."""


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, meta: Mapping[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(meta))
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path}: {exc}") from exc


def save_model(path: Path, model: torch.nn.Module, meta: Mapping[str, Any]) -> None:
    state = model.state_dict()
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    _atomic_save(_dedup(tensors), path, {"ddpbus": json.dumps(dict(meta), sort_keys=True)})


def _dedup(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied weights): store copies."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def read_meta(path: Path) -> dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, ValueError) as exc:  # safetensors raises its own subclass of these
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return dict(json.loads(meta.get("ddpbus", "{}")))


def load_model(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load parameters and buffers into ``model`` in place; returns the metadata."""
    try:
        tensors = load_file(str(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path} does not fit this model: {exc}") from exc
    return read_meta(path)


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer,
                   meta: Mapping[str, Any]) -> None:
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value
            else:
                plain.setdefault(str(index), {})[name] = value
    doc = {"param_groups": state["param_groups"], "plain_state": plain, **dict(meta)}
    _atomic_save(tensors, path, {"ddpbus": json.dumps(doc, sort_keys=True, default=str)})


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    try:
        tensors = load_file(str(path))
        doc = read_meta(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, entries in doc.get("plain_state", {}).items():
        state.setdefault(int(index), {}).update(entries)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": doc["param_groups"]})
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} does not fit this optimizer: {exc}") from exc
