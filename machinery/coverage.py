"""The coverage guard: which decision spots self-play still reaches, and how varied its moves are.

A spot is what a player faces, read off the text it was shown: KuhnPoker-v1's card and the betting
so far in the round ("K", "K check", "Q bet", "J check bet"), TicTacToe-v0's move number ("move 3"),
SimpleNegotiation-v1's offer ("offer open": one made to the mover awaits its answer, or "no offer").
A policy that collapses onto one line stops reaching the spots off it: they leave training, while
the evaluation's random opponent still leads the policy there. of_step measures a step's turns,
drops names the spots that fell below a tenth of their share at step 1, and invalid_warnings the
games whose evaluation was lost by invalid moves too often.
"""

from __future__ import annotations

import math
import re
from collections import Counter

DROP = 0.1  # a spot below this fraction of its step-1 share is reported
EVIDENCE = 10  # ... where that share would have put this many of the step's turns there
INVALID = 0.10  # an evaluation invalid share above this is reported

_MESSAGE = re.compile(r"\n\[(GAME|Player \d+)\] ")  # LLMObservationWrapper: "\n[sender] message"
_ROUND = re.compile(r"^Starting round \d+ out of \d+ rounds\.\nYour card is: ([JQK])\b")
_KUHN_MOVE = re.compile(r"\[(Check|Bet|Fold|Call)\]", re.IGNORECASE)  # games/spiral.py's
_FACING_BET = {"fold": None, "call": None}  # None: the round is over
_KUHN_TREE = {"check": {"check": None, "bet": _FACING_BET}, "bet": _FACING_BET}
_BOARD = re.compile(r"Current Board:\n\n(.*?)\n\nAvailable Moves", re.DOTALL)
_NEGOTIATOR = re.compile(r"You are Player (\d) in the Negotiation Game")
_OFFER = re.compile(r"^Player \d made the following offer to Player (\d):")
_OFFER_GONE = re.compile(r"^(Player \d (denied|accepted) the trade offer|Trade cancelled)")


def _messages(observation: str) -> list[tuple[str, str]]:
    """(sender, text) of each message of a whole-history observation, in order."""
    parts = _MESSAGE.split(observation)
    return list(zip(parts[1::2], parts[2::2]))


def _kuhn(observation: str) -> str | None:
    """The card, then the moves the game took in this round (a rejected move left no mark)."""
    messages = _messages(observation)
    starts = [i for i, (who, text) in enumerate(messages) if who == "GAME" and _ROUND.match(text)]
    if not starts:
        return None
    card = _ROUND.match(messages[starts[-1]][1]).group(1)
    tree, moves = _KUHN_TREE, []
    for who, text in messages[starts[-1] + 1 :]:
        move = _KUHN_MOVE.search(text.strip()) if who != "GAME" else None
        if move and tree is not None and move.group(1).lower() in tree:
            moves.append(move.group(1).lower())
            tree = tree[moves[-1]]
    return " ".join([card, *moves])


def _tictactoe(observation: str) -> str | None:
    """'move N': the marks on the last board shown, plus one."""
    boards = _BOARD.findall(observation)
    rows = boards[-1].split("\n---+---+---\n") if boards else []
    cells = [c.strip() for row in rows for c in row.split("|")]
    if len(rows) != 3 or len(cells) != 9:
        return None
    return f"move {sum(c in ('X', 'O') for c in cells) + 1}"


def _negotiation(observation: str) -> str | None:
    """'offer open' when an offer made to the mover stands, else 'no offer'."""
    player = _NEGOTIATOR.search(observation)
    if player is None:
        return None
    to = None  # the player the standing offer is made to
    for who, text in _messages(observation):
        if who == "GAME" and (offer := _OFFER.match(text)):
            to = int(offer.group(1))
        elif who == "GAME" and _OFFER_GONE.match(text):
            to = None
    return "offer open" if to == int(player.group(1)) else "no offer"


SPOTS = {
    "KuhnPoker-v1": _kuhn,
    "TicTacToe-v0": _tictactoe,
    "SimpleNegotiation-v1": _negotiation,
}  # the games whose spots are tracked


def spot(game: str, observation: str) -> str | None:
    """The decision spot of a turn of `game`, read from the observation text; None for a game not
    tracked or a text it cannot be read from (Kuhn Poker's first/last format shows no card)."""
    read = SPOTS.get(game)
    return read(observation) if read else None


def entropy(counts: Counter) -> float:
    """Shannon entropy in bits of a count of moves."""
    n = sum(counts.values())
    return -sum(k / n * math.log2(k / n) for k in counts.values() if k) if n else 0.0


def of_step(trajectories) -> dict:
    """{game: {spot: {"share", "entropy", "n"}}} over the turns of `trajectories`: the share of the
    game's tracked turns at the spot, the entropy in bits of the moves played there (lowercased,
    spaces collapsed; "", no move read, is a move of its own) and the turns. Sorted keys; games with
    no tracked turn are left out."""
    moves: dict = {}  # game -> spot -> Counter of moves
    for t in trajectories:
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
    ok = isinstance(share, (int, float)) and not isinstance(share, bool) and math.isfinite(share)
    return float(share) if ok else None


def _count(cell: dict) -> bool:
    """Whether a spot's cell holds a count of turns (a hand-edited line may not)."""
    n = cell.get("n")
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


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


def invalid_spots(records: list[dict]) -> dict:
    """{game: {spot: count}} of the policy's invalid moves in an evaluation's records (each with
    its "moves", [observation, action] pairs: the last is the one that lost)."""
    out: dict = {}
    for r in records:
        if r["invalid"] and r["moves"]:
            where = spot(r["game"], r["moves"][-1][0]) or "?"
            counts = out.setdefault(r["game"], {})
            counts[where] = counts.get(where, 0) + 1
    return out
