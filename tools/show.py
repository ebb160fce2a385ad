"""`stratagem.py show`: one player-trajectory of a run, read closely (turns, scores, A_game -> A_mod)."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import judge_prompts
from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.runfiles import read_config, read_jsonl
from tools.runs import run_file


def visible(text: str) -> str:
    """`text` with its control and format characters written as escapes (ESC as \\x1b, a bidi override as
    \\u202e), so that what a policy wrote cannot move the cursor, recolour or rewrite the terminal; newlines
    and tabs stay."""
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp")
                   else ch.encode("unicode_escape", "backslashreplace").decode() for ch in text)


def say(text: str) -> None:
    print(visible(text))


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py show", description=(
        "Print one player-trajectory of a run readably: its turns, the judge's scores and A_game -> A_mod."))
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=int, default=0, help="only trajectories of this step (default: any)")
    p.add_argument("--judged", action="store_true", help="only trajectories the judge scored")
    p.add_argument("--index", type=int, default=-1, help="the index among the matching ones (default: random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pick (default: 0)")
    ns = p.parse_args(argv)
    path = run_file(Path(ns.run), "trajectories.jsonl")
    rows = [r for r in read_jsonl(path)
            if (not ns.step or r["step"] == ns.step) and (not ns.judged or r["scores"])]
    if not rows:
        raise UserError("no trajectory matches (check --step and --judged)")
    if not -1 <= ns.index < len(rows):
        raise UserError(f"--index must be in [0, {len(rows) - 1}]")
    i = ns.index if ns.index >= 0 else random.Random(ns.seed).randrange(len(rows))
    r = rows[i]
    beta = read_config(Path(ns.run)).get("beta", 0.0)
    say(f"{ns.run} | step {r['step']} | trajectory {i} of {len(rows)} | {r['game']}, Player {r['role']}, "
        f"{len(r['turns'])} turn(s)")
    say(f"reward R = {r['reward']:+g}   baseline b = {r['baseline']:+.4f}   A_game = R - b = {r['a_game']:+.4f}")
    s = r["scores"]
    if s:
        say(f"judge: alpha {s['alpha']:g}  sigma {s['sigma']:g}  rho {s['rho']:g}  -> phi = {r['phi']:.4f}")
        if s.get("d") is not None:
            say(f"       d {s['d']:g}  a {s['a']:g}  c {s['c']:g}  -> psi = {r['psi']:+.4f}")
    else:
        say(f"judge: {'failed' if r['judged'] else 'not sampled'}; batch means used: phi = {r['phi']:.4f}, "
            f"psi = {r['psi']:+.4f}")
    say(f"A_mod = A_game*phi + beta*psi = {r['a_game']:+.4f}*{r['phi']:.4f} + {beta}*{r['psi']:+.4f} "
        f"= {r['a_mod']:+.4f}")
    news = judge_prompts.new_observations([t["observation"] for t in r["turns"]])
    for k, (turn, new) in enumerate(zip(r["turns"], news), 1):
        say(f"\n--- turn {k} ---\n[observation, new part]\n{new.strip()}\n\n[response]\n{turn['response'].strip()}"
            f"\n\n[action sent] {turn['action'] or '(none found)'}")
    return 0
