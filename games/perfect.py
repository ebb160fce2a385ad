"""Perfect players for the evaluation (`eval --opponent minimax|best-response`, --eval-opponent).

TicTacToe-v0: MinimaxPlayer plays exact minimax (cached over boards), a random one of the best moves.

KuhnPoker-v1: only the last round (the deciding round) decides the game, and its winner wins it, so a
round is worth 1 to its winner whatever was bet. From the policy's moves in that round, read off its
observations, come its move frequencies at each information set, and the win rate of the exact best
response to them (best_response), with a bootstrap interval (exploitability). The round's value is 0.5
to either seat: a player who never folds wins every showdown it holds the higher card in and every fold,
which by symmetry of the deal is at least half. So the best response wins between 0.5 (a policy that
cannot be exploited) and 1; its excess over 0.5 is the policy's exploitability.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections import Counter

from games.spiral import CARD, KuhnPokerV1, TicTacToeV0
from games.spots import invalid_spots
from machinery import UserError
from machinery.matches import RandomPlayer, summarize_matches

# ----------------------------------------------------------------------------------- TicTacToe
MINIMAX_GAMES = ("TicTacToe-v0",)
_OTHER = {"O": "X", "X": "O"}


def _won(board: tuple[str, ...], mark: str) -> bool:
    return any(board[a] == board[b] == board[c] == mark for a, b, c in TicTacToeV0.LINES)


@functools.cache
def _score(board: tuple[str, ...], to_move: str) -> int:
    """The value to the player to move under best play: a win is 1 + the cells still empty when it
    ends (quicker is better), a loss minus that, a draw 0."""
    if _won(board, _OTHER[to_move]):
        return -(1 + board.count(""))
    if all(board):
        return 0
    return max(-_score(_place(board, cell, to_move), _OTHER[to_move]) for cell in _free(board))


def _free(board: tuple[str, ...]) -> list[int]:
    return [cell for cell in range(9) if not board[cell]]


def _place(board: tuple[str, ...], cell: int, mark: str) -> tuple[str, ...]:
    return board[:cell] + (mark,) + board[cell + 1 :]


def minimax_moves(board, to_move: str) -> list[int]:
    """The best cells for `to_move`: the quickest win, else a draw, else the slowest loss."""
    board = tuple(board)
    scores = {cell: -_score(_place(board, cell, to_move), _OTHER[to_move]) for cell in _free(board)}
    return [cell for cell, s in scores.items() if s == max(scores.values())]


class MinimaxPlayer:
    """Exact minimax on TicTacToe-v0 (MINIMAX_GAMES), read from the game's board; ties broken by `rng`."""

    def __init__(self, rng):
        self.rng, self.name = rng, "minimax"

    def act(self, jobs: list[tuple[object, int, str]]) -> list[str]:
        moves = []
        for env, pid, _ in jobs:
            board = env.state.game_state.get("board")
            if board is None or len(board) != 9:
                raise ValueError(f"MinimaxPlayer plays {', '.join(MINIMAX_GAMES)} only")
            moves.append(f"[{self.rng.choice(minimax_moves(board, 'X' if pid == 1 else 'O'))}]")
        return moves


# ----------------------------------------------------------------------------------- Kuhn Poker
BEST_RESPONSE_GAMES = ("KuhnPoker-v1",)
GAME_VALUE = 0.5  # the deciding round's win rate at equilibrium, for either seat
ROLES = ("opener", "responder")
_ROUND = re.compile(r"Starting round (\d+) out of (\d+) rounds\.\nYour card is: ([JQK])\n")
_MESSAGE = re.compile(r"\n(?=\[(?:GAME|Player \d+)\] )")


def _node(history: tuple[str, ...]):
    """The betting tree's node after `history`: a dict of moves, or "showdown" / "loser"."""
    node = KuhnPokerV1.TREE
    for move in history:
        node = node[move]
    return node


def legal_moves(history: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_node(history))


def infoset(card: str, history: tuple[str, ...]) -> str:
    """'K:opener:', 'Q:responder:check', 'J:opener:check,bet': the mover's card, role, the bets."""
    return f"{card}:{ROLES[len(history) % 2]}:{','.join(history)}"


HISTORIES = ((), ("check",), ("bet",), ("check", "bet"))  # where a player moves in a round
INFOSETS = tuple(infoset(card, h) for card in CARD.values() for h in HISTORIES)  # the 12 spots


def kuhn_infoset(observation: str) -> str | None:
    """The information set of the player to move, read from its observation (the whole history, as
    LLMObservationWrapper shows it): its card, whether it opened the round, the valid moves so far
    (a move the game refused, with a retry left, is skipped as the game skips it). None before the
    deciding round, after it, or for text it cannot read (most spots of the first/last format)."""
    rounds = list(_ROUND.finditer(observation))
    if not rounds or rounds[-1].group(1) != rounds[-1].group(2):
        return None
    history: list[str] = []
    for message in _MESSAGE.split(observation[rounds[-1].end() :]):
        said = re.match(r"\[Player \d+\] (.*)", message, re.DOTALL)
        move = said and KuhnPokerV1.MOVE.search(said.group(1).strip())
        if move and move.group(1).lower() in legal_moves(tuple(history)):
            history.append(move.group(1).lower())
    if not isinstance(_node(tuple(history)), dict):
        return None
    return infoset(rounds[-1].group(3), tuple(history))


def strategy_counts(pairs) -> dict[str, dict[str, int]]:
    """{infoset: {move: count}} from (observation, action) pairs of the policy's moves, the deciding
    round's only; a move the game would refuse there ("" included) counts as "invalid"."""
    counts: dict[str, Counter] = {}
    for observation, action in pairs:
        spot = kuhn_infoset(observation)
        if spot is None:
            continue
        history = tuple(h for h in spot.split(":")[2].split(",") if h)
        found = KuhnPokerV1.MOVE.search((action or "").strip())
        move = found.group(1).lower() if found else ""
        counts.setdefault(spot, Counter())[move if move in _node(history) else "invalid"] += 1
    return {spot: dict(c) for spot, c in counts.items()}


def _shares(freqs: dict, spot: str, history: tuple[str, ...]) -> dict[str, float]:
    """The policy's probability of each legal move and of "invalid" (any other move) at `spot`;
    unseen: uniform over the legal moves."""
    legal, shares = legal_moves(history), Counter()
    for m, p in freqs.get(spot, {}).items():
        shares[m if m in legal else "invalid"] += float(p)
    total = sum(shares.values())
    if total <= 0:
        return {m: 1 / len(legal) for m in legal}
    return {m: p / total for m, p in shares.items()}


def _br_wins(history, cards, br_role, plan, freqs) -> float:
    """The best responder's chance of winning from `history`; cards = {role: card}; plan: its move
    at each of its histories; the policy plays `freqs`."""
    node = _node(history)
    if node == "showdown":
        return float(cards[br_role] > cards[ROLES[1 - ROLES.index(br_role)]])
    if node == "loser":  # the player who just moved folded
        return float(ROLES[len(history) % 2] == br_role)
    mover = ROLES[len(history) % 2]
    if mover == br_role:
        return _br_wins(history + (plan[history],), cards, br_role, plan, freqs)
    spot = infoset(CARD[cards[mover]], history)
    return sum(
        p * (1.0 if m == "invalid" else _br_wins(history + (m,), cards, br_role, plan, freqs))
        for m, p in _shares(freqs, spot, history).items()
    )


def best_response_by_role(freqs: dict) -> dict[str, float]:
    """{policy's role: the exact best response's win rate} against a policy that plays `freqs`
    ({infoset: {move: frequency or count}}; "invalid", or a move illegal there, loses the game for
    the policy, as with eval's default --error-allowance 0) in the deciding round, over the 6 equally
    likely deals. The best response knows its own card only: for each card it takes the plan (a move
    at each of its spots) that wins most often against the policy's two possible cards."""
    out = {}
    for role in ROLES:
        br_role = ROLES[1 - ROLES.index(role)]
        spots = [h for h in HISTORIES if ROLES[len(h) % 2] == br_role]
        plans = [
            dict(zip(spots, moves)) for moves in itertools.product(*(legal_moves(h) for h in spots))
        ]
        total = 0.0
        for mine in CARD:
            theirs = [c for c in CARD if c != mine]
            total += max(
                sum(
                    _br_wins((), {br_role: mine, role: other}, br_role, plan, freqs)
                    for other in theirs
                )
                / len(theirs)
                for plan in plans
            )
        out[role] = total / len(CARD)
    return out


def best_response(freqs: dict) -> float:
    """The best response's win rate, the policy opening the deciding round in half the games: its last
    round is opened by Player 1 (the opener alternates, Player 1 opening round 1, five rounds), and
    eval's schedule seats the model as Player 0 and Player 1 in turn. GAME_VALUE (0.5) is unexploitable,
    1 is a policy that always loses to it."""
    return sum(best_response_by_role(freqs).values()) / len(ROLES)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


SAMPLES = 1000  # the bootstrap's resamples: about 0.5 s on one core (docs/evaluation.md)


def exploitability(counts: dict, rng, samples: int = SAMPLES) -> dict:
    """The best response's win rate against the frequencies of `counts` (strategy_counts), with a 95 %
    percentile bootstrap interval (`samples` resamples, drawn by `rng`: each information set's moves
    drawn again with replacement, as many as it had). The win rate is a maximum over plans, so
    frequencies from few moves overstate it and resamples lean upwards; the interval is stretched to
    hold the point value where they all lie on one side of it. by_role: the win rate against the
    policy as opener and as responder; infosets: each spot's moves and frequencies. JSON as it is."""
    point = best_response_by_role(counts)
    resampled = []
    for _ in range(samples):
        drawn = {}
        for spot, moves in counts.items():
            n = sum(moves.values())
            if n:
                drawn[spot] = Counter(rng.choices(list(moves), weights=list(moves.values()), k=n))
        resampled.append(best_response(drawn))
    win = sum(point.values()) / len(ROLES)
    low, high = (_percentile(resampled, q) for q in (0.025, 0.975)) if samples else (win, win)
    return {
        "win_rate": win,
        "ci95": [min(low, win), max(high, win)],
        "exploitability": win - GAME_VALUE,
        "game_value": GAME_VALUE,
        "by_role": point,
        "n": sum(sum(m.values()) for m in counts.values()),
        "method": f"percentile bootstrap, {samples} resamples of each information set's moves",
        "infosets": {
            spot: {
                "n": sum(counts.get(spot, {}).values()),
                "freq": {
                    m: c / (sum(counts[spot].values()) or 1)
                    for m, c in counts.get(spot, {}).items()
                },
            }
            for spot in INFOSETS
        },
    }


# ----------------------------------------------------------------------------------- evaluations
PERFECT = {"minimax": MINIMAX_GAMES, "best-response": BEST_RESPONSE_GAMES}  # their games only


def check(opponent: str, games: list[str], first_last: list[str], flag: str) -> None:
    """minimax and best-response play their own games only (`flag`: the games' flag); the best
    response reads the model's moves from the whole history, not the first/last format."""
    if other := [g for g in games if g not in PERFECT.get(opponent, games)]:
        raise UserError(
            f"{flag}: {opponent} plays {', '.join(PERFECT[opponent])} only, not {', '.join(other)}"
        )
    if opponent == "best-response" and first_last:
        shown = flag.replace("games", "first-last")
        raise UserError(
            "best-response reads the model's moves from the whole history: "
            f"drop {', '.join(first_last)} from {shown}"
        )


def player(opponent: str, rng: random.Random):
    """The player an evaluation plays: minimax, else the random legal player (best-response's
    matches are against it)."""
    return MinimaxPlayer(rng) if opponent == "minimax" else RandomPlayer(rng)


def readable(first_last, error_allowance: int) -> bool:
    """Whether an evaluation's KuhnPoker-v1 games hand the best reply the model's moves: shown with
    their whole history (the first/last format drops the bets kuhn_infoset reads) and played with
    no error allowance (an answer the game refused and asked again would read as a move lost)."""
    return not error_allowance and not set(BEST_RESPONSE_GAMES) & set(first_last)


def report(
    records: list[dict], opponent: str, rng: random.Random, every=False, samples: int = SAMPLES
) -> dict:
    """An evaluation's summary (summarize_matches) with the spots of its invalid moves (the
    coverage guard names them) and the exploitability of the model's play, read from its own moves
    in its KuhnPoker-v1 games alone: for best-response, and where `every` (--eval-every's, where
    `readable`) for any opponent whose games include KuhnPoker-v1."""
    spots = invalid_spots(records)
    played = "minimax" if opponent == "minimax" else "random"  # best-response's games: random's
    summary = summarize_matches(records) | {"opponent": played, "spots": spots}
    kuhn = [r for r in records if r["game"] in BEST_RESPONSE_GAMES]
    if opponent == "best-response" or (every and kuhn):
        pairs = [pair for r in kuhn for pair in r["moves"]]
        summary["best_response"] = exploitability(strategy_counts(pairs), rng, samples)
    return summary
