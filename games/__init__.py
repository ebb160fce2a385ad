"""Games that TextArena 0.7.4 does not ship, registered with its registry on import so that
`textarena.make(id)` builds them like any TextArena game.

    spiral.py   SPIRAL's own games (github.com/spiral-rl/spiral, spiral/envs/), written here from their
                rules for TextArena 0.7.4: KuhnPoker-v1, SimpleNegotiation-v1 (SPIRAL's training games,
                with TextArena's TicTacToe-v0), PigDice-v1, LiarsDice-v1, TruthAndDeception-v1
"""

from games import spiral  # noqa: F401  (registers the ids)
