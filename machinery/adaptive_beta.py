"""Adaptive beta (--beta-share), the project's extension, off by default. RAE's baselines converge
towards each role's expected return, so |A_game| shrinks over a run and a fixed beta*psi takes a
growing share of A_mod. A controller, as RLHF's for its KL coefficient (Ziegler et al. 2019, arXiv
1909.08593), keeps that share where the researcher sets it. Only judged trajectories count: the
imputed ones carry the batch mean. docs/judge.md#adaptive-beta has the figures."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdaptiveBetaFlags:
    """--beta-share, the controller that moves beta: stratagem.Args's adaptive beta flags."""

    # --- adaptive beta ---
    beta_share: float = 0.0
    """adaptive beta (0: off, the paper's fixed beta): beta moves so that
    the share of beta*psi in A_mod, RMS(beta*psi) / (RMS(A_game*phi) +
    RMS(beta*psi)), nears this (docs/judge.md#adaptive-beta)"""
    beta_horizon: float = 10.0
    """with --beta-share: the controller's horizon in steps (a step moves
    beta by 1 - e/horizon)"""
    beta_min: float = 0.01
    """with --beta-share: the lowest beta the controller may set"""
    beta_max: float = 1.0
    """with --beta-share: the highest beta the controller may set"""


def evolution_share(trajs: list, beta: float) -> float | None:
    """RMS(beta*psi) / (RMS(A_game*phi) + RMS(beta*psi)) over the judged trajectories, in [0, 1]; None
    where none was judged or both terms are 0."""
    judged = [t for t in trajs if t.scores is not None]
    game = math.sqrt(sum((t.a_game * t.phi) ** 2 for t in judged) / max(len(judged), 1))
    evolution = math.sqrt(sum((beta * t.psi) ** 2 for t in judged) / max(len(judged), 1))
    return evolution / (game + evolution) if game + evolution > 0 else None


def next_beta(
    beta: float, share: float | None, target: float, horizon: float, low: float, high: float
) -> float:
    """The next step's beta: the share's relative error e = share / target - 1, clipped to +-0.2, moves it by a
    factor 1 - e / horizon, within [low, high]. Held where the share is unknown or 0 (psi 0 on every judged
    trajectory: beta cannot move the share then)."""
    if not share:
        return beta
    error = max(-0.2, min(0.2, share / target - 1))
    return min(high, max(low, beta * (1 - error / horizon)))


def first(args) -> float | None:
    """The controller's beta at a fresh start: --beta; None where beta is fixed (no --beta-share)."""
    return args.beta if args.beta_share else None


def resumed(args, saved) -> float | None:
    """The controller's beta read back from a checkpoint: the saved one if it is a number in
    [--beta-min, --beta-max], else --beta; None where beta is fixed."""
    if not args.beta_share:
        return None
    ok = isinstance(saved, int | float) and not isinstance(saved, bool)
    return float(saved) if ok and args.beta_min <= saved <= args.beta_max else args.beta


def step(run, trajs: list, beta: float) -> dict | None:
    """--beta-share: the controller moves run.beta for the next step. Returns this step's record for
    metrics.jsonl (its value, the share measured, the target: None where beta is fixed), or None for
    SPIRAL, where beta plays no part."""
    args = run.args
    if args.mode == "spiral":
        return None
    share = evolution_share(trajs, beta)
    target = args.beta_share or None
    if target:
        run.beta = next_beta(beta, share, target, args.beta_horizon, args.beta_min, args.beta_max)
    return {"value": beta, "share": share, "target": target}
