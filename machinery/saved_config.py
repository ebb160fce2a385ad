"""A run folder's config.json read back and checked as its flags would be: --resume's saved config
(saved_config), and the config a command reads of a run (run_config)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from machinery import UserError, flags, runfiles

MODE_SCRIPTS = {
    "spyrl": "spyrl.py"
}  # the script that trains each mode; every other mode: stratagem.py


def saved_config(
    explicit: dict, cls, script: str, choices: dict | None = None, bounds: list | None = None
) -> dict | None:
    """With --resume, the run folder's saved config (its fields of `cls`), after the folder's checks:
    it is a run, holds no link, and is one `script` trains; its values pass their flags' checks
    (`choices`, `bounds`: stratagem.py's by default); a judge URL it records is confirmed on the
    command line (the API key goes there), and so is a judge cache it records anywhere but the run
    folder's own (the run appends to it). Else None."""
    if not explicit.get("resume"):
        return None
    if not explicit.get("out"):
        raise UserError("--resume needs --out (the run directory to continue)")
    out = Path(explicit["out"])
    if out.is_symlink() and not out.exists():
        raise UserError(
            f"--resume: {out} is a symbolic link to {os.readlink(out)}, which does not exist"
        )
    if out.exists() and not out.is_dir():
        raise UserError(f"--resume: {out} is a file, not a run folder")
    runfiles.check_no_links(out)  # before a file of it is read
    if not (out / "config.json").exists():
        why = "it has no config.json" if out.is_dir() else "it does not exist"
        raise UserError(
            f"--resume --out {out}: not a run folder ({why}); --out names the run to continue"
        )
    mode = runfiles.read_config(out).get("mode")
    theirs = MODE_SCRIPTS.get(mode, "stratagem.py")
    if theirs != script:
        raise UserError(f"{out} is a --mode {mode} run: continue it with python {theirs} --resume")
    config = runfiles.read_config(out, cls.__dataclass_fields__)
    check_recorded(
        out / "config.json", config, cls, choices or flags.CHOICES, bounds or flags.BOUNDS
    )
    url = config.get("judge_base_url")
    if url and script == "stratagem.py" and "judge_base_url" not in explicit:  # SpyRL has no judge
        raise UserError(
            f"--resume: {out / 'config.json'} sends the judge's requests, with your API key, to "
            f"{url}: if that is your judge, confirm it with --judge-base-url {shlex.quote(url)} "
            "(or name another)"
        )
    cache = runfiles.foreign_cache(out, config)
    if cache and script == "stratagem.py" and "judge_cache" not in explicit:  # SpyRL has no judge
        raise UserError(
            f"--resume: {out / 'config.json'} keeps the judge's verdicts in {cache}, not in the run folder's "
            "own judge_cache.jsonl, and the run would read that file and append to it: if it is your cache, "
            f"confirm it with --judge-cache {shlex.quote(cache)}"
        )
    return config


KINDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    flags.int_or_auto: "an integer or auto",
}


def flaw(name: str, value, cls, choices: dict, bounds: list[tuple]) -> str | None:
    """What field `name`'s flag requires that `value` lacks, in words: the flag's type (a whole
    number is a number too, a bool is none), one of its choices (a mode may be any script's: the
    script that reads a run checks it is its own), its bounds. None where it passes them all."""
    kind = flags.kind_of(cls, name)
    numeric = kind is float and isinstance(value, int) and abs(value) <= 2**53  # a float's exactly
    auto = kind is flags.int_or_auto and (value == "auto" or isinstance(value, int))
    if isinstance(value, bool) != (kind is bool) or not (
        auto or (kind is not flags.int_or_auto and isinstance(value, kind)) or numeric
    ):
        return KINDS[kind]
    options = (*choices.get(name, ()), *MODE_SCRIPTS) if name == "mode" else choices.get(name)
    if options and value not in options:
        return f"one of {', '.join(options)}"
    return flags.broken(name, value, bounds)


def check_recorded(path: Path, config: dict, cls, choices: dict, bounds: list[tuple]) -> None:
    """Every value of `config` (read from `path`) that is a field of `cls` passes the checks its
    flag's value would (flaw), else one line naming the file, the key and the value."""
    for name, value in config.items():
        if name in cls.__dataclass_fields__ and (
            wording := flaw(name, value, cls, choices, bounds)
        ):
            shown = json.dumps(value)
            raise UserError(
                f"{path}: {name} is {shown[:80]}{'...' if len(shown) > 80 else ''}, but "
                f"--{name.replace('_', '-')} must be {wording}; correct it, or restore the file "
                "from a copy"
            )


def run_config(run: Path, cls) -> dict:
    """A run's config.json (none: {}) for a command that reads it, its values checked as a resume
    checks them (stratagem.py's choices and bounds); a key of no field of `cls` is left as it is."""
    if not (run / "config.json").exists():
        return {}
    config = runfiles.read_config(run)
    check_recorded(run / "config.json", config, cls, flags.CHOICES, flags.BOUNDS)
    return config
