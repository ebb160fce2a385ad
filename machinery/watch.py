"""Watching a run: the start line, one line per step, the closing line, a progress bar on a terminal,
TensorBoard / W&B (--report-to), the judge's alarms, a timer per phase of a step, and transformers kept quiet.

Every number shown or reported is read from the step's metrics.jsonl line: nothing is computed for a
display only. stdout carries the lines; stderr the bar (on a terminal only) and the alarms.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

import judge_prompts
from machinery import UserError, flags, visible
from machinery.openai_api import scrub
from machinery.runfiles import warn as runfiles_warn
from machinery.runfiles import write_atomic


class Timer:
    """Accumulates wall time per named phase: `with timer("generate"): ...`; `start` is when it was made."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


def tiny_model(args) -> str:
    """--tiny's policy in words: the shipped warm start, or a random model built offline (--tiny-init)."""
    if args.tiny_init == "warm" and args.mode == "spyrl":
        return "the warm start warmstart/spy, taught the game's format"
    if args.tiny_init == "warm":
        return "the warm start warmstart/tiny, taught the games' rules"
    return "a random tiny Qwen3, built offline"


def quiet_transformers() -> None:
    """No progress bars or advice from transformers in the run's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


warn = runfiles_warn  # a warning line on stderr: something went wrong that the run survives


def start_line(
    args,
    out: Path,
    device,
    engine: str,
    threads: tuple[int, str] | None = None,
    world: int = 1,
    structured=None,
) -> str:
    """The first line of a run: where it writes and what it will do; `threads`: torch's intra-op threads and why
    (distributed.pick_threads), `world`: the torchrun ranks."""
    if args.mode == "spyrl":
        detail = f", {args.spy_players} players, {args.spy_task}, mask {args.spy_mask}, alternate {args.spy_alternate}"
    else:
        detail = (
            "" if args.mode == "spiral" else " w/o psi" if args.no_psi else f", beta {args.beta}"
        )
        detail += ", psi centred" if args.centre_psi else ""
    detail += f", KL {args.kl_coef}" if args.kl_coef else ""
    model = f"tiny ({tiny_model(args)})" if args.tiny else args.model
    judge = args.judge_kind.words(args) + (
        "" if structured is None else f", {'structured' if structured else 'free-text'} verdicts"
    )
    judge = (
        f"none ({args.mode})"
        if not args.asked
        else f"{judge} on {args.judge_sample_rate:.0%} of trajectories"
        + (" (--judge-shadow: scores logged, not in A_mod)" if args.judge_shadow else "")
    )
    report = "" if args.report_to == "none" else f" + {args.report_to}"
    where = f"{args.backend} on {device} ({engine})"
    where += f", torch threads {threads[0]} ({threads[1]})" if threads else ""
    where += f", {world} ranks (torchrun), each playing 1/{world} of the games" if world > 1 else ""
    script = "spyrl" if args.mode == "spyrl" else "stratagem"
    return visible(  # the model, the out folder and the judge URL may come from a run's config.json
        f"{script}: {'resuming' if args.resume else 'new'} run in {out} | mode {args.mode}{detail} | model {model}, "
        f"{where} | judge {judge} | steps {args.steps}, "
        f"batch {args.batch_size} transitions{evaluations(args)} | "
        f"logs metrics.jsonl{report}",
        lines=False,
    )


def evaluations(args) -> str:
    """The start line's evaluations (--eval-every): their games and steps, and the work after the last
    step (--keep-best's fresh games, their count and why that many), so that no phase of a run comes
    unannounced. "" without --eval-every."""
    if not getattr(args, "eval_every", 0):
        return ""
    every, ids = args.eval_every, len(flags.items(args.eval_games))
    steps = list(range(every, args.steps + 1, every))
    when = ["step 0"] if args.mode != "spyrl" else []  # stratagem's curve starts before any update
    if steps:
        when.append(f"every {every} step{'' if every == 1 else 's'}, the last at step {steps[-1]}")
    said = (
        f" | eval vs {args.eval_opponent}: {args.eval_n * ids} games ({args.eval_n} per id of {ids}) "
        f"at {' and '.join(when) or 'no step (--eval-every is over --steps)'}"
    )
    if args.keep_best:
        per = args.best_eval_n or 5 * args.eval_n
        why = f"--best-eval-n {per}" if args.best_eval_n else f"5 x --eval-n {args.eval_n}"
        said += (
            f" | after the last step: best/ (the best evaluated policy) on {per * ids} fresh games "
            f"vs random ({per} per id: {why})"
        )
    return said


def step_line(m: dict, args) -> str:
    """One line per step, from its metrics.jsonl record `m`."""
    cost = (
        f" ${m['judge_cost_total']:.4f} (run at this rate: ${m['judge_cost_total'] / m['step'] * args.steps:.2f})"
        if args.judge_price_in + args.judge_price_out
        else ""
    )
    ppo = (
        f" (last epoch: ratio {m['ppo']['ratio_mean'][-1]:.3f}, clipped {m['ppo']['clip_frac'][-1]:.1%})"
        if "ppo" in m
        else ""
    )
    kl = f" (KL {m['kl']:.2e})" if "kl" in m else ""
    spent = m.get(
        "imputed_after_budget"
    )  # the budget is spent: the recent judged steps' means stand in
    scores = (
        " ".join(f"{name} {value:.3f}" for name, value in spent.items())
        + " (recent judged steps' mean: budget spent)"
        if spent
        else " ".join(f"{name} {fmt(m.get(f'{name}_mean'))}" for name in judge_prompts.SCORES)
        + (" (logged, not in A_mod)" if args.judge_shadow and not m.get("modulated") else "")
    )
    middle = (
        f"judged {m['judge_judged']} (failed {m['judge_failed']}, multi-turn {m.get('judged_multi_turn', 0)}){cost}"
        f" | {scores}"
    )
    if (m.get("beta") or {}).get(
        "target"
    ) is not None:  # --beta-share: beta this step, and the share it made
        middle += f" | beta {m['beta']['value']:.3f} share {fmt(m['beta']['share'])} (target {m['beta']['target']})"
    if "distill" in m:  # --distill: the heads' lowest kappa on the holdout, and who scored what
        d = m["distill"]
        kappas = [v for k, v in d["kappa"].items() if k in d["used"] and v is not None]
        middle += (
            f" | heads {'TRUSTED' if d['trusted'] else 'learning'}, min kappa {fmt(min(kappas, default=None))} "
            f"on {min(d['holdout'][k] for k in d['used'])} held out; scored judge {d['scored']['judge']}, "
            f"heads {d['scored']['heads']}, mean {d['scored']['imputed']}"
        )
    if "spy" in m:  # SpyRL: no judge; the game's own figures
        s = m["spy"]
        middle = (
            f"trains {s['trained']} | detection {fmt(s['detection_accuracy'])}, caught {fmt(s['caught_rate'])}, "
            f"invalid votes {fmt(s['invalid_vote_rate'])}, zero-sum residual {s['zero_sum_residual']:.1e}"
            + (f", ROUGE-L {s['rouge_l']:.3f}" if s["rouge_l"] is not None else "")
        )
    evaluation = f" | {eval_text(m['eval'])}" if "eval" in m else ""
    results = "" if "spy" in m else f" ({results_text(m)})"
    return (
        f"step {m['step']}/{args.steps} | {m['episodes']} games{results}, {m['trajectories']} trajectories, "
        f"{m['transitions']} transitions | {middle} | A_mod {m['a_mod_mean']:+.3f}±{m['a_mod_std']:.3f} | "
        f"loss {m['loss']:+.4f}{ppo}{kl}{evaluation} | {m['time_s']:.1f}s"
    )


def results_text(m: dict) -> str:
    """The step's games in its step line: self-play's won-drawn-lost from the first seat (the second
    seat's are the mirror), each fixed opponent's (--opponents) from the learner's seat, adding up to
    the games; then how many the model lost on an invalid move (in self-play, in either seat). An
    invalid move ends the game, a loss for its maker and a win for the other seat, as training pays
    it (stratagem.game_result): the counts are the metrics.jsonl line's."""
    parts, lost = [], 0
    kinds = {"self-play": {g: c["player0"] for g, c in m["games"].items()}}
    kinds |= m.get("opponents", {})
    for kind, games in kinds.items():
        w, d, l_ = (sum(c[k] for c in games.values()) for k in ("win", "draw", "loss"))
        if w + d + l_:
            parts.append(
                f"{w}-{d}-{l_} {'by the first seat' if kind == 'self-play' else 'vs ' + kind}"
            )
        lost += sum(c["invalid"] for c in games.values())
    lost += sum(c["player1"]["invalid"] for c in m["games"].values())
    said = "won-drawn-lost " + ", ".join(parts) + "; " if parts else ""
    return f"{said}{lost} lost on an invalid move"


def eval_text(e: dict) -> str:
    """--eval-every's result in a step line: the win rate against its opponent with its 95 % interval (and,
    where it played KuhnPoker-v1, the exact best reply's win rate against the policy's play there)."""
    low, high = e["win_ci95"]
    text = f"eval: win {e['win_rate']:.3f} [{low:.3f}, {high:.3f}] of {e['n']} vs "
    text += e.get("opponent", "random")
    if (best := e.get("best_response")) and not best.get("n", 1):  # lost before round 5 each time
        text += "; KuhnPoker-v1: no move of its deciding round to reply to"
    elif best:  # games/perfect.report's
        low, high = best["ci95"]
        text += f"; KuhnPoker-v1's best reply wins {best['win_rate']:.3f} [{low:.3f}, {high:.3f}]"
    return text


def best_text(out: Path) -> str:
    """--keep-best's policy in words: its step, its fresh games' win rate (and the biased one it was kept on)."""
    try:
        best = json.loads((out / "best" / "best.json").read_text())
        fresh, kept = best["fresh"], best["win_rate"]
        low, high = fresh["win_ci95"]
        return (
            f"; best/: step {best['step']}, win {fresh['win_rate']:.3f} [{low:.3f}, {high:.3f}] on {fresh['n']} fresh "
            f"games ({kept:.3f} on the games it was kept on)"
        )
    except (OSError, ValueError, KeyError, TypeError):  # none kept, or not measured
        return ""


def closing_line(out: Path, args) -> str:
    """The last line of a run: where its outputs are, and the commands a newcomer runs next on them (a SpyRL run's:
    those that read its games, and spyrl.py to train it further). Each takes minutes for the run that printed it,
    or the line says how long: its evaluation plays the games it trained on, not every --eval-games id (a model
    that loses each unseen game on its first move would spend most of the time there); training further takes
    about as long as the run did."""
    run, steps, mode = shlex.quote(str(out)), args.steps, args.mode
    best = best_text(out) if args.keep_best else ""
    then = [f"python stratagem.py plot {run} --out {shlex.quote(str(out / 'plots'))}"]
    later = ""  # what a suggested command takes where it is not minutes
    if mode == "spyrl":
        later = f"; training it {steps} more step{'' if steps == 1 else 's'} takes about as long as these"
        then += [
            f"python stratagem.py show {run}",
            f"python spyrl.py --resume --out {run} --steps {2 * steps}",
        ]
    else:
        trained = shlex.quote(",".join(flags.items(args.games)))
        then += [
            f"python stratagem.py show {run} --judged",
            f"python stratagem.py eval {run} --games {trained} --n 20",
        ]
    return (
        f"done: {steps} step{'' if steps == 1 else 's'} in {out} (metrics.jsonl, trajectories.jsonl, checkpoints/"
        f"{best}){later}. Next: " + "  |  ".join(then)
    )


def terminal_bar(desc: str, total: int, tail: str, show: bool) -> tqdm:
    """A tqdm bar on stderr that draws only on a terminal (disable=None) and is wiped when closed
    (leave=False): `desc`, the bar, the count of `total`, then `tail` (tqdm's format fields)."""
    return tqdm(
        total=total,
        desc=desc,
        file=sys.stderr,
        disable=None if show else True,
        leave=False,
        dynamic_ncols=True,
        bar_format="{desc} {bar:24} {n_fmt}/{total_fmt} " + tail,
    )


class Progress:
    """One step on a terminal: a tqdm bar on stderr of transitions played (of the batch), games finished
    and judge requests answered. With stderr not a terminal (a log, a pipe) tqdm draws nothing
    (disable=None), so logs stay clean lines."""

    def __init__(self, step: int, steps: int, target: int, show: bool):
        self.games, self.step = 0, step
        tail = "transitions{postfix} [{elapsed}]"
        self.bar = terminal_bar(f"step {step}/{steps}", target, tail, show)

    def played(self, transitions: int, games: int) -> None:
        self.games = games
        self.bar.set_postfix_str(f"{games} games finished", refresh=False)
        self.bar.total = max(self.bar.total, transitions)  # live games finish past the target
        self.bar.update(transitions - self.bar.n)

    def phase(self, name: str) -> None:
        self.bar.set_postfix_str(f"{self.games} games finished, {name}")

    def close(self) -> None:
        self.bar.close()  # leave=False: the bar is wiped, the step line takes its place


class Games:
    """An evaluation's games on a terminal: a tqdm bar on stderr of games finished, with the time
    left. Called with the count so far (play_matches' `finished`); like Progress, it draws nothing
    off a terminal."""

    def __init__(self, desc: str, total: int, show: bool = True):
        self.bar = terminal_bar(desc, total, "games [{elapsed}<{remaining}]", show)

    def __call__(self, done: int) -> None:
        self.bar.update(done - self.bar.n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


LINE_EVERY = 30.0  # seconds between two of Lines' lines


class Lines:
    """Where a long phase is, in a log or a pipe, where terminal_bar draws nothing: called with the count
    so far, it prints `desc: n/total unit, Ns, about Ns left` on stdout once LINE_EVERY seconds have
    passed since the phase began or its last line (a phase shorter than that says nothing). On a
    terminal (stderr a tty) it prints nothing: the bar says it."""

    def __init__(self, desc: str, total: int, unit: str):
        self.desc, self.total, self.unit, self.every = desc, total, unit, LINE_EVERY
        self.on = not sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if not self.on or not done or now - self.last < self.every:
            return
        self.last, spent = now, now - self.start
        left = (
            f", about {spent / done * (self.total - done):.0f}s left" if done < self.total else ""
        )
        print(f"{self.desc}: {done}/{self.total} {self.unit}, {spent:.0f}s{left}", flush=True)


# --report-to tags: CleanRL-style namespaces for metrics.jsonl's top-level keys (`judge_x` -> `judge/x`);
# nested dicts continue the path (game/games/TicTacToe-v0/player0/win), unlisted keys keep their name.
NAMESPACES = {
    "game": (
        "episodes",
        "trajectories",
        "transitions",
        "generate_calls",
        "response_tokens",
        "response_tokens_mean",
        "games",
    ),
    "judge": (
        "modulated",
        *(f"{name}_mean" for name in judge_prompts.SCORES),
        "levels_mean",
        "psi_centre",
    ),
    "adv": ("a_game_mean", "a_game_std", "a_mod_mean", "a_mod_std", "baselines", "beta"),
    "update": ("loss", "grad_norm", "kl"),
    "time": ("time_s", "elapsed_s", "time_split_s"),
}
TAG_OF = {key: f"{ns}/{key}" for ns, keys in NAMESPACES.items() for key in keys}


def scalars(metrics: dict) -> dict[str, float]:
    """One metrics.jsonl line as {tag: number}: every number in it (booleans as 0/1, list items by
    index), the step itself and None (nothing measured) left out."""
    flat: dict[str, float] = {}

    def walk(tag: str, value) -> None:
        if isinstance(value, (dict, list, tuple)):
            for k, v in value.items() if isinstance(value, dict) else enumerate(value):
                walk(f"{tag}/{k}", v)
        elif isinstance(value, (bool, int, float)):
            flat[tag] = float(value)

    for key, value in metrics.items():
        if key != "step":
            walk(
                TAG_OF.get(
                    key, "judge/" + key.removeprefix("judge_") if key.startswith("judge_") else key
                ),
                value,
            )
    return flat


class Reporter:
    """--report-to: every scalar of metrics.jsonl at its step, to TensorBoard (<out>/tensorboard) or to
    W&B (<out>/wandb, with config.json as the run's config). The library is imported only when asked
    for. Nothing secret leaves: the key lives in the environment only, never in config.json or metrics."""

    def __init__(self, kind: str):
        self.kind = kind
        try:  # before --out is touched: a missing package ends the run before it starts
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self.lib = SummaryWriter
            else:
                import wandb

                self.lib = wandb
        except ImportError:
            raise UserError(
                f"--report-to {kind} needs the {kind} package: pip install {kind}"
            ) from None

    def open(self, out: Path, args, start: int) -> None:
        if self.kind == "tensorboard":
            # purge_step: a resumed run hides what older event files hold after its checkpoint,
            # as metrics.jsonl drops it
            self.run = self.lib(
                log_dir=str(out / "tensorboard"), purge_step=start + 1 if start else None
            )
            return
        id_file = out / "wandb_run_id"  # a resumed run continues the same W&B run
        try:
            self.run = self.lib.init(
                dir=str(out),
                name=out.name,
                config=flags.as_config(args),
                resume="allow",
                id=id_file.read_text().strip() if id_file.exists() else None,
                settings=self.lib.Settings(save_code=False, disable_git=True),
            )
        except self.lib.errors.Error as e:
            first = scrub(str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"--report-to wandb: {first} (or run offline: WANDB_MODE=offline)"
            ) from None
        write_atomic(id_file, self.run.id.encode())  # never through a link (runfiles.refuse_link)

    def log(self, metrics: dict) -> None:
        values = scalars(metrics)
        if self.kind == "tensorboard":
            for tag, value in values.items():
                self.run.add_scalar(tag, value, metrics["step"])
            self.run.flush()  # watchable now, not after the writer's 2-minute flush
        else:
            self.run.log(values, step=metrics["step"])

    def close(self) -> None:
        if self.kind == "tensorboard":
            self.run.close()
        else:
            self.run.finish()


def judge_alarm(judged: int, failures: dict[str, int], where: str) -> str:
    """The loud line when half or more of the judged trajectories failed (the caller decides when)."""
    failed = sum(failures.values())
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(failures.items()))
    effect = (
        "ran unmodulated (phi = 1, psi = 0: A_mod = A_game, plain SPIRAL)"
        if failed == judged
        else f"phi and psi batch means rest on {judged - failed} verdict(s) only"
    )
    return f"!!! JUDGE ALARM {where}: {failed} of {judged} judged trajectories failed ({kinds}); {effect}"


def run_alarm(judged: int, failures: dict[str, int], first: int, last: int) -> str | None:
    """The end-of-run alarm, or None: said when no step of the run got a single valid verdict."""
    if sum(failures.values()) != judged:
        return None
    where = f"over the whole run (steps {first}-{last}), no valid verdict"
    return (
        judge_alarm(judged, failures, where)
        if judged
        else f"!!! JUDGE ALARM {where}: no trajectory was judged (--judge-sample-rate, --judge-budget); "
        f"the run trained as plain SPIRAL (A_mod = A_game)"
    )


def same_file(a, b) -> bool:
    """Whether two streams write to one file (`> log 2>&1`, or one terminal): a line for both is said once."""
    try:
        x, y = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (
        AttributeError,
        OSError,
        ValueError,
    ):  # io.UnsupportedOperation is both an OSError and a ValueError
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def announce_budget(cost: float, budget: float, step: int) -> None:
    """Said once, loudly, on stdout and on stderr (once when both go to one file): from here on no trajectory is
    judged, and the unjudged get the running mean of recent judged phi and psi (modulation.after_budget), so A_mod
    keeps its scale. A progress bar on the terminal steps aside for it."""
    bar = "!" * 100
    line = (
        f"JUDGE BUDGET REACHED at step {step}: estimated cost {cost:.4f} >= --judge-budget {budget}. "
        f"No more judge requests; every trajectory now gets the mean phi and psi of the last judged steps (the "
        f"step lines show them), so A_mod keeps its scale (with --distill: the heads' levels while they are trusted)."
    )
    with tqdm.external_write_mode(file=sys.stderr):
        for stream in (
            (sys.stdout,) if same_file(sys.stdout, sys.stderr) else (sys.stdout, sys.stderr)
        ):
            print(f"{bar}\n{line}\n{bar}", file=stream, flush=True)
