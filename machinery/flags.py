"""A dataclass as a command line, CleanRL/tyro style: the string literal under each field is its --help
line, and a `# --- group ---` comment above a field names its --help section. What stratagem.py and
spyrl.py share of their command lines: the parser, the layering of defaults, presets, a resumed run's
saved config and the flags given, the bounds check, and a resumed run folder's checks."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import time
from pathlib import Path

from machinery import UserError, runfiles


def field_docs(cls) -> dict[str, tuple[str, str]]:
    """{field: (group, help)} of a dataclass, read from its source; a subclass (spyrl.py's Args) adds its own
    fields and may re-document its parents' (their order is kept)."""
    docs: dict[str, tuple[str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        source = inspect.getsource(klass)
        body = ast.parse(source).body[0].body
        groups, group = {}, "options"
        for number, line in enumerate(source.splitlines(), 1):
            if m := re.fullmatch(r"\s*# --- (.+) ---", line):
                group = m.group(1)
            groups[number] = group
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = (groups[node.lineno], " ".join(nxt.value.value.split()))
    return docs


class FriendlyParser(argparse.ArgumentParser):
    """argparse that ends a mistake in one line (main prints it) and takes no abbreviated flags
    (`--judge` must never be read as `--judgements`)."""

    def __init__(self, hints: dict | None = None, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)
        self.hints = hints or {}  # {(field, value): a line said when --field value is refused}

    def error(self, message):
        """One line; a mistyped flag gets the nearest real ones ("--step": did you mean --steps?)."""
        if message.startswith("unrecognized arguments: "):
            words = message.split(": ", 1)[1].split()
            near = [m for k, w in enumerate(words) if w.startswith("--") for m in self.nearest(w, words[k + 1 :])]
            message += f" (did you mean {' or '.join(dict.fromkeys(near))}?)" if near else ""
        if m := re.match(r"argument --([\w-]+): invalid choice: '([^']*)'", message):
            hint = self.hints.get((m.group(1).replace("-", "_"), m.group(2)))
            message += f"; {hint}" if hint else ""
        raise UserError(message)

    def nearest(self, typed: str, after: list[str]) -> list[str]:
        """The flags a mistyped one most likely meant: those that extend what was typed and take the value that
        follows it (--judge-sample 0.5: --judge-sample-rate, not the integer --judge-samples), else the closest."""
        flag, _, value = typed.partition("=")
        value = value or next((w for w in after[:1] if not w.startswith("--")), None)
        longer = [o for o in self._option_string_actions if o.startswith(flag) and o != flag]

        def takes(option: str) -> bool:
            kind = self._option_string_actions[option].type
            try:
                return value is None or kind is None or kind(value) is not None
            except (TypeError, ValueError):
                return False

        fits = [o for o in longer if takes(o)]
        return sorted(fits or longer, key=len)[:2] or difflib.get_close_matches(flag, self._option_string_actions, n=1)


def dataclass_parser(cls, choices: dict, presets: dict[str, dict], hidden=(), **kwargs) -> argparse.ArgumentParser:
    """One flag per field of `cls`, grouped by section, each with its docstring, its default and the defaults
    that `presets` ({"--tiny": {field: default}, "--spy-task math": ...}) give it. The parsed namespace holds
    only the flags actually given (argparse.SUPPRESS), so that defaults, presets and a saved config can be layered."""
    p = FriendlyParser(argument_default=argparse.SUPPRESS, **kwargs)
    sections: dict[str, argparse._ArgumentGroup] = {}
    for name, (group, doc) in field_docs(cls).items():
        if name in hidden:
            continue
        section = sections.setdefault(group, p.add_argument_group(group))
        flag, default = "--" + name.replace("_", "-"), cls.__dataclass_fields__[name].default
        kind = type(default)
        if kind is bool:
            section.add_argument(flag, action="store_true", help=doc)
            continue
        preset = "".join(f"; with {flag}: {values[name]!r}" for flag, values in presets.items() if name in values)
        section.add_argument(
            flag,
            type=kind,
            choices=choices.get(name),
            metavar=None if name in choices else kind.__name__.upper(),
            help=f"{doc} (default: {default!r}{preset})",
        )
    return p


def number_pair(text: str, flag: str) -> tuple[float, float]:
    """'-1.5,0.5' -> (-1.5, 0.5); anything else is the user's mistake."""
    parts = text.split(",")
    try:
        pair = tuple(float(x) for x in parts)
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(math.isfinite(x) for x in pair):
        raise UserError(f"{flag} takes two numbers A,B, got {text!r}")
    return pair


def items(spec: str) -> list[str]:
    """A comma-separated flag's items, blanks dropped: "TicTacToe-v0, KuhnPoker-v1" -> two ids."""
    return [x.strip() for x in spec.split(",") if x.strip()]


def check_bounds(args, bounds: list[tuple]) -> None:
    """Every (fields, test, wording) of `bounds` holds, and every number is finite, else one line."""
    for names, ok, wording in bounds:
        for name in names:
            value = getattr(args, name)
            if not (ok(value) and (isinstance(value, int) or math.isfinite(value))):
                raise UserError(f"--{name.replace('_', '-')} must be {wording}, got {value}")


def resolve(cls, explicit: dict, saved: dict | None, resumable: set, presets: dict, check):
    """The run's arguments: defaults <- the presets of the flags given ({(field, value): defaults},
    e.g. --tiny's) <- a resumed run's saved config <- the flags given; a default run folder; `check`."""
    if saved is not None:
        changed = sorted(k for k, v in explicit.items() if k not in resumable and saved.get(k) != v)
        if changed:
            flags = ", ".join("--" + k.replace("_", "-") for k in changed)
            raise UserError(f"--resume continues the saved config; these flags cannot change: {flags}")
        values = {**saved, **explicit}
    else:
        values = dict(explicit)
        for (name, value), preset in presets.items():
            values = {**preset, **values} if values.get(name) == value else values
    args = cls(**values)
    if not args.out:
        tags = f"{'-nopsi' if args.no_psi else ''}{'-tiny' if args.tiny else ''}"
        args.out = os.path.join("runs", f"{args.mode}{tags}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    check(args)
    return args


MODE_SCRIPTS = {"spyrl": "spyrl.py"}  # the script that trains each mode; every other mode: stratagem.py


def saved_config(explicit: dict, cls, script: str) -> dict | None:
    """With --resume, the run folder's saved config (its fields of `cls`), after the folder's checks:
    it is a run, holds no link, and is one `script` trains; else None."""
    if not explicit.get("resume"):
        return None
    if not explicit.get("out"):
        raise UserError("--resume needs --out (the run directory to continue)")
    out = Path(explicit["out"])
    if out.is_symlink() and not out.exists():
        raise UserError(f"--resume: {out} is a symbolic link to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise UserError(f"--resume: {out} is a file, not a run folder")
    runfiles.check_no_links(out)  # before a file of it is read
    if not (out / "config.json").exists():
        why = "it has no config.json" if out.is_dir() else "it does not exist"
        raise UserError(f"--resume --out {out}: not a run folder ({why}); --out names the run to continue")
    mode = runfiles.read_config(out).get("mode")
    theirs = MODE_SCRIPTS.get(mode, "stratagem.py")
    if theirs != script:
        raise UserError(f"{out} is a --mode {mode} run: continue it with python {theirs} --resume")
    return runfiles.read_config(out, cls.__dataclass_fields__)
