"""--async-level 1: the learner never waits for the games. Steps 1-3 of step t+1 (the games,
RAE, the judge, A_mod) run on a thread while step t's update runs, played by a second copy of
the weights (the generator) one update behind the learner; the update corrects the lag with a
truncated importance ratio.

    batch       stratagem.train()'s one call: a step's batch (steps 1-3), the next launched
    behaviour   log mu, each response token's log-prob under the weights that played it
    corrected   step 4's token weights times the truncated ratio min(pi / mu, --is-cap)
    join        after the update: the next batch waited for, the run's state put back as it
                was at its launch, so that the step's metrics and checkpoint are the step's

The order at step t: batch t taken (played during update t-1, or played now at the first step
after a start or a resume) -> the generator synced to the learner (theta_{t-1}) -> batch t+1
launched on a thread -> update t (theta_{t-1} -> theta_t) beside it -> joined -> the step's
metrics and checkpoint. Batch t+1 is played by theta_{t-1} and updated from theta_t: one step
behind ("lag" in metrics.jsonl's "async").

What the thread and the learner share: nothing while both run. The thread alone draws from the
run's random streams (torch's sampling, Python's, NumPy's, the run's own) and moves RAE's
baselines, the game lengths, --beta-share's beta and the judge's totals; the update draws none
(the model has no dropout). At the join those are set back to what they were at the launch (and
kept aside for the next step), so that end_step, the evaluation and the checkpoint see what
--async-level 0 sees after step t. The checkpoint also holds the generator's weights
(theta_{t-1}): a resume plays batch t+1 again, identically, before it launches t+2
(docs/speed.md#async-level).

Nothing here imports stratagem.py: the step's functions are passed in.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from machinery import UserError, lora, runfiles, watch


@dataclass
class OverlapFlags:
    """--async-level, the games beside the update: stratagem.Args's overlap flags."""

    # --- overlap ---
    async_level: int = 0
    """0: play, judge, then learn (the paper's loop); 1: the next step's
    games and judge run beside the update, played by the weights one
    update behind, the lag corrected by a truncated importance ratio
    (docs/speed.md#async-level)"""
    is_cap: float = 2.0
    """with --async-level 1: the cap C of the truncated importance ratio
    min(pi/mu, C) each response token's weight is multiplied by"""


# What cannot overlap: {flag: (the values it may take, why not)}, checked before anything runs.
REFUSED = {
    "backend": (
        ("auto", "hf"),
        "--backend vllm: its engine sleeps and wakes around the update on the same device, while "
        "--async-level 1 plays on a second copy of the weights (--backend hf)",
    ),
    "distill": ((False,), "--distill: its heads read the learner's hidden states as it updates"),
    "ppo_epochs": ((1,), "--ppo-epochs > 1: PPO's own ratio to the player would meet the lag's"),
    "judge_budget": (
        (0.0,),
        "--judge-budget: once spent, the batch uses means end_step keeps after it is played",
    ),
    "opponents": (("self=1",), "--opponents: its past pool grows in the step the batch is played"),
}


def check(args, world: int = 1) -> None:
    """--async-level's combinations, each refused in one line where it cannot overlap (flags'
    validate, and again once the engine and the processes are known)."""
    level = getattr(args, "async_level", 0)
    if level == 0:
        if getattr(args, "is_cap", 2.0) != 2.0:
            raise UserError(
                "--is-cap bounds --async-level 1's importance ratio: give --async-level 1"
            )
        return
    if level != 1:
        raise UserError(f"--async-level must be 0 or 1, got {level}")
    if not 1.0 <= args.is_cap <= 1000:
        raise UserError(f"--is-cap must be in [1, 1000], got {args.is_cap}")
    if world > 1:
        raise UserError(
            "--async-level 1 runs in one process: its thread and FSDP's would interleave"
        )
    for name, (allowed, why) in REFUSED.items():
        if getattr(args, name, allowed[0]) not in allowed:
            raise UserError(f"--async-level 1 cannot overlap with {why}")


class Overlap:
    """The generator (a copy of the engine over weights of its own), the step whose update made
    them, the thread and the batch it played, and the run's state at its launch and after it."""

    def __init__(self, run, saved: dict | None):
        self.cap = run.args.is_cap
        self.engine = copy.copy(run.policy)  # stratagem.HFPolicy, over a model of its own
        frozen = {id(p): p for p in run.model.parameters() if not p.requires_grad}
        # deepcopy's memo hands back what it holds: LoRA's frozen base is shared, not copied
        self.engine.model = copy.deepcopy(run.model, frozen).requires_grad_(False)
        self.version = run.start  # the step whose update made its weights (0: the initial ones)
        if saved is not None:  # the weights that play a resumed run's next batch again
            load(self.engine.model, saved["weights"])
            self.version = saved["version"]
        self.thread: threading.Thread | None = None
        self.ready = self.error = self.launch = self.after = None
        self.record: dict = {}
        self.sums = {"ratio": 0.0, "capped": 0.0, "tokens": 0.0}

    def sync(self, run, step: int) -> None:
        """The generator given the learner's weights before update `step` (copied, not shared)."""
        if self.version != step - 1:
            self.version = None  # half-loaded weights are no step's: a stop now saves none of them
            load(self.engine.model, own(run.model))
            self.version = step - 1


def own(model) -> dict[str, torch.Tensor]:
    """The weights the generator holds a copy of: the whole state dict, or with --lora-rank the
    adapters alone (the frozen base is the learner's own tensors)."""
    weights = model.state_dict()
    if lora.is_lora(model):
        return {k: v for k, v in weights.items() if "lora_" in k}
    return weights


def load(model, weights: dict) -> None:
    """`own`'s weights copied into the generator; with LoRA the base is left as it is (shared)."""
    model.load_state_dict(weights, strict=not lora.is_lora(model))


def start(run, state: dict | None) -> Overlap | None:
    """--async-level 1's generator: the learner's weights, or a resumed run's checkpointed ones."""
    if getattr(run.args, "async_level", 0) == 0:
        return None
    check(run.args, run.dist.world)
    if dropout := dropouts(run.model):
        raise UserError(
            f"--async-level 1 needs a model without dropout ({dropout}): the update would draw from "
            "the random streams the thread samples with, and its log pi would not be the player's"
        )
    return Overlap(run, state.get("overlap") if state is not None else None)


def dropouts(model) -> str:
    """The model's dropout in words ("attention_dropout 0.1", "a Dropout of p 0.1"), "" if none."""
    config = getattr(model, "config", None)
    for name, value in sorted(vars(config).items() if config is not None else ()):
        if name.endswith(("dropout", "pdrop")) and isinstance(value, float) and value > 0:
            return f"{name} {value:g}"
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"a Dropout of p {module.p:g}"
    return ""


def checkpointing(args) -> dict | None:
    """gradient_checkpointing_enable's kwargs: at --async-level 1 torch's recompute must not set the
    process's random state back while the thread samples (the model has no dropout: nothing to
    preserve); None, HF's default, at 0."""
    if getattr(args, "async_level", 0) == 0:
        return None
    return {"use_reentrant": False, "preserve_rng_state": False}


def fresh_sums(run) -> None:
    """The ratio's figures zeroed: an update tried again (out of memory) counts its tokens once."""
    if (o := getattr(run, "overlap", None)) is not None:
        o.sums = dict.fromkeys(o.sums, 0.0)


def problem(args, state: dict, model) -> str | None:
    """What trainer_state.pt's 'overlap' (the generator's step and weights) holds that this run
    contradicts, in words: a generator where --async-level is 0, none where it is 1, a step past
    the checkpoint's, weights of another name or shape than the model's."""
    saved, level = state.get("overlap"), getattr(args, "async_level", 0)
    if (saved is not None) != (level == 1):
        has = "null" if saved is None else "a generator's weights"
        return f"'overlap' is {has}, but this run has --async-level {level}"
    if saved is None:
        return None
    if saved["version"] != state["step"] - 1:  # what every checkpoint at level 1 holds
        return f"'overlap' holds step {saved['version']}'s weights, not step {state['step'] - 1}'s"
    mine = own(model)
    theirs = saved["weights"]
    if set(theirs) != set(mine) or any(
        (theirs[k].shape, theirs[k].dtype) != (mine[k].shape, mine[k].dtype) for k in mine
    ):
        return "'overlap' holds weights of another shape or dtype than the model's"
    return None


def saved(run) -> dict | None:
    """state_of's part: the generator's step and (live, not copied) weights; None at level 0."""
    o = getattr(run, "overlap", None)
    if o is None:
        return None
    return {"version": o.version, "weights": own(o.engine.model)}


def current(run, saved: dict | None) -> bool:
    """Whether `saved` (state_of's, maybe taken a step ago) still holds the weights it names: a stop
    after the next launch synced the generator finds them gone, and the last checkpoint stands."""
    o = getattr(run, "overlap", None)
    return saved is None or (o is not None and o.version == saved["version"])


FIELDS = ("baselines", "lengths", "beta")  # the run's fields the thread moves (besides the RNGs)


def state(run) -> dict:
    """The run's fields the thread moves, copied: the RNG states, the baselines, lengths, beta and
    the judge's totals."""
    taken = {f: copy.deepcopy(getattr(run, f)) for f in FIELDS}
    taken["totals"] = copy.deepcopy(run.runner.totals) if run.runner is not None else None
    return taken | {"rng": runfiles.rng_states(run.rng)}


def put(run, taken: dict) -> None:
    """`taken` (state's) set back into the run."""
    for f in FIELDS:
        setattr(run, f, copy.deepcopy(taken[f]))
    if run.runner is not None:
        run.runner.totals = copy.deepcopy(taken["totals"])
    runfiles.set_rng_states(run.rng, taken["rng"])


def batch(run, step: int, rollout, timer: watch.Timer, progress) -> tuple:
    """Step `step`'s batch, `rollout(run, policy, step, timer, progress)` (stratagem's steps 1-3):
    at --async-level 0 played now, exactly as without this call. At 1, the batch the thread played
    beside the last update (played now at a run's first step, or a resume's), its lag recorded; then
    the generator is synced to the learner and the next batch launched (none after the last
    step)."""
    o = run.overlap
    if o is None:
        return rollout(run, run.policy, step, timer, progress)
    if o.ready is not None and o.ready[0] == step:
        _, done, mine, played_by, took = o.ready
        put(run, o.after)  # the run as the thread left it
        for name, seconds in took.items():
            timer.totals[name] = timer.totals.get(name, 0.0) + seconds
        done.timer = timer
    else:  # a run's first step, or a resumed run's: the generator plays it now
        played_by = o.version
        done, mine = rollout(run, o.engine, step, timer, progress)
    o.record = {"played_by": played_by, "lag": step - 1 - played_by}
    done.mod["async"] = o.record  # the update adds the ratio's figures
    o.ready = o.error = o.after = None
    o.sums = dict.fromkeys(o.sums, 0.0)
    o.sync(run, step)
    o.launch = state(run)
    if step < run.args.steps:
        o.thread = threading.Thread(target=play, args=(run, rollout, step + 1), daemon=True)
        o.thread.start()
    return done, mine


def play(run, rollout, step: int) -> None:
    """The thread: step `step`'s batch, played by the generator; an error is kept for the join."""
    o, timer = run.overlap, watch.Timer()
    try:
        quiet = watch.Progress(step, run.args.steps, 1, show=False)
        done, mine = rollout(run, o.engine, step, timer, quiet)
        o.ready = (step, done, mine, o.version, timer.totals)
    except BaseException as e:  # noqa: BLE001 - raised again by join(), on the main thread
        o.error = e


def join(run, timer: watch.Timer) -> None:
    """After the update: the thread waited for ("wait" in time_split_s), its error raised here, the
    run's state kept aside and set back to what it was at the launch; the ratio's figures
    recorded."""
    o = getattr(run, "overlap", None)
    if o is None:
        return
    if o.thread is not None:
        with timer("wait"):
            o.thread.join()
        o.thread = None
        if o.error is not None:
            raise o.error
        o.after = state(run)
        put(run, o.launch)
    tokens = o.sums["tokens"]
    o.record["is_ratio_mean"] = o.sums["ratio"] / tokens if tokens else 1.0
    o.record["is_capped_share"] = o.sums["capped"] / tokens if tokens else 0.0


def behaviour(run, policy, trajs: list, micro_batches, forward) -> None:
    """--async-level 1: each turn's log mu (turn.behaviour, [r]), its response's log-probs under
    the weights that played it, scored by `forward(run, chunk, model)` on the generator's copy in
    the micro-batches step 4 will use, so that on equal weights the ratio is exactly 1."""
    if getattr(run, "overlap", None) is None:
        return
    with torch.no_grad():
        for chunk in micro_batches(run, trajs)[0]:
            logps = forward(run, chunk, policy.model)[0]  # [b, R]
            for item, row in zip(chunk, logps):
                item[3].behaviour = row[row.shape[0] - len(item[1]) :].float().cpu()  # [r]


def corrected(run, logps: torch.Tensor, chunk: list, weights: torch.Tensor) -> torch.Tensor:
    """Step 4's token weights with the lag corrected: times the truncated importance ratio
    min(pi_theta / mu, C) per response token (truncated IS, C = --is-cap), pi_theta the learner's
    (detached: the gradient stays REINFORCE's), mu the player's. At --async-level 0 the weights
    are returned untouched and nothing is computed. logps, weights [b, R] -> [b, R]"""
    o = getattr(run, "overlap", None)
    if o is None:
        return weights
    pi = logps.detach().float()  # [b, R]
    mu, mask = pi.clone(), torch.zeros_like(pi)  # [b, R]: padding's ratio 1, weight 0
    for i, item in enumerate(chunk):
        if r := len(item[1]):
            mu[i, pi.shape[1] - r :] = item[3].behaviour.to(pi.device)
            mask[i, pi.shape[1] - r :] = 1.0
    ratio = torch.exp(pi - mu)  # [b, R]
    o.sums["ratio"] += (ratio.clamp(max=o.cap) * mask).sum().item()
    o.sums["capped"] += ((ratio > o.cap).float() * mask).sum().item()
    o.sums["tokens"] += mask.sum().item()
    return weights * ratio.clamp(max=o.cap).to(weights.dtype)  # [b, R]
