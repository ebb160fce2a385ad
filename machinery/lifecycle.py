"""A training run's life cycle, around Algorithm 1's loop: what a reader of the algorithm can skip.

    start_run       every check that can fail, before --out is claimed; the policy, the judge, the run's files;
                    a resumed run's state read back from its checkpoint
    halve_on_oom    step 4's update where the memory projection was wrong: out of memory, the micro-batch
                    halved and the step tried once more
    whole_batch     every rank's trajectories in one batch (rank 0 computes A_game and A_mod over it), and
    share_advantages    A_mod handed back to the rank that played each trajectory
    first_eval      --eval-every's point before the first update (step 0), the start of the learning curve
    end_step        the step's metrics.jsonl line, trajectories.jsonl, the step line, the checkpoint; --keep-best
    finish_run      the end-of-run alarm, the engines and the process group closed (main() prints the closing line)

stratagem.py's train() (and spyrl.py's) call each of these in one line. What they need of the trainer (how the
policy is loaded, how an env is made, how everything is seeded) is passed in: nothing here imports stratagem.py.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

import judge_prompts
from machinery import (
    UserError,
    adaptive_beta,
    costs,
    coverage,
    distill,
    distributed,
    flags,
    memory,
    modelfiles,
    opponents,
    overlap,
    runfiles,
    truth,
    watch,
)
from machinery.distributed import (
    Dist,
    load_optimizer_state,
    pick_backend,
    pick_device,
    pick_threads,
)
from machinery.judge import JudgeRunner, make_judge


@dataclass
class RunFlags:
    """A run's folder, its saving, seeding aside, and how it is watched: stratagem.Args's run flags."""

    # --- run ---
    out: str = ""
    """run directory (default runs/<mode>-s<seed>-<date>); an existing one
    needs --resume"""
    resume: bool = False
    """continue the run in --out from its last checkpoint, exactly where it
    stopped"""
    save_every: int = 50
    """write a checkpoint every N steps (the last step is always saved)"""
    report_to: str = "none"
    """also stream every scalar of metrics.jsonl to tensorboard
    (<out>/tensorboard) or wandb"""
    dry_run: bool = False
    """print the plan (model, engine, games, judge requests, money, memory)
    and exit; nothing is loaded or written"""
    dist_timeout: float = 0.0
    """torchrun: seconds a rank waits in a collective before the run fails;
    0: 30 min + the longest a step's judging can take"""


@dataclass
class Pieces:
    """What a run's life cycle needs of the trainer above it, passed in (nothing here imports it):
    `load(args, checkpoint, dist, device)` -> (model, tokenizer, generation engine, KL reference or
    None, optimizer); `make_env` (the judge's cost projection plays a few games); `seed(seed)` -> the
    run's own Random (its seeding block); `shape(args)` -> the model's config fields or None
    (--dry-run's memory projection, --micro-batch-size auto's); `spot(game, observation)` -> a turn's
    decision spot or None (the coverage guard's, games/spots.py)."""

    load: object
    make_env: object
    seed: object
    shape: object = None
    spot: object = None


@dataclass
class Run:
    """What a training run carries from step to step. Rank 0 alone judges, writes and prints."""

    # what it is and plays with
    args: RunFlags  # stratagem.Args (or spyrl.py's)
    dist: Dist
    out: Path
    device: torch.device
    games: list[str]
    eval_games: list[str]
    rng: random.Random  # our own draws (games, judge sampling); checkpointed
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer (or the tiny byte-level one)
    policy: object  # the engine: stratagem.HFPolicy or vllm_engine.VLLMPolicy
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None  # --kl-coef: the initial policy, frozen
    spot: Callable | None = None  # Pieces.spot: the coverage guard's reading of a turn
    # the algorithm's state, checkpointed
    baselines: dict[str, float] = field(default_factory=dict)  # RAE: b[G, p], "game/playerP"
    beta: float | None = None  # --beta-share: where its controller moved beta (None: --beta)
    lengths: dict[str, float] = field(default_factory=dict)  # transitions a game, to size a step
    start: int = 0  # steps already done (a resumed run)
    elapsed: float = 0.0
    recent: list = field(default_factory=list)  # judged steps' means: modulation.after_budget
    first_spots: dict | None = None  # the coverage guard: step 1's spots (coverage.of_step)
    # the extensions' and the judge's
    distiller: distill.Distiller | None = None  # --distill: the heads (rank 0)
    versus: opponents.Versus | None = None  # --opponents: the kinds, the past pool
    overlap: overlap.Overlap | None = None  # --async-level 1: the generator and its thread
    runner: JudgeRunner | None = None
    reproject: Callable | None = None  # (steps, counts) -> the judge's projection, after step 1
    judged: int = 0  # trajectories judged over this process's steps: the end-of-run alarm
    failures: Counter = field(default_factory=Counter)
    # watching and stopping
    reporter: watch.Reporter | None = None
    announced: bool = False  # the judge budget's banner is shown once
    warned: set = field(default_factory=set)  # the guard's lines said once
    truth: truth.History = field(default_factory=truth.History)  # the judge vs the best reply
    updates: int = 0  # optimizer steps taken (--ppo-epochs a step): check_update names the step
    finished: tuple | None = None  # (step, updates, state_of) of the last step that ended
    saving: int | None = None  # the step of the last checkpoint begun


@dataclass
class Start:
    """What start_run learns before it loads anything: the processes, the device and engine, the
    checkpoint to resume, the judge and its projected cost."""

    dist: Dist
    out: Path
    device: torch.device
    engine: str  # the engine taken, and why (the start line)
    threads: int
    ckpt: Path | None  # the checkpoint to resume (None: a fresh run, or no save yet)
    steps_left: int
    reproject: object  # (steps, counts) -> the judge's projection, or None
    projection: dict | None
    judge: object  # machinery/judge.py's judge, or None (none asked, or not rank 0)
    chose: str = ""  # --micro-batch-size auto's choice, said on the start line
    asked: str = "auto"  # the --backend asked: config.json keeps it, so a resume chooses again
    reporter: object = None  # --report-to's watch.Reporter (rank 0), its package imported


def start_run(args, pieces: Pieces) -> Run | None:
    """Everything before the first step: every check that can fail (flags, games, devices, outputs,
    the checkpoint to resume) before --out is claimed, then the policy and the judge (a fresh --out
    whose run fails to start is removed again), then the run's files. Returns None, touching
    nothing, for --dry-run (the plan printed) and for a resumed run that has already done --steps."""
    watch.quiet_transformers()
    start = preflight(args, pieces)
    if start is None:
        return None
    if start.dist.main:
        claim_and_announce(args, start)
    run = load_run(args, start, pieces)
    state = restore(run, start.ckpt) if start.ckpt is not None else None
    if start.ckpt is None and run.dist.main:
        (run.out / "checkpoints").mkdir(exist_ok=True)
    run.versus = opponents.Versus(run, state.get("past_pool") if state is not None else None)
    run.overlap = overlap.start(run, state)  # --async-level 1 (None: 0)
    if run.dist.main:
        open_run_files(run, start, state)
    return run


def preflight(args, pieces: Pieces) -> Start | None:
    """The checks that touch nothing: the device and engine, the checkpoint to resume, the judge's
    projected cost, the micro-batch and the output folder. None once --dry-run has printed its plan,
    or for a run with nothing left to do."""
    dist, out = Dist(args), Path(args.out)
    if args.keep_best and dist.world > 1:
        raise UserError("--keep-best saves rank 0's evaluated policy: run it without torchrun")
    device = pick_device(args.device, dist.local_rank)
    threads = pick_threads(device)  # torch's intra-op threads: OMP_NUM_THREADS, else half the cores
    requested = args.backend
    args.backend, engine = pick_backend(args.backend, device)  # config.json: open_run_files
    if requested == "auto" and args.backend == "vllm" and args.async_level:
        args.backend, engine = "hf", "auto: --async-level 1 plays on a second copy, with HF"
    overlap.check(args, dist.world)  # --async-level 1: one process, HF's engine
    if args.resume and dist.main:  # another job may be in the middle of a save: refused first
        runfiles.check_not_in_use(out)
    ckpt = None  # a LoRA run's checkpoint holds its adapter in place of the model
    if args.resume:
        ckpt = runfiles.resume_checkpoint(out, args.steps, dist.world, args.lora_rank > 0)
    done = runfiles.checkpoint_step(ckpt) if ckpt is not None else 0
    steps_left = args.steps - done
    reproject = judge_projector(args, pieces, dist, steps_left)
    projection = reproject(steps_left, measured_so_far(out, done)) if reproject else None
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    shape = pieces.shape(args) if pieces.shape else None
    if args.dry_run:
        if dist.main:
            fit = memory.plan_lines(args, shape, device, dist.world, total, requested)
            games = flags.items(args.games)
            print(costs.plan(args, out, games, device, engine, projection, fit))
        dist.close()
        return None
    # SPIRAL: none, unless shadowed; none either for a run with only its end-of-run work left
    judge = make_judge(args) if args.asked and dist.main and steps_left else None
    # a re-queued job ends cleanly, once the end of the run is done too (--keep-best's fresh games)
    if ckpt is not None and steps_left == 0 and not best_unmeasured(args, out):
        if dist.main:
            print(
                f"{out} is already finished ({args.steps} of {args.steps} steps); nothing to do "
                f"(pass --resume --steps N with N > {args.steps} to train it further)"
            )
        dist.close()
        return None
    # --micro-batch-size auto: chosen for this device before the policy loads (its checkpointing
    # with it); rank 0's choice on every rank (a CPU's free memory differs between them)
    known = shape if args.micro_batch_size == "auto" else None
    chose = memory.fit(args, known, device, dist.world, total, requested)
    args.micro_batch_size, args.gradient_checkpointing = dist.broadcast(
        (args.micro_batch_size, args.gradient_checkpointing)
    )
    if dist.main:
        check_out(args, out, judge)
    start = Start(
        dist, out, device, engine, threads, ckpt, steps_left, reproject, projection, judge
    )
    start.chose, start.asked = chose, requested
    if args.report_to != "none" and dist.main:  # before --out is touched: a missing package
        start.reporter = watch.Reporter(args.report_to)
    return start


def judge_projector(args, pieces: Pieces, dist: Dist, steps_left: int):
    """(steps, counts) -> the judge's projected requests and cost, where a judge is paid (or
    --dry-run prices it); else None."""
    paid = args.dry_run or args.judge_kind.requests
    if not (args.asked and dist.main and steps_left and paid):
        return None
    return functools.partial(costs.judge_projection, args, flags.items(args.games), pieces.make_env)


def measured_so_far(out: Path, done: int) -> dict | None:
    """A resumed run projects from what its own policy played: its metrics up to the checkpoint."""
    if not done or not (out / "metrics.jsonl").exists():
        return None
    path = out / "metrics.jsonl"
    steps = [m for m in runfiles.read_jsonl(path) if "transitions" in m]  # not step 0's evaluation
    steps = [m for m in steps if m.get("step", math.inf) <= done]
    for m in steps:
        counts = [m.get(k) for k in ("trajectories", "judge_judged", "judge_failed", "transitions")]
        rules = m.get("judge_evolution_rules")
        counts += list(rules.values()) if isinstance(rules, dict) else [None]
        if not all(type(n) is int and 0 <= n <= 10**9 for n in counts):
            raise UserError(
                f"--resume: {path}, step {str(m.get('step'))[:20]}: its counts of trajectories, "
                "judgements and transitions are not whole numbers of a sane size; restore the file"
            )
    return costs.measured(steps)


def check_out(args, out: Path, judge) -> None:
    """--out is a folder this run may write (a fresh run's must not exist yet), and so is the judge's
    cache."""
    runfiles.check_writable_dir(out, "--out")  # first: a file or a dangling link is said as such
    if not args.resume and out.exists():
        if (out / "config.json").exists():
            raise UserError(
                f"{out} already exists; pass --resume to continue it, or choose another --out"
            )
        raise UserError(
            f"{out} already exists and is no run folder (no config.json): choose another --out"
        )
    if judge is not None and args.judge_cache:
        runfiles.check_writable_file(Path(args.judge_cache), "--judge-cache")


def claim_and_announce(args, start: Start) -> None:
    """Rank 0: the judge's probe first (before the run folder exists, anything is said or paid),
    then the run folder claimed and the start lines printed."""
    judge = start.judge
    checked = judge.check_reachable() if judge is not None and judge.requests else None
    runfiles.claim_run(start.out, fresh=not args.resume)  # released by main() or finish_run()
    structured = judge.structured if judge is not None and judge.requests else None
    line = watch.start_line(
        args, start.out, start.device, start.engine, start.threads, start.dist.world, structured
    )
    print(line + (f" | {start.chose}" if start.chose else ""), flush=True)  # auto: which and why
    if start.projection is not None:
        print("\n".join(costs.projection_lines(args, start.projection)), flush=True)
    if checked:
        print(checked, flush=True)
    what = start.ckpt or (watch.tiny_model(args) if args.tiny else args.model)
    print(f"loading the policy: {what} ...", flush=True)


def load_run(args, start: Start, pieces: Pieces) -> Run:
    """The policy, its engine and optimizer loaded, and the Run that carries them, its hooks set:
    every update checked, a stop held during the update and saved after it."""
    t_load = time.perf_counter()
    loaded = pieces.load(args, start.ckpt, start.dist, start.device)
    if start.dist.main:
        took = time.perf_counter() - t_load
        print(f"loaded in {took:.1f}s; self-play begins (one line per step)", flush=True)
    model, tokenizer, policy, reference, optimizer = loaded
    where = (start.dist, start.out, start.device)
    games = flags.items(args.games)  # checked by the trainer's validate()
    eval_games = flags.items(args.eval_games) if args.eval_every else []
    rng = pieces.seed(args.seed + start.dist.rank)  # rank 0 of N draws what one process draws
    run = Run(args, *where, games, eval_games, rng, model, tokenizer, policy, optimizer, reference)
    run.spot = pieces.spot
    run.beta = adaptive_beta.first(args)
    run.reproject = start.reproject
    optimizer.register_step_post_hook(functools.partial(check_update, run))
    optimizer.register_step_pre_hook(lambda *_: held(run))  # from here, a stop waits for the save
    distributed.ON_STOP[:] = [functools.partial(keep_step, run)]  # cli.main, on a stop
    if args.distill and start.dist.main:
        run.distiller = distill.Distiller(model.config.hidden_size, args)
    return run


def restore(run: Run, ckpt: Path) -> dict:
    """A resumed run's state read back from its checkpoint (the baselines, the step, the optimizer,
    the random streams, ...), its engine synced to the weights. Returns trainer_state.pt."""
    args, model = run.args, run.model
    state = load_finite(ckpt / "trainer_state.pt", runfiles.TRAINER_STATE)
    own = load_finite(ckpt / f"rank{run.dist.rank}.pt", runfiles.RANK_STATE)
    check_state(run, ckpt, state, own)
    run.baselines, run.start, run.elapsed = state["baselines"], state["step"], state["elapsed"]
    recent = state.get("recent", [])  # a checkpoint written before it was kept has none
    run.recent = [dict(zip(("phi", "psi"), r)) if isinstance(r, list) else r for r in recent]
    run.lengths = own["lengths"]
    run.first_spots = state.get("first_spots")
    run.beta = adaptive_beta.resumed(args, state.get("beta"))
    try:  # what the schema cannot see: an optimizer or heads' state of another shape
        load_optimizer_state(model, run.optimizer, state["optimizer"])
        if run.distiller is not None:
            run.distiller.load_state_dict(state["distill"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        why = " ".join(str(e).split())[:160]
        raise UserError(
            f"--resume: {ckpt} does not fit this run ({type(e).__name__}: {why}); restore it"
        ) from None
    runfiles.set_rng_states(run.rng, own["rng"])
    run.policy.sync(model)
    return state


# The optimizer's settings a checkpoint's param_groups carry, which torch's load_state_dict would put
# in place of those this run's flags give (--lr, --adam-betas) and make_optimizer's.
OPTIMIZER_SETTINGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def state_problems(run: Run, state: dict) -> list[str]:
    """What trainer_state.pt holds that this run's own flags and the checkpoint's step contradict, in
    words naming each field: the past pool and the baselines per opponent kind (machinery/opponents.py),
    beta where it is fixed or outside --beta-min/--beta-max, the judge's totals of a run with no judge
    (or none where it has one, or below 0), the seconds spent, --distill's heads, the optimizer's
    settings against the flags'."""
    args, bad = run.args, []
    bad.append(opponents.pool_problem(args, state, state["step"], run.model))
    bad.append(opponents.baselines_problem(args, state["baselines"]))
    bad.append(overlap.problem(args, state, run.model))
    if "beta" in state:  # a checkpoint written before it was kept has none: adaptive_beta.resumed
        beta, low, high = state["beta"], args.beta_min, args.beta_max
        if not args.beta_share and beta is not None:
            bad.append(f"'beta' is {beta:g}, but this run's beta is fixed (no --beta-share)")
        elif args.beta_share and not (beta is not None and low <= beta <= high):
            bad.append(
                f"'beta' is {beta}, not in this run's [--beta-min, --beta-max] = [{low}, {high}]"
            )
    totals = state["judge_totals"]
    if bool(args.asked) != (totals is not None):
        has = (
            "a judge's totals, but this run asks no judge"
            if totals is not None
            else "null, but this run asks a judge"
        )
        bad.append(f"'judge_totals' is {has}")
    elif totals and min(totals.values()) < 0:
        key = min(totals, key=totals.get)
        bad.append(f"'judge_totals' holds {key[:40]!r} {totals[key]:g}, below 0")
    if state["elapsed"] < 0:
        bad.append(f"'elapsed' is {state['elapsed']:g} seconds, below 0")
    if (state.get("distill") is not None) != bool(args.distill):
        bad.append(
            "'distill' is null, but this run has --distill"
            if args.distill
            else "'distill' holds --distill's heads, but this run has no --distill"
        )
    saved = state["optimizer"]["param_groups"]
    if isinstance(saved, list) and len(saved) == len(run.optimizer.param_groups):
        for group, mine in zip(saved, run.optimizer.param_groups):
            for key in OPTIMIZER_SETTINGS:
                if isinstance(group, dict) and key in group and not same(group[key], mine[key]):
                    bad.append(f"'optimizer' has {key} {group[key]}, but this run's is {mine[key]}")
    return [b for b in bad if b]


def same(a, b) -> bool:
    """Two optimizer settings alike (a tuple saved may come back a list)."""
    return (list(a) if isinstance(a, tuple | list) else a) == (
        list(b) if isinstance(b, tuple | list) else b
    )


def rank_problems(run: Run, own: dict) -> list[str]:
    """What rank<r>.pt holds that this run contradicts: game lengths of a game it does not play, or
    outside what --max-turns lets a game last (a game's moves, both seats', are at most --max-turns)."""
    most = getattr(run.args, "max_turns", math.inf)
    for game, length in own["lengths"].items():
        if game not in run.games:
            return [f"'lengths' holds {game[:80]!r}, a game this run does not play (--games)"]
        if not 1 - 1e-6 <= length <= most + 1e-6:  # an average of whole games' moves
            return [f"'lengths' holds {length:g} moves for {game}, outside [1, --max-turns {most}]"]
    return []


def check_state(run: Run, ckpt: Path, state: dict, own: dict) -> None:
    """Every field of the checkpoint's run state checked against this run's own flags and step before
    anything trains (what the schema, runfiles.TRAINER_STATE, cannot see): the first contradiction is
    one line naming the file and the field. Nothing is rebuilt in place of what is wrong."""
    for path, problems in (
        (ckpt / "trainer_state.pt", state_problems(run, state)),
        (ckpt / f"rank{run.dist.rank}.pt", rank_problems(run, own)),
    ):
        if problems:
            raise UserError(f"--resume: {path}: {problems[0]}; restore it")


def open_run_files(run: Run, start: Start, state: dict | None) -> None:
    """Rank 0: the logs replayed to the checkpoint on a resume, the reporter, config.json, and the
    judge's runner with its cache and ledger."""
    args, out = run.args, run.out
    if args.resume:  # lines logged after the checkpoint are replayed (none: step 0's evaluation)
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            runfiles.truncate_jsonl(out / name, run.start if start.ckpt else -1)
        metrics = out / "metrics.jsonl"  # the judged means and evaluations so far, again
        if metrics.exists():
            run.truth = truth.History.replay(r for _, r in runfiles.iter_jsonl(metrics))
        print(
            f"resuming {out} from step {run.start}"
            if start.ckpt
            else f"resuming {out}: it has no checkpoint yet, so it starts again from step 0 "
            "with its saved config"
        )
    if start.reporter is not None:
        start.reporter.open(out, args, run.start)  # if it fails, a fresh --out goes with it
    run.reporter = start.reporter
    # The engine --backend auto took is the start line's; config.json keeps the --backend asked, so
    # that a resume chooses again and says why in the first run's words (a micro-batch auto chose is
    # kept as the number: a resume continues with it, docs/speed.md#will-it-fit-before-the-run).
    config = flags.as_config(args) | {"backend": start.asked}
    if changes := runfiles.write_config(out, config, run.start):
        print(changes, flush=True)
    if start.judge is None:
        return
    cache_path = Path(args.judge_cache) if args.judge_cache else out / "judge_cache.jsonl"
    cache = runfiles.JudgeCache(cache_path)
    if cache.skipped:
        print(
            f"judge cache: skipped {cache.skipped} unreadable or invalid line(s) of {cache.path}; "
            "their requests are made again",
            file=sys.stderr,
        )
    ledger = out / "judge_ledger.jsonl" if start.judge.requests else None
    totals = state["judge_totals"] if state is not None else None
    run.runner = JudgeRunner(start.judge, args, cache, ledger, totals)
    if run.runner.budget_exhausted():
        watch.announce_budget(run.runner.totals["cost"], args.judge_budget, run.start)
        run.announced = True


def out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: torch.OutOfMemoryError (CUDA's, or another device's), Python's MemoryError,
    or the RuntimeError of torch's CPU allocator ("can't allocate memory")."""
    return isinstance(e, torch.OutOfMemoryError | MemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def freed(run: Run) -> None:
    """After a failed try at the update: its gradients zeroed (set to None), its memory given back."""
    run.optimizer.zero_grad(set_to_none=True)
    run.model.zero_grad(set_to_none=True)
    gc.collect()  # the failed try's frames, and the activations they hold
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def halve_on_oom(update, run: Run, trajs: list, normaliser: float, step: int) -> dict:
    """Step 4's `update(run, trajs, normaliser)` (stratagem.py's policy_update) where the memory projection
    (--micro-batch-size auto's) was wrong: an out-of-memory error halves --micro-batch-size and tries the step
    once more, as accelerate's find_executable_batch_size does, after zeroing the failed try's gradients and
    freeing its memory. The halved micro-batch is kept for the steps after and written to config.json
    (config_history.jsonl says at which step), so that a resume uses it; a later step may halve it again. Out of
    memory at micro-batch 1, again in the retry, after an Adam step of the update (--ppo-epochs: the weights have
    moved) or under torchrun (its ranks would all have to agree to retry) ends the run in one line (UserError)
    that says what lowers the memory a step takes."""
    size, updates = run.args.micro_batch_size, run.updates
    for attempt in (1, 2):
        try:
            overlap.fresh_sums(run)  # a retry's ratio figures: its own tokens only
            return update(run, trajs, normaliser)
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
        freed(run)  # out of the except: the error's traceback (and its tensors) is gone
        now = run.args.micro_batch_size
        if attempt == 2 or now == 1 or run.dist.world > 1 or run.updates != updates:
            break
        run.args.micro_batch_size = now // 2
        if run.dist.main:
            print(
                f"step {step}: out of memory at micro-batch {now}: trying the step again at micro-batch "
                f"{now // 2}, kept for the steps after (config.json)",
                flush=True,
            )
            halved = runfiles.read_config(run.out) | {"micro_batch_size": now // 2}
            runfiles.write_config(run.out, halved, step)  # the one change, the rest as recorded
    if now != size:
        why = f"again at micro-batch {now} (after {size})"
    elif run.dist.world > 1:
        why = f"at micro-batch {now} under torchrun, which does not halve it (every rank would have to agree)"
    elif run.updates != updates:
        why = (
            f"at micro-batch {now} after an Adam step of the update (--ppo-epochs): not tried again"
        )
    else:
        why = f"at micro-batch {now}"
    lower = [f"--micro-batch-size {now // 2}"] if now > 1 else []
    lower += [] if run.args.gradient_checkpointing else ["--gradient-checkpointing"]
    resume = f"resume with {' or '.join(lower)} (--resume --out {run.out}), or " if lower else ""
    raise UserError(
        f"step {step}: out of memory in the update {why}; its last checkpoint is kept: {resume}start again "
        "with --lora-rank R or a smaller --max-new-tokens (docs/speed.md#will-it-fit-before-the-run)"
    )


def load_finite(path: Path, schema: dict) -> dict:
    """A checkpoint's state file (runfiles.load_state) whose tensors and numbers are all finite, else one line
    naming the file and the value: a NaN in Adam's state would make every weight NaN at the first update."""
    state = runfiles.load_state(path, schema)
    if bad := modelfiles.nonfinite_leaf(state):
        raise UserError(f"--resume: {path}: {bad} is not finite (NaN or infinity); restore it")
    return state


def check_update(run: Run, optimizer, *_) -> None:
    """After every optimizer step (a hook): the weights and the optimizer's state are finite on every rank, else the
    run stops in one line naming the step, before the weights are played, evaluated, kept as best or saved, so
    that the last checkpoint and best/ stay the good ones."""
    run.updates += 1
    names = {id(p): n for n, p in run.model.named_parameters()}
    tensors = [(f"weight {n}", p) for n, p in run.model.named_parameters()]
    tensors += [
        (f"Adam's {k} of {names.get(id(p), 'a weight')}", v)
        for p, state in optimizer.state.items()
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    ]
    bad = [b for b in run.dist.gather(modelfiles.first_nonfinite(tensors)) if b]
    if bad:
        step = run.start + math.ceil(run.updates / run.args.ppo_epochs)
        raise UserError(
            f"step {step}: the policy diverged, {bad[0]} is not finite after its update; its last checkpoint "
            "is kept (a lower --lr, or --lora-alpha, keeps it finite)"
        )


def whole_batch(dist: Dist, mine: list) -> tuple[list, list[list]]:
    """Every rank's trajectories, rank by rank (trajectories.jsonl's order), and the parts they came in."""
    parts = dist.gather(mine)
    return [t for part in parts for t in part], parts


def share_advantages(dist: Dist, parts: list[list], mine: list) -> None:
    """Rank 0's A_mod onto this rank's own trajectories `mine` (its part of the batch): each rank learns from
    what it played."""
    a_mods = dist.broadcast([t.a_mod for part in parts for t in part])
    offset = sum(len(part) for part in parts[: dist.rank])
    for t, a in zip(mine, a_mods[offset:]):
        t.a_mod = a


def merge_counts(parts: list[dict]) -> dict:
    """Sum outcome counts of several ranks."""
    return {
        g: {p: {k: sum(part[g][p][k] for part in parts) for k in c} for p, c in seats.items()}
        for g, seats in parts[0].items()
    }


def summarize(values: list[float]) -> tuple[float, float]:
    """Mean and (population) standard deviation; (0, 0) for nothing."""
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def levels_mean(trajs: list) -> dict[str, float | None]:
    """Per rubric dimension (every key of judge_prompts.RUBRICS), the mean level over the judged trajectories
    that have it; None where none has."""
    out = {}
    for key in judge_prompts.ALL_KEYS:
        known = [
            t.scores[key] for t in trajs if t.scores is not None and t.scores.get(key) is not None
        ]
        out[key] = sum(known) / len(known) if known else None
    return out


def ppo_summary(epochs_by_rank: list[list[dict]], world: int) -> dict:
    """Per epoch, over every rank: the loss (summed like the REINFORCE loss), the mean ratio and the
    fraction of response tokens whose loss the clip bounded. Epoch 1 is always ratio 1, fraction 0."""
    out = {"loss": [], "ratio_mean": [], "clip_frac": []}
    for epoch in zip(*epochs_by_rank):
        tokens = sum(e["tokens"] for e in epoch)
        out["loss"].append(sum(e["loss"] for e in epoch) / world)
        out["ratio_mean"].append(sum(e["ratio_sum"] for e in epoch) / max(tokens, 1))
        out["clip_frac"].append(sum(e["clipped"] for e in epoch) / max(tokens, 1))
    return out


@dataclass
class Step:
    """What one step of Algorithm 1 produced, for its bookkeeping (end_step): its number and timer,
    the batch's trajectories, this rank's (outcome counts, generate calls), the judge's verdicts and
    usage, step 3's means (mod), this rank's policy_update() result, and --eval-every's evaluation
    and a trainer's own metrics where there are some."""

    number: int
    timer: watch.Timer
    trajs: list
    played: tuple[dict, int]
    judged: dict
    usage: dict
    mod: dict
    update: dict
    evaluation: dict | None = None
    extra: dict | None = None  # spyrl.py: its "spy" metrics


def step_metrics(run: Run, done: Step, ranks: list[tuple], step_time: float) -> dict:
    """The step's metrics.jsonl line; `ranks` holds every rank's (outcomes, generate calls, loss, PPO
    epochs)."""
    return {
        "step": done.number,
        "time_s": round(step_time, 3),
        "elapsed_s": round(run.elapsed, 3),
        "time_split_s": {k: round(v, 3) for k, v in done.timer.totals.items()},
        **game_metrics(run, done.trajs, ranks),
        **judge_metrics(run, done.trajs, done.judged, done.usage),
        **done.mod,
        **learn_metrics(run, done.trajs, ranks, done.update["grad_norm"]),
        **({"eval": done.evaluation} if done.evaluation else {}),
        **({"distill": run.distiller.report} if run.distiller else {}),
        **(done.extra or {}),
    }


def game_metrics(run: Run, trajs: list, ranks: list[tuple]) -> dict:
    """Step 1's part of the line: the games' results, the trajectories and transitions, the tokens
    written, the opponents' results and the coverage guard's spots."""
    outcomes = merge_counts([r[0] for r in ranks])
    versus = run.versus.results if run.versus and run.versus.mixed else None
    played = [t for t in trajs if t.turns]  # the others: seats that never moved (RAE only)
    resp_tokens = [len(turn.response_ids) for t in trajs for turn in t.turns]
    first_seat = sum(
        c[next(iter(c))][k] for c in outcomes.values() for k in ("win", "draw", "loss")
    )  # 1 a game
    fixed = sum(
        c[k] for g in (versus or {}).values() for c in g.values() for k in ("win", "draw", "loss")
    )  # the games against fixed opponents
    return {
        "games": outcomes,
        "episodes": first_seat + fixed,
        "trajectories": len(played),
        "idle_seats": len(trajs) - len(played),
        "transitions": len(resp_tokens),
        "generate_calls": sum(r[1] for r in ranks),
        "response_tokens": sum(resp_tokens),
        "response_tokens_mean": sum(resp_tokens) / len(resp_tokens),
        **({"opponents": versus} if versus is not None else {}),
        "coverage": coverage.of_step(played, run.spot),
    }


def judge_metrics(run: Run, trajs: list, judged: dict, usage: dict) -> dict:
    """Step 3's judge in the line: what was judged and failed, the levels, the requests and money."""
    played = [t for t in trajs if t.turns]
    failures = Counter(j.failure for j in judged.values() if j.failure)
    runner = run.runner
    return {
        "judge_judged": sum(not j.skipped for j in judged.values()),
        "judge_failed": sum(failures.values()),
        "judge_failures": failures,
        "judge_skipped_budget": sum(j.skipped for j in judged.values()),
        "judge_evolution_rules": Counter(j.rule for j in judged.values() if j.rule),
        "judged_multi_turn": sum(t.judged and len(t.turns) > 1 for t in played),  # psi can compare
        "psi_nonzero": sum(t.judged and t.logged.get("psi", t.psi) != 0 for t in played),
        "levels_mean": levels_mean(played),
        **{
            f"judge_{k}": usage.get(k, 0)
            for k in ("requests", "cache_hits", "prompt_tokens", "completion_tokens")
        },
        "judge_cost": usage.get("cost", 0.0),
        "judge_cost_total": runner.totals["cost"] if runner else 0.0,
        "judge_budget_exhausted": bool(runner and runner.budget_exhausted()),
    }


def learn_metrics(run: Run, trajs: list, ranks: list[tuple], grad_norm: float) -> dict:
    """Steps 2 and 4 in the line: the advantages, the loss and gradient norm, PPO's and the KL's
    figures, the baselines."""
    played = [t for t in trajs if t.turns]
    a_game_mean, a_game_std = summarize([t.a_game for t in played])
    a_mod_mean, a_mod_std = summarize([t.a_mod for t in played])
    world, epochs = run.dist.world, [r[3] for r in ranks]
    extras = {}
    if run.args.ppo_epochs > 1:
        extras["ppo"] = ppo_summary(epochs, world)
    if run.reference is not None:
        extras["kl"] = sum(e["kl"] for r in epochs for e in r) / (len(epochs[0]) * world)
    return {
        "a_game_mean": a_game_mean,
        "a_game_std": a_game_std,
        "a_mod_mean": a_mod_mean,
        "a_mod_std": a_mod_std,
        "loss": sum(r[2] for r in ranks) / world,
        "grad_norm": grad_norm,
        **extras,
        "baselines": dict(run.baselines),
    }


def end_step(run: Run, done: Step) -> None:
    """The step's bookkeeping: rank 0 logs it (metrics.jsonl, trajectories.jsonl, the step line, the
    judge's budget banner once it is spent); every rank takes part in the checkpoint."""
    ranks = run.dist.gather((*done.played, done.update["loss"], done.update["epochs"]))
    step, step_time = done.number, time.perf_counter() - done.timer.start
    run.elapsed += step_time
    if run.dist.main:
        if done.mod.get("modulated"):  # the judged means after_budget averages once it is spent
            means = {s: done.mod.get(f"{s}_mean") for s in judge_prompts.SCORES}
            run.recent.append({s: v for s, v in means.items() if v is not None})
        metrics = step_metrics(run, done, ranks, step_time)
        run.truth.add(metrics)  # its evaluation gets the judged means since the previous one
        if run.runner is not None and run.runner.budget_exhausted() and not run.announced:
            watch.announce_budget(run.runner.totals["cost"], run.args.judge_budget, step)
            run.announced = True
        log_step(run, metrics, done.trajs)
        guard(run, metrics)
        if run.reproject is not None and step == 1 and step < run.args.steps:  # its own counts now
            projection = run.reproject(run.args.steps - step, costs.measured([metrics]))
            print("\n".join(costs.projection_lines(run.args, projection)), flush=True)
    if done.evaluation:
        keep_best(run, step, done.evaluation)
    run.finished = (step, run.updates, state_of(run))  # what a stop in the next step saves
    distributed.hold(False)  # a stop held during the step stops here (keep_step saves it)
    if step % run.args.save_every == 0 or step == run.args.steps:
        save(run, step, run.finished[2])  # a stop during it: the previous checkpoint stands


def guard(run: Run, metrics: dict) -> None:
    """The coverage guard: a warning line, once a spot, for a spot of step 1 that self-play has
    stopped reaching; one when an evaluation of a game loses over 10 % of it on invalid moves. And
    once a run, where the judge's scores rose while the best reply gained beyond its noise
    (truth.warning: the judge rewards what the game punishes)."""
    spots = metrics.get("coverage", {})
    if run.first_spots is None and metrics["step"] == 1:
        run.first_spots = spots
    drops = coverage.drops(run.first_spots or {}, spots)
    lines = [x for x in drops if x.split(" fell to")[0] not in run.warned]
    run.warned.update(x.split(" fell to")[0] for x in lines)
    if e := metrics.get("eval"):  # said when a game passes 10 %, again once it fell back under
        over = coverage.invalid_warnings(e, e["spots"])
        keys = {x.split(" lost ")[0] for x in over}
        lines += [
            f"step {metrics['step']}: {x}" for x in over if x.split(" lost ")[0] not in run.warned
        ]
        run.warned -= {f"evaluation: {g}" for g in e["games"]} - keys
        run.warned |= keys
    if (said := truth.warning(run.truth.points)) and truth.WARNING not in run.warned:
        run.warned.add(truth.WARNING)  # once a run
        lines.append(f"step {metrics['step']}: {said}")
    for line in lines:
        watch.warn(line)


def first_eval(run: Run, evaluation: dict | None) -> None:
    """A fresh run's evaluation before any update (None without --eval-every): its own metrics.jsonl line
    {"step": 0, "eval": ...} and step line, so that a learning curve starts where the policy started."""
    if evaluation:
        run.truth.add({"step": 0, "eval": evaluation})
        runfiles.append_jsonl(run.out / "metrics.jsonl", {"step": 0, "eval": evaluation})
        guard(run, {"step": 0, "eval": evaluation})
        print(
            f"step 0/{run.args.steps} | before any update | {watch.eval_text(evaluation)}",
            flush=True,
        )
        keep_best(run, 0, evaluation)


BEST = {  # what best/best.json must hold: (in words, the test)
    "step": ("a step number", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "win_rate": (
        "a rate",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
    ),
}


def read_best(out: Path) -> dict | None:
    """best/best.json of a --keep-best run (the step and evaluation it was kept on, its fresh games once measured),
    or None where nothing was kept yet. A best/ left half-swapped by a kill is put back first (.best-old); a best/
    that is no folder, or a best.json that is malformed or no plain file, ends in one line."""
    best, old = out / "best", out / ".best-old"
    if not best.exists() and old.is_dir() and not old.is_symlink():
        old.rename(best)  # killed between the two renames of keep_best: the previous best is whole
    if not best.exists():
        return None
    runfiles.refuse_link(best)
    if not best.is_dir():
        raise UserError(f"{best} is not a folder; --keep-best keeps its policy there: move it away")
    try:
        record = json.loads(runfiles.read_small(best / "best.json"))
    except (OSError, ValueError) as e:
        raise UserError(
            f"{best / 'best.json'} is unreadable ({type(e).__name__}); move {best} away"
        ) from None
    bad = [
        k
        for k, (_, ok) in BEST.items()
        if not isinstance(record, dict) or k not in record or not ok(record[k])
    ]
    if bad:
        raise UserError(
            f"{best / 'best.json'} is malformed ({bad[0]!r} is not {BEST[bad[0]][0]}); move {best} away"
        )
    return record


def best_unmeasured(args, out: Path) -> bool:
    """--keep-best: whether the kept policy still awaits its fresh games (stratagem.best_on_fresh_games, the end
    of a run): a run stopped there has done its steps but not that, so --resume does it."""
    best = read_best(out) if args.keep_best else None
    return best is not None and "fresh" not in best


def write_best(out: Path, record: dict) -> None:
    runfiles.write_atomic(out / "best" / "best.json", json.dumps(record, indent=1).encode())


def keep_best(run: Run, step: int, evaluation: dict) -> None:
    """--keep-best: the policy goes to <out>/best whenever its evaluation win rate beats best.json's (a tie keeps
    the earlier), so that a peak survives self-play's drift away from it. Written aside, then swapped in; a full disk
    is one warning and best/ keeps the previous one. The pick is biased upwards: at the end,
    stratagem.best_on_fresh_games measures it again on fresh games."""
    best = read_best(run.out) if run.args.keep_best else None
    if not run.args.keep_best or (best is not None and best["win_rate"] >= evaluation["win_rate"]):
        return
    tmp, old, final = run.out / ".best-tmp", run.out / ".best-old", run.out / "best"
    try:
        runfiles.remove(
            tmp
        )  # left by a kill during an earlier write; a link there goes, not what it points to
        tmp.mkdir(mode=0o700)
        run.model.save_pretrained(tmp)
        run.tokenizer.save_pretrained(tmp)
        runfiles.write_atomic(
            tmp / "best.json", json.dumps({"step": step, **evaluation}, indent=1).encode()
        )
        runfiles.follow_umask(tmp)
    except (
        OSError,
        RuntimeError,
        SafetensorError,
    ) as e:  # a full disk: safetensors raises its own error
        runfiles.remove(tmp)
        kept = f"step {best['step']}'s" if best else "nothing yet"
        watch.warn(
            f"could not keep step {step}'s policy in {final} ({str(e).strip()[:120]}); it holds {kept}"
        )
        return
    runfiles.remove(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    runfiles.remove(old)


def log_step(run: Run, metrics: dict, trajs: list) -> None:
    """trajectories.jsonl, metrics.jsonl, --report-to and the step line; a judge alarm when half or more
    of the judged trajectories failed."""
    for t in trajs:
        runfiles.append_jsonl(run.out / "trajectories.jsonl", t.record(metrics["step"]))
    runfiles.append_jsonl(run.out / "metrics.jsonl", metrics)
    if run.reporter is not None:
        run.reporter.log(metrics)
    print(watch.step_line(metrics, run.args), flush=True)
    run.judged += metrics["judge_judged"]
    run.failures.update(metrics["judge_failures"])
    if metrics["judge_judged"] and 2 * metrics["judge_failed"] >= metrics["judge_judged"]:
        print(
            watch.judge_alarm(
                metrics["judge_judged"], metrics["judge_failures"], f"at step {metrics['step']}"
            ),
            file=sys.stderr,
            flush=True,
        )


def state_of(run: Run) -> dict:
    """What a checkpoint holds besides the weights and the optimizer, copied as it is now: RAE's
    baselines, judge totals and the rest (rank 0's `shared`), this rank's RNG states and game lengths
    (`own`)."""
    shared = {
        "baselines": run.baselines,
        "beta": run.beta,
        "elapsed": run.elapsed,
        "judge_totals": run.runner.totals if run.runner else None,
        "recent": run.recent,
        "distill": run.distiller.state_dict() if run.distiller else None,
        "first_spots": run.first_spots,
    }
    own = {"rng": runfiles.rng_states(run.rng), "lengths": run.lengths}
    pool = run.versus.state() if run.versus else None  # its snapshots are never changed
    generator = overlap.saved(run)  # --async-level 1: checked current when saved
    return copy.deepcopy({"shared": shared, "own": own}) | {"pool": pool, "generator": generator}


def save(run: Run, step: int, state: dict | None = None) -> None:
    """The checkpoint: weights (a LoRA run's adapter, in PEFT's format), optimizer and `state` (state_of's,
    now by default), so that --resume replays exactly what an uninterrupted run does."""
    state = state or state_of(run)
    if not overlap.current(run, state["generator"]):  # a stop after the next launch
        return
    shared = state["shared"] | {"past_pool": state["pool"]}
    shared |= {"overlap": state["generator"]} if state["generator"] else {}
    model, tokenizer, optimizer = run.model, run.tokenizer, run.optimizer
    run.saving = step
    runfiles.save_checkpoint(
        run.out, step, model, tokenizer, optimizer, shared, state["own"], run.dist
    )


def keep_step(run: Run) -> None:
    """A stop signal ended the run in a step that had not changed the weights yet: the step before,
    finished, is saved if no save of it was begun (one stopped midway is not tried again: the
    previous checkpoint stands). One process; under torchrun the last checkpoint stands."""
    if run.dist.world == 1 and run.finished and run.finished[0] != run.saving:
        step, updates, state = run.finished
        if run.updates == updates:
            save(run, step, state)


def held(run: Run) -> None:
    """From a step's first optimizer step till it is saved, a stop signal waits for the step's end
    (one process: a torchrun rank's stop must not wait on the others)."""
    distributed.hold(run.dist.world == 1)


def finish_run(run: Run) -> Path | None:
    """The end-of-run judge alarm, the engines and process group closed. Returns the run folder on rank 0 (main()
    prints the closing line with the next commands for it; bench, whose folder is temporary, does not), else None."""
    if run.runner is not None and (
        line := watch.run_alarm(run.judged, run.failures, run.start + 1, run.args.steps)
    ):
        print(line, file=sys.stderr, flush=True)
    if run.reporter is not None:
        run.reporter.close()
    run.dist.gather(None)  # every rank is done with the group before vLLM's teardown may destroy it
    run.policy.close()
    run.dist.close()
    runfiles.release_runs()
    return run.out if run.dist.main else None
