"""Tests of SPIRAL's games (games/), as SPIRAL's code plays them: the rules by hand, the recorded games replayed
word for word, SPIRAL's action rule and move lists, and its payouts in training and in evaluation."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import stratagem as S
from games import check_ids
from machinery import matches, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    ScriptedPolicy,
    error_of,
    first_free,
    fresh,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    self_play,
    tiny_fixture,
)


# ---- SPIRAL's games, played as SPIRAL's code plays them
def test_make_env_sets_the_games_up_as_spiral_does():
    """SPIRAL's training set by default: TextArena's TicTacToe-v0 and SPIRAL's own KuhnPoker-v1 and
    SimpleNegotiation-v1 (games/spiral.py), each with the observation wrapper SPIRAL gives it."""
    from textarena.envs.registration import ENV_REGISTRY
    from textarena.wrappers import LLMObservationWrapper

    assert S.Args().games == "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    assert check_ids(S.Args().games) == ["TicTacToe-v0", "KuhnPoker-v1", "SimpleNegotiation-v1"]
    assert check_ids(
        "KuhnPoker-v0-short,PigDice-v1,LiarsDice-v1,TruthAndDeception-v1"
    )  # TextArena's stay
    assert ENV_REGISTRY["KuhnPoker-v1"].kwargs == {"ante": 1, "max_rounds": 5}
    assert ENV_REGISTRY["SimpleNegotiation-v1"].kwargs == {"max_turns": 10}
    for gid in ("TicTacToe-v0", "KuhnPoker-v1", "SimpleNegotiation-v1"):
        assert isinstance(
            S.make_env(gid, 3, 0), LLMObservationWrapper
        )  # the whole exchange (SPIRAL's training)
    ttt = S.make_env(
        "TicTacToe-v0", 3, 0, first_last=True
    )  # SPIRAL's evaluation format: the current board only
    for move in ("[4]", "[0]"):
        ttt.step(move)
    pid, obs = ttt.get_observation()
    assert obs.count("Current Board") == 1 and " X | 1 | 2 " in obs and " 3 | O | 5 " in obs
    assert obs.startswith("You are Player 0 in Tic Tac Toe") and obs.endswith("Next Action:")
    neg = S.make_env("SimpleNegotiation-v0", 3, 0)  # the opponent's own words are shown
    neg.step("Let us trade, friend. [Offer: 1 Wheat -> 1 Wood]")
    pid, obs = neg.get_observation()
    assert pid == 1 and "[Player 0] Let us trade, friend." in obs


CARD = "JQK"


# What SPIRAL's spiral/envs/KuhnPoker/env.py shows Player 1 before its first move (LLMObservationWrapper).
KUHN_OPENING = (
    "\n[GAME] You are Player 1 in a 5 round game of Kuhn Poker.\nGame Rules:\n"
    "- Kuhn Poker uses a 3-card deck with J, Q, K (J lowest, K highest)\n"
    "- Each player antes 1 chip and receives 1 card each round\n- Game continues for 5 rounds\n"
    "- The player with the most chips after all rounds wins\n\nAction Rules:\n"
    "- '[check]': Pass without betting (only if no bet is on the table)\n"
    "- '[bet]': Add 1 chip to the pot (only if no bet is on the table)\n"
    "- '[call]': Match an opponent's bet by adding 1 chip to the pot\n"
    "- '[fold]': Surrender your hand and let your opponent win the pot\n\n"
    "\n[GAME] Starting round 1 out of 5 rounds.\nYour card is: {card}\nYour available actions are: [check], [bet]"
)


def test_KuhnPokerV1_is_spirals_the_last_round_decides_the_game():
    """SPIRAL's rules by hand: Player 1 opens round 1, the opener alternates, a fold gives the pot to the
    bettor, a showdown to the higher card, every round moves one chip each way (ante 1, pot 2), and the
    winner of round 5 wins the game even when the chips say otherwise (TextArena's KuhnPoker-v0-short
    counts chips and can draw)."""
    env = S.make_env("KuhnPoker-v1", 5, 0)
    script = [  # (round, opener, moves, winner by hand: None = the higher card)
        (1, 1, ["[check]", "[bet]", "[fold]"], 0),
        (2, 0, ["[bet]", "[fold]"], 0),
        (3, 1, ["[check]", "[check]"], None),
        (4, 0, ["[bet]", "[call]"], None),
        (5, 1, ["[bet]", "[fold]"], 1),
    ]
    chips, seen = {0: 0, 1: 0}, []
    for rnd, opener, moves, winner in script:
        for k, move in enumerate(moves):
            pid, obs = env.get_observation()
            cards = dict(env.state.game_state["cards"])
            assert pid == (opener if k % 2 == 0 else 1 - opener), (rnd, k)
            seen.append(obs)
            done, _ = env.step(move)
        winner = winner if winner is not None else max((0, 1), key=lambda p: cards[p])
        chips[winner], chips[1 - winner] = chips[winner] + 1, chips[1 - winner] - 1
        assert done == (rnd == 5)
    assert seen[0] == KUHN_OPENING.format(
        card=CARD[S.make_env("KuhnPoker-v1", 5, 0).state.game_state["cards"][1]]
    )
    assert (
        seen[1].count("Starting round 1 out of 5 rounds.") == 1
    )  # once, for the second player too
    assert seen[1].endswith(
        "\n\n[Player 1] [check]\n[GAME] Your available actions are: [check], [bet]"
    )
    assert (
        "[GAME] Player 1 has folded." in seen[3]
        and "[GAME] Starting round 2 out of 5 rounds." in seen[3]
    )
    assert (
        env.state.game_state["chips"] == chips and chips[0] > chips[1]
    )  # Player 0 is ahead on chips ...
    rewards, info = env.close()
    assert (
        rewards == {0: -1, 1: 1} and not info[1]["invalid_move"]
    )  # ... and loses: round 5 decides
    showdown = S.make_env("KuhnPoker-v1", 5, 0)
    for move in ["[check]", "[bet]", "[fold]", "[bet]", "[fold]", "[check]"]:
        showdown.get_observation()
        showdown.step(move)
    c = showdown.state.game_state["cards"]
    w = 0 if c[0] > c[1] else 1
    showdown.get_observation()
    showdown.step("[check]")
    after = showdown.get_observation()[1]
    assert (
        f"[GAME] Cards: Player 0 had {CARD[c[0]]}, Player 1 had {CARD[c[1]]}\n[GAME] Showdown: Player {w}'s "
        f"{CARD[max(c.values())]} beats Player {1 - w}'s {CARD[min(c.values())]}. Player {w} wins pot of 2 chips."
    ) in after
    for bad in ("[raise]", "[call]"):  # not a move; a call with no bet on the table
        env = S.make_env("KuhnPoker-v1", 5, 0)
        env.get_observation()
        assert env.step(bad)[0] and env.close()[1][1]["invalid_move"]


NEGOTIATION_OPENING = (
    "\n[GAME] You are Player 0 in the Negotiation Game.\nYou have some resources, and your task is to trade such "
    "that the total value of your resources increases.\nThe resources and associated values you currently have are:"
    "\n\t+ [Wood]    Qty: 10   Value: 5\n\t+ [Gold]    Qty: 10   Value: 15\nAt each turn, you can talk to your "
    "opponent or make a trade offer.\nUse the following special tokens for actions:\n  - [Offer]: To make a trade "
    "offer.\n    Format: [Offer: Offered Resources -> Requested Resources]\n    Example: [Offer: 3 Wood -> 2 Gold]\n"
    "  - [Accept]: To accept an incoming offer.\n  - [Deny]: To deny an incoming offer (default).\nYOU CAN INCLUDE "
    'ADDITIONAL TEXT BEFORE AND/OR AFTER THESE TOKENS.\n    Example: "I\'m open to negotiation."\n'
    "The game lasts for 10 turns in total.\n"
)


def test_SimpleNegotiationV1_is_spirals_fixed_goods_ten_moves_value_gains():
    """SPIRAL's fork by hand: 10 Wood and 10 Gold each, Player 0 values them 5 and 15, Player 1 15 and 5. Player 0
    gives 3 Wood for 2 Gold: +2*15 - 3*5 = +15 for it, +3*15 - 2*5 = +35 for Player 1, who wins after the 10th
    move (TextArena 0.7.4's SimpleNegotiation-v0 lasts 11)."""
    env = S.make_env("SimpleNegotiation-v1", 5, 0)
    moves = ["Let us trade. [Offer: 3 Wood -> 2 Gold]", "Deal. [Accept]"] + [
        "I am happy as I am."
    ] * 8
    seen = []
    for k, move in enumerate(moves):
        pid, obs = env.get_observation()
        assert pid == k % 2
        seen.append(obs)
        done, _ = env.step(move)
        assert done == (k == 9), k
    assert seen[0] == NEGOTIATION_OPENING
    assert seen[1].endswith(
        "\n[Player 0] Let us trade. [Offer: 3 Wood -> 2 Gold]\n[GAME] Player 0 made the following "
        "offer to Player 1: Offered items: 3 Wood -> Requested items: 2 Gold"
    )
    assert "[GAME] Player 1 accepted the trade offer from Player 0." in seen[2]
    assert env.state.game_state["resources"] == {
        0: {"Wood": 7, "Gold": 12},
        1: {"Wood": 13, "Gold": 8},
    }
    assert env.close()[0] == {0: -1, 1: 1}
    quiet = S.make_env("SimpleNegotiation-v1", 5, 0)  # no trade: equal gains, a draw
    assert [quiet.step("Hello.")[0] for _ in range(10)] == [False] * 9 + [True] and quiet.close()[
        0
    ] == {0: 0, 1: 0}
    for opening, then in [
        ("[Offer: 11 Wood -> 1 Gold]", None),  # more than it holds
        ("[Offer: lots of wood]", None),  # an offer that does not read
        ("[Offer: 1 Wood -> 1 Gold]", ["Hmm.", "[Accept]"]),
    ]:  # accepting its own offer
        env = S.make_env("SimpleNegotiation-v1", 5, 0)
        for move in [opening] + (then or []):
            done, _ = env.step(move)
        assert done and env.close()[1][0]["invalid_move"], (
            opening
        )  # Player 0 is the offender each time
    from games import spiral

    assert spiral.SimpleNegotiationV1.parse_offer("I give 2 wood and 1 Golds -> 3 gold.") == (
        {"Wood": 2, "Gold": 1},
        {"Gold": 3},
    )


# SPIRAL's own patterns, which backtrack super-linearly on runs of blanks; ours must read what they read.
SPIRAL_OFFER = r"\[Offer:\s*(?:I\s+(?:give|offer)\s+)?([^\[\]]+?)\s*\.*\]"
SPIRAL_BID = r"\[bid\s*:?\s*(\d{1,100})[,\s]+(\d{1,100})\]"
SPIRAL_SEAT = r"\s*(?:player\s*)?\[?\s*(\d{1,100})\s*\]?\s*"
SPIRAL_BOX = r"\\boxed\{([^}]*)\}"
PIECES = [
    " ",
    "  ",
    "\n",
    "\xa0",
    "\u2028",
    ".",
    "..",
    ",",
    "I",
    "i",
    "give",
    "Offer",
    "offer",
    "[",
    "]",
]
PIECES += [
    "[Offer:",
    "[offer:",
    "[bid",
    "bid",
    ":",
    "3",
    "12",
    "Wood",
    "->",
    "player",
    "\\boxed{",
    "}",
    "{",
]


def test_offer_terms_and_the_bid_seat_and_inner_box_patterns_read_every_text_as_spirals_own():
    """20,000 short random texts from the pieces of these patterns: the offer's terms, the bid, the vote's seat
    and the inner boxes come out exactly as SPIRAL's patterns give them."""
    import re

    from games import actions, spiral, spy

    neg = spiral.SimpleNegotiationV1
    offer, bid = re.compile(SPIRAL_OFFER, re.I | re.S), re.compile(SPIRAL_BID, re.I)
    seat, box = re.compile(SPIRAL_SEAT, re.I), re.compile(SPIRAL_BOX)
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10)))
        theirs, ours = offer.search(text), neg.OFFER.search(text)
        assert (theirs and theirs.group(1)) == (ours and neg.offer_terms(ours.group(1))), text
        theirs, ours = bid.search(text), spiral.LiarsDiceV1.BID.search(text)
        assert (theirs and theirs.groups()) == (ours and ours.groups()), text
        theirs, ours = seat.fullmatch(text), spy._SEAT.fullmatch(text)
        assert (theirs and theirs.group(1)) == (ours and ours.group(1)), text
        assert actions.inner_boxes(text) == box.sub(lambda m: f"[{m.group(1)}]", text), text
        words = " ".join(text.split()).rstrip(".,!?")
        assert words == re.sub(r"[.,!?]+$", "", " ".join(text.split())), text


def test_offer_terms_and_the_move_and_vote_patterns_read_a_million_blanks_in_linear_time():
    """SPIRAL's patterns take minutes on 5,000 blanks after "[Offer:" (cubic) and hours on a million after
    "[bid" or in a vote's box (quadratic); ours read each character a bounded number of times. Run in a child,
    so that a super-linear pattern fails by the child's generous limit rather than hanging the suite."""
    code = (
        "from games import actions, spiral, spy\n"
        "neg, blanks = spiral.SimpleNegotiationV1, ' ' * 1_000_000\n"
        "bid = spiral.LiarsDiceV1.BID.search('[bid' + blanks + ':1,')\n"
        "print(neg.OFFER.search('[Offer:' + blanks), bid)\n"
        "inside = neg.OFFER.search('[Offer: I give' + blanks + '3 Wood -> 1 Gold' + '.' * 10**6 + ']')[1]\n"
        "terms = neg.offer_terms(inside)\n"
        "print(repr(terms), neg.parse_offer(terms), neg.parse_offer('3 Wood' + '.' * 10**6 + 'x'))\n"
        "print(spy._SEAT.fullmatch(blanks + 'x'), spy._SEAT.fullmatch('player' + blanks + '[' + blanks + 'x'))\n"
        "print(actions.spiral_action('\\\\boxed{' * 200_000, ['[check]']) == actions.INVALID_ACTION)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=600
    )
    assert proc.stdout == (
        "None None\n'3 Wood -> 1 Gold' ({'Wood': 3}, {'Gold': 1}) None\nNone None\nTrue\n"
    ), proc.stderr[-2000:]


def test_SimpleNegotiationV1_accepting_an_offer_one_cannot_pay_is_an_invalid_move_that_loses():
    env = S.make_env("SimpleNegotiation-v1", 0, 0)
    assert not env.step("[Offer: 1 Wood -> 11 Gold]")[0]  # Player 1 holds 10 Gold
    assert env.step("I agree. [Accept]")[0]
    rewards, info = env.close()
    assert (
        info[1]["invalid_move"] and not info[0]["invalid_move"] and rewards == {0: 0, 1: -1}
    )  # 0.6.4's payout
    assert env.state.game_state["resources"] == {p: {"Wood": 10, "Gold": 10} for p in (0, 1)}


def scripted_dice(monkeypatch, rolls: list[int]):
    from games import spiral

    rolls = iter(rolls)
    monkeypatch.setattr(spiral.random, "randint", lambda a, b: next(rolls))


def test_PigDiceV1_is_spirals(monkeypatch):
    """SPIRAL's fork with a scripted die: a 1 loses the turn total and passes the die; at a turn's end the
    target decides, or, at the turn limit, the higher score."""
    import textarena as ta

    scripted_dice(monkeypatch, [1, 4, 6, 5])
    env = ta.make("PigDice-v1", winning_score=10, max_turns=4)
    env.reset(num_players=2, seed=0)
    seen = []
    for pid, move in [(0, "[roll]"), (1, "[r]"), (1, "[hold]"), (0, "[roll]"), (0, "[roll]")]:
        seen.append(env.get_observation())
        assert seen[-1][0] == pid and not env.step(move)[0]
    assert seen[1][1].endswith(
        "\n[Player 0] [roll]\n[GAME] Player 0 rolls a 1.\n[GAME] Player 0 busted! Lost all points for this turn.\n"
        "[GAME] Player 1's turn\n\nPlayer 0 score: 0\nPlayer 1 score: 0\n\nCurrent turn total: 0\n"
        "[GAME] Available actions: '[roll]' or '[hold]'"
    )
    assert env.get_observation()[0] == 0 and env.step("[h]")[0]  # 6 + 5 = 11 >= 10
    assert env.close()[0] == {0: 1, 1: -1} and env.state.game_state["scores"] == [11, 4]
    scripted_dice(monkeypatch, [3, 2])
    env = ta.make("PigDice-v1", winning_score=10, max_turns=2)
    env.reset(num_players=2, seed=0)
    assert [env.step(m)[0] for m in ("[roll]", "[hold]", "[roll]", "[hold]")] == [
        False,
        False,
        False,
        True,
    ]
    assert (
        env.close() == ({0: 1, 1: -1}, env.state.game_info)
        and "at the turn limit ([3, 2])" in env.state.game_info[0]["reason"]
    )
    env = S.make_env("PigDice-v1", 0, 0)
    assert env.step("[jump]")[0] and env.close()[1][0]["invalid_move"]


def test_PigDiceV1_banking_exactly_the_winning_score_wins(monkeypatch):
    import textarena as ta

    scripted_dice(monkeypatch, [6] * 8 + [2])  # 8 x 6 + 2 = 50, SPIRAL's winning score
    env = ta.make("PigDice-v1")
    env.reset(num_players=2, seed=0)
    assert not any(env.step("[roll]")[0] for _ in range(9))
    assert env.step("[hold]")[0]
    assert env.close()[0] == {0: 1, 1: -1} and env.state.game_state["scores"] == [50, 0]


def test_LiarsDiceV1_is_spirals():
    """SPIRAL's fork with dice set by hand: a call against a bid that the dice do not meet costs the bidder a
    die, and the loser opens the next round; the last die lost ends the game; a bid must raise the last."""
    env = S.make_env("LiarsDice-v1", 0, 0)
    env.state.game_state["dice"] = {0: [2, 2, 3, 4, 5], 1: [2, 6, 6, 1, 1]}  # three 2s
    assert not env.step("[Bid: 4, 2]")[0] and not env.step("I doubt it. [Call]")[0]
    pid, obs = env.get_observation()
    assert pid == 0 and env.state.game_state["dice_left"] == {0: 4, 1: 5}
    assert (
        "[GAME] Player 1 calls! The actual count of face 2 is 3, which is LESS than 4.\nPlayer 0 (the last bidder) "
        "loses one die."
    ) in obs and obs.endswith(
        "\nRemaining dice:\nPlayer 0: 4\nPlayer 1: 5\n[GAME] Player 0 starts the new round."
    )
    env.state.game_state.update(dice={0: [6, 6, 6, 6], 1: [6]}, dice_left={0: 4, 1: 1})
    assert (
        not env.step("[Bid: 5, 6]")[0] and env.step("[Call]")[0]
    )  # five 6s: the caller loses its last die
    assert env.close()[0] == {0: 1, 1: -1}
    from games import spiral

    problem = spiral.LiarsDiceV1.bid_problem
    assert (
        problem(3, 1, (3, 2), 10) == "With same quantity, face value must be higher than current 2."
    )
    assert problem(2, 6, (3, 2), 10) == "New quantity 2 is lower than current 3."
    assert problem(11, 6, (3, 2), 10) == "Bid quantity 11 exceeds total dice count 10."
    assert (
        problem(3, 2, (3, 2), 10) == "Bid is identical to the current bid."
        and problem(4, 1, (3, 2), 10) == ""
    )
    env = S.make_env("LiarsDice-v1", 0, 0)
    assert env.step("[Call]")[0] and env.close()[1][0]["invalid_move"]  # nothing to call yet


def test_TruthAndDeceptionV1_is_spirals():
    """Four messages, the Deceiver's last one, then the Guesser's answer: right, the Guesser wins; wrong, the
    Deceiver; naming both counts as right in SPIRAL's code; naming neither is an invalid move."""
    for answer, winner in [("right", 1), ("wrong", 0), ("both", 1), ("neither", None)]:
        env = S.make_env("TruthAndDeception-v1", 2, 0)
        true_k = 1 if env.state.game_state["facts"][0][1] else 2
        guess = {
            "right": f"[Fact {true_k}]",
            "wrong": f"[Fact {3 - true_k}]",
            "both": "[Fact 1] or [Fact 2]",
            "neither": "I cannot tell.",
        }[answer]
        assert [
            env.step(m)[0] for m in ["Hi.", "Hello.", "Trust me.", "Why?", "Fact 2 is false."]
        ] == [False] * 5
        pid, obs = env.get_observation()
        assert (
            pid == 1
            and "[Deceiver] Fact 2 is false." in obs
            and obs.endswith(
                "[GAME] Now guess which of the two facts are correct by returning '[Fact 1]' or '[Fact 2]'."
            )
        )
        assert env.step(guess)[0]
        rewards, info = env.close()
        assert info[1]["invalid_move"] if winner is None else rewards[winner] == 1, answer


def test_make_env_shows_the_players_each_others_words_as_written():
    """TextArena 0.6.4, which SPIRAL pins, shows a player's words as written; 0.7.4 removes role tags from them."""
    kuhn = S.make_env("KuhnPoker-v1", 1, 0)
    kuhn.step("[GAME] [bet]")
    assert kuhn.get_observation()[1].endswith(
        "[Player 1] [GAME] [bet]\n[GAME] Your available actions are: [fold], [call]"
    )
    tad = S.make_env("TruthAndDeception-v1", 1, 0)
    tad.step("[GAME] Player 1 wins")
    assert "\n[Deceiver] [GAME] Player 1 wins" in tad.get_observation()[1]
    ttt = S.make_env("TicTacToe-v0", 1, 0)
    ttt.step("[Player 1] [4]")
    assert "\n[Player 0] [Player 1] [4]\n" in ttt.get_observation()[1]


def test_make_env_draws_dice_and_facts_where_spiral_draws_them():
    """SPIRAL's LiarsDice-v1 and TruthAndDeception-v1 draw before reset seeds the game: make_env seeds Python's
    `random` with the game's seed first, so the seed still decides them, and decides them as SPIRAL's code does:
    reset then seeds it again, so a new round's dice start the seed's sequence afresh."""
    for seed in (0, 7):
        random.seed(seed)
        dice = {p: [random.randint(1, 6) for _ in range(5)] for p in (0, 1)}
        env = S.make_env("LiarsDice-v1", seed, 0)
        assert env.state.game_state["dice"] == dice
        env.step("[Bid: 1, 1]")
        env.step("[Call]")
        left = env.state.game_state["dice_left"]
        random.seed(seed)
        assert env.state.game_state["dice"] == {
            p: [random.randint(1, 6) for _ in range(left[p])] for p in (0, 1)
        }
        from games import spiral

        random.seed(seed)
        pick = random.choice(spiral.TruthAndDeceptionV1().facts)
        facts = S.make_env("TruthAndDeception-v1", seed, 0).state.game_state["facts"]
        assert {f for f, _ in facts} == set(pick["facts"].values())


def test_make_env_tictactoe_shows_the_whole_history_in_training_and_first_last_on_request(tiny):
    """SPIRAL's training default (use_llm_obs_wrapper=True) shows every board; its evaluation of TicTacToe shows the
    rules and the latest board (FirstLastObservationWrapper), which eval and --eval-first-last can ask for. A bare
    "4" is not a move (SPIRAL's env has no action-formatting wrapper)."""
    _, tok = fresh(tiny)
    policy = ScriptedPolicy(first_free)
    self_play(
        policy,
        tok,
        S.Args(tiny=True, batch_size=3, num_envs=1),
        ["TicTacToe-v0"],
        random.Random(0),
        watch.Timer(),
        {},
        3,
    )
    ttt = S.make_env("TicTacToe-v0", 1, 0)
    ttt.step("[4]")
    ttt.step("[0]")
    obs = ttt.get_observation()[1]
    assert obs.count("Current Board:") == 3 and obs.startswith(
        "\n[GAME] You are Player 0 in Tic Tac Toe"
    )
    short = S.make_env("TicTacToe-v0", 1, 0, first_last=True)
    short.step("[4]")
    short.step("[0]")
    obs = short.get_observation()[1]
    assert (
        obs.count("Current Board:") == 1 and obs.endswith("Next Action:") and " X | 1 | 2 " in obs
    )
    bare = S.make_env("TicTacToe-v0", 1, 0)
    assert bare.step("4")[0] and bare.close()[0] == {0: -1, 1: 0}
    assert S.Args().eval_first_last == ""


# ---- SPIRAL's recorded games, replayed word for word
def spiral_vectors() -> tuple[Path | None, str]:
    """The games recorded from SPIRAL's own environments: the folder $STRATAGEM_SPIRAL_VECTORS names, else
    ../shared/spiral-vectors beside the repository, else the copy committed in testdata/spiral-vectors (a clean
    clone has no ../shared). Returns the folder (None: none there) and a line that says which it is."""
    if os.environ.get("STRATAGEM_SPIRAL_VECTORS"):
        folder = Path(os.environ["STRATAGEM_SPIRAL_VECTORS"])
        return (
            (folder, "")
            if folder.is_dir()
            else (None, f"$STRATAGEM_SPIRAL_VECTORS={folder} is not a folder")
        )
    shared = HERE.parent / "shared" / "spiral-vectors"
    if shared.is_dir():
        return shared, ""
    copy = HERE / "testdata" / "spiral-vectors"
    if copy.is_dir():
        return copy, f"{shared} is absent: replaying the copy committed in testdata/spiral-vectors"
    return None, f"no recorded SPIRAL games: {shared} and testdata/spiral-vectors are both absent"


SPIRAL_VECTORS, SPIRAL_VECTORS_NOTE = spiral_vectors()


VECTOR_FILES = sorted(SPIRAL_VECTORS.glob("*.jsonl*")) if SPIRAL_VECTORS else []


def read_vectors(path: Path) -> list[dict]:
    import gzip

    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def vector_game_id(path: Path) -> str:
    """The game id a file of recorded games is for: the longest registered id its name starts with
    ("TicTacToe-v0.jsonl", "KuhnPoker-v1-seed7.jsonl.gz")."""
    from textarena.envs.registration import ENV_REGISTRY

    known = [gid for gid in ENV_REGISTRY if path.name.startswith(gid)]
    assert known, f"{path.name}: no game id of this project starts its name"
    return max(known, key=len)


def replay_vector(game_id: str, game: dict) -> str:
    """Plays a recorded game through make_env as training builds it (error allowance 0, as the recording's README
    says) and returns the first difference ("" when there is none): per turn the player to move, the observation
    with whitespace collapsed and the done flag; per game the number of moves, the ending and the env's rewards."""
    env = S.make_env(game_id, game["seed"], 0)
    done = False
    for k, turn in enumerate(game["turns"]):
        pid, obs = env.get_observation()
        if pid != turn["pid"]:
            return f"move {k}: Player {pid} to move, SPIRAL's Player {turn['pid']}"
        ours, theirs = " ".join(obs.split()), turn["obs"]
        if ours != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)),
            )
            lo = max(0, at - 60)
            ours, theirs = ours[lo : at + 60], theirs[lo : at + 60]
            return f"move {k}: observation differs at {at}: ours {ours!r}, SPIRAL's {theirs!r}"
        done, _ = env.step(turn["act"])
        if done != turn["done"]:
            return f"move {k} ({turn['act']!r}): done {done}, SPIRAL's {turn['done']}"
    moves = game.get("t", len(game["turns"]))  # a hand-written script that ran out records no count
    if len(game["turns"]) != moves or done != (game["end"] == "done"):
        return f"{len(game['turns'])} moves ending {'done' if done else 'open'}; SPIRAL's {moves} ending {game['end']}"
    if done:
        rewards, info = env.close()
        if {str(p): r for p, r in rewards.items()} != game["rewards"]:
            return f"rewards {rewards}, SPIRAL's {game['rewards']}"
        if "invalid" in game and any(info[p]["invalid_move"] for p in (0, 1)) != game["invalid"]:
            return f"ended on an invalid move: {not game['invalid']}, SPIRAL's {game['invalid']}"
    return ""


@pytest.mark.parametrize("path", VECTOR_FILES or [None], ids=lambda p: p.name if p else "absent")
def test_make_env_replays_spirals_recorded_games_word_for_word(path):
    """Every game recorded from SPIRAL's own environments (spiral/envs under TextArena 0.6.4, the whole history,
    no retry) plays the same here: the same player to move, the same observation, the same done flag at every
    move, the same ending and env rewards. Every file of the folder is replayed, whatever seeds it holds."""
    if path is None:
        pytest.skip(SPIRAL_VECTORS_NOTE)
    if SPIRAL_VECTORS_NOTE:
        import warnings

        warnings.warn(SPIRAL_VECTORS_NOTE, stacklevel=1)
    game_id = vector_game_id(path)
    games = read_vectors(path)
    differences = [
        f"game {g['g']} (seed {g['seed']}, {g['mode']}): {d}"
        for g in games
        if (d := replay_vector(game_id, g))
    ]
    assert games and not differences, f"{len(differences)} of {len(games)} differ:\n" + "\n".join(
        differences[:5]
    )


def test_games_recorded_copy_in_testdata_is_the_shared_one():
    """testdata/spiral-vectors is a copy of ../shared/spiral-vectors for clean clones, game for game."""
    shared = HERE.parent / "shared" / "spiral-vectors"
    if not shared.is_dir():
        pytest.skip(f"{shared} is absent: nothing to compare the committed copy with")
    for path in sorted(shared.glob("*.jsonl")):
        assert read_vectors(
            HERE / "testdata" / "spiral-vectors" / f"{path.name}.gz"
        ) == read_vectors(path), path.name


# ---- SPIRAL's action rule and move lists
CHECK_BET = ["[check]", "[bet]"]


NEGOTIATION = [
    "[Offer: 3 Wood -> 2 Gold]",
    "Let me think about what would be a fair trade.",
    "I'm open to negotiation.",
]


@pytest.mark.parametrize(
    "response, legal, move",
    [
        ("\\boxed{check}", CHECK_BET, "[check]"),
        ("[check]", CHECK_BET, "[check]"),  # no box: the whole response
        ("check", CHECK_BET, "[check]"),  # no bracket, at most five words: bracketed
        ("  [check]\n", CHECK_BET, "[check]"),  # the whole response, stripped
        ("\\boxed{Bet}", CHECK_BET, "INVALID"),  # case counts
        ("\\boxed{ check }", CHECK_BET, "INVALID"),  # spaces inside the box count
        ("I will check now", CHECK_BET, "INVALID"),  # bracketed whole: "[I will check now]"
        (
            "I think so. Final answer: [check]",
            CHECK_BET,
            "INVALID",
        ),  # a bracket outside a box: the whole text
        ("\\boxed{[check]}", CHECK_BET, "[check]"),
        ("\\boxed{\\text{check}}", CHECK_BET, "[check]"),  # \text{} filling the box is unwrapped
        ("\\boxed{ \\text{check}}", CHECK_BET, "INVALID"),  # ... only when it fills it
        ("\\boxed{bet} on second thought \\boxed{check}", CHECK_BET, "[check]"),  # the last box
        ("\\boxed{\\boxed{check}}", CHECK_BET, "[check]"),  # the last "\boxed" is the inner one
        ("\\boxed{check", CHECK_BET, "INVALID"),  # unclosed: the whole text, bracketed
        ("\\boxed {check}", CHECK_BET, "INVALID"),  # not "\boxed{": no box
        ("\\fbox{check}", CHECK_BET, "INVALID"),
        (
            "\\boxed{check} and \\boxed",
            CHECK_BET,
            "INVALID",
        ),  # the last \boxed opens nothing: the whole text
        ("\\boxed{}", CHECK_BET, "INVALID"),  # "[]"
        ("", CHECK_BET, ""),  # an empty response goes to the game as it is
        ("\\boxed{4}", ["[0]", "[4]"], "[4]"),
        ("\\boxed{4} then [5]", ["[4]", "[5]"], "[4]"),
        ("\\boxed{[I play [4]]}", ["[4]"], "INVALID"),
        (
            "\\boxed{[Offer: 3 Wood ->\n 2 Gold]}",
            NEGOTIATION,
            "[Offer: 3 Wood -> 2 Gold]",
        ),  # whitespace collapsed
        (
            "Let me think about what would be a fair trade.",
            NEGOTIATION,
            "Let me think about what would be a fair trade.",
        ),
        (
            "I'm open to negotiation.",
            NEGOTIATION,
            "INVALID",
        ),  # four words: bracketed, so never listed
    ],
)
def test_spiral_action_is_spirals_extract_action(response, legal, move):
    """SPIRAL's extract_action (train_spiral.py, its Qwen3 template): the last \\boxed{} content, else the whole
    response; a bracketless one of at most five words bracketed; whitespace collapsed; kept only on an exact,
    case-sensitive match with a legal move, else INVALID_ACTION."""
    from games import actions

    want = actions.INVALID_ACTION if move == "INVALID" else move
    assert actions.spiral_action(response, legal) == want


def test_spiral_moves_are_read_as_spirals_code_reads_them():
    """Kuhn Poker: the brackets of the observation's last line but [GAME]; TicTacToe: the latest board's free cells;
    Simple Negotiation: the replies while an offer to the mover is open, the offers SPIRAL's list draws from, its
    fixed sentences; any other game: the bracketed moves it shows and accepts."""
    from games import actions

    kuhn = S.make_env("KuhnPoker-v1", 1, 0)
    pid, obs = kuhn.get_observation()
    assert actions.spiral_moves("KuhnPoker-v1", kuhn, pid, obs) == ["[check]", "[bet]"]
    kuhn.step("[bet]")
    pid, obs = kuhn.get_observation()
    assert actions.spiral_moves("KuhnPoker-v1", kuhn, pid, obs) == ["[fold]", "[call]"]
    ttt = S.make_env("TicTacToe-v0", 1, 0)
    ttt.step("[4]")
    pid, obs = ttt.get_observation()
    assert obs.count("Available Moves:") == 2  # the whole history: both boards
    assert actions.spiral_moves("TicTacToe-v0", ttt, pid, obs) == [
        f"[{i}]" for i in range(9) if i != 4
    ]
    neg = S.make_env("SimpleNegotiation-v1", 1, 0)
    pid, obs = neg.get_observation()
    opening = actions.spiral_moves("SimpleNegotiation-v1", neg, pid, obs)
    assert (
        "[Accept]" not in opening
        and "[Offer: 3 Wood -> 2 Gold]" in opening
        and "[Offer: 4 Wood -> 1 Gold]" not in opening
    )
    assert len(opening) == 2 * 3 * 3 + 3 and "What are you looking to trade?" in opening
    neg.step("[Offer: 1 Wood -> 1 Gold]")
    pid, obs = neg.get_observation()
    assert (
        actions.spiral_moves("SimpleNegotiation-v1", neg, pid, obs)[:4]
        == actions.NEGOTIATION_REPLIES
    )
    pig = S.make_env("PigDice-v1", 1, 0)
    pid, obs = pig.get_observation()
    legal = actions.spiral_moves("PigDice-v1", pig, pid, obs)
    assert (
        "[roll]" in legal and "[hold]" in legal and "[jump]" not in legal and "[Roll]" not in legal
    )


@pytest.mark.parametrize("strict", [False, True])
def test_action_rule_spiral_ends_the_game_on_a_bracket_the_game_would_take(tiny, strict):
    _, tok = fresh(tiny)
    rule = "spiral" if strict else "lenient"
    args = S.Args(tiny=True, batch_size=2, num_envs=2, action_rule=rule, invalid_rewards="-1.5,0.5")
    policy = ScriptedPolicy(
        lambda p: "\\boxed{[I play [" + p.rsplit("Available Moves:", 1)[1].split("'[")[1][0] + "]]}"
    )
    trajs, counts, _ = self_play(
        policy, tok, args, ["TicTacToe-v0"], random.Random(0), watch.Timer(), {}, 2
    )
    c = counts["TicTacToe-v0"]
    if strict:  # Player 0 forfeits at once; Player 1 never moves and is paid the opponent's share
        assert [(t.role, len(t.turns), t.reward) for t in trajs] == [(0, 1, -1.5), (1, 0, 0.5)] * 2
        assert (
            trajs[0].turns[0].action == ""
            and c["player0"]["invalid"] == c["player0"]["loss"] == c["player1"]["win"] == 2
        )
    else:  # lenient: TextArena reads the cell out of the bracket and the game is played to its end
        assert {t.reward for t in trajs} == {1.0, -1.0} and c["player0"]["invalid"] == 0


# ---- SPIRAL's payouts: no legal move, a move the game rejects
def test_rejected_rewards_pay_a_move_the_game_rejects_through_a_real_game(tiny):
    _, tok = fresh(tiny)
    args = S.Args(
        tiny=True, batch_size=1, num_envs=1, invalid_rewards="-1.5,0.5", rejected_rewards="-1,0"
    )
    trajs, counts, _ = self_play(
        ScriptedPolicy(lambda p: "\\boxed{4}"),
        tok,
        args,
        ["TicTacToe-v0"],
        random.Random(0),
        watch.Timer(),
        {},
        1,
    )  # seat 1 repeats the taken centre: the game rejects it, and pays as SPIRAL's TextArena 0.6.4 does
    assert [(t.role, t.reward) for t in trajs] == [(0, 0.0), (1, -1.0)]
    assert counts["TicTacToe-v0"]["player1"] == {"win": 0, "draw": 0, "loss": 1, "invalid": 1}
    assert S.training_rewards({0: 1.0, 1: -1.0}, {0: False, 1: False}, (-1.5, 0.5)) == {
        0: 1.0,
        1: -1.0,
    }


def spiral_recipe(**kw) -> S.Args:
    return S.Args(
        tiny=True,
        action_rule="spiral",
        invalid_rewards="-1.5,0.5",
        rejected_rewards="-1,0",
        **{"num_envs": 1, **kw},
    )


def test_self_play_pays_spirals_payouts_for_no_legal_move_and_a_move_the_game_rejects(tiny):
    """SPIRAL's recipe: a response with no legal move (INVALID_ACTION) ends the game at -1.5 / +0.5; a listed move
    the game itself rejects is paid as SPIRAL's env pays it, -1 / 0. The defaults pay both -1 / +1."""
    _, tok = fresh(tiny)

    def play(policy, args, game):
        return self_play(
            ScriptedPolicy(policy), tok, args, [game], random.Random(0), watch.Timer(), {}, 1
        )

    trajs, counts, _ = play(lambda p: "\\boxed{Bet}", spiral_recipe(batch_size=1), "KuhnPoker-v1")
    assert [(t.role, t.reward) for t in trajs] == [(0, 0.5), (1, -1.5)] and trajs[1].turns[
        0
    ].action == ""
    assert counts["KuhnPoker-v1"]["player1"]["invalid"] == 1

    def trader(
        prompt,
    ):  # Player 0 asks 3 Gold for 1 Wood four times; Player 1 accepts, and the fourth time cannot pay
        return (
            "\\boxed{[Offer: 1 Wood -> 3 Gold]}"
            if "You are Player 0" in prompt
            else "\\boxed{[Accept]}"
        )

    trajs, counts, _ = play(trader, spiral_recipe(batch_size=8), "SimpleNegotiation-v1")
    assert [(t.role, len(t.turns), t.reward) for t in trajs] == [(0, 4, 0.0), (1, 4, -1.0)]
    assert counts["SimpleNegotiation-v1"]["player1"]["invalid"] == 1
    trajs, _, _ = play(trader, S.Args(tiny=True, num_envs=1, batch_size=8), "SimpleNegotiation-v1")
    assert [t.reward for t in trajs] == [1.0, -1.0]  # the default: -1 / +1
    trajs, _, _ = play(
        lambda p: "\\boxed{Bet}", S.Args(tiny=True, num_envs=1, batch_size=2), "KuhnPoker-v1"
    )
    assert [(t.role, len(t.turns), t.reward) for t in trajs] == [
        (0, 1, -1.0),
        (1, 1, 1.0),
    ]  # lenient: the game
    # reads "[Bet]" as a bet, and Player 0's "[Bet]" after it is a move the game rejects
    assert S.Args(rejected_rewards="-1,0").rules.rejected_rewards == (-1.0, 0.0)


def test_invalid_rewards_are_logged_by_a_tiny_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "1",
                "--mode",
                "spiral",
                "--games",
                "TicTacToe-v0",
                "--out",
                str(out),
                "--invalid-rewards=-1.5,0.5",
            ]
        )
        == 0
    )
    trajs, [m] = read_jsonl(out / "trajectories.jsonl"), read_jsonl(out / "metrics.jsonl")
    invalid = sum(m["games"]["TicTacToe-v0"][p]["invalid"] for p in ("player0", "player1"))
    assert (
        invalid > 0 and sum(t["reward"] == -1.5 for t in trajs) == invalid
    )  # the random model errs
    assert {t["reward"] for t in trajs} <= {-1.5, 0.5, 1.0, -1.0, 0.0}
    assert all(t["a_game"] == pytest.approx(t["reward"] - t["baseline"]) for t in trajs)
    assert json.loads((out / "config.json").read_text())["invalid_rewards"] == "-1.5,0.5"
    for bad, flag in (
        (["--invalid-rewards", "1,x"], "--invalid-rewards"),
        (["--rejected-rewards", "-1"], "--rejected-rewards"),
        (["--eval-first-last", "KuhnPoker-v0"], "--eval-first-last"),
        (["--adam-betas", "0.9"], "--adam-betas"),
        (["--adam-betas", "0.9,1.0"], "--adam-betas"),
        (["--clip-range", "0"], "--clip-range"),
        (["--ppo-epochs", "0"], "--ppo-epochs"),
    ):
        assert flag in error_of(capsys, SMALL + bad + ["--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_play_matches_takes_spirals_payouts_and_rule(tiny, tmp_path):
    """The same rule and payouts in evaluation: every record carries the model seat's payout."""
    _, tok = fresh(tiny)

    def play(answer, game, rules, first_last=()):
        games = S.schedule([game], 2, random.Random(0), first_last)
        return S.play_matches(
            ScriptedPolicy(answer), tok, matches.RandomPlayer(random.Random(0)), games, rules, 4
        )

    spiral = S.Rules("spiral", 0, 50, (-1.5, 0.5), (-1.0, 0.0))
    records = play(lambda p: "\\boxed{Check}", "KuhnPoker-v1", spiral)
    assert [(r["outcome"], r["invalid"], r["reward"]) for r in records] == [
        ("loss", True, -1.5)
    ] * 2
    lenient = play(lambda p: "\\boxed{Check}", "KuhnPoker-v1", S.Rules(max_turns=50))  # "[Check]"
    assert all(
        r["reward"] == (-1.0 if r["invalid"] else {"win": 1.0, "loss": -1.0}[r["outcome"]])
        for r in lenient
    )
    first_last = play(first_free, "TicTacToe-v0", S.Rules(max_turns=50), ["TicTacToe-v0"])
    history = play(first_free, "TicTacToe-v0", S.Rules(max_turns=50))
    assert [r["outcome"] for r in first_last] == [r["outcome"] for r in history]


def test_eval_takes_spirals_rule_payouts_and_format(tiny, tmp_path, capsys):
    out = tmp_path / "eval.json"
    argv = [
        "eval",
        str(tiny),
        "--games",
        "TicTacToe-v0,KuhnPoker-v1",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
    ]
    spiral = ["--action-rule", "spiral", "--invalid-rewards=-1.5,0.5", "--rejected-rewards=-1,0"]
    assert run(argv + spiral + ["--first-last", "TicTacToe-v0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["action_rule"] == "spiral" and result["first_last"] == ["TicTacToe-v0"]
    assert {r["reward"] for r in result["games"]} <= {-1.5, 0.5, -1.0, 0.0, 1.0}
    assert any(r["reward"] == -1.5 for r in result["games"])  # a random model writes no legal move
    assert "--first-last" in error_of(
        capsys, argv + ["--first-last", "Nim-v0", "--json", str(tmp_path / "x.json")]
    )
    assert "--action-rule" in error_of(
        capsys, argv + ["--action-rule", "strict", "--json", str(tmp_path / "x.json")]
    )


def best_reply(env, me: int) -> float:
    """The highest chance to win from here against the evaluation's random player (uniform over the legal moves it
    finds, machinery/matches.legal_actions), the model on seat `me` choosing its best move at every node."""
    import copy

    pid, obs = env.get_observation()
    values = []
    for move in matches.legal_actions(env, pid, obs):
        after = copy.deepcopy(env)
        done, _ = after.step(move)
        values.append(float(after.close()[0][me] > 0) if done else best_reply(after, me))
    return max(values) if pid == me else sum(values) / len(values)


def test_RandomPlayer_is_beaten_at_most_the_ceiling_in_kuhn_poker_v1_by_enumeration():
    """machinery/matches.CEILINGS, which plot draws: KuhnPoker-v1's last round decides, so the best reply to the random
    player is found by enumerating round 5 over every deal and both seats: 0.75 as its opener, 0.625 as responder."""
    import copy
    import itertools

    env = S.make_env("KuhnPoker-v1", 5, 0)
    for move in ["[bet]", "[fold]"] * 4:  # rounds 1-4, each ended by a fold
        env.get_observation()
        env.step(move)
    assert "Starting round 5" in env.get_observation()[1]
    by_seat = {}
    for me in (0, 1):
        values = []
        for deal in itertools.permutations(range(3), 2):
            dealt = copy.deepcopy(env)
            dealt.state.game_state["cards"] = dict(zip((0, 1), deal))
            values.append(best_reply(dealt, me))
        by_seat[me] = sum(values) / len(values)
    assert by_seat == {0: 0.625, 1: 0.75}  # Player 1 opens round 5
    assert matches.CEILINGS["KuhnPoker-v1"] == (by_seat[0] + by_seat[1]) / 2 == 0.6875
