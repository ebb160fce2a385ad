"""Games of our own, as TextArena environments: importing this package registers them with TextArena
(`ta.make(id)` then works for any TextArena agent).

    spy.py   WhoIsTheSpy-v0: SpyRL's "who is the spy" (RLSVR), the game of `stratagem.py --mode spyrl`

Like machinery/, nothing here imports stratagem.py.
"""

from games import spy  # noqa: F401 - registers WhoIsTheSpy-v0
