"""Opponents beyond the mirror (--opponents). Each self-play game is drawn against the policy
itself (the paper's self-play: both seats learn), a frozen past policy or the random legal
player; against a fixed opponent only the learner's seat makes a trajectory.

The past policies are a small pool of snapshots of the learner's trainable weights, one taken
every --past-every steps, the newest --past-pool kept; until the first, the pool holds the
initial policy. One frozen copy of the model plays them all, each game's snapshot loaded into
it before its turn (a swap of CPU tensors); with vLLM the learner's engine generates for it,
taking its weights for the call (Swapped). The pool is part of the checkpoint.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import torch

from machinery import UserError
from machinery.flags import items
from machinery.matches import RandomPlayer


@dataclass
class OpponentFlags:
    """Who the policy plays in self-play's games: stratagem.Args's opponents flags."""

    # --- opponents ---
    opponents: str = "self=1"
    """shares of the games played against the policy itself, a past policy
    and the random legal player, e.g. self=0.6,past=0.2,random=0.2 (the
    paper: self=1; docs/learning.md#opponents)"""
    past_every: int = 0
    """with a past share: steps between snapshots of the learner joining
    the past pool (0: 10)"""
    past_pool: int = 0
    """with a past share: the newest snapshots kept, one drawn per game
    (0: 3)"""
    opponent_baselines: bool = False
    """with --opponents: RAE keeps a baseline per (game, role, fixed
    opponent kind) beside self-play's, instead of one shared by all"""


KINDS = ("self", "past", "random")
PAST_EVERY, PAST_POOL = 10, 3  # what --past-every 0 and --past-pool 0 stand for


def parse(spec: str) -> dict[str, float]:
    """'self=0.6,past=0.2,random=0.2' -> {kind: share}, the kinds of share 0 dropped. Anything
    else is one line: an unknown kind, a share below 0 or no number, shares not summing to 1."""
    shares: dict[str, float] = {}
    for item in items(spec):
        kind, _, value = (x.strip() for x in item.partition("="))
        if kind not in KINDS:
            raise UserError(f"--opponents: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        try:
            share = float(value)
        except ValueError:
            share = math.nan
        if not math.isfinite(share) or share < 0 or kind in shares:
            why = "is given twice" if kind in shares else f"must be a number >= 0, got {value!r}"
            raise UserError(f"--opponents: {kind}'s share {why}")
        shares[kind] = share
    if abs(sum(shares.values()) - 1) > 1e-6:
        raise UserError(f"--opponents: the shares must sum to 1, got {sum(shares.values()):g}")
    return {kind: share for kind, share in shares.items() if share > 0}


def check(args) -> None:
    """--opponents parses, and --past-every and --past-pool come with a past share."""
    shares = parse(args.opponents)
    for name in ("past_every", "past_pool"):
        if getattr(args, name) and "past" not in shares:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} shapes the past pool: give --opponents with a past share")
    if args.opponent_baselines and shares == {"self": 1.0}:
        raise UserError("--opponent-baselines needs --opponents with a past or random share")


def baseline_key(t) -> str:
    """--opponent-baselines: RAE's key of a trajectory, its opponent kind added where that is
    a fixed one (self-play's keys are the paper's, game/playerP)."""
    key = f"{t.game}/player{t.role}"
    return f"{key}/vs-{t.opponent}" if t.opponent else key


def words(shares: dict, every: int, size: int, steps: list[int]) -> str:
    """The mix in words: each kind's share, the past pool's rhythm, what it holds (`steps`) and when
    its next snapshot comes, in the same words for a fresh run and a resumed one (a resumed run's
    pool may still hold the initial policy alone: snapshots come every `every` steps)."""
    said = {"self": "the policy itself", "random": "the random legal player"}
    held = ", ".join(f"{s}{' (the initial policy)' if s == 0 else ''}" for s in steps)
    last = steps[-1] if steps else 0  # no past share: no pool, and these words go unsaid
    following = last - last % every + every  # snapshots come at the multiples of `every`
    said["past"] = (
        f"a past policy (a snapshot every {every} steps, the newest {size} kept; the pool holds "
        f"step{'' if len(steps) == 1 else 's'} {held}; the next snapshot at step {following}; "
        "one more copy of the model in memory, the snapshots on the CPU; with vLLM the engine takes "
        "a past policy's weights for its turns)"
    )
    mix = ", ".join(f"{share:g} {said[kind]}" for kind, share in shares.items())
    return f"opponents: {mix}; only the learner's seat trains against a fixed one"


def planned(args) -> str | None:
    """--dry-run's line for a mix (None for the paper's self=1)."""
    shares = parse(args.opponents)
    every, size = args.past_every or PAST_EVERY, args.past_pool or PAST_POOL
    return None if shares == {"self": 1.0} else words(shares, every, size, [0])


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the weights that learn (a LoRA run's adapters; else all of them)."""
    return {
        n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad
    }


class Past:
    """One snapshot of the pool as a generation engine: it loads its weights into the shared
    frozen copy, then generates as the learner's engine does."""

    def __init__(self, versus: Versus, k: int):
        self.versus, self.k, self.room = versus, k, versus.engine.room

    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        self.versus.load(self.k)
        return self.versus.engine.generate(prompts)


class Swapped:
    """The frozen copy played by the learner's own vLLM engine (one engine on the device): the
    engine takes the copy's weights for the call and the learner's back after it, two weight
    syncs a turn that has past games."""

    def __init__(self, policy, frozen: torch.nn.Module, learner: torch.nn.Module):
        self.policy, self.frozen, self.learner, self.room = policy, frozen, learner, policy.room

    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        self.policy.sync(self.frozen)
        try:
            return self.policy.generate(prompts)
        finally:
            self.policy.sync(self.learner)


class Versus:
    """The run's opponents: their shares, the past pool, and this step's results against
    each fixed kind (metrics.jsonl's "opponents")."""

    def __init__(self, run, state: dict | None = None):
        args = run.args
        self.shares = parse(getattr(args, "opponents", "self=1"))  # spyrl.py has none
        self.mixed = self.shares != {"self": 1.0}
        self.every = getattr(args, "past_every", 0) or PAST_EVERY
        self.size = getattr(args, "past_pool", 0) or PAST_POOL
        self.results, self.pool, self.members = {}, [], []
        self.random = RandomPlayer(random.Random(0))
        self.key = baseline_key if getattr(args, "opponent_baselines", False) else None
        if not self.mixed:
            return
        if run.dist.world > 1:
            raise UserError("--opponents other than self=1 plays on one process for now")
        if "past" in self.shares:
            self.frozen = copy.deepcopy(run.model).requires_grad_(False)
            self.engine = (
                Swapped(run.policy, self.frozen, run.model)
                if getattr(run.policy, "own_weights", False)  # vLLM: its engine holds a copy
                else type(run.policy)(self.frozen, run.tokenizer, args, run.device)
            )
            fresh = [(0, trainable(run.model))]
            self.pool = restored(state, run.model) if state is not None else fresh
            self.members = [Past(self, k) for k in range(len(self.pool))]
            self.loaded = None
        if run.dist.main:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """The start line: each kind's share, and what the past pool holds now."""
        return words(self.shares, self.every, self.size, [s for s, _ in self.pool])

    def begin(self, rng: random.Random) -> None:
        """A step's fresh results, and its random player's stream, drawn from the run's (which
        the checkpoint keeps). Pure self-play draws nothing."""
        self.results = {}
        if "random" in self.shares:
            self.random = RandomPlayer(random.Random(rng.getrandbits(64)))

    def draw(self, rng: random.Random) -> tuple[str, int | None, object | None]:
        """(kind, the learner's seat, the opponent) of a new game. Pure self-play draws
        nothing, so the paper's run keeps its random stream."""
        if not self.mixed:
            return "self", None, None
        kind = rng.choices(list(self.shares), weights=list(self.shares.values()))[0]
        if kind == "self":
            return kind, None, None
        seat = rng.randrange(2)
        if kind == "random":
            return kind, seat, self.random
        return kind, seat, self.members[rng.randrange(len(self.members))]

    def tally(self, kind: str, game: str, outcome: str, invalid: bool) -> None:
        """One ended game against a fixed opponent, from the learner's seat."""
        cell = self.results.setdefault(kind, {}).setdefault(
            game, {"win": 0, "draw": 0, "loss": 0, "invalid": 0}
        )
        cell[outcome] += 1
        cell["invalid"] += invalid

    def load(self, k: int) -> None:
        if self.loaded != k:
            self.frozen.load_state_dict(self.pool[k][1], strict=False)  # the names: restored()
            self.loaded = k

    def snapshot(self, step: int, model: torch.nn.Module) -> None:
        """Every --past-every steps, the learner's weights join the pool (the oldest leaves
        once it holds --past-pool)."""
        if "past" not in self.shares or step % self.every:
            return
        self.pool = [*self.pool, (step, trainable(model))][-self.size :]
        self.members, self.loaded = [Past(self, k) for k in range(len(self.pool))], None

    def state(self) -> dict | None:
        """The pool for the checkpoint (None without a past share)."""
        if not self.pool:
            return None
        return {"steps": [s for s, _ in self.pool], "weights": [w for _, w in self.pool]}


def fits(state: dict, model: torch.nn.Module) -> bool:
    """A saved pool holds as many snapshots as steps, each step a number >= 0 and each snapshot
    the model's trainable weights (their names, shapes and dtypes)."""
    want = {n: (p.shape, p.dtype) for n, p in model.named_parameters() if p.requires_grad}
    steps, weights = state.get("steps"), state.get("weights")
    return (
        isinstance(steps, list)
        and isinstance(weights, list)
        and len(steps) == len(weights) >= 1
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)
        and all(
            isinstance(w, dict)
            and set(w) == set(want)
            and all(
                isinstance(t, torch.Tensor) and (t.shape, t.dtype) == want[n] for n, t in w.items()
            )
            for w in weights
        )
    )


def restored(state: dict, model: torch.nn.Module) -> list[tuple[int, dict]]:
    """A checkpoint's pool, each snapshot checked against the model's trainable weights (names,
    shapes, dtypes) before it is used; anything else is one line."""
    if not fits(state, model):
        raise UserError("--resume: the checkpoint's past pool does not fit this model; restore it")
    return list(zip(state["steps"], state["weights"]))


def kept(every: int, size: int, step: int) -> list[int]:
    """The steps of the snapshots a pool holds after `step` steps: the initial policy (0) and every
    `every`-th step since, the newest `size` of them (Versus.snapshot's rule)."""
    return [0, *range(every, step + 1, every)][-size:]


def shown(steps: list) -> str:
    """A list of steps in a line of bounded length: '0, 1, 2' or '0, 1, ..., 49 (50 in all)'."""
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} in all)"


def pool_problem(args, saved: dict, step: int, model: torch.nn.Module) -> str | None:
    """What is wrong with a checkpoint's 'past_pool' (in `saved`, its trainer_state.pt) for a run of
    these flags resumed at `step`, in words naming the field; None where it is the pool such a run
    holds: null without a past share, else the snapshots of the steps `kept` names, each fitting
    the model. A pool is never rebuilt in place of one that is missing or wrong: the opponents a
    resumed run plays would silently not be the ones it saved."""
    spec = getattr(args, "opponents", "self=1")
    pool, past = saved.get("past_pool"), "past" in parse(spec)
    if not past:
        return (
            None
            if pool is None
            else f"'past_pool' holds a pool, but --opponents {spec} has no past share"
        )
    if pool is None:
        held = "null" if "past_pool" in saved else "missing"
        return f"'past_pool' is {held}, but --opponents {spec} plays past policies from the pool it saves"
    every, size = args.past_every or PAST_EVERY, args.past_pool or PAST_POOL
    steps = pool.get("steps")
    if not (
        isinstance(steps, list)
        and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
    ):
        return "'past_pool' holds no list of snapshot steps"
    want = kept(every, size, step)
    if len(steps) > size:
        why = f"{len(steps)} snapshots, more than --past-pool {size} keeps"
    elif not steps:
        why = "no snapshot"
    elif max(steps) > step:
        why = f"a snapshot of step {max(steps)}, after the checkpoint's step {step}"
    elif any(a >= b for a, b in zip(steps, steps[1:])):
        why = f"snapshots of steps {shown(steps)}, not increasing"
    elif steps != want:
        why = (
            f"snapshots of steps {shown(steps)}, but a snapshot every {every} steps, the newest {size} "
            f"kept, holds those of steps {shown(want)} at step {step}"
        )
    elif not fits(pool, model):
        why = (
            "snapshots that are not this model's trainable weights (their names, shapes or dtypes)"
        )
    else:
        return None
    return f"'past_pool' holds {why}"


def baselines_problem(args, baselines: dict) -> str | None:
    """A baseline of RAE kept against an opponent kind (a key ending in /vs-KIND) that this run does
    not keep one for (no --opponent-baselines, or a kind of no share), in words; else None."""
    spec = getattr(args, "opponents", "self=1")
    kinds = set(parse(spec)) - {"self"} if getattr(args, "opponent_baselines", False) else set()
    for key in baselines:
        kind = key.rpartition("/vs-")[2] if "/vs-" in key else None
        if kind is not None and kind not in kinds:
            keeps = (
                f"those of --opponents {spec}: {', '.join(sorted(kinds))}"
                if kinds
                else "none (no --opponent-baselines)"
            )
            return f"'baselines' holds {key[:80]!r}, but this run's baselines per opponent kind are {keeps}"
    return None
