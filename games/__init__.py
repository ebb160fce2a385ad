"""Games that TextArena 0.7.4 does not ship, as TextArena environments: importing this package registers
them with TextArena's registry, so `textarena.make(id)` builds them like any TextArena game (and any
TextArena agent can play them).

    spiral.py   SPIRAL's own games (github.com/spiral-rl/spiral, spiral/envs/), written here from their
                rules for TextArena 0.7.4: KuhnPoker-v1, SimpleNegotiation-v1 (SPIRAL's training games,
                with TextArena 0.6.4's TicTacToe-v0, which make() builds), PigDice-v1, LiarsDice-v1,
                TruthAndDeception-v1
    spy.py      WhoIsTheSpy-v0: SpyRL's "who is the spy" (RLSVR), the game of spyrl.py
    actions.py  SPIRAL's action rule (--action-rule spiral): its extract_action and the move lists it matches

check_ids() checks the --games a run is given, first_last_ids() the games shown in SPIRAL's first/last format.
Like machinery/, nothing here imports stratagem.py.
"""

import contextlib
import io
import random

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from games import perfect, spiral, spy  # noqa: F401  (importing spiral and spy registers the ids)
from machinery import UserError
from machinery.flags import items


def check_ids(spec: str, flag: str = "--games") -> list[str]:
    """A comma-separated list of game ids (ours or TextArena's), checked against TextArena's registry and for
    two-player play offline: a bad id ends the run in one line before any work."""
    ids = items(spec)
    if not ids:
        raise UserError(f"{flag} is empty")
    for gid in ids:
        if gid not in ENV_REGISTRY:
            raise UserError(
                f"unknown game id {gid!r} (SPIRAL's look like KuhnPoker-v1, textarena 0.7.4's like TicTacToe-v0)"
            )
        state = random.getstate()  # reset(seed=...) reseeds the global `random`; leave it as it was
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                ta.make(gid).reset(num_players=2, seed=0)
        except LookupError:  # nltk's "Resource 'words' not found": the word games download corpora
            raise UserError(
                f"game {gid!r} needs data it downloads from the network (NLTK corpora); it cannot run offline"
            ) from None
        except Exception as e:  # noqa: BLE001 - any other failure means "this id cannot be played here"
            raise UserError(
                f"game {gid!r} cannot be played by two players here: {type(e).__name__}: {e}"
            ) from None
        finally:
            random.setstate(state)
    return ids


def first_last_ids(spec: str, games: str, flag: str = "--first-last") -> list[str]:
    """The ids of `spec` (comma-separated) to show in SPIRAL's first/last format, each one of `games`."""
    ids = items(spec)
    played = {g.strip() for g in games.split(",")}
    if stray := [g for g in ids if g not in played]:
        raise UserError(
            f"{flag} names {', '.join(stray)}, which is not evaluated here ({', '.join(sorted(played))})"
        )
    return ids


def check_flags(args) -> None:
    """A run's game flags, each one line if wrong: --games, and with --eval-every the evaluation's
    games, those shown in SPIRAL's first/last format, and the perfect players' own games."""
    check_ids(args.games)
    if args.eval_every:
        check_ids(args.eval_games, "--eval-games")
    shown = first_last_ids(args.eval_first_last, args.eval_games, "--eval-first-last")
    if args.eval_every:
        perfect.check(args.eval_opponent, items(args.eval_games), shown, "--eval-games")
