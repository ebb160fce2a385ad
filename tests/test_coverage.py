"""Tests of machinery/coverage.py, the coverage guard: the decision spots read off real games' texts, a
step's shares and entropies, the warnings of a spot self-play stopped reaching and of an evaluation lost
by invalid moves, and plot's coverage figure, which skips a malformed value."""

from __future__ import annotations

import json
import math

import stratagem as S
from games.spots import spot
from machinery import coverage
from machinery.matches import summarize_matches
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    no_process_left_behind,
    only_the_vllm_tests,
)
from tools import plot

KUHN, TICTACTOE, NEGOTIATION = "KuhnPoker-v1", "TicTacToe-v0", "SimpleNegotiation-v1"


def played(game: str, moves: list[str], seed: int = 3, retries: int = 0, first_last=False):
    """The observation each move of `moves` was played on, in a real game."""
    env = S.make_env(game, seed, retries, first_last)
    seen = []
    for move in moves:
        seen.append(env.get_observation()[1])
        if env.step(move)[0]:
            break
    assert len(seen) == len(moves)
    return seen


def spots(game: str, observations: list[str]) -> list[str | None]:
    return [spot(game, o) for o in observations]


# ---- spot
def test_spot_of_kuhn_poker_is_the_card_and_the_round_s_betting_into_the_last_round():
    moves = ["[check]", "[bet]", "[call]", "[bet]", "[fold]", "[check]", "[check]", "[bet]"]
    moves += ["[call]", "[check]", "[bet]", "[fold]"]  # rounds 4 and 5
    seen = played(KUHN, moves)
    assert "Starting round 5 out of 5 rounds" in seen[-1]
    assert spots(KUHN, seen) == [
        "K",
        "Q check",
        "K check bet",
        "Q",
        "J bet",
        "Q",
        "J check",
        "Q",
        "J bet",
        "K",
        "Q check",
        "K check bet",
    ]


def test_spot_of_kuhn_poker_skips_a_rejected_move_and_needs_the_card():
    seen = played(KUHN, ["[check]", "[call]", "[bet]", "[raise]", "[call]"], retries=1)
    assert spots(KUHN, seen) == ["K", "Q check", "Q check", "K check bet", "K check bet"]
    assert spots(KUHN, played(KUHN, ["[check]", "[bet]"], first_last=True)) == [None, None]


def test_spot_of_tictactoe_is_the_move_number_in_both_formats():
    moves = ["[4]", "[4]", "[0]", "[8]", "[2]"]  # the second is rejected and retried
    for first_last in (False, True):
        seen = played(TICTACTOE, moves, seed=1, retries=1, first_last=first_last)
        assert spots(TICTACTOE, seen) == ["move 1", "move 2", "move 2", "move 3", "move 4"]


def test_spot_of_simple_negotiation_is_whether_an_offer_to_the_mover_stands():
    moves = ["Hello", "[Offer: 3 Wood -> 2 Gold]", "[Deny]", "[Offer: 1 Gold -> 1 Wood]", "talk"]
    moves += [
        "[Accept]",
        "[Offer: 2 Gold -> 1 Wood]",
        "so [Offer: 2 Gold -> 1 Wood] then",
        "[Accept]",
    ]
    seen = played(NEGOTIATION, moves + ["bye"], seed=1, retries=1)
    assert spots(NEGOTIATION, seen) == [
        "no offer",
        "no offer",
        "offer open",  # Player 1's offer to Player 0
        "no offer",  # Player 1's own offer stands, none to it
        "offer open",
        "no offer",  # Player 1 tried to accept the offer made to Player 0: rejected, retried
        "no offer",
        "offer open",  # a counter-offer replaces the offer
        "offer open",
        "no offer",  # accepted
    ]


def test_spot_of_an_untracked_game_or_an_unreadable_text_is_none():
    assert spot("LiarsDice-v1", played("LiarsDice-v1", ["[Bid: 1, 2]"])[0]) is None
    assert [spot(game, "hello") for game in (KUHN, TICTACTOE, NEGOTIATION)] == [None] * 3


# ---- of_step
def test_of_step_shares_entropy_and_turns_per_game_and_spot():
    kuhn = played(KUHN, ["[check]", "[bet]"])  # "K", "Q check"
    board = played(TICTACTOE, ["[4]"], seed=1)[0]  # "move 1"

    def trajectory(game, turns):
        return S.Trajectory(game, 0, [S.Turn(o, "", a, [], []) for o, a in turns], 0.0)

    trajectories = [
        trajectory(KUHN, [(kuhn[0], "[bet]"), (kuhn[1], "[bet]")]),
        trajectory(KUHN, [(kuhn[0], "[Check]"), (kuhn[1], " [Bet]\n")]),
        trajectory(KUHN, [(kuhn[0], "[BET]"), (kuhn[0], "[check]")]),
        trajectory(TICTACTOE, [(board, "[4]"), (board, "[4]"), (board, "")]),  # "": no move read
        trajectory("LiarsDice-v1", [(board, "[4]")]),  # not tracked
    ]
    out = coverage.of_step(trajectories, spot)
    assert out == {
        KUHN: {
            "K": {"share": 0.6667, "entropy": 1.0, "n": 4},  # bet twice, check twice
            "Q check": {"share": 0.3333, "entropy": 0.0, "n": 2},  # bet twice
        },
        TICTACTOE: {"move 1": {"share": 1.0, "entropy": 0.9183, "n": 3}},  # 2/3 and 1/3
    }
    assert list(out) == sorted(out) and json.loads(json.dumps(out)) == out
    assert coverage.of_step([], spot) == {} and coverage.entropy(coverage.Counter()) == 0.0
    assert math.isclose(coverage.entropy(coverage.Counter(a=1, b=1, c=1, d=1)), 2.0)


# ---- drops
def test_drops_fires_below_a_tenth_of_the_first_share_and_names_the_spot():
    first = {
        KUHN: {"K check": {"share": 0.2}, "Q": {"share": 0.5}, "J": {"share": 0.3}},
        TICTACTOE: {"move 1": {"share": 0.5}},  # not played now: no evidence, no line
        NEGOTIATION: {"offer open": {"share": 0.4}, "no offer": {"share": 0.6}},
    }
    now = {
        KUHN: {
            "K check": {"share": 0.02, "n": 20},
            "Q": {"share": 0.049, "n": 49},
            "J": {"share": 0.931, "n": 931},
        },
        NEGOTIATION: {"no offer": {"share": 1.0, "n": 25}},  # "offer open" absent: 0
    }
    assert coverage.drops(first, now) == [
        "coverage: KuhnPoker-v1 spot 'Q' fell to 0.049 of turns (0.5 at step 1): "
        "self-play stopped reaching it",
        "coverage: SimpleNegotiation-v1 spot 'offer open' fell to 0 of turns (0.4 at step 1): "
        "self-play stopped reaching it",
    ]  # 'K check' at exactly a tenth is not below it
    now = {KUHN: {"Q": {"share": 0.05, "n": 5}, "K check": {"share": 0.95, "n": 95}}}
    assert coverage.drops(first, now) == [
        "coverage: KuhnPoker-v1 spot 'J' fell to 0 of turns (0.3 at step 1): "
        "self-play stopped reaching it"
    ]
    assert coverage.drops({KUHN: {"K": "x", "Q": [1]}, TICTACTOE: 5}, {KUHN: {}}) == []


def test_drops_needs_the_evidence_of_ten_expected_turns():
    first = {KUHN: {"J": {"share": 0.3}, "Q": {"share": 0.7}}}
    # 0.3 of 33 turns is 9.9 expected at J: none there may be chance
    assert coverage.drops(first, {KUHN: {"Q": {"share": 1.0, "n": 33}}}) == []
    assert coverage.drops(first, {KUHN: {"Q": {"share": 1.0, "n": 34}}}) == [
        "coverage: KuhnPoker-v1 spot 'J' fell to 0 of turns (0.3 at step 1): "
        "self-play stopped reaching it"
    ]


# ---- invalid_warnings
def test_invalid_warnings_over_a_tenth_of_the_games_names_the_game_and_its_spots():
    def evaluation(invalid: int) -> dict:
        records = [
            {"game": KUHN, "seat": k % 2, "turns": 2, "outcome": "loss", "invalid": k < invalid}
            for k in range(100)
        ]
        return summarize_matches(records)

    assert coverage.invalid_warnings(evaluation(10)) == []  # 0.10 does not pass 0.10
    assert coverage.invalid_warnings(evaluation(11)) == [
        "evaluation: KuhnPoker-v1 lost 0.11 of its games by an invalid move (over 0.1)"
    ]
    where = {KUHN: {"Q check": 3, "K check": 7, "J": 1}}
    assert coverage.invalid_warnings(evaluation(11), where) == [
        "evaluation: KuhnPoker-v1 lost 0.11 of its games by an invalid move (over 0.1), "
        "at 'K check' (7), 'Q check' (3), 'J' (1)"
    ]
    many = {KUHN: {f"move {k}": 10 - k for k in range(1, 8)}}
    assert coverage.invalid_warnings(evaluation(11), many)[0].endswith(
        "'move 5' (5) and 2 more spots"
    )
    assert coverage.invalid_warnings({"games": {KUHN: {"both": 5}}}) == []


# ---- plot
def test_plot_draws_coverage_and_skips_a_coverage_value_of_the_wrong_shape(tmp_path, capsys):
    good = {KUHN: {"K": {"share": 0.75, "entropy": 1.0, "n": 3}, "Q": {"share": 0.25}}}
    lines = [
        {"step": 1, "coverage": good},
        {"step": 2, "coverage": 5},
        {"step": 3, "coverage": {KUHN: [1], TICTACTOE: "x"}},
        {"step": 4, "coverage": {KUHN: {"K": "x", "Q": {"share": "0.5", "entropy": None}}}},
        {"step": 5, "coverage": {KUHN: {"K": {"share": float("nan")}, "$\\frac{": {"share": 1}}}},
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert S.main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [(run, lines)]
    assert plot.coverage_series(runs) == {
        KUHN: {
            "K": {(0, "share"): [(1, 0.75)], (0, "entropy"): [(1, 1.0)]},
            "Q": {(0, "share"): [(1, 0.25)]},
            "$\\frac{": {(0, "share"): [(5, 1.0)]},
        }
    }
    capsys.readouterr()
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines[1:4]))
    assert S.main(["plot", str(run), "--out", str(tmp_path / "bad")]) == 0
    assert "coverage.png (self-play of a game whose spots are tracked)" in capsys.readouterr().out
