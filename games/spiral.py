"""SPIRAL's games, written from the rules of SPIRAL's code for TextArena 0.7.4.

SPIRAL (github.com/spiral-rl/spiral) trains on TextArena's TicTacToe-v0 and on two forks of its own,
KuhnPoker-v1 and SimpleNegotiation-v1, and evaluates on three more forks (PigDice-v1, LiarsDice-v1,
TruthAndDeception-v1); all five are registered in `spiral/envs/__init__.py` and written against
TextArena 0.6.4's State, which 0.7.4 no longer has. Each class below plays the fork's rules with the
same terminal conditions, turn limits and observation text (every message a player is shown, word for
word), and TicTacToeV0 plays TextArena 0.6.4's TicTacToe-v0 (0.7.4's adds a line after every move). What
SPIRAL's code leaves to TextArena 0.6.4 is 0.6.4's here too, on SpiralState:

- an invalid move with no retry left loses: the state records it in game_info and pays -1 to the offender
  and 0 to the opponent (0.7.4 pays +1; the trainer's --rejected-rewards decides what it is worth);
- a player's words reach the other player as written (0.7.4 removes role tags such as "[GAME]" from them);
- random draws come where SPIRAL's code makes them: LiarsDice-v1's first dice and TruthAndDeception-v1's
  facts before the seed is set (make_env seeds Python's `random` before it builds a game, so the seed
  decides them too).

make() builds an id as SPIRAL's make_env does (`spiral/envs/__init__.py`): the bare game in
LLMObservationWrapper (every message, the opponent's words included; it ships in 0.7.4 and renders
messages as 0.6.4 did), or in FirstLastObservationWrapper, the format of SPIRAL's evaluation of TicTacToe.
"""

from __future__ import annotations

import importlib.resources
import json
import random
import re

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY, register
from textarena.wrappers import LLMObservationWrapper
from textarena.wrappers.ObservationWrappers.llm_observation_wrapper import (
    FirstLastObservationWrapper,
)

from machinery import UserError

GAME, MESSAGE, ACTION = (
    ta.GAME_ID,
    ta.ObservationType.GAME_MESSAGE,
    ta.ObservationType.PLAYER_ACTION,
)


class SpiralState(ta.TwoPlayerState):
    """0.7.4's two-player state with TextArena 0.6.4's two rules that SPIRAL's games rely on."""

    def add_observation(
        self, message: str, observation_type, from_id: int = GAME, to_id: int = -1
    ) -> None:
        """A message as sent: 0.7.4's state strips role tags ("[GAME]", "[Player 0]") from a player's words."""
        self.logs.append((from_id, message))
        for pid in range(self.num_players) if to_id == -1 else [to_id]:
            self.observations[pid].append((from_id, message, observation_type))

    def set_invalid_move(self, reason: str) -> None:
        """With no retry left the offender gets -1 and the opponent 0 (0.7.4: +1)."""
        retry = self.error_allowance > self.error_count
        super().set_invalid_move(reason)
        if not retry:
            self.rewards[1 - self.current_player_id] = 0


class SpiralGame(ta.Env):
    """What the forks share: messages from the game, a player's words shown to both players."""

    def say(self, message: str, to: int = -1) -> None:
        self.state.add_observation(
            message=message, observation_type=MESSAGE, from_id=GAME, to_id=to
        )

    def show_action(self, action: str) -> None:
        self.state.add_observation(
            message=action, observation_type=ACTION, from_id=self.state.current_player_id
        )


# ----------------------------------------------------------------------------------- Kuhn Poker
CARD = {0: "J", 1: "Q", 2: "K"}


class KuhnPokerV1(SpiralGame):
    """SPIRAL's spiral/envs/KuhnPoker/env.py. J < Q < K, one card each, ante 1 (pot 2; bets and calls are
    not added to it). The seats take turns to open a round, Player 1 opening round 1. A round: check or
    bet; after a check, check (showdown) or bet; after a bet, fold (the bettor takes the pot) or call
    (showdown: the higher card takes the pot). The game ends with its last round, and the winner of that
    round wins the game: earlier rounds move chips, which decide nothing (there are no draws)."""

    TREE = {
        "check": {"check": "showdown", "bet": {"fold": "loser", "call": "showdown"}},
        "bet": {"fold": "loser", "call": "showdown"},
    }
    MOVE = re.compile(r"\[(Check|Bet|Fold|Call)\]", re.IGNORECASE)

    def __init__(self, ante: int = 1, max_rounds: int = 5):
        self.ante, self.max_rounds = ante, max_rounds

    def reset(self, num_players: int, seed: int | None = None):
        self.state = SpiralState(num_players=num_players, seed=seed)
        self.deck = [
            0,
            1,
            2,
        ]  # shuffled in place each round, as SPIRAL's code does: a seed deals its cards
        self.state.reset(
            game_state={"chips": {0: 0, 1: 0}, "round": 0, "opener": 0, "round_over": False},
            player_prompt_function=self._prompt,
        )
        self._start_round()

    def _prompt(self, player_id: int, game_state: dict) -> str:
        return (
            f"You are Player {player_id} in a {self.max_rounds} round game of Kuhn Poker.\n"
            "Game Rules:\n"
            "- Kuhn Poker uses a 3-card deck with J, Q, K (J lowest, K highest)\n"
            f"- Each player antes {self.ante} chip and receives 1 card each round\n"
            f"- Game continues for {self.max_rounds} rounds\n"
            "- The player with the most chips after all rounds wins\n\n"
            "Action Rules:\n"
            "- '[check]': Pass without betting (only if no bet is on the table)\n"
            "- '[bet]': Add 1 chip to the pot (only if no bet is on the table)\n"
            "- '[call]': Match an opponent's bet by adding 1 chip to the pot\n"
            "- '[fold]': Surrender your hand and let your opponent win the pot\n\n"
        )

    def _start_round(self):
        gs = self.state.game_state
        random.shuffle(self.deck)
        gs["cards"], gs["pot"], gs["tree"] = (
            {0: self.deck[0], 1: self.deck[1]},
            2 * self.ante,
            self.TREE,
        )
        gs["round"] += 1
        gs["opener"] = opener = 1 - gs["opener"]
        for p in (0, 1):
            gs["chips"][p] -= self.ante
            message = (
                f"Starting round {gs['round']} out of {self.max_rounds} rounds.\n"
                f"Your card is: {CARD[gs['cards'][p]]}\n"
            )
            self.say(
                message + (f"Your available actions are: {self._options()}" if p == opener else ""),
                to=p,
            )
        self.state.current_player_id = opener

    def _options(self) -> str:
        return ", ".join(f"[{k}]" for k in self.state.game_state["tree"])

    def get_observation(self):
        if self.state.game_state[
            "round_over"
        ]:  # the next round is dealt when someone is to act in it
            self.state.game_state["round_over"] = False
            self._start_round()
        return self.state.current_player_id, self.state.get_current_player_observation()

    def step(self, action: str):
        pid, gs = self.state.current_player_id, self.state.game_state
        self.show_action(action)
        match = self.MOVE.search(action.strip())
        if not match:
            self.state.set_invalid_move(reason="Action must be [Check], [Bet], [Call], or [Fold].")
            return self.state.step()
        move = match.group(1).lower()
        if move not in gs["tree"]:
            self.state.set_invalid_move(reason=f"Action must be {self._options()}.")
            return self.state.step()
        gs["tree"] = gs["tree"][move]
        if gs["tree"] == "loser":
            self._round_won_by(1 - pid, f"Player {pid} has folded.")
        elif gs["tree"] == "showdown":
            c0, c1 = gs["cards"][0], gs["cards"][1]
            self.say(f"Cards: Player 0 had {CARD[c0]}, Player 1 had {CARD[c1]}")
            w = 0 if c0 > c1 else 1
            self._round_won_by(
                w,
                f"Showdown: Player {w}'s {CARD[max(c0, c1)]} beats Player {1 - w}'s "
                f"{CARD[min(c0, c1)]}. Player {w} wins pot of {gs['pot']} chips.",
            )
        else:
            self.say(f"Your available actions are: {self._options()}", to=1 - pid)
            return self.state.step()
        return self.state.step(
            rotate_player=False
        )  # the next round's opener is set when it is dealt

    def _round_won_by(self, pid: int, reason: str):
        gs = self.state.game_state
        gs["chips"][pid] += gs["pot"]
        self.say(reason)
        if (
            gs["round"] >= self.max_rounds
        ):  # SPIRAL's terminal rule: the last round's winner wins the game
            self.state.set_winner(
                pid,
                f"Player {pid} won by having more chips at the end of all {self.max_rounds} rounds.",
            )
        else:
            gs["round_over"] = True


# ----------------------------------------------------------------------------------- Simple Negotiation
class SimpleNegotiationV1(SpiralGame):
    """SPIRAL's spiral/envs/SimpleNegotiation/env.py. Two resources; both players hold 10 Wood and 10 Gold;
    Player 0 values Wood 5 and Gold 15, Player 1 Wood 15 and Gold 5 (fixed, nothing random). A move may
    respond to the offer made to the mover ([Accept] trades if both sides hold the goods, [Deny] drops it,
    a counter-offer replaces it) and may make an offer [Offer: 3 Wood -> 2 Gold]; anything else is talk.
    Invalid: accepting an offer not made to you or one you cannot pay, offering what you do not hold, an
    offer that cannot be read. The game ends after its 10th move: the larger gain in inventory value
    (at one's own values) wins; equal gains draw."""

    RESOURCES = ("Wood", "Gold")
    VALUES = {0: {"Wood": 5, "Gold": 15}, 1: {"Wood": 15, "Gold": 5}}
    ACCEPT, DENY = re.compile(r"\[Accept\]", re.IGNORECASE), re.compile(r"\[Deny\]", re.IGNORECASE)
    OFFER = re.compile(r"\[Offer:([^\[\]]+)\]", re.IGNORECASE)  # what lies inside: offer_terms
    GIVE = re.compile(r"I\s+(?:give|offer)(\s+)", re.IGNORECASE)

    def __init__(self, max_turns: int = 10):
        self.max_turns = max_turns

    def reset(self, num_players: int, seed: int | None = None):
        self.state = SpiralState(num_players=num_players, seed=seed, max_turns=self.max_turns)
        holdings = {p: {"Wood": 10, "Gold": 10} for p in (0, 1)}
        self.state.reset(
            game_state={"offer": None, "resources": holdings, "history": []},
            player_prompt_function=self._prompt,
        )
        self.initial = {p: self.value(p) for p in (0, 1)}

    def value(self, pid: int) -> int:
        return sum(
            q * self.VALUES[pid][r] for r, q in self.state.game_state["resources"][pid].items()
        )

    def _prompt(self, player_id: int, game_state: dict) -> str:
        held = "\n\t+ ".join(
            f"{'[' + r + ']':<8}  Qty: {q:<2}   Value: {self.VALUES[player_id][r]}"
            for r, q in game_state["resources"][player_id].items()
        )
        return (
            f"You are Player {player_id} in the Negotiation Game.\n"
            "You have some resources, and your task is to trade such that the total value of your resources "
            "increases.\n"
            f"The resources and associated values you currently have are:\n\t+ {held}\n"
            "At each turn, you can talk to your opponent or make a trade offer.\n"
            "Use the following special tokens for actions:\n"
            "  - [Offer]: To make a trade offer.\n"
            "    Format: [Offer: Offered Resources -> Requested Resources]\n"
            "    Example: [Offer: 3 Wood -> 2 Gold]\n"
            "  - [Accept]: To accept an incoming offer.\n"
            "  - [Deny]: To deny an incoming offer (default).\n"
            "YOU CAN INCLUDE ADDITIONAL TEXT BEFORE AND/OR AFTER THESE TOKENS.\n"
            '    Example: "I\'m open to negotiation."\n'
            f"The game lasts for {self.max_turns} turns in total.\n"
        )

    def step(self, action: str):
        pid = self.state.current_player_id
        self.show_action(action)
        self._respond(pid, action)
        if not self.state.done:
            self._new_offer(pid, action)
        if self.state.turn + 1 >= self.max_turns and not self.state.done:  # this was the last move
            gain = {p: self.value(p) - self.initial[p] for p in (0, 1)}
            if gain[0] == gain[1]:
                self.state.set_draw("Same change in inventory value for all players. Draw.")
            else:
                w = 0 if gain[0] > gain[1] else 1
                self.state.set_winner(
                    w, f"Player {w} won by having a larger gain in inventory value."
                )
        return self.state.step()

    def _has(self, pid: int, goods: dict) -> bool:
        return all(self.state.game_state["resources"][pid].get(r, 0) >= q for r, q in goods.items())

    def _respond(self, pid: int, action: str):
        gs = self.state.game_state
        offer = gs["offer"]
        if offer is None:
            return
        if pid != offer["to"]:
            if self.ACCEPT.search(action):
                self.state.set_invalid_move(
                    reason=f"Player {pid} tried to accept an offer that was not made to them."
                )
            return
        if self.ACCEPT.search(action):
            self._trade(offer)
        elif self.DENY.search(action):
            self.say(f"Player {pid} denied the trade offer from Player {offer['from']}.")
            gs["history"].append({**offer, "outcome": "Denied"})
            gs["offer"] = None

    def _trade(self, offer: dict):
        gs, giver, taker = self.state.game_state, offer["from"], offer["to"]
        giver_can, taker_can = self._has(giver, offer["give"]), self._has(taker, offer["get"])
        if giver_can and taker_can:
            for goods, src, dst in ((offer["give"], giver, taker), (offer["get"], taker, giver)):
                for r, q in goods.items():
                    gs["resources"][src][r] -= q
                    gs["resources"][dst][r] += q
            self.say(f"Player {taker} accepted the trade offer from Player {giver}.")
            gs["history"].append({**offer, "outcome": "Accepted"})
            gs["offer"] = None
        elif not giver_can and not taker_can:
            self.say("Trade cancelled: Neither player has sufficient resources for the trade.")
            gs["offer"] = None
        elif not taker_can:
            self.state.set_invalid_move(
                reason=f"Player {taker} tried accepting a trade without having the necessary resources."
            )
        else:  # the proposer no longer holds the goods: the offer lapses, nobody is punished
            self.say(f"Trade cancelled: Player {giver} no longer has the resources they offered.")
            gs["offer"] = None

    def _new_offer(self, pid: int, action: str):
        gs = self.state.game_state
        match = self.OFFER.search(action)
        if not match:
            return
        parsed = self.parse_offer(self.offer_terms(match.group(1)).strip())
        if parsed is None:
            self.state.set_invalid_move(
                reason=f"Player {pid} made a trade offer in an incorrect format."
            )
        elif not self._has(pid, parsed[0]):
            self.state.set_invalid_move(
                reason=f"Player {pid} tried to make a trade offer without having the necessary resources."
            )
        else:
            previous = gs["offer"]
            if previous is not None and previous["to"] == pid:
                self.say(
                    f"Player {pid} implicitly denied the previous offer by making a counter-offer."
                )
                gs["history"].append({**previous, "outcome": "Implicitly Denied"})
            gs["offer"] = {"from": pid, "to": 1 - pid, "give": parsed[0], "get": parsed[1]}
            listed = [", ".join(f"{q} {r}" for r, q in goods.items()) for goods in parsed]
            self.say(
                f"Player {pid} made the following offer to Player {1 - pid}: "
                f"Offered items: {listed[0]} -> Requested items: {listed[1]}"
            )

    @classmethod
    def offer_terms(cls, inside: str) -> str:
        """What SPIRAL's offer pattern, `\\[Offer:\\s*(?:I\\s+(?:give|offer)\\s+)?([^\\[\\]]+?)\\s*\\.*\\]`, keeps
        of the text inside the brackets, found without its backtracking (cubic in a run of blanks: minutes
        for 5,000 of them). Blanks and "I give " go from the front, dots and the blanks before them from the
        end; one character at least is kept."""
        first = len(inside) - len(inside.lstrip())
        if first == len(inside):  # all blank: the pattern keeps the last blank
            return inside[-1]
        last = len(inside.rstrip(".").rstrip())
        give = cls.GIVE.match(inside, first)
        if give and give.end() < len(inside):
            first = give.end()
        elif (
            give and give.end(1) - give.start(1) > 1
        ):  # "I give" and blanks to the end: one blank kept
            return inside[-1]
        return inside[first : max(last, first + 1)]

    @classmethod
    def parse_offer(cls, text: str) -> tuple[dict, dict] | None:
        """'3 Wood, 1 gold -> 2 Golds' -> ({'Wood': 3, 'Gold': 1}, {'Gold': 2}); None if it does not read."""
        text = " ".join(text.split()).rstrip(
            ".,!?"
        )  # rstrip: a pattern [.,!?]+$ is quadratic in a run
        text = re.sub(r"^(I\s+(?:give|offer)\s+)", "", text, flags=re.IGNORECASE)
        sides = re.split(r"\s*->\s*", text)
        if len(sides) != 2:
            return None
        parsed = tuple(cls._goods(side.strip()) for side in sides)
        return parsed if all(parsed) else None

    @classmethod
    def _goods(cls, text: str) -> dict | None:
        goods: dict[str, int] = {}
        for item in filter(
            None, (s.strip() for s in re.split(r",\s*|\s+and\s+", text, flags=re.IGNORECASE))
        ):
            m = re.match(
                r"^(\d{1,100})\s+(.+)$", item
            )  # a longer number is no quantity (and int() may refuse it)
            if not m:
                return None
            qty, name = int(m.group(1)), m.group(2).strip().title()
            name = {"Woods": "Wood", "Golds": "Gold"}.get(name, name)
            if name not in cls.RESOURCES or qty <= 0:
                return None
            goods[name] = goods.get(name, 0) + qty
        return goods


# ----------------------------------------------------------------------------------- Pig Dice
class PigDiceV1(SpiralGame):
    """SPIRAL's spiral/envs/PigDice/env.py. Player 0 starts. On your turn, [roll] (or [r]) adds a 2-6 to the
    turn total, a 1 loses it and ends the turn; [hold] (or [h]) banks it and ends the turn. When a turn
    ends: if that was the last of `max_turns` turns, the higher score wins (equal: draw); else, if a score
    reached `winning_score`, the higher one wins (equal: draw); else the other player's turn begins."""

    MOVE = re.compile(r"\[(roll|hold|r|h)\]", re.IGNORECASE)
    OPTIONS = "Available actions: '[roll]' or '[hold]'"

    def __init__(self, winning_score: int = 50, max_turns: int = 50):
        self.winning_score, self.max_turns = winning_score, max_turns

    def reset(self, num_players: int, seed: int | None = None):
        self.state = SpiralState(num_players=num_players, seed=seed)
        self.state.reset(
            game_state={"scores": [0, 0], "turn_total": 0, "turn_count": 0},
            player_prompt_function=self._prompt,
        )
        self.say(
            f"Game starting! Player 0 goes first.\n\n{self._scores()}\n\nCurrent turn total: 0"
        )
        self.say(self.OPTIONS, to=0)

    def _prompt(self, player_id: int, game_state: dict) -> str:
        return (
            "[GAME] Welcome to Pig Dice Game!\n\n"
            f"You are Player {player_id}.\n\n"
            "Rules:\n"
            "- On your turn, you can either '[roll]' or '[hold]'\n"
            "- Roll a 2-6: Add to your turn total\n"
            "- Roll a 1: Lose turn total and end turn\n"
            "- Hold: Add turn total to your score and end turn\n"
            f"- First to {self.winning_score} points wins\n\n"
            "When it's your turn, you'll see the current scores and turn total.\n"
            "Respond with '[roll]' to roll the die or '[hold]' to bank your points.\n"
        )

    def _scores(self) -> str:
        return "\n".join(
            f"Player {i} score: {s}" for i, s in enumerate(self.state.game_state["scores"])
        )

    def step(self, action: str):
        pid, gs = self.state.current_player_id, self.state.game_state
        self.show_action(action)
        match = self.MOVE.search(action.strip())
        if not match:
            self.state.set_invalid_move(
                reason="Invalid action format. Use '[roll]' or '[hold]' or one letter shorthands."
            )
            return self.state.step(rotate_player=False)
        if match.group(1).lower() in ("roll", "r"):
            roll = random.randint(1, 6)
            self.say(f"Player {pid} rolls a {roll}.")
            if roll == 1:
                self.say(f"Player {pid} busted! Lost all points for this turn.")
                self._end_turn()
            else:
                gs["turn_total"] += roll
                self.say(f"Turn total is now {gs['turn_total']}.")
                self.say(self.OPTIONS, to=pid)
        else:
            gs["scores"][pid] += gs["turn_total"]
            self.say(
                f"Player {pid} holds and banks {gs['turn_total']} points. Total score: {gs['scores'][pid]}"
            )
            self._end_turn()
        return self.state.step(rotate_player=False)  # _end_turn hands the die over

    def _end_turn(self):
        gs = self.state.game_state
        s = gs["scores"]
        lead = None if s[0] == s[1] else int(s[1] > s[0])
        if gs["turn_count"] + 1 >= self.max_turns:
            if lead is None:
                self.state.set_draw(
                    f"The turn limit has been reached and all players have the same score: {s}"
                )
            else:
                self.state.set_winner(
                    lead, f"Player {lead} won by having a higher score at the turn limit ({s})"
                )
        elif max(s) >= self.winning_score:
            if min(s) >= self.winning_score and lead is None:
                self.state.set_draw(
                    f"Both players reached {self.winning_score} with the same score!"
                )
            elif min(s) >= self.winning_score:
                self.state.set_winner(
                    lead, f"Player {lead} won with the higher score ({s[lead]} vs {s[1 - lead]})!"
                )
            else:
                self.state.set_winner(
                    lead, f"Player {lead} won by reaching the target score of {self.winning_score}!"
                )
        else:
            gs["turn_count"] += 1
            gs["turn_total"] = 0
            nxt = 1 - self.state.current_player_id
            self.state.manually_set_current_player_id(nxt)
            self.say(f"Player {nxt}'s turn\n\n{self._scores()}\n\nCurrent turn total: 0")
            self.say(self.OPTIONS, to=nxt)


# ----------------------------------------------------------------------------------- Liar's Dice
class LiarsDiceV1(SpiralGame):
    """SPIRAL's spiral/envs/LiarsDice/env.py, two players. Five dice each, hidden. Player 0 opens. A bid
    [Bid: Q, F] claims at least Q dice of face F among all dice; it must raise the last bid (a higher
    quantity, or the same quantity and a higher face), with 1 <= F <= 6 and Q at most the dice in play.
    [Call] (checked first) challenges the last bid: if fewer than Q dice show F the bidder loses a die,
    else the caller does; the loser opens the next round with fresh dice. No dice left loses the game."""

    BID = (
        re.compile(  # a number longer than 100 digits is no bid (nor int()); never two \s* in a row
            r"\[bid\s*(?::\s*)?(\d{1,100})[,\s]+(\d{1,100})\]", re.IGNORECASE
        )
    )
    CALL = re.compile(r"\[call\]", re.IGNORECASE)

    def __init__(self, num_dice: int = 5):
        self.num_dice = num_dice

    def reset(self, num_players: int, seed: int | None = None):
        dice = {
            p: [random.randint(1, 6) for _ in range(self.num_dice)] for p in (0, 1)
        }  # before the seed, as SPIRAL
        self.state = SpiralState(num_players=num_players, seed=seed)
        self.state.reset(
            game_state={
                "bid": (0, 0),
                "bidder": None,
                "dice_left": {p: self.num_dice for p in (0, 1)},
                "dice": dice,
            },
            player_prompt_function=self._prompt,
        )

    def _prompt(self, player_id: int, game_state: dict) -> str:
        mine, (q, f) = game_state["dice"][player_id], game_state["bid"]
        return (
            f"You are Player {player_id} in an N-player Liar's Dice game.\n"
            f"You have {len(mine)} dice: {', '.join(map(str, mine))}.\n"
            f"Player {1 - player_id} has {game_state['dice_left'][1 - player_id]} dice.\n\n"
            "Rules:\n"
            "- On your turn, you may either:\n"
            "  [1] Make a new bid with a higher quantity or higher face (or both),\n"
            "  [2] Call the last bid by typing '[Call]'.\n\n"
            "If you call:\n"
            "  - If the actual count of that face value among all dice is less than the bid, "
            "the last bidder loses one die.\n"
            "  - Otherwise, the caller loses one die.\n"
            "A player who reaches 0 dice is eliminated. The last remaining player wins.\n\n"
            f"Current bid: Quantity = {q}, Face Value = {f}\n"
            "Your action? (e.g. '[Bid: 3, 4]' or '[Call]')"
        )

    def step(self, action: str):
        pid, gs = self.state.current_player_id, self.state.game_state
        self.show_action(action)
        if self.CALL.search(action):
            if gs["bidder"] is None:
                self.state.set_invalid_move(reason="Call made with no prior bid.")
                return self.state.step()
            (q, f), bidder = gs["bid"], gs["bidder"]
            count = sum(d.count(f) for d in gs["dice"].values())
            loser = bidder if count < q else pid
            self._lose_die(
                loser,
                f"Player {pid} calls! The actual count of face {f} is {count}, which is "
                + (
                    f"LESS than {q}.\nPlayer {loser} (the last bidder) loses one die."
                    if count < q
                    else f">= {q}.\nPlayer {loser} (the caller) loses one die."
                ),
            )
            return self.state.step(rotate_player=False)  # the loser opens the next round
        bid = self.BID.search(action)
        if not bid:
            self.state.set_invalid_move(
                reason="Action not recognized as either a valid '[Bid: X, Y]' or '[Call]'."
            )
            return self.state.step()
        q, f = int(bid.group(1)), int(bid.group(2))
        problem = self.bid_problem(q, f, gs["bid"], sum(gs["dice_left"].values()))
        if problem:
            self.state.set_invalid_move(reason=f"Invalid bid: {problem}")
            return self.state.step()
        gs["bid"], gs["bidder"] = (q, f), pid
        self.say(f"Player {pid} bids {q} of face {f}.")
        done, info = self.state.step()
        if not done:
            self.say(
                f"Current bid: {q} of face {f}\nYour turn, Player {1 - pid}. '[Bid: X, Y]' or '[Call]'?",
                to=1 - pid,
            )
        return done, info

    @staticmethod
    def bid_problem(q: int, f: int, last: tuple[int, int], dice_in_play: int) -> str:
        """Why a bid of q dice of face f may not follow `last`; "" when it may."""
        if q <= 0:
            return "Quantity must be positive."
        if not 1 <= f <= 6:
            return "Face value must be between 1 and 6."
        if q < last[0]:
            return f"New quantity {q} is lower than current {last[0]}."
        if q == last[0] and f < last[1]:
            return f"With same quantity, face value must be higher than current {last[1]}."
        if (q, f) == last:
            return "Bid is identical to the current bid."
        if q > dice_in_play:
            return f"Bid quantity {q} exceeds total dice count {dice_in_play}."
        return ""

    def _lose_die(self, loser: int, message: str):
        gs = self.state.game_state
        self.say(message)
        gs["dice_left"][loser] -= 1
        if gs["dice_left"][loser] == 0:
            self.say(f"Player {loser} is eliminated!")
            self.state.set_winner(
                1 - loser, f"Player {1 - loser} wins! All other players ran out of dice."
            )
            return
        gs["bid"], gs["bidder"] = (0, 0), None
        gs["dice"] = {
            p: [random.randint(1, 6) for _ in range(n)] for p, n in gs["dice_left"].items()
        }
        for p, dice in gs["dice"].items():
            self.say(
                f"Your new dice are: {', '.join(map(str, dice))}\nRemaining dice:\n"
                + "\n".join(f"Player {o}: {n}" for o, n in gs["dice_left"].items()),
                to=p,
            )
        self.state.manually_set_current_player_id(loser)
        self.say(f"Player {loser} starts the new round.")


# ----------------------------------------------------------------------------------- Truth and Deception
class TruthAndDeceptionV1(SpiralGame):
    """SPIRAL's spiral/envs/TruthAndDeception/env.py. Player 0, the Deceiver, knows which of two facts (from
    TextArena's facts.json) is true; Player 1, the Guesser, does not. They talk for max_turns - 2 moves,
    the Deceiver adds a last message, and the Guesser answers [Fact 1] or [Fact 2]: right, the Guesser wins;
    wrong, the Deceiver wins; neither, an invalid move. (As in SPIRAL's code, an answer naming both facts
    counts as right.)"""

    GUESS = {
        1: re.compile(r"\[Fact 1\]", re.IGNORECASE),
        2: re.compile(r"\[Fact 2\]", re.IGNORECASE),
    }

    def __init__(self, max_turns: int = 6):
        assert max_turns % 2 == 0, f"max_turns must be even, got {max_turns}"
        self.max_turns = max_turns
        with (
            importlib.resources.files("textarena.envs.TruthAndDeception")
            .joinpath("facts.json")
            .open() as f
        ):
            self.facts = json.load(f)

    def reset(self, num_players: int, seed: int | None = None):
        pick = random.choice(self.facts)  # before the seed, as SPIRAL's code draws them
        facts = [
            (pick["facts"]["fact1"], pick["correct_fact"] == "fact1"),
            (pick["facts"]["fact2"], pick["correct_fact"] == "fact2"),
        ]
        random.shuffle(facts)
        self.state = SpiralState(num_players=num_players, seed=seed)
        self.state.reset(
            game_state={"facts": facts},
            player_prompt_function=self._prompt,
            role_mapping={0: "Deceiver", 1: "Guesser"},
        )

    def _prompt(self, player_id: int, game_state: dict) -> str:
        (f1, true1), (f2, true2) = game_state["facts"]
        if player_id == 0:
            return (
                "You are Player 0, and you are the Deceiver in the 'Truth and Deception' game.\n"
                "You know which of the following two facts is correct:\n"
                f"Fact 1: {f1} ({'correct' if true1 else 'wrong'})\n"
                f"Fact 2: {f2} ({'correct' if true2 else 'wrong'})\n"
                "Your goal is to convince the other player to choose the incorrect fact.\n"
                f"You will have a conversation for {self.max_turns - 1} turns.\n"
                "After that, the other player will make their guess.\n"
                "On your turn, simply type your message."
            )
        return (
            "You are Player 1, and you are the Guesser in the 'Truth and Deception' game.\n"
            "You need to determine which of the following two facts is correct:\n"
            f"Fact 1: {f1}\nFact 2: {f2}\n"
            f"You will have a conversation with the other player for {self.max_turns - 2} turns.\n"
            "After that, you will make your guess.\n"
            "On your turn, simply type your message."
        )

    def step(self, action: str):
        self.show_action(action)
        if (
            self.state.turn < self.max_turns - 1
        ):  # the conversation, the Deceiver's last message included
            done, info = self.state.step()
            if self.state.turn == self.max_turns - 1 and not done:
                self.say(
                    "Now guess which of the two facts are correct by returning '[Fact 1]' or '[Fact 2]'."
                )
            return done, info
        named = [k for k, pattern in self.GUESS.items() if pattern.search(action)]
        if not named:
            self.state.set_invalid_move(
                reason="Player 1 did not make their guess in the correct format."
            )
        elif any(self.state.game_state["facts"][k - 1][1] for k in named):
            self.state.set_winner(1, "Player 1 guessed correct fact.")
        else:
            self.state.set_winner(0, "Player 1 guessed the wrong fact.")
        return self.state.step()


# ----------------------------------------------------------------------------------- Tic Tac Toe
class TicTacToeV0(SpiralGame):
    """TextArena 0.6.4's TicTacToe-v0, which SPIRAL trains on: 3x3, Player 0 is O and moves first, "[4]" takes the
    centre, three in a row wins, a full board draws; after every move (and at the start) both players are shown
    the board and the free cells. TextArena 0.7.4's also tells them who placed which mark where."""

    LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]

    def reset(self, num_players: int, seed: int | None = None):
        self.state = SpiralState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"board": [""] * 9}, player_prompt_function=self._prompt)
        self._show_board()

    def _prompt(self, player_id: int, game_state: dict) -> str:
        mark, other = ("X", "O") if player_id == 1 else ("O", "X")
        return (
            f"You are Player {player_id} in Tic Tac Toe.\n"
            "Your goal is to win three in a row (horizontally, vertically, or diagonally) on the board.\n"
            "On your turn, you should select the square number (0-8) you want to put your mark in next.\n"
            "For example, '[4]' places your mark in the center cell of the board.\n\n"
            f"As Player {player_id}, you will be '{mark}', while your opponent is '{other}'.\n"
        )

    def _show_board(self):
        board = self.state.game_state["board"]
        rows = ["|".join(f" {board[r * 3 + c] or r * 3 + c} " for c in range(3)) for r in range(3)]
        free = ", ".join(f"'[{i}]'" for i in range(9) if not board[i])
        self.say(
            "Current Board:\n\n" + "\n---+---+---\n".join(rows) + f"\n\nAvailable Moves: {free}"
        )

    def step(self, action: str):
        pid, board = self.state.current_player_id, self.state.game_state["board"]
        self.show_action(action)
        match = re.search(r"\[\s*(\d+)\s*\]", action)
        if match is None:
            self.state.set_invalid_move(
                reason=f"Invalid move format. Player {pid} did not respond with a valid move."
            )
        elif not 0 <= (cell := int(match.group(1))) <= 8:
            self.state.set_invalid_move(
                reason=f"Invalid cell number: {cell}. Must be between 0 and 8."
            )
        elif board[cell]:
            self.state.set_invalid_move(
                reason=f"Invalid move. Player {pid} selected cell {cell} which is already occupied."
            )
        else:
            board[cell] = "X" if pid == 1 else "O"
            if any(board[a] == board[b] == board[c] != "" for a, b, c in self.LINES):
                self.state.set_winner(pid, f"Player {pid} has won!")
            elif all(board):
                self.state.set_draw("The game is a draw!")
        self._show_board()
        return self.state.step()


# ----------------------------------------------------------------------------------- the ids, as SPIRAL builds them
SPIRAL_IDS = {  # id: (game, arguments), as `spiral/envs/__init__.py` registers them (TicTacToe-v0: TextArena 0.6.4's)
    "TicTacToe-v0": (TicTacToeV0, {}),
    "KuhnPoker-v1": (KuhnPokerV1, dict(ante=1, max_rounds=5)),
    "SimpleNegotiation-v1": (SimpleNegotiationV1, dict(max_turns=10)),
    "PigDice-v1": (PigDiceV1, dict(winning_score=50, max_turns=50)),
    "LiarsDice-v1": (LiarsDiceV1, {}),
    "TruthAndDeception-v1": (TruthAndDeceptionV1, dict(max_turns=6)),
}
for _id, (_cls, _kwargs) in SPIRAL_IDS.items():
    if (
        _id not in ENV_REGISTRY
    ):  # TextArena's own id stays TextArena's for `ta.make`; make() below builds ours
        register(id=_id, entry_point=_cls, default_wrappers=[LLMObservationWrapper], **_kwargs)


def make(game_id: str, first_last: bool = False) -> ta.Env:
    """`game_id` as SPIRAL's make_env builds it: the bare game in LLMObservationWrapper (the whole history, SPIRAL's
    training default) or, with `first_last`, in FirstLastObservationWrapper (the first message and the latest one).
    SPIRAL_IDS are this module's games; another TextArena id is its bare "-raw" game, so no action-formatting
    wrapper brackets a bare "4" (an id with no "-raw" twin, such as a "-train" one, is built as TextArena names it)."""
    if game_id in SPIRAL_IDS:
        game, kwargs = SPIRAL_IDS[game_id]
        bare = game(**kwargs)
    elif f"{game_id}-raw" in ENV_REGISTRY:
        bare = ta.make(f"{game_id}-raw")
    elif first_last:
        raise UserError(
            f"{game_id} has no bare game to show in the first/last format; name its default id"
        )
    else:
        return ta.make(game_id)
    return FirstLastObservationWrapper(bare) if first_last else LLMObservationWrapper(bare)
