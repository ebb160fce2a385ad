"""Matches against a fixed opponent, for the evaluation (--eval-every and the `eval` command): SPIRAL's
random legal player, which reads the legal moves of any TextArena game off its text and tries them on a
copy of the game, and the statistics of a set of matches (rates with Wilson intervals, per game and seat).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import re
from dataclasses import dataclass


@dataclass
class EvalFlags:
    """The periodic evaluation against a fixed opponent and the kept best: stratagem.Args's evaluation flags."""

    # --- evaluation ---
    eval_every: int = 0
    """every N steps, play --eval-n games of each --eval-games id against a
    random legal player"""
    eval_games: str = (
        "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1,"  # the training games, then unseen ones
        "Snake-v0,PigDice-v0,ConnectFour-v0,Nim-v0,LiarsDice-v0"
    )
    """games of the periodic evaluation: the training games and
    out-of-distribution ones"""
    eval_n: int = 10
    """games per id and evaluation, the model taking each seat in turn"""
    eval_opponent: str = "random"
    """the evaluation's opponent: random (the random legal player), minimax
    (TicTacToe-v0 only) or best-response (KuhnPoker-v1 only: the random
    player, and the exploitability of the policy's play)"""
    eval_max_turns: int = 200
    """turn cap of an evaluation game (a capped game is a draw)"""
    keep_best: bool = False
    """with --eval-every: keep the policy of the best evaluation so far in
    <out>/best (self-play can drift away from a peak), evaluated again on
    fresh games at the end"""
    best_eval_n: int = 0
    """with --keep-best: games per id of the kept policy's fresh evaluation
    (0: 5 x --eval-n)"""
    eval_first_last: str = ""
    """--eval-games ids shown in SPIRAL's evaluation format, the first
    message and the latest one (SPIRAL's: TicTacToe-v0); the others show the
    whole history"""


def accepts(env, pid: int, action: str) -> bool:
    """Whether the game takes `action` from seat `pid` as a valid move, tried on a deep copy with no
    retries (global `random` restored, so a dice roll tried here does not change the real game). A move
    the game raises on (a number too long for int()) is not one it takes."""
    state = random.getstate()
    trial = copy.deepcopy(env)
    trial.state.error_allowance = 0
    try:
        trial.step(action)
    except Exception:  # noqa: BLE001 - whatever the game raises, it did not take the move
        return False
    finally:
        random.setstate(state)
    return not trial.state.game_info[pid].get("invalid_move")


_ROLE_TAG = re.compile(r"\[(GAME|Player \d+)\]")


def candidate_actions(observation: str) -> list[str]:
    """Every bracketed action the game's text shows ('[4]', '[col 4]', '[Bid: 3, 4]', '[roll]', ...), and
    each of them with its numbers (at most two) replaced by every value 0..15: a superset of the legal
    moves of TextArena's board, card and dice games, read off the text so any game id works."""
    shown = dict.fromkeys(
        m for m in re.findall(r"\[[^\[\]\n]{1,60}\]", observation) if not _ROLE_TAG.fullmatch(m)
    )
    out = dict.fromkeys(shown)
    for action in shown:
        numbers = list(re.finditer(r"\d+", action))
        if 1 <= len(numbers) <= 2:
            for values in itertools.product(range(16), repeat=len(numbers)):
                pieces, last = [], 0
                for m, v in zip(numbers, values):
                    pieces += [action[last : m.start()], str(v)]
                    last = m.end()
                out["".join(pieces) + action[last:]] = None
    return list(out)


def legal_actions(env, pid: int, observation: str) -> list[str]:
    """The candidates that the game accepts, each tried on a deep copy of it (global `random` restored,
    so trying a dice roll does not change the real game's dice)."""
    return [action for action in candidate_actions(observation) if accepts(env, pid, action)]


SMALL = 32  # candidate moves up to which every one is tried; above, a legal move is found by rejection sampling


def random_legal_move(
    env, pid: int, observation: str, rng: random.Random
) -> tuple[str, tuple[str, ...]]:
    """(a uniformly random legal move or "" if there is none, the legal moves or () where they were not enumerated).
    Up to SMALL candidates (TicTacToe, Kuhn Poker) every one is tried; with more (SimpleNegotiation's ~200 offers,
    Liar's Dice's bids) by rejection sampling: a uniform draw from the candidates, kept once the game accepts it, is
    uniform over the legal moves, in a trial or two instead of one per candidate (55 ms a move)."""
    candidates = candidate_actions(observation)
    if len(candidates) > SMALL:
        for _ in range(4 * len(candidates)):
            if accepts(env, pid, action := rng.choice(candidates)):
                return action, ()
    legal = tuple(
        legal_actions(env, pid, observation)
    )  # a small set, or (almost) nothing legal in a large one
    return (rng.choice(legal) if legal else ""), legal


# A game's highest win rate against the random legal player, in expectation over the two seats. KuhnPoker-v1: only
# its last round decides, and betting or calling whatever the card wins 0.75 as the opener and 0.625 as the
# responder (enumerated in the tests). A kept best above it was chosen on a lucky evaluation.
CEILINGS = {"KuhnPoker-v1": 0.6875}


class RandomPlayer:
    """SPIRAL's fixed opponent: a uniformly random legal action."""

    def __init__(self, rng: random.Random):
        self.rng, self.name = rng, "random"

    def act(self, jobs: list[tuple[object, int, str]]) -> list[str]:
        return [random_legal_move(env, pid, obs, self.rng)[0] for env, pid, obs in jobs]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k/n (sound at small n and at 0 or n successes)."""
    if n == 0:
        return 0.0, 1.0
    p, denom = k / n, 1 + z * z / n
    centre, half = (
        (p + z * z / (2 * n)) / denom,
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom,
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize_matches(records: list[dict]) -> dict:
    """Per game and seat (and 'both'): n, counts and rates with 95 % intervals of win/draw/loss, of the
    games the model lost on an invalid move (invalid, among its losses) and of those the opponent lost on
    one (opponent_invalid, among the model's wins: a win the model did not play for). Each record's outcome
    is stratagem.settle's, as in training."""
    table: dict = {}
    for game in dict.fromkeys(r["game"] for r in records):
        for seat in ("seat0", "seat1", "both"):
            rows = [
                r
                for r in records
                if r["game"] == game and (seat == "both" or f"seat{r['seat']}" == seat)
            ]
            cell = {
                "n": len(rows),
                "turns_mean": sum(r["turns"] for r in rows) / len(rows) if rows else 0.0,
            }
            for key in ("win", "draw", "loss", "invalid", "opponent_invalid"):
                k = sum(bool(r.get(key)) if "invalid" in key else r["outcome"] == key for r in rows)
                cell[key] = {
                    "count": k,
                    "rate": k / len(rows) if rows else 0.0,
                    "ci95": wilson(k, len(rows)),
                }
            table.setdefault(game, {})[seat] = cell
    wins = sum(r["outcome"] == "win" for r in records)
    return {
        "games": table,
        "n": len(records),
        "win_rate": wins / len(records) if records else 0.0,
        "win_ci95": wilson(wins, len(records)),
    }
