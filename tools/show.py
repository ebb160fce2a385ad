"""`stratagem.py show`: one player-trajectory of a run, read closely (turns, scores, A_game -> A_mod); in a
SpyRL run, one whole game (seats, inputs with the spy's removed parts marked, outputs, votes, rewards)."""

from __future__ import annotations

import random
from pathlib import Path

import judge_prompts
from games import spy
from machinery import UserError, visible
from machinery.flags import FriendlyParser
from machinery.runfiles import read_jsonl
from stratagem import asked
from tools.runs import keep, run_config, run_file


def say(text: str) -> None:
    print(visible(text))


def signed(x: float) -> str:
    """x as +0.1234: a value that rounds to zero is +0.0000, never -0.0000."""
    return f"{round(x, 4) + 0.0:+.4f}"


RULE_WORDS = {
    "one_turn": "d, a and c set by code, not the judge: one turn has nothing to compare, every level 0",
    "stagnant": "d and a set by code, not the judge: the responses repeat themselves (stagnation), -1",
}


def decided(turns: list[dict], scores: dict) -> str | None:
    """In words, the rule of code that set evolution levels of this verdict (judge_prompts.RULES),
    if one did: it is found again from the turns, as the trainer found it."""
    if not any(k in scores for k in judge_prompts.keys("evolution")):
        return None
    seen = [str(t.get("observation", "")) for t in turns]
    said = [str(t.get("response", "")) for t in turns]
    rule = judge_prompts.evolution_rules(seen, said, {})[1]
    return RULE_WORDS.get(rule)


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py show",
        description=(
            "Print one player-trajectory of a run readably: its turns, the judge's scores (and the distilled heads' "
            "levels, --distill) and A_game -> A_mod. "
            "In a SpyRL run (spyrl.py), one whole game: --index counts games, --judged does not apply."
        ),
    )
    p.add_argument("run", help="run directory")
    p.add_argument(
        "--step", type=int, default=0, help="only trajectories of this step (default: any)"
    )
    p.add_argument("--judged", action="store_true", help="only trajectories the judge scored")
    p.add_argument(
        "--index", type=int, default=-1, help="the index among the matching ones (default: random)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random pick (default: 0)")
    p.add_argument(
        "--prompts",
        action="store_true",
        help="print every turn's whole prompt, as the policy was given "
        "it (default: the first turn's, then the new part of each observation)",
    )
    ns = p.parse_args(argv)
    path = run_file(Path(ns.run), "trajectories.jsonl")
    config = run_config(Path(ns.run))
    if config.get("mode") == "spyrl":
        rows = keep(read_jsonl(path), path, spy_line_ok, "whole SpyRL trajectory")
        return show_spy_game(ns, [r for r in rows if not ns.step or r.get("step") == ns.step])
    rows = [
        r
        for r in read_jsonl(path)
        if (not ns.step or r.get("step") == ns.step) and (not ns.judged or r.get("scores"))
    ]
    if not rows:
        raise UserError("no trajectory matches (check --step and --judged)")
    if not -1 <= ns.index < len(rows):
        raise UserError(f"--index must be in [0, {len(rows) - 1}]")
    i = ns.index if ns.index >= 0 else random.Random(ns.seed).randrange(len(rows))
    r = rows[i]
    beta = config.get("beta", 0.0)
    turns = r.get("turns") if isinstance(r.get("turns"), list) else []
    turns = [t if isinstance(t, dict) else {} for t in turns]
    say(
        f"{ns.run} | step {r.get('step', '?')} | trajectory {i} of {len(rows)} | {r.get('game', '?')}, "
        f"Player {r.get('role', '?')}, {len(turns)} turn(s)"
    )
    say(advantage_line(r))
    s = r.get("scores") if isinstance(r.get("scores"), dict) else None
    logged = r.get("logged") if isinstance(r.get("logged"), dict) else {}
    scores = {
        **r,
        **logged,
    }  # each rubric's score: phi and psi as they entered A_mod, the others logged
    if s:  # what the judge gave, whole or not (a hand-edited or foreign file may hold part of a verdict)
        first, *rest = judge_prompts.RUBRICS
        say(f"judge: {levels(s, first, scores.get(judge_prompts.RUBRICS[first]['score']))}")
        for rubric in rest:
            if any(level_of(s, k) is not None for k in judge_prompts.keys(rubric)):
                say(
                    f"       {levels(s, rubric, scores.get(judge_prompts.RUBRICS[rubric]['score']))}"
                )
        if rule := decided(turns, s):
            say(f"       ({rule})")
    elif (r.get("predicted") or {}).get("used"):
        say(
            f"judge: {'failed' if r.get('judged') else 'not sampled'}; the trusted heads' levels used (below)"
        )
    else:
        means = ", ".join(
            f"{spec['score']} = {num(scores, spec['score'], score_format(rubric))}"
            for rubric, spec in judge_prompts.RUBRICS.items()
            if spec["score"] in scores
        )
        say(f"judge: {'failed' if r.get('judged') else 'not sampled'}; batch means used: {means}")
    predicted = r.get("predicted") if isinstance(r.get("predicted"), dict) else None
    if (
        predicted
    ):  # --distill: the heads' levels beside the judge's (evolution rules applied to both)
        h = predicted.get("levels") if isinstance(predicted.get("levels"), dict) else {}
        role = (
            "scored this trajectory"
            if predicted.get("used")
            else "the judge's verdict stands"
            if s
            else "not trusted: the batch mean stands"
        )
        mode, no_psi = config.get("mode", "stratagem"), bool(config.get("no_psi"))
        for k, rubric in enumerate(asked(mode, no_psi, bool(config.get("judge_shadow")))):
            say(
                f"{'heads:' if k == 0 else '      '} {levels(h, rubric)}"
                + (f"  ({role})" if k == 0 else "")
            )
    say(modulation_line(r, beta, lambda: step_metrics(Path(ns.run), r.get("step"))))
    if not turns:
        say(
            "this seat never moved (the other lost on its first move): RAE took its return, nothing to judge or learn"
        )
    news = judge_prompts.new_observations([str(t.get("observation", "")) for t in turns])
    for k, (turn, new) in enumerate(zip(turns, news), 1):
        whole = (
            ns.prompts or k == 1
        ) and "prompt" in turn  # runs before the prompt was kept have observations only
        shown = (
            f"[prompt, as the policy got it]\n{turn['prompt']}"
            if whole
            else f"[observation, new part]\n{new.strip()}"
        )
        say(
            f"\n--- turn {k} ---\n{shown}\n\n[response]\n{str(turn.get('response', '')).strip()}"
            f"\n\n[action sent] {turn.get('action') or '(none found)'}"
        )
    return 0


def number(r: dict, key: str) -> float | None:
    value = r.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def advantage_line(r: dict) -> str:
    """R, b and A_game, saying R - b only where A_game is R - b (RAE): another estimator
    (docs/hacking.md's group advantage, SpyRL's votes) writes A_game without a baseline."""
    reward, baseline, a_game = (number(r, k) for k in ("reward", "baseline", "a_game"))
    head = f"reward R = {num(r, 'reward', '+g')}   baseline b = {num(r, 'baseline', '+.4f')}   "
    if None not in (reward, baseline, a_game) and abs(reward - baseline - a_game) <= 1e-9:
        return head + f"A_game = R - b = {num(r, 'a_game', '+.4f')}"
    return (
        head
        + f"A_game = {num(r, 'a_game', '+.4f')} (not R - b: set by the run's advantage estimator)"
    )


def step_metrics(run: Path, step) -> dict:
    """The metrics.jsonl line of `step`, or {} where there is none (beta and psi's centre are there)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    return next((m for m in read_jsonl(path) if isinstance(m, dict) and m.get("step") == step), {})


def modulation_line(r: dict, beta, metrics=dict) -> str:
    """A_mod and how it came about: A_game*phi + beta*psi, with the step's beta (--beta-share moves
    it) less psi's centre (--centre-psi), both read from `metrics()` (the step's metrics.jsonl line)
    where the run's --beta does not give the logged A_mod. A value that the numbers do not give is
    said to come from an extension of step 3."""
    values = [number(r, k) for k in ("a_game", "phi", "psi", "a_mod")]
    known = None not in values and isinstance(beta, (int, float)) and not isinstance(beta, bool)
    step = {} if known and agrees(values, beta, None) else metrics()
    step_beta = step.get("beta")
    if isinstance(step_beta, dict) and number(step_beta, "value") is not None:
        beta = step_beta["value"]
    centre = number(step, "psi_centre")
    shown = f"{num(r, 'a_game', '+.4f')}*{num(r, 'phi', '.4f')} + {beta}*"
    if centre is None:
        text = f"A_mod = A_game*phi + beta*psi = {shown}{num(r, 'psi', '+.4f')}"
    else:
        psi = f"({num(r, 'psi', '+.4f')} - {centre:.4f})"
        text = f"A_mod = A_game*phi + beta*(psi - centre) = {shown}{psi}"
    text += f" = {num(r, 'a_mod', '+.4f')}"
    known = None not in values and isinstance(beta, (int, float)) and not isinstance(beta, bool)
    if known and not agrees(values, beta, centre):
        text += "  (not from these numbers: an extension of step 3 set it)"
    return text


def agrees(values: list[float], beta: float, centre: float | None) -> bool:
    a_game, phi, psi, a_mod = values
    return abs(a_game * phi + beta * (psi - (centre or 0.0)) - a_mod) <= 1e-9


def num(r: dict, key: str, spec: str) -> str:
    """r[key] formatted, or "?" where the line does not hold a number there."""
    value = r.get(key)
    return (
        format(value, spec)
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else "?"
    )


def level_of(levels: dict, key: str) -> float | None:
    value = levels.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def score_format(rubric: str) -> str:
    """How a rubric's score is printed: with its sign where it can be negative (psi), else plain (phi)."""
    return "+.4f" if min(judge_prompts.RUBRICS[rubric]["levels"]) < 0 else ".4f"


def levels(given: dict, rubric: str, value: float | None = None) -> str:
    """'alpha 1  sigma 0.5  rho 0  -> phi = 0.6750' from a verdict or the heads' levels, in the rubric table's order:
    the score is `value` (the logged one), else computed; with a level missing, what is there and "(k: not given)"
    in place of the score."""
    keys, name = judge_prompts.keys(rubric), judge_prompts.RUBRICS[rubric]["score"]
    value = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    there = [k for k in keys if level_of(given, k) is not None]
    text = "  ".join(f"{k} {given[k]:g}" for k in there)
    missing = [k for k in keys if k not in there]
    if missing:
        return (text + "  " if text else "") + f"({', '.join(missing)}: not given)"
    score = judge_prompts.weighted(rubric, given) if value is None else value
    return f"{text}  -> {name} = {format(score, score_format(rubric))}"


def marked(text: str, removed: list[list[int]]) -> str:
    """`text` with each removed (start, end) span shown as [-...-] (what the spy's copy lacks)."""
    out, last = [], 0
    for a, b in removed:
        piece = text[a:b]
        out += [text[last:a], f"[-{piece.rstrip()}-]{piece[len(piece.rstrip()) :]}"]
        last = b
    return "".join(out + [text[last:]])


def spy_line_ok(r: dict) -> bool:
    """A SpyRL trajectory line as spyrl.py writes it (what show_spy_game reads of it)."""
    info, turn = r["info"], r["turns"][0]
    return (
        isinstance(r["step"], int)
        and isinstance(info["seed"], int)
        and info["phase"] in ("performance", "detection")
        and info["task"] in spy.TASKS
        and isinstance(turn["response"], str)
        and isinstance(turn["observation"], str)
        and all(isinstance(r[k], (int, float)) for k in ("reward", "baseline", "a_mod", "role"))
        and len(info["votes"]) == len(info["shares"])
    )


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
    say(
        f"\n--- the {thing} (civilians' copy; [-...-]: removed from the spy's) ---\n{marked(text, g['removed'])}"
    )
    for k in range(n):
        out, vote = outputs[k], votes.get(k)
        say(
            f"\n--- Player {k} ({out['info']['role']}) ---\n[output]\n{out['turns'][0]['response'].strip()}\n"
            f"[output, performance] votes drawn s = {g['shares'][k]:.3f}  |  r^P = {signed(out['reward'])}, "
            f"b = {signed(out['baseline'])}, A = {signed(out['a_mod'])}"
            + (f"  |  ROUGE-L {out['info']['rouge_l']:.3f}" if "rouge_l" in out["info"] else "")
        )
        voted = (
            f"Player {g['votes'][k]}"
            if g["votes"][k] is not None
            else "invalid (it names no other player)"
        )
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
