"""SPIRAL's action rule (`--action-rule spiral`), read off SPIRAL's code and written here from its behaviour.

SPIRAL's trainer (github.com/spiral-rl/spiral, `train_spiral.py`, `extract_action` with its default Qwen3
template) turns a response into a move in five steps, and `spiral_action` does the same:

1. an empty response is sent to the game as it is (the empty string);
2. the content of the last `\\boxed{...}` (braces matched; `\\fbox` is looked for only when there is no
   `\\boxed` at all, and a box that does not open with `\\boxed{` counts as none; a `\\text{...}` filling the
   whole content is unwrapped), else the whole response, stripped;
3. any `\\boxed{...}` left inside it becomes `[...]`, and text with no bracket at all of at most five words is
   put in brackets (`check` -> `[check]`, `I will check now` -> `[I will check now]`);
4. every run of whitespace becomes one space;
5. the result is the move only if it equals one of the mover's legal moves exactly (case and spaces count),
   else it is `INVALID_ACTION`, which ends the game at SPIRAL's -1.5 / +0.5.

The legal moves are SPIRAL's per-game lists (`spiral/agents/utils.py`, `get_valid_action_parser`), built by
`spiral_moves` from what the mover sees; see its docstring for where ours differ.
"""

from __future__ import annotations

import re
from collections.abc import Container

from machinery.matches import accepts, candidate_actions

INVALID_ACTION = "[｜INVALID_ACTION｜]"  # SPIRAL's marker for "no legal move in this response", as its code spells it


def last_box(response: str) -> str | None:
    """The content of the last \\boxed{...} (\\text{...} unwrapped), or None, as SPIRAL's `spiral/utils.py` reads
    it: from the last "\\boxed" (else the last "\\fbox") to the brace that closes the first one opened after it."""
    start = response.rfind("\\boxed")
    start = start if start >= 0 else response.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(response)):
        if response[i] == "{":
            depth += 1
        elif response[i] == "}":
            depth -= 1
            if depth == 0:
                box = response[start : i + 1]
                break
    else:
        return None
    if not box.startswith("\\boxed{"):  # "\\boxed {x}", "\\fbox{x}": not a box SPIRAL reads
        return None
    content = box[len("\\boxed{") : -1]
    return (
        content[len("\\text{") : -1]
        if content.startswith("\\text{") and content.endswith("}")
        else content
    )


_INNER_BOX = re.compile(r"\\boxed\{([^}]*)\}")


def inner_boxes(raw: str) -> str:
    """Step 3's first half: every \\boxed{...} left inside `raw` becomes [...]."""
    cut = raw.rfind("}") + 1  # no box closes after it: the pattern need not look there (quadratic)
    return _INNER_BOX.sub(lambda m: f"[{m.group(1)}]", raw[:cut]) + raw[cut:]


def spiral_action(response: str, legal: Container[str]) -> str:
    """SPIRAL's move from a response (the module docstring's five steps): one of `legal`, INVALID_ACTION, or ""
    for an empty response."""
    if not response:
        return ""
    raw = last_box(response)
    raw = response.strip() if raw is None else raw
    action = inner_boxes(raw)
    if "[" not in action and "]" not in action and len(action.split()) <= 5:
        action = f"[{action}]"
    action = " ".join(action.split())
    return action if action in legal else INVALID_ACTION


class Accepted:
    """The legal moves of a game SPIRAL has no list for: the bracketed moves its text shows (with their numbers
    varied, machinery.matches.candidate_actions) that the game accepts from the mover, tried one at a time."""

    def __init__(self, env, pid: int, observation: str):
        self.env, self.pid, self.observation = env, pid, observation

    def __contains__(self, action: object) -> bool:
        return action in candidate_actions(self.observation) and accepts(
            self.env, self.pid, str(action)
        )


def kuhn_moves(observation: str) -> list[str]:
    """SPIRAL's Kuhn Poker list: every [...] on the observation's last line except [GAME] (that line is the game's
    "Your available actions are: [check], [bet]")."""
    last_line = observation.strip().split("\n")[-1]
    return [f"[{m}]" for m in re.findall(r"\[(.*?)\]", last_line) if m != "GAME"]


def tictactoe_moves(observation: str) -> list[str]:
    """The free cells the last board lists ("Available Moves: '[0]', '[4]'"). SPIRAL's reader takes the list between
    "Available Moves:" and "Next Action:", which only the first/last format writes (one board, the latest); on the
    whole history, the training default, it finds none and SPIRAL's code stops with an error. Reading the latest
    board gives the list that reader gives on the first/last format."""
    _, found, board = observation.rpartition("Available Moves:")
    return (
        [f"[{cell}]" for cell in re.findall(r"'\[(\d+)\]'", board.split("Next Action:")[0])]
        if found
        else []
    )


NEGOTIATION_TALK = [
    "Let me think about what would be a fair trade.",
    "What are you looking to trade?",
    "I'm open to negotiation.",  # four words: step 3 of the rule brackets it, so no response ever matches it
]
NEGOTIATION_REPLIES = [
    "[Accept]",
    "[Deny]",
    "That sounds good to me. [Accept]",
    "I'll pass on this offer. [Deny]",
]


def negotiation_moves(observation: str) -> list[str]:
    """SPIRAL's Simple Negotiation list, with every offer its reader could draw in place of the three it draws at
    random each turn: [Accept], [Deny] and two fixed sentences ending in them while an offer made to the mover
    has not been accepted or denied; "[Offer: A R -> B S]" for each resource R the prompt lists, A from 1 to
    min(3, R's quantity in the prompt), each other resource S and B from 1 to 3; and three fixed sentences."""
    me = re.search(r"You are Player (\d+)", observation)
    if not me:
        return ["I'll think about my strategy."]
    held = {name: int(qty) for name, qty in re.findall(r"\[(\w+)\]\s+Qty:\s+(\d+)", observation)}
    moves = []
    offers = list(
        re.finditer(r"Player (\d+) made the following offer to Player (\d+):", observation)
    )
    if offers and int(offers[-1].group(2)) == int(me.group(1)):
        if not re.search(r"(accepted|denied|implicitly denied)", observation[offers[-1].end() :]):
            moves += NEGOTIATION_REPLIES
    if len(held) >= 2:
        moves += [
            f"[Offer: {a} {give} -> {b} {get}]"
            for give in held
            for a in range(1, min(3, held[give]) + 1)
            for get in held
            if get != give
            for b in range(1, 4)
        ]
    return moves + NEGOTIATION_TALK


def spiral_moves(game_id: str, env, pid: int, observation: str) -> Container[str]:
    """The mover's legal moves under SPIRAL's rule: SPIRAL's list for its three training games (TicTacToe-v0,
    KuhnPoker-v1, SimpleNegotiation-v1); for any other id, which SPIRAL's code has no list for (its trainer stops
    with NotImplementedError), the bracketed moves the game shows and accepts (Accepted)."""
    if game_id == "KuhnPoker-v1":
        return kuhn_moves(observation)
    if game_id == "TicTacToe-v0":
        return tictactoe_moves(observation)
    if game_id == "SimpleNegotiation-v1":
        return negotiation_moves(observation)
    return Accepted(env, pid, observation)
