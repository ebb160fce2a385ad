"""`stratagem.py agree`: the cross-judge agreement check of the paper's Table 1: Cohen's kappa on
every level, Spearman's rho on every rubric's score (the keys and scores of judge_prompts.RUBRICS)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import torch

import judge_prompts
from machinery import UserError, distill, flags, saved_config, watch
from machinery.distill import cohen_kappa, spearman
from machinery.distributed import Dist, pick_device
from machinery.flags import FriendlyParser, field_docs
from machinery.judge import HeuristicJudge, JudgeRunner, OpenAIJudge, render_for_judge
from machinery.runfiles import (
    JudgeCache,
    check_writable_file,
    latest_checkpoint,
    load_state,
    read_config,
    write_atomic,
)
from stratagem import (
    Args,
    Trajectory,
    collate,
    format_prompt,
    judge_trajectories,
    load_policy,
    validate,
)
from tools.eval import openai_spec
from tools.runs import read_trajectories


class DistilledJudge:
    """`distilled:RUN`: the --distill heads of RUN's last checkpoint as a judge. That checkpoint's policy computes
    every trajectory's features, its turns tokenised again from the text trajectories.jsonl keeps (the sampled
    token ids are not kept, so a few tokens may split differently), and the heads give their levels."""

    cacheable = False  # free, and it answers from its own table

    def __init__(self, spec: str, trajs: list[Trajectory]):
        run = Path(spec.removeprefix("distilled:"))
        ckpt = latest_checkpoint(run) if (run / "config.json").exists() else None
        if ckpt is None:
            raise UserError(f"{spec}: {run} is not a run with a checkpoint")
        heads = {
            "distill": (
                "the heads of a --distill run (or null)",
                lambda v: v is None or isinstance(v, dict),
            )
        }
        state = load_state(ckpt / "trainer_state.pt", heads, spec).get("distill")
        if state is None:
            raise UserError(f"{spec}: {run} was trained without --distill; it has no heads to ask")
        config = read_config(run, Args.__dataclass_fields__)
        saved_config.check_recorded(run / "config.json", config, Args, flags.CHOICES, flags.BOUNDS)
        args = Args(**config)
        device = pick_device("auto")
        model, tok = load_policy(str(ckpt), device)
        for t in trajs:
            for turn in t.turns:
                turn.prompt_ids = tok(
                    turn.prompt or format_prompt(tok, turn.observation, t.role),
                    add_special_tokens=False,
                ).input_ids
                turn.response_ids = tok(turn.response, add_special_tokens=False).input_ids or [
                    tok.eos_token_id
                ]
        feats = distill.features(
            model,
            trajs,
            collate,
            tok.pad_token_id,
            args.micro_batch_size,
            device,
            Dist(),
            watch.Timer(),
        )
        heads = distill.Distiller(model.config.hidden_size, args)
        heads.load_state_dict(state)
        self.name, self.levels = (
            spec,
            dict(zip(map(render_for_judge, trajs), heads.predict(torch.stack(feats)))),
        )

    def complete(self, rubric: str, messages: list[dict]) -> tuple[str, int, int]:
        levels = self.levels[judge_prompts.trajectory_in(messages[-1]["content"])]
        return json.dumps({k: levels[k] for k in judge_prompts.keys(rubric)}), 0, 0


def judge_from_spec(
    spec: str, args: Args, trajs: list[Trajectory]
) -> HeuristicJudge | OpenAIJudge | DistilledJudge:
    if spec == "heuristic":
        return HeuristicJudge()
    if spec.startswith("distilled:"):
        return DistilledJudge(spec, trajs)
    judge = OpenAIJudge(*openai_spec(spec, "heuristic, distilled:RUN_DIR"), args)
    judge.check_reachable()
    return judge


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py agree",
        description=(
            "Re-score a sample of a run's trajectories with two or more judges and print, per rubric dimension, "
            "Cohen's kappa on the discrete levels and Spearman's rho for each rubric's score, phi and psi (as in the "
            "paper's Table 1)."
        ),
    )
    p.add_argument(
        "run", help="run directory (its trajectories.jsonl is read, its judge_cache.jsonl reused)"
    )
    p.add_argument(
        "--judges",
        nargs="+",
        required=True,
        metavar="JUDGE",
        help="two or more of: heuristic, openai:MODEL, openai:MODEL@BASE_URL (key from OPENAI_API_KEY), "
        "distilled:RUN_DIR (a --distill run's heads, on its last checkpoint's features)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=200,
        help="trajectories to re-score (default: 200, as in the paper)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the sample (default: 1)")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    docs = field_docs(Args)
    for name in (
        "judge_temperature",
        "judge_max_tokens",
        "judge_concurrency",
        "judge_timeout",
        "judge_retries",
    ):
        default = Args.__dataclass_fields__[name].default
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{docs[name][1]} (default: {default})",
        )
    ns = p.parse_args(argv)
    if len(ns.judges) < 2 or ns.sample < 2:
        raise UserError("agree needs at least two --judges and --sample >= 2")
    run = Path(ns.run)
    args = dataclasses.replace(
        Args(),
        judge_temperature=ns.judge_temperature,
        judge_max_tokens=ns.judge_max_tokens,
        judge_concurrency=ns.judge_concurrency,
        judge_timeout=ns.judge_timeout,
        judge_retries=ns.judge_retries,
    )
    validate(args)  # NaN or negative judge settings end here, in one line
    if ns.json:
        check_writable_file(Path(ns.json), "--json")
    pool = read_trajectories(run)
    trajs = [
        pool[i]
        for i in sorted(random.Random(ns.seed).sample(range(len(pool)), min(ns.sample, len(pool))))
    ]
    cache = JudgeCache(run / "judge_cache.jsonl")
    judges = [
        judge_from_spec(spec, args, trajs) for spec in ns.judges
    ]  # every judge is checked before any is paid
    verdicts, ruled = [], set()
    for spec, judge in zip(ns.judges, judges):
        runner = JudgeRunner(judge, args, cache)
        judgements, usage = judge_trajectories(runner, trajs, list(judge_prompts.RUBRICS))
        verdicts.append([j.scores for j in judgements])
        ruled |= {
            i for i, j in enumerate(judgements) if j.rule
        }  # levels set by the rules, not by the judge
        print(
            f"{spec}: {usage.get('requests', 0)} requests, {usage.get('cache_hits', 0)} from cache, "
            f"{sum(j.failure is not None for j in judgements)} failed",
            file=sys.stderr,
        )
    keep = [i for i in range(len(trajs)) if all(v[i] is not None for v in verdicts)]
    if len(keep) < 2:
        raise UserError(
            f"only {len(keep)} trajectories were scored by every judge; nothing to compare"
        )
    names = [chr(ord("A") + k) for k in range(len(ns.judges))]
    pairs = [(x, y) for x in range(len(names)) for y in range(x + 1, len(names))]
    table: dict[str, dict[str, float]] = {}
    free = [
        i for i in keep if i not in ruled
    ]  # a rubric with rules (evolution) agrees where the judges decided
    for dim in judge_prompts.ALL_KEYS:
        rows = keep if judge_prompts.RUBRIC_OF[dim] not in judge_prompts.RULES else free
        table[f"kappa {dim}"] = {
            f"{names[x]}~{names[y]}": cohen_kappa(
                [verdicts[x][i][dim] for i in rows], [verdicts[y][i][dim] for i in rows]
            )
            for x, y in pairs
        }
    for rubric, spec in judge_prompts.RUBRICS.items():  # each rubric's score: phi, psi, ...
        rows = keep if rubric not in judge_prompts.RULES else free
        values = [[judge_prompts.weighted(rubric, v[i]) for i in rows] for v in verdicts]
        table[f"spearman {spec['score']}"] = {
            f"{names[x]}~{names[y]}": spearman(values[x], values[y]) for x, y in pairs
        }
    ruled_rubrics = [r for r in judge_prompts.RUBRICS if r in judge_prompts.RULES]
    ruled_names = [*(k for r in ruled_rubrics for k in judge_prompts.keys(r))]
    ruled_names += [judge_prompts.RUBRICS[r]["score"] for r in ruled_rubrics]
    print(
        f"agreement on {len(keep)} of {len(trajs)} sampled trajectories of {run} "
        f"({len(trajs) - len(keep)} dropped: a judge failed); {', '.join(ruled_names)} on the {len(free)} "
        f"where no rule of code decided them (judge_prompts.RULES)"
    )
    for name, spec in zip(names, ns.judges):
        print(f"  {name} = {spec}")
    columns = list(next(iter(table.values())))
    print(f"{'':16}" + "".join(f"{c:>10}" for c in columns))
    for row, values in table.items():
        print(
            f"{row:16}"
            + "".join(
                f"{'n/a' if math.isnan(values[c]) else f'{values[c]:.3f}':>10}" for c in columns
            )
        )
    print(
        "paper (Table 1): kappa > 0.60, Spearman > 0.70; n/a: undefined, for kappa when both judges of the pair gave "
        "every trajectory one and the same level (or none was compared), for Spearman when either judge gave one "
        "value throughout"
    )
    if (
        ns.json
    ):  # renamed into place: a link planted at the name meanwhile is replaced, not followed
        write_atomic(
            Path(ns.json),
            json.dumps(
                {
                    "run": str(run),
                    "judges": dict(zip(names, ns.judges)),
                    "n": len(keep),
                    "sampled": len(trajs),
                    "table": {
                        r: {c: (None if math.isnan(v) else v) for c, v in vals.items()}
                        for r, vals in table.items()
                    },
                },
                indent=2,
            ).encode(),
        )
    return 0
