"""`stratagem.py show`: one player-trajectory of a run, read closely (turns, scores, A_game -> A_mod); in a
SpyRL run, one whole game (seats, inputs with the spy's removed parts marked, outputs, votes, rewards)."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import judge_prompts
from games import spy
from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.runfiles import read_config, read_jsonl
from stratagem import phi, psi
from tools.runs import run_file


def visible(text: str) -> str:
    """`text` with its control and format characters written as escapes (ESC as \\x1b, a bidi override as
    \\u202e), so that what a policy wrote cannot move the cursor, recolour or rewrite the terminal; newlines
    and tabs stay."""
    return "".join(
        ch
        if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp")
        else ch.encode("unicode_escape", "backslashreplace").decode()
        for ch in text
    )


def say(text: str) -> None:
    print(visible(text))


def signed(x: float) -> str:
    """x as +0.1234: a value that rounds to zero is +0.0000, never -0.0000."""
    return f"{round(x, 4) + 0.0:+.4f}"


def levels(scores: dict, rubric: str) -> str:
    """One rubric's levels, in the table's order: "alpha 1  sigma 0.5  rho 0"."""
    return "  ".join(f"{k} {scores[k]:g}" for k in judge_prompts.keys(rubric))


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py show",
        description=(
            "Print one player-trajectory of a run readably: its turns, the judge's scores (and the distilled heads' "
            "levels, --distill) and A_game -> A_mod. "
            "In a SpyRL run (--mode spyrl), one whole game: --index counts games, --judged does not apply."
        ),
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=int, default=0, help="only trajectories of this step (default: any)")
    p.add_argument("--judged", action="store_true", help="only trajectories the judge scored")
    p.add_argument("--index", type=int, default=-1, help="the index among the matching ones (default: random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random pick (default: 0)")
    p.add_argument(
        "--prompts",
        action="store_true",
        help="print every turn's whole prompt, as the policy was given "
        "it (default: the first turn's, then the new part of each observation)",
    )
    ns = p.parse_args(argv)
    path = run_file(Path(ns.run), "trajectories.jsonl")
    if read_config(Path(ns.run)).get("mode") == "spyrl":
        return show_spy_game(ns, [r for r in read_jsonl(path) if not ns.step or r["step"] == ns.step])
    rows = [r for r in read_jsonl(path) if (not ns.step or r["step"] == ns.step) and (not ns.judged or r["scores"])]
    if not rows:
        raise UserError("no trajectory matches (check --step and --judged)")
    if not -1 <= ns.index < len(rows):
        raise UserError(f"--index must be in [0, {len(rows) - 1}]")
    i = ns.index if ns.index >= 0 else random.Random(ns.seed).randrange(len(rows))
    r = rows[i]
    config = read_config(Path(ns.run))
    beta = config.get("beta", 0.0)
    say(
        f"{ns.run} | step {r['step']} | trajectory {i} of {len(rows)} | {r['game']}, Player {r['role']}, "
        f"{len(r['turns'])} turn(s)"
    )
    say(f"reward R = {r['reward']:+g}   baseline b = {r['baseline']:+.4f}   A_game = R - b = {r['a_game']:+.4f}")
    s = r["scores"]
    if s:
        say(f"judge: {levels(s, 'transferability')}  -> phi = {r['phi']:.4f}")
        if any(s.get(k) is not None for k in judge_prompts.keys("evolution")):
            say(f"       {levels(s, 'evolution')}  -> psi = {r['psi']:+.4f}")
    elif (r.get("predicted") or {}).get("used"):
        say(f"judge: {'failed' if r['judged'] else 'not sampled'}; the trusted heads' levels used (below)")
    else:
        say(
            f"judge: {'failed' if r['judged'] else 'not sampled'}; batch means used: phi = {r['phi']:.4f}, "
            f"psi = {r['psi']:+.4f}"
        )
    if r.get("predicted"):  # --distill: the heads' levels beside the judge's (evolution rules applied to both)
        h, role = (
            r["predicted"]["levels"],
            (
                "scored this trajectory"
                if r["predicted"]["used"]
                else "the judge's verdict stands"
                if s
                else "not trusted: the batch mean stands"
            ),
        )
        say(f"heads: {levels(h, 'transferability')}  -> phi = {phi(h):.4f}  ({role})")
        if not config.get("no_psi"):
            say(f"       {levels(h, 'evolution')}  -> psi = {psi(h):+.4f}")
    say(
        f"A_mod = A_game*phi + beta*psi = {r['a_game']:+.4f}*{r['phi']:.4f} + {beta}*{r['psi']:+.4f} "
        f"= {r['a_mod']:+.4f}"
    )
    if not r["turns"]:
        say("this seat never moved (the other lost on its first move): RAE took its return, nothing to judge or learn")
    news = judge_prompts.new_observations([t["observation"] for t in r["turns"]])
    for k, (turn, new) in enumerate(zip(r["turns"], news), 1):
        whole = (ns.prompts or k == 1) and "prompt" in turn  # runs before the prompt was kept have observations only
        shown = (
            f"[prompt, as the policy got it]\n{turn['prompt']}" if whole else f"[observation, new part]\n{new.strip()}"
        )
        say(
            f"\n--- turn {k} ---\n{shown}\n\n[response]\n{turn['response'].strip()}"
            f"\n\n[action sent] {turn['action'] or '(none found)'}"
        )
    return 0


def marked(text: str, removed: list[list[int]]) -> str:
    """`text` with each removed (start, end) span shown as [-...-] (what the spy's copy lacks)."""
    out, last = [], 0
    for a, b in removed:
        piece = text[a:b]
        out += [text[last:a], f"[-{piece.rstrip()}-]{piece[len(piece.rstrip()) :]}"]
        last = b
    return "".join(out + [text[last:]])


def show_spy_game(ns, rows: list[dict]) -> int:
    """One SpyRL game: its trajectories are consecutive lines of trajectories.jsonl with one step and seed."""
    games: dict[tuple, list[dict]] = {}
    for r in rows:
        games.setdefault((r["step"], r["info"]["seed"]), []).append(r)
    if not games:
        raise UserError("no game matches (check --step)")
    if not -1 <= ns.index < len(games):
        raise UserError(f"--index must be in [0, {len(games) - 1}]")
    i = ns.index if ns.index >= 0 else random.Random(ns.seed).randrange(len(games))
    game = list(games.values())[i]
    g = game[0]["info"]
    n, thing = len(g["votes"]), spy.TASKS[g["task"]][0]
    outputs = {r["role"]: r for r in game if r["info"]["phase"] == "performance"}
    votes = {r["role"]: r for r in game if r["info"]["phase"] == "detection"}
    civilian = next(r for r in outputs.values() if r["info"]["role"] == "civilian")
    text = civilian["turns"][0]["observation"].split(f"\nThe {thing}:\n", 1)[1]
    say(
        f"{ns.run} | step {game[0]['step']} | game {i} of {len(games)} | {spy.GAME}, {g['task']}, {n} players, "
        f"the spy: Player {g['spy']} | seed {g['seed']}"
    )
    say(f"\n--- the {thing} (civilians' copy; [-...-]: removed from the spy's) ---\n{marked(text, g['removed'])}")
    for k in range(n):
        out, vote = outputs[k], votes.get(k)
        say(
            f"\n--- Player {k} ({out['info']['role']}) ---\n[output]\n{out['turns'][0]['response'].strip()}\n"
            f"[output, performance] votes drawn s = {g['shares'][k]:.3f}  |  r^P = {signed(out['reward'])}, "
            f"b = {signed(out['baseline'])}, A = {signed(out['a_mod'])}"
            + (f"  |  ROUGE-L {out['info']['rouge_l']:.3f}" if "rouge_l" in out["info"] else "")
        )
        voted = f"Player {g['votes'][k]}" if g["votes"][k] is not None else "invalid (it names no other player)"
        if vote is not None:  # the vote's own line, then the text it was read from
            say(
                f"[vote, detection] {voted}  |  r^D = {vote['reward']:g}, A (group-relative) = "
                f"{signed(vote['a_mod'])}\n{vote['turns'][0]['response'].strip()}"
            )
        else:
            say(
                f"[vote] {voted}: the spy's vote, counted in the tally, paid nothing, not trained (its text not logged)"
            )
    tally = ", ".join(f"Player {k}: {g['votes'].count(k)}" for k in range(n))
    say(
        f"\ntally: {tally} | "
        f"spy caught: {'yes' if g['caught'] else 'no'} | zero-sum residual {g['zero_sum_residual']:.1e}"
    )
    return 0
