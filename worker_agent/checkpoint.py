"""Model and optimizer files: safetensors only (tensors + JSON metadata, never pickle).

- ``save_model`` writes a module's state dict (parameters and buffers) with metadata
  (epoch, global step, reason, ...); ``load_model`` loads it back strictly.
- ``save_optimizer`` flattens an optimizer's state dict: every tensor under
  ``state.<param index>.<name>``, everything else (param groups, non-tensor state such as a
  plain-int step) as JSON in the metadata; ``load_optimizer`` rebuilds it.

Writes are atomic (temporary file, then rename), so a crash mid-write leaves the previous
file intact. ``model_bytes`` / ``optimizer_bytes`` and their ``load_*_bytes`` twins do the same
in memory, for resume bundles that travel through the Object Store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load, load_file, save, save_file

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


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return _dedup({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})


def save_model(path: Path, model: torch.nn.Module, meta: Mapping[str, Any]) -> None:
    _atomic_save(_model_tensors(model), path, {"ddpbus": json.dumps(dict(meta), sort_keys=True)})


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}


def model_bytes(model: torch.nn.Module, meta: Mapping[str, Any]) -> bytes:
    """The model's parameters and buffers as one safetensors blob (a copy, off the device)."""
    return save(_cpu(_model_tensors(model)),
                metadata={"ddpbus": json.dumps(dict(meta), sort_keys=True)})


def load_model_bytes(blob: bytes, model: torch.nn.Module, what: str) -> None:
    """Load a :func:`model_bytes` blob into ``model`` in place (strict)."""
    try:
        tensors = load(blob)
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {what}: {exc}") from exc
    _fit(model, tensors, what)


def _fit(model: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{what} does not fit this model: {exc}") from exc


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
        doc = json.loads(meta.get("ddpbus", "{}"))
    except (OSError, ValueError, SafetensorError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"cannot read {path}: its ddpbus metadata is not a JSON record")
    return doc


def load_model(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load parameters and buffers into ``model`` in place; returns the metadata."""
    try:
        tensors = load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    _fit(model, tensors, str(path))
    return read_meta(path)


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer,
                   meta: Mapping[str, Any]) -> None:
    tensors, doc = _flatten_optimizer(optimizer, meta)
    _atomic_save(tensors, path, {"ddpbus": doc})


def optimizer_bytes(optimizer: torch.optim.Optimizer, meta: Mapping[str, Any]) -> bytes:
    tensors, doc = _flatten_optimizer(optimizer, meta)
    return save(_cpu(tensors), metadata={"ddpbus": doc})


def load_optimizer_bytes(blob: bytes, optimizer: torch.optim.Optimizer, what: str) -> None:
    try:
        tensors = load(blob)
        doc = json.loads(_blob_meta(blob).get("ddpbus", "{}"))
    except (OSError, ValueError, SafetensorError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {what}: {exc}") from exc
    if not isinstance(doc, dict):
        raise CheckpointError(f"cannot read {what}: its ddpbus metadata is not a JSON record")
    _rebuild_optimizer(optimizer, tensors, doc, what)


def _blob_meta(blob: bytes) -> dict[str, str]:
    """A safetensors blob's metadata: an 8-byte little-endian header length, then JSON."""
    if len(blob) < 8:
        raise ValueError("truncated safetensors blob")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ValueError("truncated safetensors header")
    try:
        header = json.loads(blob[8:8 + size])
    except RecursionError:
        raise ValueError("safetensors header nests too deep") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a map")  # noqa: TRY004 - one family
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("safetensors metadata is not a map")  # noqa: TRY004 - one family
    return {str(k): str(v) for k, v in meta.items()}


def _flatten_optimizer(optimizer: torch.optim.Optimizer, meta: Mapping[str, Any]
                       ) -> tuple[dict[str, torch.Tensor], str]:
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
    return tensors, json.dumps(doc, sort_keys=True, default=str)


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    try:
        tensors = load_file(str(path))
        doc = read_meta(path)
    except (OSError, ValueError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    _rebuild_optimizer(optimizer, tensors, doc, str(path))


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                       doc: dict[str, Any], what: str) -> None:
    state: dict[int, dict[str, Any]] = {}
    try:
        for key, value in tensors.items():
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
        for index, entries in doc.get("plain_state", {}).items():
            state.setdefault(int(index), {}).update(entries)
        optimizer.load_state_dict({"state": state, "param_groups": doc["param_groups"]})
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"{what} does not fit this optimizer: {exc}") from exc
