"""`stratagem.py bench`: a few training steps, measured: games/s, tokens/s, where the wall time goes, Adam's state,
lockstep against one-game-at-a-time rollouts (with --mode spyrl: spyrl.py's SpyRL against STRATAGEM; with
--lora-rank: LoRA against full fine-tuning; the same flags otherwise), and optionally the judge's latency."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

import judge_prompts
from machinery import UserError
from machinery.distributed import pick_device, pick_threads
from machinery.flags import FriendlyParser
from machinery.judge import JudgeRunner, OpenAIJudge, make_judge
from machinery.runfiles import (
    TRAINER_STATE,
    JudgeCache,
    append_jsonl,
    check_writable_file,
    latest_checkpoint,
    load_state,
    read_jsonl,
)
from stratagem import Args, Trajectory, build_parser, judge_trajectories, resolve_args, train
from tools.runs import read_trajectories

PHASES = ("generate", "game", "judge", "learn", "sync")


def bench_summary(metrics: list[dict]) -> dict:
    """Rates and the wall-time split over the measured steps (step 1 is warm-up when there are more)."""
    rows = metrics[1:] if len(metrics) > 1 else metrics
    total = sum(m["time_s"] for m in rows)
    split = {k: sum(m["time_split_s"].get(k, 0.0) for m in rows) / total for k in PHASES}
    split["other"] = 1 - sum(split.values())
    return {
        "steps_measured": len(rows),
        "s_per_step": total / len(rows),
        "games_per_s": sum(m["episodes"] for m in rows) / total,
        "rollout_games_per_s": sum(m["episodes"] for m in rows)
        / (total * (split["generate"] + split["game"])),
        "transitions_per_s": sum(m["transitions"] for m in rows) / total,
        "tokens_per_s": sum(m["response_tokens"] for m in rows) / total,
        "live_games_per_call": sum(m["transitions"] for m in rows)
        / sum(m["generate_calls"] for m in rows),
        "generate_calls_per_game": sum(m["generate_calls"] for m in rows)
        / sum(m["episodes"] for m in rows),
        "time_split": split,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else None,
    }


def optimizer_size(run: Path) -> dict:
    """Adam's state in the run's last checkpoint (every tensor of it) and the parameters it trains."""
    state = load_state(latest_checkpoint(run) / "trainer_state.pt", TRAINER_STATE, "bench")[
        "optimizer"
    ]["state"]
    state = state.values()
    return {
        "optimizer_state_mb": sum(t.numel() * t.element_size() for s in state for t in s.values())
        / 2**20,
        "trained_parameters": sum(s["exp_avg"].numel() for s in state),
    }


def bench_judge(args: Args, trajs: list[Trajectory], n: int) -> dict:
    """Wall time of n judgements (both rubrics; one-turn trajectories are not asked the evolution one) with the
    configured judge, bypassing the cache."""
    judge = make_judge(args)
    if isinstance(judge, OpenAIJudge):
        judge.check_reachable()
    runner = JudgeRunner(judge, args, JudgeCache(None))
    batch = [trajs[i % len(trajs)] for i in range(n)]
    t0 = time.perf_counter()
    judgements, usage = judge_trajectories(runner, batch, list(judge_prompts.RUBRICS))
    return {
        "judgements": n,
        "requests": usage.get("requests", 0),
        "seconds": time.perf_counter() - t0,
        "concurrency": args.judge_concurrency,
        "failed": sum(j.failure is not None for j in judgements),
        "one_turn": sum(len(t.turns) == 1 for t in batch),
    }


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py bench",
        description=(
            "Run a few training steps (any training flag applies; --steps defaults to 3, step 1 is warm-up) and "
            "print games/s, transitions/s, generated tokens/s, the split of wall time and peak memory; "
            "optionally against the sequential reference (one game at a time, one generate call per turn). "
            "With --mode spyrl: a SpyRL run and a STRATAGEM run with the same flags, side by side; with --lora-rank "
            "R: a LoRA run and a full fine-tuning run, lockstep, side by side (--rollout lockstep: the LoRA run alone)."
        ),
    )
    p.add_argument(
        "--rollout",
        choices=("lockstep", "sequential", "both"),
        default="both",
        help="lockstep (--num-envs games per generate call), sequential (one), or both (default)",
    )
    p.add_argument(
        "--judgements",
        type=int,
        default=0,
        help="also time this many uncached judgements with the configured judge (default: 0)",
    )
    p.add_argument(
        "--json",
        default="bench.jsonl",
        help="append the results here, one JSON line (default: bench.jsonl)",
    )
    ns, rest = p.parse_known_args(argv)
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode")
    chosen, others = mode.parse_known_args(rest)
    spyrl = (
        importlib.import_module("spyrl") if chosen.mode == "spyrl" else None
    )  # spyrl.py's flags, its mode implied
    explicit = vars(
        spyrl.build_parser().parse_args(others) if spyrl else build_parser().parse_args(rest)
    )
    if "out" in explicit or "resume" in explicit:
        raise UserError("bench runs in a temporary directory; drop --out and --resume")
    if ns.judgements < 0:
        raise UserError(f"--judgements must be >= 0, got {ns.judgements}")
    check_writable_file(Path(ns.json), "--json")  # now, not after the benchmark has run
    explicit.setdefault("steps", 3)
    base = (spyrl.resolve_args if spyrl else resolve_args)(explicit)
    modes = ["lockstep", "sequential"] if ns.rollout == "both" else [ns.rollout]
    configs = {
        mode: dataclasses.replace(base, num_envs=base.num_envs if mode == "lockstep" else 1)
        for mode in modes
    }
    trainers = dict.fromkeys(modes, train)
    if spyrl:  # SpyRL's figures beside STRATAGEM's, lockstep, measured in the same invocation
        modes, trainers = ["spyrl", "stratagem"], {"spyrl": spyrl.train, "stratagem": train}
        shared = {k: v for k, v in explicit.items() if k in Args.__dataclass_fields__}
        configs = {"spyrl": base, "stratagem": resolve_args({**shared, "mode": "stratagem"})}
    if (
        base.lora_rank and not spyrl and ns.rollout == "both"
    ):  # LoRA's figures beside full fine-tuning's, lockstep
        modes, trainers = ["lora", "full"], {"lora": train, "full": train}
        configs = {
            "lora": base,
            "full": resolve_args({k: v for k, v in explicit.items() if not k.startswith("lora_")}),
        }
    threads = pick_threads(pick_device(base.device))  # what each run's start_run sets again
    machine = {
        "threads": threads[0],
        "why": threads[1],
        "cores": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            args = dataclasses.replace(configs[mode], out=os.path.join(tmp, mode))
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            print(
                f"--- bench: {mode} ({args.mode}), {args.num_envs} game(s) in flight ---",
                flush=True,
            )
            trainers[mode](args)
            results[mode] = {
                **bench_summary(read_jsonl(Path(args.out) / "metrics.jsonl")),
                **optimizer_size(Path(args.out)),
            }
        if ns.judgements > 0:
            results["judge"] = bench_judge(
                base, read_trajectories(Path(tmp) / modes[0]), ns.judgements
            )
    machine["load_after"] = os.getloadavg()[
        0
    ]  # the 1-minute load average: a shared machine moves every figure
    print(f"\n{'':24}" + "".join(f"{m:>12}" for m in modes))
    rows = [
        ("s/step", "s_per_step", 2),
        ("games/s", "games_per_s", 2),
        ("games/s in rollout", "rollout_games_per_s", 2),
        ("transitions/s", "transitions_per_s", 1),
        ("generated tokens/s", "tokens_per_s", 0),
        ("live games per call", "live_games_per_call", 1),
        ("generate calls per game", "generate_calls_per_game", 2),
        ("peak RSS MB", "peak_rss_mb", 0),
        ("trained parameters", "trained_parameters", 0),
        ("Adam state MB", "optimizer_state_mb", 3),
    ]
    for label, key, digits in rows:
        print(f"{label:24}" + "".join(f"{results[m][key]:>12.{digits}f}" for m in modes))
    for phase in (*PHASES, "other"):
        print(
            f"{'time: ' + phase + ' %':24}"
            + "".join(f"{100 * results[m]['time_split'][phase]:>12.1f}" for m in modes)
        )
    for m in modes:
        print(
            f"{m}: 400 steps of this configuration (batch {configs[m].batch_size}, up to {configs[m].max_new_tokens} "
            f"new tokens a turn) would take {400 * results[m]['s_per_step'] / 3600:.2f} h at this rate "
            f"(the paper's run: 400 steps of batch 128, up to 4096 new tokens, on GPUs)"
        )
    if modes == ["lockstep", "sequential"]:
        speedup = results["lockstep"]["games_per_s"] / results["sequential"]["games_per_s"]
        rollout = (
            results["lockstep"]["rollout_games_per_s"]
            / results["sequential"]["rollout_games_per_s"]
        )
        results["lockstep_speedup"], results["lockstep_rollout_speedup"] = speedup, rollout
        print(f"lockstep / sequential games/s: {speedup:.1f}x per step, {rollout:.1f}x in rollout")
    if "judge" in results:
        j = results["judge"]
        print(
            f"judge: {j['judgements']} judgements ({j['requests']} requests, {j['failed']} failed) in "
            f"{j['seconds']:.2f} s with {j['concurrency']} in flight"
        )
    print(
        f"torch threads {threads[0]} ({threads[1]}); load average {machine['load_before']:.1f} before, "
        f"{machine['load_after']:.1f} after (1 min, {machine['cores']} cores here)"
    )
    record = {
        "argv": argv,
        "config": dataclasses.asdict(base),
        "machine": machine,
        "results": results,
    }
    append_jsonl(Path(ns.json), record)  # never through a link planted while it ran
    return 0
