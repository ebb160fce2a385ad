"""A model folder (--model, a checkpoint, best/, a LoRA adapter) read as untrusted input: researchers share them.
Its config.json's sizes are checked before anything is allocated (machinery/memory.shape_of), a folder that names
code of its own (`auto_map`) is refused before transformers sees it, its weights must be floats that fit the model
whole (no tensor missing, unexpected, of another shape, of an integer type or not finite: never a silent
re-initialisation or cast), its generation config's token ids are checked, its chat template is run once, in a
bounded child process, and whatever its loaders raise ends in one line naming the folder."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

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
    adapter alone, a config.json whose sizes are sane, no code of its own, weights of floating-point types)."""
    if not looks_local(path):
        return path
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise UserError(f"{path}: no such directory")
    if (folder / "adapter_config.json").exists() and not (folder / "config.json").exists():
        merge = f"python stratagem.py merge-lora {path} OUT"
        raise UserError(f"{path} holds a LoRA adapter, not a whole model: write one with {merge}")
    if (folder / "config.json").exists():
        config = read_json(folder / "config.json")
        memory.shape_of(config, str(folder / "config.json"))
        refuse_quantized(folder / "config.json", config)
    refuse_code(folder)
    check_dtypes(str(folder))
    return str(folder)


def read_json(path: Path, limit: int = 16 << 20) -> dict:
    """A folder's JSON object (config.json, tokenizer_config.json), else one line naming the file."""
    try:
        config = json.loads(runfiles.read_small(path, limit))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}); restore it") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a model's config (not a JSON object)")
    return config


def refuse_code(folder: Path) -> None:
    """A folder whose config.json or tokenizer_config.json names code of its own (`auto_map`: Python files that
    transformers would import) is refused before transformers reads it, so that nothing can offer to run it."""
    for name in ("config.json", "tokenizer_config.json"):
        if (folder / name).exists() and "auto_map" in read_json(folder / name):
            raise UserError(
                f"{folder / name} names code of its own (auto_map); stratagem never runs a model folder's "
                "code: use a model that transformers loads without it"
            )


def refuse_quantized(path: Path, config: dict) -> None:
    """A config that claims a quantization (`quantization_config`) is refused before anything loads: the trainer
    keeps full-precision weights, and such a folder fails at its first checkpoint ("quantized with gguf and is not
    serializable") and at vLLM's start, after minutes of work. Its weights are whole floats or refused anyway."""
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise UserError(
            f"{path} claims {str(method)[:40] if method else 'a'} quantization (quantization_config): stratagem "
            "trains and saves full-precision models only; dequantise it and save it without that entry (for "
            "SmolLM2's GGUF, python stratagem.py real-model does)"
        )


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a folder's weights (one, or the shards its index lists)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(os.path.join(folder, "model.safetensors")) or not os.path.exists(index):
        return [os.path.join(folder, "model.safetensors")]
    shards = read_json(Path(index)).get("weight_map")
    if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
        raise UserError(f"{index}: weight_map must map tensors to file names")
    return [os.path.join(folder, os.path.basename(v)) for v in sorted(set(shards.values()))]


def check_dtypes(folder: str) -> None:
    """Every tensor in the weights' safetensors headers is of a floating-point type (an int32 or bool embedding
    would be cast to float without a word), read from the headers alone. A header that cannot be read is left to
    from_pretrained, which says so in its own words."""
    from safetensors import SafetensorError, safe_open

    for file in weight_files(folder):
        if not os.path.exists(file):
            continue
        runfiles.refuse_special(Path(file))
        try:
            with safe_open(file, "pt") as f:
                dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        except (OSError, SafetensorError):
            continue
        refuse_integers(file, dtypes)


def refuse_integers(file, dtypes: dict[str, str]) -> None:
    """One line naming the first tensor of `dtypes` (safetensors' names: F32, BF16, I32, BOOL, ...) that is not
    of a floating-point type."""
    for name, dtype in sorted(dtypes.items()):
        if not dtype.startswith(("F", "BF")):
            raise UserError(
                f"{file}: tensor {name} is of type {dtype}, not a floating-point type: it is no "
                "model's weights; restore it"
            )


def first_nonfinite(tensors) -> str | None:
    """The name of the first of (name, tensor) `tensors` holding a NaN or an infinity, else None: one pass, one
    synchronisation (a sharded tensor is checked on this rank's shard)."""
    named = [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in tensors]
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()  # one device sync
    return next((n for (n, _), ok in zip(named, finite) if not ok), None)


def check_finite_weights(folder: str, model) -> None:
    """Every weight loaded is finite, else one line naming the file and the tensor."""
    if name := first_nonfinite(model.named_parameters()):
        raise UserError(
            f"{weights_file(folder)}: tensor {name} is not finite (it holds NaN or infinity); restore it"
        )


def nonfinite_leaf(state) -> str | None:
    """The dotted path of the first tensor or float in a checkpoint's state (nested dicts, lists, tuples) that is
    not finite, else None; read without recursion, so that no nesting depth can overflow the stack."""
    stack = [("", state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{path}.{k}".lstrip("."), v) for k, v in reversed(value.items())]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{path}.{i}".lstrip("."), v) for i, v in reversed(list(enumerate(value)))]
        elif isinstance(value, float) and not math.isfinite(value):
            return path
        elif isinstance(value, torch.Tensor) and first_nonfinite([(path, value)]):
            return path
    return None


def generation_eos(folder: str, config, vocab: int):
    """The EOS a generation config gives, the only part of it generation reads (stop_ids), checked: null, a token id
    in [0, vocab) or a list of them; anything else is one line naming the file, the key and the value."""
    source = os.path.join(folder, "generation_config.json")
    if not os.path.exists(source):  # transformers derives it from the model's config
        source = os.path.join(folder, "config.json")
    is_id = lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab  # noqa: E731
    eos = getattr(config, "eos_token_id", None)
    if not (eos is None or is_id(eos) or (isinstance(eos, list) and eos and all(map(is_id, eos)))):
        raise UserError(
            f"{source}: eos_token_id must be a token id in [0, {vocab}) or a list of them, "
            f"got {eos!r:.60}"
        )
    return eos


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


# ------------------------------------------------------------------ the chat template, run once in a bounded child
# A chat template is a program (Jinja): one can build a 1.5 GB string or loop for hours, and jinja2's sandbox bounds
# neither. So the trainer never runs one: a child process renders it once, under a memory and a CPU-time limit the
# kernel enforces, for a marker message, and the trainer writes every prompt as the text around that marker
# (format_prompt). Probes check that the template passes a message's text through (trimmed, at most) unchanged.
MARKER = "STRATAGEMxMESSAGExMARKER"
SAMPLE = "Player 0, your move.\n[0] {a} <b> \\boxed{[4]}\n  - x & 'y' \"z\""
TEMPLATE_BYTES, OUTPUT_CHARS, CPU_SECONDS, MEMORY_BYTES = 1 << 20, 1 << 20, 5, 1 << 30
RENDER = """
import json, sys
try:
    from transformers.utils.chat_template_utils import render_jinja_template
    job = json.loads(sys.stdin.read())
    out = [
        render_jinja_template(
            conversations=[[{"role": "user", "content": c}]], chat_template=job["template"],
            add_generation_prompt=True, **job["tokens"],
        )[0][0]
        for c in job["contents"]
    ]
    if sum(map(len, out)) > job["limit"]:
        raise ValueError(f"it writes more than {job['limit']:,} characters")
    print(json.dumps(out))
except BaseException as e:
    said = " ".join(str(e).split())[:200]
    print(type(e).__name__ + (": " + said if said else ""), file=sys.stderr)
    sys.exit(1)
"""


def bounded() -> None:
    """The child's limits (run between fork and exec)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))


def render_in_child(template: str, tokens: dict, contents: list[str]) -> list[str]:
    """`template` rendered for one user message of each of `contents` by transformers' own renderer, in a child
    process (isolated: no path of the folder's is imported) with MEMORY_BYTES of memory and CPU_SECONDS of CPU."""
    job = {"template": template, "tokens": tokens, "contents": contents, "limit": OUTPUT_CHARS}
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", RENDER],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=6 * CPU_SECONDS,
            preexec_fn=bounded,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"it took more than {6 * CPU_SECONDS} s") from None
    if proc.returncode < 0:  # SIGXCPU, or SIGKILL past the hard limit
        raise ValueError(f"it ran past {CPU_SECONDS} s of CPU")
    if proc.returncode:
        said = proc.stderr.strip().splitlines()[-1:]
        raise ValueError(f"rendering it failed ({said[0] if said else 'no reason given'})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def chat_markup(folder: str, template, tokens: dict) -> tuple[str, str, bool] | None:
    """(prefix, suffix, trimmed) such that a prompt is prefix + text + suffix (text stripped if `trimmed`): what the
    folder's chat template makes of one user message with the generation prompt; None without a template. A template
    that is no plain string, too long, failing, unbounded, or that rewrites a message's text is one line."""
    if not template:
        return None
    try:
        if not isinstance(template, str) or len(template.encode()) > TEMPLATE_BYTES:
            raise ValueError(f"it is no plain string of at most {TEMPLATE_BYTES >> 20} MiB")
        marked, padded, sample = render_in_child(
            template, tokens, [MARKER, f"\n {MARKER} \n", SAMPLE]
        )
        if marked.count(MARKER) != 1:
            raise ValueError("it does not write a message's text exactly once")
        prefix, suffix = marked.split(MARKER)
        trimmed = padded == marked
        text = SAMPLE.strip() if trimmed else SAMPLE
        if (
            padded not in (marked, f"{prefix}\n {MARKER} \n{suffix}")
            or sample != prefix + text + suffix
        ):
            raise ValueError("it rewrites a message's text")
    except ValueError as e:
        raise UserError(f"{folder}: its chat template is refused: {e}; fix or remove it") from None
    return prefix, suffix, trimmed
