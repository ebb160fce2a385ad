"""A dataclass as a command line, CleanRL/tyro style: the string literal under each field is its --help
line, and a `# --- group ---` comment above a field names its --help section. What stratagem.py and
spyrl.py share of their command lines: the parser, the layering of defaults, presets, a resumed run's
saved config and the flags given, the bounds check, and a resumed run folder's checks."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import time

from machinery import UserError


@functools.cache
def field_docs(cls) -> dict[str, tuple[str, str]]:
    """{field: (group, help)} of a dataclass, read from its source, the class's own fields first and then
    each base's in turn (stratagem.Args: the paper's, then the machinery's groups); a subclass (spyrl.py's
    Args) adds its own fields and may re-document its parents' (their place is kept)."""
    docs: dict[str, tuple[str, str]] = {}
    order: list[str] = []
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        source = inspect.getsource(klass)
        body = ast.parse(source).body[0].body
        groups, group = {}, "options"
        for number, line in enumerate(source.splitlines(), 1):
            if m := re.fullmatch(r"\s*# --- (.+) ---", line):
                group = m.group(1)
            groups[number] = group
        own = []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                name = node.target.id
                docs[name] = (groups[node.lineno], " ".join(nxt.value.value.split()))
                own += [] if name in order else [name]
        order = own + order
    return {name: docs[name] for name in order}


def as_config(args) -> dict:
    """A run's arguments as config.json keeps them: every field, in --help's order (the paper's
    hyperparameters first)."""
    values = dataclasses.asdict(args)
    return {name: values[name] for name in [*field_docs(type(args)), *values]}


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
            near = [
                m
                for k, w in enumerate(words)
                if w.startswith("--")
                for m in self.nearest(w, words[k + 1 :])
            ]
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
        return sorted(fits or longer, key=len)[:2] or difflib.get_close_matches(
            flag, self._option_string_actions, n=1
        )


class NotAutoOrInt(argparse.ArgumentTypeError, ValueError):
    """A value that is neither auto nor a whole number: argparse's one line says it (a ValueError
    too, for FriendlyParser.nearest's test of whether a flag takes a value)."""


def int_or_auto(text: str) -> int | str:
    """An `int | str` field's value (--micro-batch-size): auto, or a whole number (its bounds are
    checked with the other numbers')."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise NotAutoOrInt(f"a whole number or auto, got {text!r}") from None


def kind_of(cls, name: str):
    """How field `name` of `cls` reads a flag's value: int_or_auto for a field typed `int | str`
    (auto or a number), else the type of its default."""
    field = cls.__dataclass_fields__[name]
    return int_or_auto if str(field.type).replace(" ", "") == "int|str" else type(field.default)


METAVARS = {int_or_auto: "{auto,N}"}  # --help's name for a kind's value, where not its type's


def dataclass_parser(
    cls, choices: dict, presets: dict[str, dict], hidden=(), **kwargs
) -> argparse.ArgumentParser:
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
        kind = kind_of(cls, name)
        if kind is bool:
            section.add_argument(flag, action="store_true", help=doc)
            continue
        preset = "".join(
            f"; with {flag}: {values[name]!r}" for flag, values in presets.items() if name in values
        )
        section.add_argument(
            flag,
            type=kind,
            choices=choices.get(name),
            metavar=None if name in choices else METAVARS.get(kind, kind.__name__.upper()),
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


def holds(ok, value) -> bool:
    """A bound's test passes, and the number is finite; auto (an `int | str` field's) keeps them."""
    if isinstance(value, str):
        return value == "auto"
    return ok(value) and (isinstance(value, int) or math.isfinite(value))


def check_bounds(args, bounds: list[tuple]) -> None:
    """Every (fields, test, wording) of `bounds` holds, and every number is finite, else one line."""
    for names, ok, wording in bounds:
        for name in names:
            value = getattr(args, name)
            if not holds(ok, value):
                raise UserError(f"--{name.replace('_', '-')} must be {wording}, got {value}")


def broken(name: str, value, bounds: list[tuple]) -> str | None:
    """The wording of the first bound of `bounds` that field `name`'s `value` breaks (None: it keeps
    them all)."""
    return next((w for names, ok, w in bounds if name in names and not holds(ok, value)), None)


def resolve(cls, explicit: dict, saved: dict | None, resumable: set, presets: dict, check):
    """The run's arguments: defaults <- the presets of the flags given ({(field, value): defaults},
    e.g. --tiny's) <- a resumed run's saved config <- the flags given; a default run folder; `check`."""
    if saved is not None:
        changed = sorted(k for k, v in explicit.items() if k not in resumable and saved.get(k) != v)
        if changed:
            flags = ", ".join("--" + k.replace("_", "-") for k in changed)
            raise UserError(
                f"--resume continues the saved config; these flags cannot change: {flags}"
            )
        values = {**saved, **explicit}
    else:
        values = dict(explicit)
        for (name, value), preset in presets.items():
            values = {**preset, **values} if values.get(name) == value else values
    args = cls(**values)
    if not args.out:
        tags = f"{'-nopsi' if args.no_psi else ''}{'-tiny' if args.tiny else ''}"
        args.out = os.path.join(
            "runs", f"{args.mode}{tags}-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    check(args)
    return args


# ---- stratagem.py's flags: their choices, the ones a resume may change, their bounds, the checks
CHOICES = {
    "mode": ("stratagem", "spiral"),
    "action_rule": ("lenient", "spiral"),
    "tiny_init": ("warm", "random"),
    "backend": ("auto", "hf", "vllm"),
    "judge": ("openai", "heuristic"),
    "judge_aggregate": ("majority", "mean"),
    "judge_structured": ("auto", "on", "off"),
    "report_to": ("none", "tensorboard", "wandb"),
    "eval_opponent": ("random", "minimax", "best-response"),
}
# The flags a resumed run may change; everything else is read back from its config.json. The memory
# flags change how a step is computed, not what it computes: a resume on another device may retune
# them (--micro-batch-size auto chooses again; config.json records the number a run used).
RESUMABLE = set(
    "out resume steps save_every judge_base_url judge_concurrency judge_budget judge_timeout judge_retries "
    "device backend vllm_gpu_memory_utilization report_to vllm_enforce_eager dry_run dist_timeout "
    "micro_batch_size gradient_checkpointing device_memory".split()
)
# (fields, test, wording) of every number flag. Upper bounds: past them a value is a slip of the
# keyboard that would overflow a timer, a tensor or the memory hours into a run.
BOUNDS = [
    (
        "steps save_every ppo_epochs batch_size micro_batch_size num_envs max_new_tokens max_turns eval_n "
        "eval_max_turns judge_max_tokens judge_concurrency judge_samples distill_window".split(),
        lambda v: v >= 1,
        ">= 1",
    ),
    (
        "error_allowance eval_every beta judge_temperature judge_retries judge_budget kl_coef dist_timeout "
        "lora_rank lora_alpha best_eval_n past_every".split(),
        lambda v: v >= 0,
        ">= 0",
    ),
    (("judge_price_in", "judge_price_out"), lambda v: v >= 0, ">= 0 (or -1: the price table's)"),
    (("max_grad_norm", "judge_timeout"), lambda v: v > 0, "> 0"),
    (("lr", "distill_lr"), lambda v: 0 < v <= 1, "in (0, 1]"),
    (("temperature",), lambda v: 1e-3 <= v <= 100, "in [0.001, 100]"),  # below: logits / T overflow
    (("ema", "lora_dropout"), lambda v: 0 <= v < 1, "in [0, 1)"),
    (
        ("judge_sample_rate", "distill_kappa", "distill_audit_rate"),
        lambda v: 0 <= v <= 1,
        "in [0, 1]",
    ),
    (("vllm_gpu_memory_utilization", "clip_range"), lambda v: 0 < v < 1, "in (0, 1)"),
    (("seed",), lambda v: 0 <= v < 2**31, "in [0, 2147483647]"),  # NumPy: below 2**32 (+ rank)
    (("judge_timeout", "dist_timeout"), lambda v: v <= 86400, "<= 86400 (one day)"),
    (("judge_temperature",), lambda v: v <= 100, "<= 100"),
    (("beta", "kl_coef", "beta_max"), lambda v: v <= 1000, "<= 1000"),
    (("beta_share",), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("beta_min",), lambda v: v > 0, "> 0"),
    (("beta_horizon",), lambda v: 1 <= v <= 10**6, "in [1, 1000000]"),
    (("judge_samples", "judge_retries", "ppo_epochs"), lambda v: v <= 100, "<= 100"),
    (("lora_rank",), lambda v: v <= 4096, "<= 4096"),
    (
        ("past_pool",),
        lambda v: 0 <= v <= 64,
        "in [0, 64] (each snapshot is a copy of the weights)",
    ),  # a rank past the width adapts nothing more
    (
        ("lora_alpha",),
        lambda v: v <= 65536,
        "<= 65536",
    ),  # alpha / R scales the update: 1e300 is NaN at once
    (("judge_concurrency",), lambda v: v <= 4096, "<= 4096"),
    (("num_envs",), lambda v: v <= 65536, "<= 65536"),
    (("judge_max_tokens", "max_new_tokens"), lambda v: v <= 1 << 20, "<= 1048576"),
    (
        "max_turns eval_max_turns eval_n best_eval_n distill_window error_allowance".split(),
        lambda v: v <= 10**6,
        "<= 1000000",
    ),
    (("batch_size",), lambda v: v <= 10**7, "<= 10000000"),
    (("device_memory",), lambda v: 0 <= v <= 10**5, "in [0, 100000] (GB; 0: the device's own)"),
    (
        ("steps", "save_every", "eval_every", "micro_batch_size"),
        lambda v: v <= 10**9,
        "<= 1000000000",
    ),
]
