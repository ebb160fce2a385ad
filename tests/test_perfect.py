"""Tests of the perfect players (games/perfect.py) and `eval --opponent minimax|best-response`:
minimax on TicTacToe, the information sets of Kuhn Poker's deciding round read from real games, the
exact best response to hand-made strategies (worked out by hand), its bootstrap interval."""

from __future__ import annotations

import json
import random
import types
from fractions import Fraction

import stratagem as S
from games import perfect
from games.perfect import (
    INFOSETS,
    MinimaxPlayer,
    best_response,
    best_response_by_role,
    exploitability,
    kuhn_infoset,
    minimax_moves,
    strategy_counts,
)
from machinery import matches
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    error_of,
    no_process_left_behind,
    only_the_vllm_tests,
    run,
)


def board(rows: str) -> list[str]:
    """'OO.XX....' -> the game's 9 cells ("" for a free one)."""
    return ["" if c == "." else c for c in rows]


# ---- TicTacToe: minimax
def test_minimax_moves_score_is_a_draw_on_the_empty_board_and_exact_on_known_positions():
    def minimax_value(cells, to_move: str) -> int:  # win 1, draw 0, loss -1 under best play
        score = perfect._score(tuple(cells), to_move)
        return (score > 0) - (score < 0)

    assert minimax_value(board("........."), "O") == 0
    assert minimax_value(board("OO.XX...."), "O") == 1  # O completes the top row
    assert minimax_value(board("OO.XX...."), "X") == 1  # X completes the middle row
    assert minimax_value(board("X...O...."), "O") == 0
    # O's fork (0, 8 and 2 threaten 1 and 5): X to move cannot block both
    assert minimax_value(board("O.O.X...O"), "X") == -1
    assert minimax_value(board("OXOXOXXOX"), "O") == 0  # full, no line: a draw


def test_minimax_moves_take_a_win_in_one_and_block_a_loss_in_one():
    assert minimax_moves(board("OO.XX...."), "O") == [2]  # wins now, not after blocking 5
    assert minimax_moves(board("OO.XX...."), "X") == [5]
    assert minimax_moves(board("XX..O...."), "O") == [2]  # the only move that does not lose
    assert minimax_moves(board("........."), "O") == list(range(9))  # every first move draws


def test_MinimaxPlayer_never_loses_to_the_random_player_and_breaks_ties_by_its_rng():
    results, first_moves = [], set()
    for seed in range(20):
        env = S.make_env("TicTacToe-v0", seed, 0)
        seat = seed % 2
        players = {
            seat: MinimaxPlayer(random.Random(seed)),
            1 - seat: matches.RandomPlayer(random.Random(100 + seed)),
        }
        done, moves = False, []
        while not done:
            pid, obs = env.get_observation()
            move = players[pid].act([(env, pid, obs)])[0]
            moves.append(move)
            done, _ = env.step(move)
        if seat == 0:
            first_moves.add(moves[0])
        rewards, _ = env.close()
        results.append(rewards[seat])
    assert min(results) >= 0 and results.count(1) >= 15, results
    assert len(first_moves) > 1  # ties (every first move draws) broken by the seeded rng
    again = S.make_env("TicTacToe-v0", 0, 0)
    pid, obs = again.get_observation()
    assert [MinimaxPlayer(random.Random(3)).act([(again, pid, obs)]) for _ in range(2)] == [
        MinimaxPlayer(random.Random(3)).act([(again, pid, obs)])
    ] * 2
    assert MinimaxPlayer(random.Random(0)).name == "minimax"


# ---- Kuhn Poker: the deciding round's information sets, read from real games
def kuhn_spots(seed: int, pick, error_allowance: int = 0, first_last: bool = False):
    """A real KuhnPoker-v1 game, `pick(rng, legal moves, player)` choosing each move. Returns the
    (observation, true information set or None before the last round, round, player, move) of each
    turn."""
    env = S.make_env("KuhnPoker-v1", seed, error_allowance, first_last)
    rng, out, history, done = random.Random(seed), [], [], False
    while not done:
        pid, obs = env.get_observation()
        gs = env.state.game_state
        role = "opener" if pid == gs["opener"] else "responder"
        truth = f"{perfect.CARD[gs['cards'][pid]]}:{role}:{','.join(history)}"
        move, node = pick(rng, list(gs["tree"]), pid), gs["tree"]
        out.append((obs, truth if gs["round"] == 5 else None, gs["round"], pid, move))
        done, _ = env.step(move)
        if gs["round"] == 5 and gs["tree"] is not node:  # the game took the move
            history.append(move.strip("[]"))
    return out


def random_or_garbage(rng, legal, pid=None):
    return rng.choice([f"[{m}]" for m in legal] + ["I fold? no."])


def check_call(rng, legal, pid=None):
    return "[check]" if "check" in legal else "[call]"


def test_kuhn_infoset_reads_the_deciding_round_of_real_games():
    read = set()
    for seed in range(30):  # with a retry, a refused move is shown and skipped
        for obs, truth, *_ in kuhn_spots(seed, random_or_garbage, error_allowance=1):
            assert kuhn_infoset(obs) == truth, (seed, obs[-300:])
            read.add(truth)
    assert read - {None} == set(INFOSETS)  # all 12 spots
    spots = kuhn_spots(3, check_call)
    assert [(spot, r) for _, spot, r, *_ in spots if r == 5] == [
        ("K:opener:", 5),  # Player 1 opens the last round
        ("Q:responder:check", 5),
    ]
    assert kuhn_infoset(spots[0][0]) is None and spots[0][2] == 1
    assert kuhn_infoset("") is None and kuhn_infoset("Your card is: K") is None


def test_kuhn_infoset_reads_no_spot_wrong_in_the_first_last_format():
    for seed in range(10):
        for obs, truth, *_ in kuhn_spots(seed, random_or_garbage, first_last=True):
            assert kuhn_infoset(obs) in (None, truth)


def test_strategy_counts_counts_the_deciding_rounds_moves_and_invalid_ones():
    spots = kuhn_spots(3, check_call)
    opener = next(obs for obs, spot, *_ in spots if spot == "K:opener:")
    responder = next(obs for obs, spot, *_ in spots if spot == "Q:responder:check")
    first = spots[0][0]
    pairs = [
        (opener, "[Bet]"),
        (opener, "[bet]"),
        (opener, "[check] and more"),
        (opener, "[call]"),  # no bet to call: the game refuses it
        (opener, ""),  # no move read
        (responder, "[bet]"),
        (first, "[bet]"),  # round 1 decides nothing
    ]
    assert strategy_counts(pairs) == {
        "K:opener:": {"bet": 2, "check": 1, "invalid": 2},
        "Q:responder:check": {"bet": 1},
    }


# ---- Kuhn Poker: the exact best response
def always(first: str, facing_bet: str) -> dict:
    """A pure strategy: `first` where no bet is on the table, `facing_bet` where one is."""
    return {s: {facing_bet if s.endswith("bet") else first: 1} for s in INFOSETS}


def test_best_response_is_exact_on_hand_made_strategies():
    # Never folding: every round ends in a showdown, the higher card wins, 1/2 whatever is done.
    assert best_response_by_role(always("bet", "call")) == {"opener": 0.5, "responder": 0.5}
    assert best_response(always("check", "call")) == 0.5
    # Always folding to a bet: the best response bets and wins every game.
    assert best_response(always("check", "fold")) == 1.0
    assert best_response({s: {"invalid": 3} for s in INFOSETS}) == 1.0
    # Bet/call, but fold a Q to a bet as the responder. As opener the policy never folds: 1/2.
    # As responder, the best response opens: with K it wins (1); with Q, betting wins against the
    # policy's J (called, a showdown won) and loses to its K (1/2); with J, betting wins against
    # the folding Q and loses to K (1/2), checking loses to the policy's bet (0). (1 + 1/2 + 1/2)/3
    # = 2/3; over both roles (1/2 + 2/3)/2 = 7/12.
    q_folds = always("bet", "call") | {"Q:responder:bet": {"fold": 1}}
    by_role = best_response_by_role(q_folds)
    assert by_role["opener"] == 0.5 and abs(by_role["responder"] - 2 / 3) < 1e-12
    assert Fraction(best_response(q_folds)).limit_denominator(100) == Fraction(7, 12)
    # Unseen spots are uniform: a uniformly random player, whose best response is eval's ceiling
    # against it (matches.CEILINGS: 0.75 opening the round, 0.625 responding).
    assert best_response_by_role({}) == {"opener": 0.625, "responder": 0.75}
    assert best_response({}) == matches.CEILINGS["KuhnPoker-v1"]
    # Counts or shares, the same strategy; a move illegal at the spot is an invalid one.
    assert best_response({"Q:responder:bet": {"fold": 3, "call": 9}}) == best_response(
        {"Q:responder:bet": {"fold": 0.25, "call": 0.75}}
    )
    assert best_response({"K:opener:": {"fold": 1}}) == best_response({"K:opener:": {"invalid": 1}})


def test_best_response_never_falls_below_the_game_value():
    rng = random.Random(0)
    for _ in range(30):
        freqs = {s: {m: rng.random() for m in ("check", "bet", "fold", "call")} for s in INFOSETS}
        freqs = {
            s: {m: p for m, p in f.items() if (m in ("fold", "call")) == s.endswith("bet")}
            for s, f in freqs.items()
        }
        assert 0.5 - 1e-12 <= best_response(freqs) <= 1.0


def test_exploitability_interval_holds_the_point_and_shrinks_with_more_moves():
    counts = {s: {"bet": 4} if not s.endswith("bet") else {"call": 4} for s in INFOSETS[:-1]}
    counts |= {"Q:responder:bet": {"fold": 3, "call": 7}, "J:opener:": {"bet": 5, "check": 5}}
    few = exploitability(counts, random.Random(0), samples=300)
    many = exploitability(
        {s: {m: 10 * c for m, c in moves.items()} for s, moves in counts.items()},
        random.Random(0),
        samples=300,
    )
    assert few["win_rate"] == many["win_rate"] == best_response(counts)
    for r in (few, many):
        assert r["ci95"][0] <= r["win_rate"] <= r["ci95"][1]
        assert abs(r["exploitability"] - (r["win_rate"] - 0.5)) < 1e-12
    assert many["ci95"][1] - many["ci95"][0] < few["ci95"][1] - few["ci95"][0]
    assert few["n"] == 4 * 9 + 10 + 10 and few["infosets"]["Q:responder:bet"] == {
        "n": 10,
        "freq": {"fold": 0.3, "call": 0.7},
    }
    assert few["infosets"]["K:opener:check,bet"] == {"n": 0, "freq": {}}  # never reached
    assert json.loads(json.dumps(few)) == few  # JSON as it is
    assert exploitability(counts, random.Random(0), samples=300) == few  # seeded
    pure = exploitability(always("bet", "call"), random.Random(0), samples=50)
    assert pure["win_rate"] == 0.5 and pure["ci95"] == [0.5, 0.5]


# ---- eval --opponent minimax | best-response
def test_eval_refuses_other_games_for_minimax_and_best_response(tmp_path, capsys):
    out = tmp_path / "e.json"
    for given, said in [
        (
            ["--opponent", "minimax", "--games", "TicTacToe-v0,KuhnPoker-v1"],
            "--games: minimax plays TicTacToe-v0 only, not KuhnPoker-v1",
        ),
        (
            ["--opponent", "best-response", "--games", "TicTacToe-v0"],
            "--games: best-response plays KuhnPoker-v1 only, not TicTacToe-v0",
        ),
        (
            ["--opponent", "best-response", "--first-last", "KuhnPoker-v1"],
            "drop KuhnPoker-v1 from --first-last",
        ),
        (["--opponent", "perfect"], "use random, minimax, best-response, openai:MODEL"),
    ]:
        argv = ["eval", str(tmp_path / "no-model"), *given, "--json", str(out)]
        assert said in error_of(capsys, argv)
    assert not out.exists()


def fake_eval(monkeypatch, records_of):
    """eval with no model: play_matches replaced by `records_of(opponent, games)`."""
    from tools import eval as eval_tool

    monkeypatch.setattr(eval_tool, "load_model", lambda *a: (None, None))
    monkeypatch.setattr(eval_tool, "HFPolicy", lambda *a: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(
        eval_tool, "play_matches", lambda p, t, opponent, games, *a: records_of(opponent, games)
    )


def record(index: int, game: str, seat: int, moves=()) -> dict:
    return dict(
        index=index,
        game=game,
        seat=seat,
        turns=1,
        capped=False,
        outcome="win",
        invalid=False,
        opponent_invalid=False,
        reward=1.0,
        moves=[list(m) for m in moves],
    )


def test_eval_opponent_minimax_plays_TicTacToe_by_default(tmp_path, capsys, monkeypatch):
    def records_of(opponent, games):
        assert isinstance(opponent, MinimaxPlayer) and {g[0] for g in games} == {"TicTacToe-v0"}
        return [record(i, g[0], g[1]) for i, g in enumerate(games)]

    fake_eval(monkeypatch, records_of)
    out = tmp_path / "e.json"
    assert run(["eval", str(tmp_path / "m"), "--opponent", "minimax", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["opponent"] == "minimax" and result["best_response"] is None
    assert "model vs minimax" in capsys.readouterr().out


def test_eval_best_response_reports_the_models_deciding_round_play(tmp_path, capsys, monkeypatch):
    def records_of(opponent, games):
        assert isinstance(opponent, matches.RandomPlayer)
        assert {g[0] for g in games} == {"KuhnPoker-v1"}
        records = []
        for i, (game, seat, seed, _) in enumerate(games):  # the model bets or calls, in real games

            def pick(rng, legal, pid, seat=seat):
                if pid == seat:
                    return "[bet]" if "bet" in legal else "[call]"
                return random_or_garbage(rng, legal)

            turns = kuhn_spots(seed, pick)
            records.append(record(i, game, seat, [(t[0], t[4]) for t in turns if t[3] == seat]))
        return records

    fake_eval(monkeypatch, records_of)
    out = tmp_path / "e.json"
    argv = ["eval", str(tmp_path / "m"), "--opponent", "best-response", "--n", "4"]
    assert run([*argv, "--json", str(out)]) == 0
    best = json.loads(out.read_text())["best_response"]
    printed = capsys.readouterr().out
    assert best["n"] > 0 and "moves of the model): win rate" in printed
    # Where it was asked, the model bet or called: an unseen spot counts as uniform.
    seen = {s: c for s, c in best["infosets"].items() if c["n"]}
    assert all(set(c["freq"]) <= {"bet", "call"} for c in seen.values())
    want = best_response({s: c["freq"] for s, c in seen.items()})
    assert best["win_rate"] == want and best["ci95"] == [want, want]
    assert f"win rate {want:.3f} [{want:.3f}, {want:.3f}]" in printed
