"""Decision spots: what a player faces, read off the text it was shown (the coverage guard's unit,
machinery/coverage.py). KuhnPoker-v1's card and the betting so far in the round ("K", "K check",
"Q bet", "J check bet"), TicTacToe-v0's move number ("move 3"), SimpleNegotiation-v1's offer
("offer open": one made to the mover awaits its answer, or "no offer"). Game knowledge, so it lives
here; the trainer hands `spot` to the guard.
"""

from __future__ import annotations

import re

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
