"""Games that TextArena 0.7.4 does not ship, as TextArena environments: importing this package registers
them with TextArena's registry, so `textarena.make(id)` builds them like any TextArena game (and any
TextArena agent can play them).

    spiral.py   SPIRAL's own games (github.com/spiral-rl/spiral, spiral/envs/), written here from their
                rules for TextArena 0.7.4: KuhnPoker-v1, SimpleNegotiation-v1 (SPIRAL's training games,
                with TextArena's TicTacToe-v0), PigDice-v1, LiarsDice-v1, TruthAndDeception-v1
    spy.py      WhoIsTheSpy-v0: SpyRL's "who is the spy" (RLSVR), the game of `stratagem.py --mode spyrl`

Like machinery/, nothing here imports stratagem.py.
"""

from games import spiral, spy  # noqa: F401  (importing registers the ids)
