"""The coverage guard: which decision spots self-play still reaches, and how varied its moves are.

A spot is what a player faces, read off the text it was shown (games/spots.py: game knowledge,
handed in as `spot`). A policy that collapses onto one line stops reaching the spots off it: they leave training, while
the evaluation's random opponent still leads the policy there. of_step measures a step's turns,
drops names the spots that fell below a tenth of their share at step 1, and invalid_warnings the
games whose evaluation was lost by invalid moves too often.
"""

from __future__ import annotations

import math
from collections import Counter

DROP = 0.1  # a spot below this fraction of its step-1 share is reported
EVIDENCE = 10  # ... where that share would have put this many of the step's turns there
INVALID = 0.10  # an evaluation invalid share above this is reported


def entropy(counts: Counter) -> float:
    """Shannon entropy in bits of a count of moves."""
    n = sum(counts.values())
    return -sum(k / n * math.log2(k / n) for k in counts.values() if k) if n else 0.0


def of_step(trajectories, spot) -> dict:
    """{game: {spot: {"share", "entropy", "n"}}} over the turns of `trajectories`, each turn's spot
    read by `spot(game, observation)` (None: not tracked): the share of the
    game's tracked turns at the spot, the entropy in bits of the moves played there (lowercased,
    spaces collapsed; "", no move read, is a move of its own) and the turns. Sorted keys; games with
    no tracked turn are left out, and all of them where `spot` is None (a trainer that tracks none)."""
    moves: dict = {}  # game -> spot -> Counter of moves
    for t in trajectories if spot is not None else ():
        for turn in t.turns:
            if (where := spot(t.game, turn.observation)) is not None:
                move = " ".join(turn.action.lower().split())
                moves.setdefault(t.game, {}).setdefault(where, Counter())[move] += 1
    out = {}
    for game in sorted(moves):
        total = sum(sum(c.values()) for c in moves[game].values())
        out[game] = {
            where: {
                "share": round(sum(c.values()) / total, 4),
                "entropy": round(entropy(c) + 0.0, 4),  # + 0.0: no -0.0
                "n": sum(c.values()),
            }
            for where, c in sorted(moves[game].items())
        }
    return out


def _share(cell) -> float | None:
    """A spot's share, or None where `cell` holds none (a hand-edited line)."""
    share = cell.get("share") if isinstance(cell, dict) else None
    ok = isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1
    return float(share) if ok else None  # a share outside [0, 1] (a 400-digit int) is none


def _count(cell: dict) -> bool:
    """Whether a spot's cell holds a count of turns (a hand-edited line may not)."""
    n = cell.get("n")
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 10**12


def drops(first: dict, now: dict) -> list[str]:
    """A line for each spot of `first` (step 1's of_step) whose share in `now` is below DROP of its
    first share (absent: 0), where the first share would have put at least EVIDENCE of the game's
    turns `now` there: fewer is chance (an expected 10 turns all missing: odds of 1 in 22,000)."""
    lines = []
    for game, spots in first.items():
        if not isinstance(spots, dict) or not isinstance(now.get(game), dict):
            continue
        turns = sum(c["n"] for c in now[game].values() if isinstance(c, dict) and _count(c))
        for where, cell in spots.items():
            was, share = _share(cell), _share(now[game].get(where)) or 0.0
            if was is None or was * turns < EVIDENCE:
                continue
            if share < DROP * was * (1 - 1e-9):  # exactly a tenth is not below
                lines.append(
                    f"coverage: {game} spot {where!r} fell to {share:.3g} of turns "
                    f"({was:.3g} at step 1): self-play stopped reaching it"
                )
    return lines


def invalid_warnings(evaluation: dict, spots_of_invalid: dict | None = None) -> list[str]:
    """A line for each game whose evaluation (summarize_matches, both seats) lost more than INVALID
    of its games by an invalid move, naming the spots of those moves where `spots_of_invalid`
    ({game: {spot: count}}) gives them, most frequent first."""
    lines = []
    for game, cell in (evaluation.get("games") or {}).items():
        try:
            rate = float(cell["both"]["invalid"]["rate"])
        except (KeyError, TypeError, ValueError):
            continue
        if not rate > INVALID:
            continue
        line = (
            f"evaluation: {game} lost {rate:.3g} of its games by an invalid move (over {INVALID:g})"
        )
        counts = (spots_of_invalid or {}).get(game) or {}
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if ranked:
            line += ", at " + ", ".join(f"{where!r} ({k})" for where, k in ranked[:5])
            line += f" and {len(ranked) - 5} more spots" if len(ranked) > 5 else ""
        lines.append(line)
    return lines
