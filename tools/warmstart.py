"""`stratagem.py warmstart`: teach a small random Qwen3 the rules of the training games by supervised learning on
games of the random legal player (machinery/warmstart.py), save it, and measure it on held-out games."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path

import torch

from machinery import UserError, warmstart
from machinery.flags import FriendlyParser, field_docs
from machinery.matches import RandomPlayer, summarize_matches
from machinery.runfiles import check_writable_dir
from machinery.watch import quiet_transformers
from stratagem import (
    Args,
    HFPolicy,
    build_random_model,
    collate,
    format_prompt,
    load_policy,
    make_env,
    play_matches,
)


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="output directory (must not exist)")
    defaults = warmstart.Recipe()
    docs = field_docs(warmstart.Recipe)
    for f in dataclasses.fields(warmstart.Recipe):
        value = getattr(defaults, f.name)
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(value),
            default=value,
            help=f"{docs[f.name][1]} ({value})".replace("%", "%%"),
        )
    p.add_argument(
        "--eval-n", type=int, default=0, help="held-out games per game id against the random player (0: none)"
    )
    ns = vars(p.parse_args(argv))
    out, eval_n = ns.pop("dir"), ns.pop("eval_n")
    recipe = warmstart.Recipe(**ns)
    if os.path.exists(out):
        raise UserError(f"{out} already exists")
    check_writable_dir(Path(out), "dir")
    quiet_transformers()
    torch.set_num_threads(1)  # one thread: the same sums in the same order on any machine (the same bytes), and the
    # fastest for a model this small (two threads were 1.9x slower on 2 cores: docs/learning.md)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    model, tokenizer, losses = warmstart.build(
        out,
        recipe,
        build_random_model,
        load_policy,
        make_env,
        format_prompt,
        collate,
        lambda step, loss: print(
            f"step {step}/{recipe.steps} loss {loss:.4f} {time.perf_counter() - t0:.0f}s", flush=True
        ),
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time()
    report = {
        "recipe": dataclasses.asdict(recipe),
        "build_s": seconds,
        "cpu_s": cpu,
        "load_avg_1min": [load0, os.getloadavg()[0]],
        "final_loss": losses[-1],
    }
    print(
        f"built in {seconds:.0f}s, {cpu:.0f}s of CPU (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}); "
        f"final loss {losses[-1]:.4f}"
    )
    if eval_n:
        policy = HFPolicy(model, tokenizer, Args(max_new_tokens=48, temperature=1.0), torch.device("cpu"))
        with torch.random.fork_rng():
            torch.manual_seed(recipe.seed)
            report["measure"] = warmstart.measure(
                policy,
                tokenizer,
                lambda pol, tok, games, n, opp, rng: play_matches(pol, tok, games, n, opp, rng, 200, 0, 64),
                summarize_matches,
                RandomPlayer(random.Random(recipe.seed)),
                list(recipe.moves_per_game()),
                eval_n,
                recipe.seed + 10**6,
            )
        for game, r in report["measure"].items():
            print(
                f"{game:22} legal {r['legal_rate']:.3f} ({r['moves']} moves)  length {r['length']:.2f}  "
                f"win {r['win_rate']:.3f} [{r['win_ci95'][0]:.3f}, {r['win_ci95'][1]:.3f}]  draw {r['draw_rate']:.3f}"
            )
    Path(out, "warmstart.json").write_text(json.dumps(report, indent=1))
    return 0
