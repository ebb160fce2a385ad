"""A model folder (--model, a checkpoint, best/, a LoRA adapter) read as untrusted input: researchers share them.
Its config.json's sizes are checked before anything is allocated (machinery/memory.shape_of), its weights must fit
the model whole (no tensor missing, unexpected or of another shape: never a silent re-initialisation), and whatever
its loaders raise ends in one line naming the folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from machinery import UserError, memory, runfiles


def looks_local(path: str) -> bool:
    """A hub id is NAME or OWNER/NAME, and an OWNER is no folder here: runs/<typo> is a local path."""
    parts = Path(path).parts
    return (
        path.startswith((".", "/", "~"))
        or os.path.exists(path)
        or len(parts) > 2
        or Path(parts[0]).is_dir()
    )


def check_folder(path: str) -> str:
    """The name to load `path` by: a hub id as it is, a local folder expanded, after its checks (a folder, not a LoRA
    adapter alone, and a config.json whose sizes are sane)."""
    if not looks_local(path):
        return path
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise UserError(f"{path}: no such directory")
    if (folder / "adapter_config.json").exists() and not (folder / "config.json").exists():
        merge = f"python stratagem.py merge-lora {path} OUT"
        raise UserError(f"{path} holds a LoRA adapter, not a whole model: write one with {merge}")
    if (folder / "config.json").exists():
        try:
            config = json.loads(runfiles.read_small(folder / "config.json"))
        except (OSError, ValueError) as e:
            raise UserError(
                f"{folder / 'config.json'} is unreadable ({type(e).__name__}); restore it"
            ) from None
        if not isinstance(config, dict):
            raise UserError(f"{folder / 'config.json'} is not a model config (not a JSON object)")
        memory.shape_of(config, str(folder / "config.json"))
    return str(folder)


def weights_file(folder: str) -> str:
    """The weights' file in a folder (what an error names), or the folder itself."""
    for name in ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return folder


def check_loaded(folder: str, info: dict) -> None:
    """from_pretrained's loading info: every tensor the model has was in the file, none more, each of its shape."""
    problems = [f"{k} is missing" for k in sorted(info.get("missing_keys", ()))]
    problems += [f"{k} is not one of the model's" for k in sorted(info.get("unexpected_keys", ()))]
    problems += [
        f"{m[0]} has shape {tuple(m[1])}, the model's is {tuple(m[2])}"
        for m in info.get("mismatched_keys", ())
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(
            f"{weights_file(folder)} does not fit its config.json: tensor {problems[0]}{more}"
        )


def unloadable(path: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return UserError(
        f"cannot load model {path!r} (offline, damaged, or not a causal LM?): {type(e).__name__}: {first}"
    )
