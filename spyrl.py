"""SpyRL: open-ended reasoning learned by playing "who is the spy", with rule-checked rewards and no judge.

RLSVR (self-play RL with self-verifiable rewards; Wang et al. 2026, arXiv 2607.23802): n copies of one policy do
the same open-ended task (a summary, a story, a maths solution); one of them, the spy, was given the input with a
fifth of it removed (40 % for maths). Every copy then reads all n outputs and votes on who the spy is. Votes are
checked by rule, so the rewards need no judge:

    detection    r_i^D = 1[v_i = u]: a civilian's vote is right or wrong                 (group-relative, GRPO)
    performance  r_u^P = beta (s_c - s_u),  r_cj^P = -r_u^P / (n - 1) - lambda (s_cj - s_c)  (zero-sum; RAE per role)

with s_k seat k's share of the votes. Each step alternates the phase it trains (--spy-alternate); the update is
a GRPO-style clipped objective with a k3 KL penalty to the initial policy. The game is games/spy.py's
WhoIsTheSpy-v0; what is reconstructed from the description (its formula images are missing) is listed in
docs/spyrl.md. This file is that algorithm's loop; everything else (generation, RAE, the update, the run's
files) is imported from stratagem.py, as CleanRL keeps one algorithm per file.

    python spyrl.py --tiny --steps 3                                  # offline, CPU, pydoc topics as texts
    python spyrl.py --spy-data govreport.jsonl --steps 100            # the paper's run (docs/spyrl.md)
    python spyrl.py --help
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import stratagem as S
from games import spy
from machinery import cli, flags, lifecycle, watch
from machinery.distributed import leave
from machinery.saved_config import saved_config


@dataclass
class Args(S.Args):
    """SpyRL's flags: stratagem.py's (those of the judge and of the two-player games hidden), with its own below."""

    mode: str = "spyrl"
    """spyrl: who is the spy (recorded in config.json, read by plot and show)"""
    tiny_init: str = "warm"
    """--tiny's weights: warm (warmstart/spy, taught the game's format on uniformly random outputs and votes: its
    votes are valid) or random (built from --seed: it names no seat, every vote invalid)"""
    ppo_epochs: int = 2
    """Adam steps per batch; the clipped objective binds from the second (RLSVR: 'a GRPO-style clipped objective';
    the number is not given: 2, as SPIRAL's code)"""
    kl_coef: float = 0.04
    """weight of the per-token k3 KL penalty to the initial policy (RLSVR: 'KL regularisation'; 0.04, DeepSeekMath's)"""
    # --- SpyRL ---
    spy_data: str = ""
    """task data, JSONL: one {"text": ..., "reference": ... (optional, for ROUGE-L)} a line (--tiny: Python's pydoc
    topics)"""
    spy_task: str = "summarize"
    """what the players do with a text: summarize, write (a story for a prompt) or math (solve it)"""
    spy_players: int = 5
    """players n of a game, all the same policy, one of them the spy (RLSVR: 5)"""
    spy_mask: float = 0.2
    """fraction of the text removed for the spy: sentences when it has enough, else words (RLSVR: 0.2; maths 0.4)"""
    spy_beta: float = 1.0
    """beta of the performance reward r_spy = beta*(civilians' mean vote share - spy's share) (RLSVR: named, no
    value)"""
    spy_lambda: float = 0.5
    """lambda: a civilian also pays lambda*(its vote share - the civilians' mean) (RLSVR: named, no value)"""
    spy_alternate: int = 1
    """K steps train only the outputs, then K only the votes, and so on; both are played every step (0: train both)"""


# stratagem.py's flags that mean nothing here: the judge, the modulation, the two-player games' rules
HIDDEN = {
    *(name for name in Args.__dataclass_fields__ if name.startswith(("judge", "distill"))),
    *"mode beta no_psi games max_turns error_allowance invalid_rewards rejected_rewards action_rule".split(),
    *"beta_share beta_horizon beta_min beta_max async_level is_cap".split(),  # no --async-level
}
CHOICES = {**flags.CHOICES, "mode": ("spyrl",), "spy_task": tuple(spy.TASKS)}
PRESETS = {
    ("tiny", True): S.TINY_DEFAULTS,
    ("spy_task", "math"): dict(spy_mask=spy.MASKS["math"]),
}  # RLSVR's mask
BOUNDS = [
    (("spy_beta", "spy_lambda", "spy_alternate"), lambda v: v >= 0, ">= 0"),
    (("spy_players",), lambda v: v >= 3, ">= 3"),
    (("spy_players",), lambda v: v <= 1000, "<= 1000"),
    (("spy_mask",), lambda v: 0 < v < 1, "in (0, 1)"),
    (("spy_beta", "spy_lambda"), lambda v: v <= 1000, "<= 1000"),
    (("spy_alternate",), lambda v: v <= 10**9, "<= 1000000000"),
]


WARM_START = (
    Path(__file__).parent / "warmstart" / "spy"
)  # `stratagem.py warmstart` rebuilds it (docs/spyrl.md)


def validate(args: Args) -> None:
    """stratagem.py's checks of the flags shared, then SpyRL's own bounds and warm start."""
    S.validate(args)
    flags.check_bounds(args, BOUNDS)
    if args.tiny and args.tiny_init == "warm" and not (WARM_START / "config.json").is_file():
        recipe = "--games WhoIsTheSpy-v0 --moves 3000 --steps 600"
        raise S.UserError(
            f"the warm start {WARM_START} is missing: python stratagem.py warmstart {WARM_START} {recipe}"
        )


def load_learner(args: Args, ckpt, dist, device):
    """stratagem.py's loader, with --tiny's warm start SpyRL's own (warmstart/spy): the same code path as --model."""
    if args.tiny and args.tiny_init == "warm":
        args = dataclasses.replace(args, tiny=False, model=str(WARM_START))
    return S.load_learner_and_engine(args, ckpt, dist, device)


def build_parser():
    presets = {"--tiny": S.TINY_DEFAULTS, "--spy-task math": PRESETS[("spy_task", "math")]}
    doc = __doc__.split("\n\n")[0]
    return flags.dataclass_parser(Args, CHOICES, presets, HIDDEN, prog="spyrl.py", description=doc)


def resolve_args(explicit: dict, saved: dict | None = None) -> Args:
    return flags.resolve(Args, explicit, saved, flags.RESUMABLE, PRESETS, validate)


def parse_args(argv: list[str]) -> Args:
    """The run's Args, as stratagem.py's parse_args, with SpyRL's own flags, presets and checks."""
    explicit = vars(build_parser().parse_args(argv))
    return resolve_args(
        explicit, saved_config(explicit, Args, "spyrl.py", CHOICES, flags.BOUNDS + BOUNDS)
    )


def spy_play(
    policy, tokenizer, args: Args, texts: list[dict], rng: random.Random, timer, target: int, phases
):
    """Games enough for the turns of `phases` to reach `target`, --num-envs at a time, TWO generate calls a wave
    (spy.play: every seat's output, then every vote). One trajectory per seat and paid phase (the spy's vote is
    not paid)."""
    n_games = spy.games_needed(target, args.spy_players, phases)
    games = [spy.new_game(texts, args, rng.randrange(2**31)) for _ in range(n_games)]

    def generate(observations: list[str]):
        return policy.generate(
            [S.format_prompt(tokenizer, obs, 0, "{observation}") for obs in observations]
        )

    moves, calls = spy.play(games, generate, args.num_envs, timer)
    trajs = [
        S.Trajectory(spy.GAME, p, [S.Turn(*moves[g][p, k])], r, info=info)
        for g, env in enumerate(games)
        for p, k, r, info in env.results()
    ]
    return trajs, spy.outcomes(trajs), calls


def vote_groups(parts: list[list[S.Trajectory]]) -> list[list[S.Trajectory]]:
    """GRPO's groups: the civilians' votes of one game (keyed by the rank that played it and the game's seed:
    two games of one seed would be the same situation, the same text and the same spy)."""
    groups: dict[tuple[int, int], list] = {}
    for rank, part in enumerate(parts):
        for t in part:
            if t.info["phase"] == "detection":
                groups.setdefault((rank, t.info["seed"]), []).append(t)
    return list(groups.values())


def text_room(args: Args) -> tuple[int | None, object]:
    """(room, count) for spy.load_texts: the tokens a --spy-data text may take in the model's context
    (spy.text_room), and how they are counted: by the model's own tokenizer where it is on disk, else by UTF-8
    bytes (the tiny model's byte-level tokenizer takes at most a token a byte). (None, None) where the context is
    not known before the model is loaded."""
    context = S.context_length(args)
    if context is None:
        return None, None
    count = None
    if not args.tiny:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(
                os.path.expanduser(args.model), local_files_only=True, trust_remote_code=False
            )
            count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
        except (
            OSError,
            ValueError,
        ):  # not on disk after all: bytes, an upper bound for byte-level tokenizers
            pass
    return spy.text_room(
        context, args.spy_task, args.spy_players, args.max_new_tokens, count
    ), count


def train(args: Args) -> Path | None:
    """RLSVR's loop: play (outputs, then votes), rewards by rule, advantages (RAE per role for the outputs,
    group-relative for the votes), and the clipped update on this step's phase. Run files, metrics and the
    checkpoint are machinery/lifecycle.py's, as in stratagem.py."""
    texts = spy.load_texts(
        args.spy_data, args.spy_mask, args.tiny, *text_room(args)
    )  # checked whole, before --out
    pieces = lifecycle.Pieces(load_learner, S.make_env, S.seed_everything, S.model_shape)
    run = lifecycle.start_run(args, pieces)
    if run is None:  # --dry-run, or a resumed run that had already finished
        return None
    for step in range(run.start + 1, args.steps + 1):
        timer, target = (
            watch.Timer(),
            math.ceil(args.batch_size / run.dist.world),
        )  # each rank plays its share
        progress = watch.Progress(step, args.steps, target, show=run.dist.main)
        phases = spy.trained_phases(
            step, args.spy_alternate
        )  # --spy-alternate: outputs or votes this step

        # ---- play: every seat writes its output (performance), then reads all of them and votes (detection) ----
        mine, outcomes, calls = spy_play(
            run.policy, run.tokenizer, args, texts, run.rng, timer, target, phases
        )
        trajs, parts = lifecycle.whole_batch(run.dist, mine)
        mod, extra = {}, None
        if run.dist.main:
            # ---- advantages: outputs against their role baseline (RAE keyed task/role), votes within their game ----
            outputs = [t for t in trajs if t.info["phase"] == "performance"]
            S.rae_advantages(outputs, run.baselines, args.ema, key=lambda t: t.info["key"])
            S.group_advantages(vote_groups(parts))
            mod = S.modulate(trajs, {}, [], args.beta)  # no judge: phi = 1, psi = 0: A_mod = A_game
            extra = {"spy": spy.step_metrics(trajs, phases)}
        lifecycle.share_advantages(run.dist, parts, mine)

        # ---- update: this step's phase, a GRPO-style clipped objective + k3 KL to the initial policy ----
        learn = [t for t in mine if t.info["phase"] in phases]
        transitions = sum(len(t.turns) for t in trajs if t.info["phase"] in phases)
        update = S.reinforce(run, learn, transitions, timer, progress)
        done = lifecycle.Step(step, timer, trajs, (outcomes, calls), {}, {}, mod, update)
        done.evaluation, done.extra = S.periodic_eval(run, step, timer), extra
        lifecycle.end_step(run, done)
    S.best_on_fresh_games(run)  # --keep-best: the kept policy on games it was not chosen on
    return lifecycle.finish_run(run)


def main(argv: list[str] | None = None) -> int:
    return cli.main("spyrl", sys.argv[1:] if argv is None else argv, parse_args, train, {})


if __name__ == "__main__":
    leave(main())
