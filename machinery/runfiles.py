"""A run's files: JSONL logs and their repair, atomic writes, checkpoints and exact resume, the judge's
verdict cache and money ledger, and the checks that an output can be written before any work starts.

Nothing here is lost or half-written by a crash, a full disk or a stop: a checkpoint is written to a
temporary folder and renamed into place, a rewritten file is replaced atomically, and a torn last line
of a JSONL file is skipped with a warning and dropped on resume.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

import judge_prompts
from machinery import UserError, flags, visible
from machinery.distributed import full_weights, optimizer_state


def warn(text: str) -> None:
    """A warning line on stderr (machinery/watch.py says its own through here): what a run survives."""
    print(f"stratagem: warning: {visible(text, lines=False)}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ never through a link
# Whoever can write in a shared run folder could plant a link where the trainer writes (run.lock -> ~/thesis.tex)
# and have it truncate, overwrite or delete any file its user can write. So nothing here writes through a link:
# a run's files are opened with O_NOFOLLOW, and a --resume refuses a folder with a link where the trainer writes.
RUN_FILES = (
    "run.lock",
    "config.json",
    "config_history.jsonl",
    "metrics.jsonl",
    "trajectories.jsonl",
    "judge_cache.jsonl",
    "judge_ledger.jsonl",
    "wandb_run_id",
)
RUN_FOLDERS = ("checkpoints", "tensorboard", "wandb", "best", ".best-tmp", ".best-old")


def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise link_error(path, os.readlink(path))


def link_error(path: Path, target: str) -> UserError:
    return UserError(
        f"{path} is a symbolic link (to {target}); a run never writes through a link (one planted "
        "where it writes could make it overwrite or delete files elsewhere): remove the link"
    )


def not_plain(path) -> UserError:
    return UserError(
        f"{path} is not a plain file (a fifo, a device, or a file with other names too): a run writes only its own "
        "plain files: remove it"
    )


def _no_link(path, flags: int, mode: int = 0o666) -> int:
    """os.open that refuses a link (O_NOFOLLOW) and anything but a plain file; never blocks on a fifo."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last part of the path is a link
            refuse_link(Path(path))
        if e.errno == errno.ENXIO:  # a fifo that nobody reads
            raise not_plain(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise not_plain(path)
    return fd


def refuse_special(path: Path) -> None:
    """`path` opened as the run's own files are (no link, nothing but a plain file, never blocking on a fifo) and
    closed again: the check before a library (torch, safetensors) opens it in its own way."""
    os.close(_no_link(path, os.O_RDONLY))


def read_small(path: Path, limit: int = 1 << 20) -> bytes:
    """A small file of a run (config.json, best.json) read whole, if it is a plain file of at most `limit` bytes."""
    with open(path, "rb", opener=lambda p, flags: _no_link(p, flags)) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{path} is larger than {limit:,} bytes: not a file of this project")
    return data


def _new_file(path, flags: int) -> int:
    """os.open of a file that must not exist yet (O_EXCL: a link at the name fails too)."""
    return _no_link(path, flags | os.O_EXCL)


def check_no_links(out: Path) -> None:
    """Refuse, in one line, a run folder with a link where the trainer writes: its files, their temporary names,
    its folders and anything in checkpoints/ (every entry of which the trainer may delete)."""
    for name in (*RUN_FILES, *(f".tmp-{n}" for n in RUN_FILES), *RUN_FOLDERS):
        refuse_link(out / name)
    for folder in ("checkpoints", "best"):
        if (out / folder).is_dir():
            for entry in sorted((out / folder).iterdir()):
                refuse_link(entry)


# ------------------------------------------------------------------ JSONL logs and atomic files
@contextlib.contextmanager
def naming(path: Path):
    """An OSError while writing `path` names it: a failed write() carries no file name, and "no space
    left on the device" must say where."""
    try:
        yield
    except OSError as e:
        e.filename = e.filename or str(path)
        raise


def append_jsonl(path: Path, record: dict) -> None:
    with naming(path), open_log(path) as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")


def open_log(path: Path):
    """`path` opened to append text, never through a link and never anything but a plain file."""
    return open(path, "a", encoding="utf-8", opener=_no_link)


LINE_LIMIT = (
    32 << 20
)  # bytes: a longer line is no record of this project's (a 4096-token, 50-turn trajectory is ~1 MB)


def lines(f, limit: int | None = None):
    """(line, whole) for every line of a binary file, each read in at most `limit` bytes (LINE_LIMIT): a longer one is
    skipped in chunks (whole False, its bytes not kept), so memory never grows with a hostile line."""
    limit = limit or LINE_LIMIT
    while raw := f.readline(limit + 1):
        if len(raw) <= limit:
            yield raw, True
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the long line, in bounded chunks
            raw = f.readline(limit)
        yield b"", False


def iter_jsonl(path: Path):
    """(raw line, record) for every readable line of a JSONL file, read line by line in bounded memory. A line that
    is not UTF-8, not a JSON object (a crash or a full disk in the middle of an append tears the last one) or longer
    than LINE_LIMIT is skipped with one warning on stderr, never fatal."""
    bad = long = 0
    with open(path, "rb", opener=lambda p, flags: _no_link(p, flags)) as f:
        for raw, whole in lines(f):
            raw = raw.rstrip(b"\r\n")
            try:
                record = json.loads(raw.decode("utf-8")) if raw.strip() else None
            except (
                ValueError,
                RecursionError,
            ):  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
                record = "unreadable"
            if isinstance(record, dict):
                yield raw, record
            elif not whole:
                long += 1
            elif record is not None:
                bad += 1
    if bad:
        warn(f"skipped {bad} unreadable line(s) of {path} (torn by a crash or a full disk)")
    if long:
        warn(
            f"skipped {long} line(s) of {path} longer than {LINE_LIMIT >> 20} MiB: no record of a run"
        )


def read_jsonl(path: Path) -> list[dict]:
    return [record for _, record in iter_jsonl(path)]


def end_torn_line(path: Path) -> None:
    """A file whose last line a crash tore gets its newline, so that the next record starts a line of its own."""
    if os.path.lexists(path) and (path.is_symlink() or path.stat().st_size):
        with naming(path), open(path, "rb+", opener=_no_link) as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


@contextlib.contextmanager
def atomic_file(path: Path):
    """A file written whole or not at all: written as a temporary file beside it, then renamed into place
    (an atomic rename). A write that fails midway leaves the old file as it was and no temporary file. Whatever is
    at the temporary name (a crash's leftover, a planted link) is removed first, never written through."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        tmp.unlink(missing_ok=True)
        with naming(path), open(tmp, "wb", opener=_new_file) as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def write_new(path: Path, data: bytes) -> None:
    """A file that must not exist yet, written whole: created exclusively at the moment of writing, so that
    whatever appeared at the name since it was checked (a file, a link planted in a shared folder) is
    FileExistsError, never written over or through. A write that fails midway removes it again."""
    with naming(path), open(path, "wb", opener=_new_file) as f:
        try:
            f.write(data)
            f.flush()
        except OSError:
            path.unlink(missing_ok=True)
            raise


def open_folder(path: Path, follow: bool) -> int:
    """A folder opened for write_in (its descriptor: names written there stay in this folder, whatever is renamed
    or linked at `path` later). A link at `path` is refused in one line unless `follow` (a folder named on the
    command line may be one; a folder inside a shared run folder may not)."""
    try:
        return os.open(
            path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
            refuse_link(path)
        raise


def write_in(folder: int, path: Path, data: bytes) -> None:
    """`path`, whose folder is open as `folder` (open_folder), replaced by `data` whole or not at all: written as
    .tmp-<name> (created exclusively, never through a link) and renamed over it. A link at the name is refused in
    one line (a rename would only replace it, but the link is not this command's to remove)."""
    name, tmp = path.name, f".tmp-{path.name}"
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
            raise link_error(path, os.readlink(name, dir_fd=folder))
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)  # a crash's leftover, or a link planted there
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o666,
            dir_fd=folder,
        )
        with naming(path), os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines written after the checkpoint we resume from (a crash can leave some), and a torn last
    line, streaming the file through (a 1 GB trajectories.jsonl takes no more memory than a small one)."""
    if not path.exists():
        return
    refuse_link(path)  # its lines would be copied in from elsewhere
    with atomic_file(path) as f:
        for raw, record in iter_jsonl(path):
            if record.get("step", math.inf) <= last_step:
                f.write(raw + b"\n")


def read_config(run: Path, fields=None) -> dict:
    """A run's config.json; a damaged one, or one with keys outside `fields` (when given), ends in one line."""
    path = run / "config.json"
    try:
        config = json.loads(read_small(path).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # RecursionError: brackets nested past Python's limit
        raise UserError(f"{path} is damaged ({e}); restore it from a copy") from None
    unknown = (
        (set(config) - set(fields or config)) if isinstance(config, dict) else {"(not an object)"}
    )
    if unknown:
        raise UserError(f"{path} is not a stratagem config (unknown: {', '.join(sorted(unknown))})")
    return config


def write_config(out: Path, config: dict, step: int) -> str | None:
    """config.json, the run's arguments. On a resume whose flags differ from the saved ones (those that may
    change), the changes are first appended to config_history.jsonl ({"step", "changed": {flag: [old, new]}})
    and returned as a line to print; --out and --resume themselves are not changes, nor a flag that the
    saved config predates."""
    saved = read_config(out) if (out / "config.json").exists() else config
    changed = {
        k: [saved[k], v]
        for k, v in config.items()
        if k not in ("out", "resume") and saved.get(k, v) != v
    }
    if changed:
        append_jsonl(out / "config_history.jsonl", {"step": step, "changed": changed})
    write_atomic(out / "config.json", json.dumps(config, indent=2).encode())
    if changed:
        return "config changed on resume (kept in config_history.jsonl): " + ", ".join(
            f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in changed.items()
        )
    return None


# ------------------------------------------------------------------ checkpoints and exact resume
CHECKPOINT = re.compile(
    r"step-\d{6}"
)  # the name save_checkpoint gives; anything else in checkpoints/ is none


def latest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint of a run: the highest folder named exactly step-NNNNNN (others are warned of)."""
    found = sorted((out / "checkpoints").glob("step-*"))
    if strays := [p.name for p in found if not CHECKPOINT.fullmatch(p.name)]:
        warn(
            f"{out / 'checkpoints'} holds {', '.join(strays[:3])}{', ...' if len(strays) > 3 else ''}: not "
            "checkpoints of this project (a checkpoint is named step-NNNNNN); ignored"
        )
    ckpts = [p for p in found if CHECKPOINT.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return ckpts[-1] if ckpts else None


def checkpoint_step(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("step-"))


def resume_checkpoint(out: Path, steps: int, world: int, adapter: bool = False) -> Path | None:
    """The checkpoint --resume continues from, checked whole (None: the run stopped before its first save).
    Fewer --steps than it has done are refused: config.json always describes the run that is on disk."""
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        check_checkpoint(ckpt, world, adapter)
        if steps < (done := checkpoint_step(ckpt)):
            raise UserError(
                f"--resume: {out} has already done {done} steps; --steps {steps} cannot undo them "
                f"(pass --steps > {done} to train further)"
            )
    return ckpt


def check_checkpoint(ckpt: Path, world: int, adapter: bool = False) -> None:
    """Refuse, in one line, a checkpoint that is missing files or was written by another number of processes.
    `adapter`: a LoRA run's, whose weights are its adapter in PEFT's format (the base is the run's --model)."""
    ranks = len(list(ckpt.glob("rank*.pt")))
    weights = (
        ("adapter_config.json", "adapter_model.safetensors")
        if adapter
        else ("config.json", "model.safetensors")
    )
    missing = [
        name for name in (*weights, "trainer_state.pt", "rank0.pt") if not (ckpt / name).is_file()
    ]
    if "model.safetensors" in missing and (ckpt / "model.safetensors.index.json").is_file():
        missing.remove("model.safetensors")  # a large model is saved in shards, listed by the index
    if missing:
        raise UserError(
            f"--resume: checkpoint {ckpt} is incomplete (missing {', '.join(missing)}); restore it, or "
            "delete that folder to start the run again from step 0"
        )
    if ranks != world:
        raise UserError(
            f"--resume: {ckpt} was written by {ranks} process(es); resume it with as many (this is {world})"
        )


# What each checkpoint file must hold, key by key: (what it must be, in words; the test). A file that lacks a key or
# holds the wrong kind of value there ends the resume in one line naming it, before any of it is used.
BOUND = 1e15  # no count, second, cost or score a run keeps comes near it: past it, a planted value


def _number(v) -> bool:
    """A finite number of a sane size. A 400-digit int is refused here, not left to overflow a float
    (math.isfinite, torch, json) steps later."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) <= BOUND and (isinstance(v, int) or math.isfinite(v))


def dense(v) -> bool:
    """Every tensor in `v` (dicts and lists walked) is an ordinary one: strided, on the CPU, of a
    floating or integer dtype. A meta or sparse tensor would fail deep inside the optimizer or the
    model (NotImplementedError) after the run has started."""
    if isinstance(v, torch.Tensor):
        kind = v.dtype.is_floating_point or v.dtype in (torch.int64, torch.int32, torch.uint8)
        return v.layout == torch.strided and v.device.type == "cpu" and kind
    if isinstance(v, dict):
        return all(dense(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(dense(x) for x in v)
    return True


def _numbers(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _number(x) for k, x in v.items())


def _beta(v) -> bool:
    """--beta-share's beta as a checkpoint keeps it: null (beta fixed), or a number --beta takes."""
    return v is None or (_number(v) and flags.broken("beta", v, flags.BOUNDS) is None)


def _spots(v) -> bool:
    """coverage.of_step's {game: {spot: {"share", "entropy", "n"}}}, each number of a sane size."""
    if not isinstance(v, dict) or not all(isinstance(spots, dict) for spots in v.values()):
        return False
    cells = [c for spots in v.values() for c in spots.values()]
    return all(isinstance(c, dict) and _numbers(c) for c in cells) and all(
        0 <= c.get("share", 0) <= 1 and type(c.get("n", 0)) is int for c in cells
    )


def _pair(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(map(_number, v))


def _generator(v) -> bool:
    """--async-level 1's generator (machinery/overlap.py): {version: step, weights: {name: tensor}}."""
    weights = v.get("weights") if isinstance(v, dict) else None
    return (
        isinstance(weights, dict)
        and type(v.get("version")) is int
        and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in weights.items())
        and dense(weights)
    )


TRAINER_STATE = {
    "step": ("a step number", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "optimizer": (
        "an optimizer state of dense CPU tensors",
        lambda v: isinstance(v, dict) and {"state", "param_groups"} <= set(v) and dense(v),
    ),
    "baselines": ("RAE's baselines, {key: number}", _numbers),
    "elapsed": ("seconds, a number", _number),
    "judge_totals": ("the judge's totals or null", lambda v: v is None or _numbers(v)),
    "beta": ("--beta-share's beta (null, or a number --beta takes)", _beta),
    "recent": (  # before the scores were named: [phi, psi] pairs
        "the recent judged steps' means, [{score: number}]",
        lambda v: isinstance(v, list) and all(_numbers(r) or _pair(r) for r in v),
    ),
    "past_pool": (  # its snapshots are checked against the model: opponents.restored
        "--opponents' past pool of dense CPU tensors, or null",
        lambda v: v is None or (isinstance(v, dict) and dense(v)),
    ),
    "first_spots": (
        "the coverage guard's step-1 spots, {game: {spot: {share in [0, 1], n, ...}}}, or null",
        lambda v: v is None or _spots(v),
    ),
    "overlap": (  # the weights are checked against the model: overlap.problem
        "--async-level 1's generator, {version: step, weights: {name: dense CPU tensor}}, or null",
        lambda v: v is None or _generator(v),
    ),
}
# Keys kept since a later version: a checkpoint written before lacks them (--async-level 0's: never).
LATER = {"beta", "recent", "past_pool", "first_spots", "overlap"}
RANK_STATE = {
    "rng": (
        "the RNG states",
        lambda v: (
            isinstance(v, dict)
            and {"rng", "python", "numpy", "torch", "cuda"} <= set(v)
            and _settable(v)
        ),
    ),
    "lengths": ("game lengths, {game: number}", _numbers),
}


def load_state(path: Path, schema: dict, what: str = "--resume") -> dict:
    """A trainer_state.pt / rank<r>.pt, read with weights_only=True: tensors and plain containers only, so a planted
    pickle cannot run code (torch's own default since 2.6). A damaged file, or one without a key of `schema` (or
    with the wrong kind of value there), ends in one line naming the file and the key; so does a
    checkpoint's state whose step is not its folder's (a copy's step-000002 holding step 10**15)."""
    try:
        refuse_special(path)
        state = torch.load(path, weights_only=True, map_location="cpu")  # a planted device: none
    except (
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        pickle.UnpicklingError,
    ) as e:  # a torn zip: RuntimeError
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else "empty file"
        raise UserError(
            f"{what}: {path} is damaged ({type(e).__name__}: {first[:200]}); restore it, or delete {path.parent} to "
            "start the run again from step 0"
        ) from None
    bad = "it is not a dictionary" if not isinstance(state, dict) else None
    for key, (kind, ok) in schema.items():
        if bad is None and key not in state and key not in LATER:
            bad = f"{key!r} is missing"
        elif bad is None and key in state and not ok(state[key]):
            bad = f"{key!r} is not {kind}"
    if bad:
        raise UserError(f"{what}: {path} is not a checkpoint of this project: {bad}; restore it")
    folder = path.parent
    if (
        "step" in schema
        and CHECKPOINT.fullmatch(folder.name)
        and state["step"] != checkpoint_step(folder)
    ):
        raise UserError(
            f"{what}: {path} records step {state['step']}, but its folder is {folder.name}: a "
            "checkpoint's step is its folder's name; restore it"
        )
    return state


def rng_states(rng: random.Random) -> dict:
    """Every RNG's state in plain values and tensors (NumPy's key array as a list), so that weights_only reads it."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "rng": rng.getstate(),
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set(s: dict, rng: random.Random, python, numpy, generator: torch.Generator) -> None:
    """The states `s` (rng_states') set in `rng`, Python's `python`, NumPy's `numpy` and torch's
    `generator`."""
    rng.setstate(s["rng"])
    python.setstate(s["python"])
    name, keys, pos, has_gauss, cached = s["numpy"]
    numpy.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    generator.set_state(s["torch"])


def _settable(s: dict) -> bool:
    """The RNG states of a rank file can be set: tried on generators of their own, where a hand-made
    state raises (a key out of range, the wrong length or kind); CUDA's: null or byte tensors."""
    cuda = s["cuda"] is None or (
        isinstance(s["cuda"], list)
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in s["cuda"])
    )
    try:
        _set(s, random.Random(), random.Random(), np.random.RandomState(), torch.Generator())
    except (TypeError, ValueError, KeyError, RuntimeError, OverflowError, IndexError):
        return False
    return cuda


def set_rng_states(rng: random.Random, s: dict) -> None:
    """Every RNG set from a rank file's states (load_state checked that they can be)."""
    _set(s, rng, random, np.random, torch.default_generator)
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(
    out: Path, step: int, model, tokenizer, optimizer, shared: dict, own: dict, dist
) -> None:
    """Written to a temporary folder, then renamed into place (an atomic rename): a crash leaves the
    previous checkpoint intact; older checkpoints are removed only after the new one is in place.
    `shared` (rank 0's trainer state) goes to trainer_state.pt, `own` (each rank's RNG states and
    game-length estimates) to rank<r>.pt. Every rank must call this (the weights are gathered). A LoRA model's
    save_pretrained (PEFT's) writes its adapter alone: adapter_config.json, adapter_model.safetensors."""
    root = out / "checkpoints"
    refuse_link(root)  # the old checkpoints in it are deleted
    final = root / f"step-{step:06d}"
    weights = (
        full_weights(model) if dist.world > 1 else None
    )  # None: save_pretrained reads the model
    optim = optimizer_state(model, optimizer)
    tmp = root / f".tmp-step-{step:06d}"
    try:
        if dist.main:
            remove(tmp)  # left by a kill -9 during an earlier save of this step
            tmp.mkdir(
                mode=0o700
            )  # nobody else's while it is written; given the user's umask before the rename
        dist.gather(None)
        torch.save(own, tmp / f"rank{dist.rank}.pt")
        dist.gather(None)  # every rank's file is written before the rename
        if dist.main:
            adapter = (
                {"save_embedding_layers": False} if hasattr(model, "peft_config") else {}
            )  # LoRA: adapters only
            model.save_pretrained(tmp, state_dict=weights, **adapter)
            tokenizer.save_pretrained(tmp)
            torch.save({"step": step, "optimizer": optim, **shared}, tmp / "trainer_state.pt")
            follow_umask(tmp)
            os.replace(tmp, final)
            for old in (
                root.iterdir()
            ):  # older checkpoints and leftovers of ours; nothing else a user put there
                if old != final and (
                    CHECKPOINT.fullmatch(old.name) or old.name.startswith(".tmp-step-")
                ):
                    remove(old)
    except (
        OSError,
        RuntimeError,
        SafetensorError,
    ) as e:  # a full disk: torch.save raises RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        detail = (
            e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().split(". ")[0]
        )
        raise UserError(
            f"cannot write checkpoint {final} ({detail}); the previous one is intact: make room, "
            f"then continue with --resume --out {out}"
        ) from None
    except (
        KeyboardInterrupt
    ):  # Ctrl-C or SIGTERM in the middle of a save: the previous checkpoint stands
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.gather(None)  # nobody runs ahead of the rename


def follow_umask(folder: Path) -> None:
    """A folder's files and itself given the modes the user's umask gives (some writers create 0600 files; a
    checkpoint follows the umask like the logs)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~mask)
    os.chmod(folder, 0o777 & ~mask)


def remove(path: Path) -> None:
    """A file, a link (the link only, not what it points to) or a folder, whichever is there, if anything is."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def foreign_cache(run_dir: Path, config: dict) -> str | None:
    """The judge cache a run's config.json records, where it is not the run folder's own judge_cache.jsonl: a
    resume reads and appends to it only where the command line names it again (saved_config)."""
    cache = config.get("judge_cache")
    own = os.path.abspath(run_dir / "judge_cache.jsonl")
    return str(cache) if cache and os.path.abspath(str(cache)) != own else None


def resume_advice(run_dir: Path | None) -> str:
    """What a stopped run says about continuing: the checkpoint it resumes from, or a fresh start, with the command
    that does it as it is to be typed (a SpyRL run is resumed by spyrl.py; a path with a space is quoted;
    a judge URL and a judge cache outside the run folder are named again, since a resume sends the key and
    appends verdicts only where the command line confirms)."""
    if run_dir is None or not (run_dir / "config.json").exists():
        return ""
    config = read_config(run_dir)
    script = "spyrl.py" if config.get("mode") == "spyrl" else "stratagem.py"
    command = f"python {script} --resume --out {shlex.quote(str(run_dir))}"
    if script == "stratagem.py" and config.get("judge_base_url"):
        command += f" --judge-base-url {shlex.quote(str(config['judge_base_url']))}"
    if script == "stratagem.py" and (cache := foreign_cache(run_dir, config)):
        command += f" --judge-cache {shlex.quote(cache)}"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return f" (no checkpoint yet: {command} starts it again from step 0)"
    return f" (continue from {ckpt.name} with: {command})"


# ------------------------------------------------------------------ one job per run folder
LOCK = "run.lock"
_claimed: dict[
    Path, tuple
] = {}  # run folder -> (its open lock file, whether this process created the folder)


def claim_run(out: Path, fresh: bool) -> None:
    """Make `out` this process's for the rest of its run: a fresh run creates it (two fresh runs started on
    one --out at the same instant: the second finds it made), and either takes its exclusive lock, `LOCK`,
    holding it until release_runs(). Another job on the folder (a requeued job beside the old one) is
    refused in one line naming the holder. The kernel drops the lock of a process that dies, however it
    dies, so a stale lock never blocks (fcntl.flock: on NFS the server's lock)."""
    if fresh:
        try:
            out.mkdir(parents=True)
        except FileExistsError:
            check_writable_dir(out, "--out")  # a dangling link, a file: said as such
            raise UserError(
                f"{out} already exists (another run has just started in it); choose another --out, "
                "or pass --resume to continue it"
            ) from None
    f = _open_lock(out)
    _lock(f, out)
    f.seek(0)
    f.truncate()  # the run's own lock file: a plain file with no other name, see _open_lock
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    _claimed[out] = (f, fresh)


def _open_lock(out: Path):
    """`LOCK`, created exclusively where it is new, else opened without following a link; only a plain file with
    no other name (no hard link elsewhere) is taken: emptying it can only empty the lock."""
    path = out / LOCK
    try:
        fd = _new_file(path, os.O_RDWR | os.O_CREAT)
    except FileExistsError:  # an earlier run's (or a link, which _no_link refuses)
        fd = _no_link(path, os.O_RDWR)
    if os.fstat(fd).st_nlink != 1:
        os.close(fd)
        raise not_plain(path)
    return os.fdopen(fd, "r+", encoding="utf-8")


def _lock(f, out: Path) -> None:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another job (just starting)"
        f.close()
        raise UserError(
            f"{out} is in use by {holder}, which holds {out / LOCK}; one run folder takes one job "
            "at a time: stop that job, or --resume once it has ended"
        ) from None


def check_not_in_use(out: Path) -> None:
    """For a resume, before anything of the run is read (another job may be in the middle of a save): the
    refusal of claim_run(), at once, touching nothing; and of a folder with a link where the trainer writes."""
    check_no_links(out)
    if os.path.lexists(out / LOCK):
        with _open_lock(out) as f:
            _lock(f, out)  # and let go again when the file closes


def release_runs() -> None:
    """Let go of every folder claimed (at the end of a run, or when it fails or is stopped). A fresh folder
    whose run never started (no config.json: it failed or was stopped while loading) is removed whole."""
    for out, (f, fresh) in list(_claimed.items()):
        if fresh and not (out / "config.json").exists():
            shutil.rmtree(out, ignore_errors=True)
        else:
            f.truncate(0)  # no holder any more
        f.close()
        del _claimed[out]


# ------------------------------------------------------------------ checks before any work
def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:  # exists() is False under a file too
        path = path.parent
    return path


def check_writable_dir(path: Path, flag: str) -> None:
    """Refuse, before any work, a folder that cannot be created or written (under a file, read-only,
    no permission): a probe folder is made in its nearest existing ancestor and removed again."""
    if path.is_symlink() and not path.exists():
        raise UserError(
            f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist"
        )
    base = nearest_existing(path.absolute())
    if not base.is_dir():
        raise UserError(f"{flag} {path}: {base} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=base, prefix=".stratagem-probe-").cleanup()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write in {base} ({e.strerror})") from None


def check_writable_file(path: Path, flag: str) -> None:
    """Refuse, before any work, a file that cannot be written: a folder, a missing or unwritable folder, a link."""
    refuse_link(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder, not a file")
    if not path.absolute().parent.is_dir():
        why = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise UserError(f"{flag} {path}: {nearest_existing(path.absolute().parent)} {why}")
    try:
        if path.exists():
            open(path, "a", opener=_no_link).close()  # appending nothing changes nothing
        else:
            tempfile.TemporaryFile(dir=path.absolute().parent, prefix=".stratagem-probe-").close()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror})") from None


# ------------------------------------------------------------------ the judge's cache and ledger
class JudgeCache:
    """Valid verdicts keyed by judge model, prompt version, rubric, temperature, max_tokens, sample index and
    rendered trajectory: a resumed or repeated run never pays twice for a request. Append-only JSONL, one line per
    verdict; a torn, corrupt or invalid line (validated like a fresh verdict) is skipped and counted, and
    its request made again rather than trusting a hand-edited or foreign file."""

    def __init__(self, path: Path | None):
        self.path, self.entries, self.skipped = path, {}, 0
        self.lock = threading.Lock()
        if path is not None and path.exists():
            with open(path, "rb", opener=lambda p, flags: _no_link(p, flags)) as f:
                self.read(f)
            end_torn_line(path)

    def read(self, f) -> None:
        """Every valid verdict of the file; the others counted in `skipped`."""
        for line, whole in lines(f):
            try:
                if not whole:
                    raise ValueError("longer than any verdict")
                record = json.loads(line.decode("utf-8", errors="replace"))
                keys = judge_prompts.keys(record["rubric"])
                if set(record["scores"]) != set(keys) or not isinstance(record["key"], str):
                    raise ValueError("not the rubric's keys")
                self.entries[record["key"]] = {
                    k: judge_prompts.level(record["rubric"], k, record["scores"][k]) for k in keys
                }
            except (
                ValueError,
                KeyError,
                TypeError,
                OverflowError,
                RecursionError,
            ):  # a line of any shape
                self.skipped += 1

    @staticmethod
    def key(
        model: str,
        rubric: str,
        temperature: float,
        max_tokens: int,
        sample: int,
        text: str,
        structured: bool = False,
    ) -> str:
        """Every parameter of the request (model; messages: prompt version, rubric, trajectory; temperature;
        max_tokens; the schema with --judge-structured) and the sample index: a verdict is reused only for the very
        request that produced it (a free-text request's key is what it was before structured verdicts existed)."""
        schema = [judge_prompts.response_format(rubric)] if structured else []
        ident = json.dumps(
            [
                model,
                judge_prompts.PROMPT_VERSION,
                rubric,
                temperature,
                max_tokens,
                sample,
                text,
                *schema,
            ]
        )
        return hashlib.sha256(ident.encode()).hexdigest()

    def put(self, key: str, rubric: str, scores: dict) -> None:
        if self.path is None:  # JudgeCache(None): no cache at all
            return
        with self.lock:
            self.entries[key] = scores
            append_jsonl(self.path, {"key": key, "rubric": rubric, "scores": scores})


def ledger_totals(path: Path) -> dict:
    """Requests, tokens and money of every request a run has paid for, read from its ledger
    (judge_ledger.jsonl, one line per paid request, appended as it is paid). On resume these replace the
    checkpoint's totals: a step paid for and then lost to a crash is replayed from the cache for free,
    but its money was spent, and the budget must see it."""
    totals = dict.fromkeys(("requests", "prompt_tokens", "completion_tokens", "cost"), 0)
    for _, row in iter_jsonl(path) if path.exists() else ():
        totals["requests"] += 1
        for k in ("prompt_tokens", "completion_tokens", "cost"):
            value = row.get(k, 0)
            totals[k] += (
                value if isinstance(value, (int, float)) and math.isfinite(value) else 0
            )  # hand-edited
    end_torn_line(path)
    return totals
