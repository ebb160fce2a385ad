"""A dataclass as a command line, CleanRL/tyro style: the string literal under each field is its --help
line, and a `# --- group ---` comment above a field names its --help section."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import re

from machinery import UserError


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

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        """One line; a mistyped flag gets the nearest real ones ("--step": did you mean --steps?)."""
        if message.startswith("unrecognized arguments: "):
            typed = [w.split("=")[0] for w in message.split(": ", 1)[1].split() if w.startswith("--")]
            near = [m for w in typed for m in difflib.get_close_matches(w, self._option_string_actions, n=1)]
            message += f" (did you mean {' or '.join(dict.fromkeys(near))}?)" if near else ""
        raise UserError(message)


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
