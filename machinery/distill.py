"""--distill: a judge distilled into small heads on the policy's own hidden states.

The paper's judge costs money and ties training to an API; its authors name, as future work, distilling it into
a lightweight local reward model. Distilling it from the same policy during training (and the worry that the
judge's style carries into the policy) is its review's own suggestion, not the authors'. With --distill, each step:

1. features: one no-grad pass of the current policy over the step's turns, the last hidden state (after the
   final norm) averaged over each trajectory's response tokens, all turns together, detached;
2. the heads, one per rubric dimension (every key of judge_prompts.RUBRICS, on its rubric's levels), predict every
   trajectory's levels; the evolution rules (one turn, stagnation) apply to their verdict as to a judge's;
3. a seeded share of the step's judged trajectories is held out, never trained on: the last N (prediction,
   verdict) pairs per dimension give Cohen's kappa per dimension and Spearman's rho of phi and psi;
4. trust: every used dimension at kappa >= --distill-kappa on a full window of N pairs. While trusted, the
   heads' levels score the trajectories without a verdict in place of the batch mean, and the judge samples
   at --distill-audit-rate; when agreement falls below the bar, imputation and the full rate return;
5. the heads train (Adam, --distill-lr) on the judged trajectories not held out, the last 3N of them (as many
   steps back as the holdout's N pairs reach).

The heads are ordinal (cumulative-link logistic, McCullagh 1980): one score per dimension and ordered cut
points, P(level <= k) = sigmoid(cut_k - score). The levels are ordered, and this loss charges a two-level miss
more than a one-level miss, which a softmax over unordered classes does not. Everything here runs on the CPU
in float32 (a few thousand parameters a dimension), deterministic and exactly resumable; it draws from its own
Random only, never from the run's streams, so the policy's gradient is bit-identical with --distill on or off.
Nothing here imports stratagem.py: phi, psi and the learner's collate are passed in.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import torch

import judge_prompts


@dataclass
class DistillFlags:
    """--distill, the learned judge: stratagem.Args's distillation flags."""

    # --- distilled judge ---
    distill: bool = False
    """learn the judge: heads on the policy's hidden states predict its
    levels and, trusted, score the unjudged in place of the batch mean
    (docs/distill.md)"""
    distill_kappa: float = 0.6
    """trust the heads while every used dimension reaches this Cohen's kappa
    on held-out verdicts"""
    distill_audit_rate: float = 0.0
    """the judge's sample rate while the heads are trusted (0:
    --judge-sample-rate throughout)"""
    distill_window: int = 100
    """held-out (heads, judge) pairs kept per dimension; the heads train on
    the last 3N others"""
    distill_lr: float = 1e-3
    """Adam learning rate of the heads"""


RUBRIC_OF = judge_prompts.RUBRIC_OF  # "alpha" -> "transferability"
KEYS = judge_prompts.ALL_KEYS  # every key of the rubric table, in its order: the heads' order
HOLDOUT = 0.25  # the share of each step's valid verdicts held out: compared with the heads, never trained on
EPOCHS = 20  # full-batch Adam steps on the training window per training step
WEIGHT_DECAY = 1e-3  # L2 on the heads' weights: a few hundred examples, up to thousands of features


# ------------------------------------------------------------------ agreement (the trust's, and `agree`'s)
def cohen_kappa(a: list, b: list) -> float:
    """Unweighted Cohen's kappa of two raters' labels; nan when chance agreement is 1 (no variation) or
    there is nothing to compare."""
    n, labels = len(a), set(a) | set(b)
    if n == 0:
        return float("nan")
    p_observed = sum(x == y for x, y in zip(a, b)) / n
    p_chance = sum((a.count(v) / n) * (b.count(v) / n) for v in labels)
    return float("nan") if p_chance == 1 else (p_observed - p_chance) / (1 - p_chance)


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            out[k] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); nan when either side is constant or empty."""
    if not x:
        return float("nan")
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return float("nan") if var == 0 else cov / var


def trusted(kappas: dict[str, float], counts: dict[str, int], bar: float, window: int) -> bool:
    """Every dimension given has a full window of held-out pairs and kappa >= bar. A nan kappa on a full window
    means both raters gave one and the same level throughout (chance agreement 1): perfect agreement. The 1e-9
    of slack is float rounding's: a kappa of exactly 3/5 can compute as 0.5999999999999996."""
    return all(
        counts[k] >= window and (kappas[k] >= bar - 1e-9 or math.isnan(kappas[k])) for k in kappas
    )


# ------------------------------------------------------------------ features: the policy's own hidden states
def final_norm(model) -> torch.nn.Module:
    """The decoder's last module, whose output is the last hidden state (Qwen, Llama, Mistral: `norm`)."""
    decoder = model.get_decoder()
    return next(
        getattr(decoder, name)
        for name in ("norm", "final_layernorm", "ln_f")
        if hasattr(decoder, name)
    )


def features(
    model,
    trajs: list,
    collate,
    pad_id: int,
    micro_batch_size: int,
    device: torch.device,
    dist,
    timer,
) -> list[torch.Tensor | None] | None:
    """Every trajectory's mean last hidden state over its response tokens (all its turns), [H] float32 on the CPU;
    None for a seat that never moved. Each rank passes its own trajectories; rank 0 gets the whole batch in rank
    order (the others None). Micro-batched like the learner, `logits_to_keep=1`: no full-vocabulary logits. The
    hidden state is caught by a forward hook on the final norm, which also works under FSDP (the root unit holds
    the norm). Eval mode and no_grad: no dropout, no RNG draw, no graph; the previous mode is restored."""
    items = sorted(
        ((j, t.prompt_ids, t.response_ids) for j, traj in enumerate(trajs) for t in traj.turns),
        key=lambda x: len(x[1]) + len(x[2]),
    )
    chunks = [items[k : k + micro_batch_size] for k in range(0, len(items), micro_batch_size)]
    n_real = len(chunks)
    chunks += chunks[-1:] * (
        max(dist.gather(len(chunks))) - len(chunks)
    )  # FSDP: every rank makes as many passes
    sums = [None] * len(trajs)
    counts = [0.0] * len(trajs)
    caught = {}
    hook = final_norm(model).register_forward_hook(
        lambda module, args, output: caught.update(hidden=output)
    )
    was_training = model.training
    model.eval()
    try:
        with timer("features"), torch.no_grad():
            for k, chunk in enumerate(chunks):
                ids, attn, mask = (
                    x.to(device) for x in collate([(p, r) for _, p, r in chunk], pad_id)
                )
                with torch.autocast(
                    device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
                ):
                    model(
                        input_ids=ids,
                        attention_mask=attn,
                        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                        logits_to_keep=1,
                        use_cache=False,
                    )
                if k >= n_real:  # a repeat that only keeps the ranks in step
                    continue
                hidden = caught["hidden"][
                    :, -mask.shape[1] :
                ].float()  # [b, R, H]: response positions (left-padded)
                pooled = (hidden * mask[..., None]).sum(1).cpu()  # [b, H]
                for (j, _, _), row, n in zip(chunk, pooled, mask.sum(1).tolist()):
                    sums[j] = row if sums[j] is None else sums[j] + row
                    counts[j] += n
    finally:
        hook.remove()
        model.train(was_training)
    mine = [None if s is None else s / max(n, 1.0) for s, n in zip(sums, counts)]  # [H] each
    parts = dist.gather(mine)
    return [f for part in parts for f in part] if dist.main else None


# ------------------------------------------------------------------ the heads
def features_of(run, mine: list, collate, timer) -> list | None:
    """features() of this rank's trajectories `mine` in a run with --distill (every rank takes part: under FSDP
    each pass is a collective); None without it."""
    if not run.args.distill:
        return None
    return features(
        run.model,
        mine,
        collate,
        run.tokenizer.pad_token_id,
        run.args.micro_batch_size,
        run.device,
        run.dist,
        timer,
    )


def use_heads(run, trajs: list, feats: list | None, judged: dict) -> dict[int, dict]:
    """--distill's call in step 3: the heads predict every played trajectory and learn from this
    step's verdicts. Returns {index: levels} of the unjudged that the trusted heads score in place
    of the batch mean (stratagem.final_a_mod turns them into phi and psi); {} otherwise. The heads'
    report is the run's distill entry."""
    if run.distiller is None:
        return {}
    return run.distiller.step(trajs, feats, judged)


class OrdinalHeads(torch.nn.Module):
    """Per dimension d: a score s_d = w_d . x and ordered cut points c_d0 < c_d1 (the second is the first plus
    a softplus, so the order always holds); P(level <= k) = sigmoid(c_dk - s_d). Zero weights at the start
    (no random draw): every head predicts the middle level until it has learned something."""

    def __init__(self, dim: int, n_dims: int = len(KEYS)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n_dims, dim))  # [D, H]
        self.first_cut = torch.nn.Parameter(torch.full((n_dims,), -1.0))  # [D]
        self.gap = torch.nn.Parameter(
            torch.full((n_dims,), math.log(math.expm1(2.0)))
        )  # [D]; softplus(gap) = 2

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (standardised) -> log P(level k) [N, D, 3]."""
        score = x @ self.weight.T  # [N, D]
        cuts = torch.stack(
            [self.first_cut, self.first_cut + torch.nn.functional.softplus(self.gap)], -1
        )  # [D, 2]
        below = torch.sigmoid(cuts[None] - score[..., None])  # [N, D, 2]: P(level <= k)
        probs = torch.cat(
            [below[..., :1], below[..., 1:] - below[..., :1], 1 - below[..., 1:]], -1
        )  # [N, D, 3]
        return probs.clamp_min(1e-12).log()


def ordinal_loss(
    log_probs: torch.Tensor, levels: torch.Tensor, known: torch.Tensor
) -> torch.Tensor:
    """Mean negative log-likelihood of the judge's level indices over the known entries.
    log_probs [N, D, 3]; levels [N, D] long; known [N, D] bool."""
    nll = -log_probs.gather(-1, levels[..., None]).squeeze(-1)  # [N, D]
    return (nll * known).sum() / known.sum().clamp_min(1)


def level_index(key: str, value: float) -> int:
    return judge_prompts.RUBRICS[RUBRIC_OF[key]]["levels"].index(value)


# ------------------------------------------------------------------ the distiller: heads, holdout, trust
class Distiller:
    """Rank 0's heads and their bookkeeping. `step` is called once per training step, after the judge and
    before A_mod; `state_dict` rides in the checkpoint."""

    def __init__(self, dim: int, args):
        self.args = args
        self.used = [k for k in KEYS if RUBRIC_OF[k] in args.entering]  # trust is judged on these
        self.heads = OrdinalHeads(dim)
        self.optimizer = torch.optim.Adam(self.heads.parameters(), lr=args.distill_lr)
        self.rng = random.Random(
            f"distill:{args.seed}"
        )  # the holdout split; the run's own streams stay untouched
        span = round(
            args.distill_window * (1 - HOLDOUT) / HOLDOUT
        )  # the training window covers the holdout's steps
        self.train_x: deque = deque(
            maxlen=span
        )  # [H] features of judged, not held-out trajectories
        self.train_y: deque = deque(
            maxlen=span
        )  # their verdicts (levels; None where a rule decided)
        self.pairs = {
            k: deque(maxlen=args.distill_window) for k in (*KEYS, *judge_prompts.SCORES)
        }  # (heads, judge)
        self.trusted = False
        self.report: dict = {}

    def sample_rate(self) -> float:
        """The judge's rate this step: --distill-audit-rate while trusted (if one was given), else
        --judge-sample-rate."""
        audit = self.args.distill_audit_rate
        return audit if self.trusted and audit > 0 else self.args.judge_sample_rate

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        """Features scaled by the training window's mean and spread (mean-pooled hidden states share a large
        common part; what tells trajectories apart is small beside it). x [N, H] -> [N, H]"""
        if len(self.train_x) < 2:
            return x
        window = torch.stack(list(self.train_x))  # [W, H]
        return (x - window.mean(0)) / (window.std(0, unbiased=False) + 1e-5)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> list[dict[str, float]]:
        """The most probable level of every dimension. x [N, H] -> N dicts."""
        best = self.heads.log_probs(self.standardise(x)).argmax(-1)  # [N, D]
        return [
            {k: judge_prompts.RUBRICS[RUBRIC_OF[k]]["levels"][int(i)] for k, i in zip(KEYS, row)}
            for row in best
        ]

    def train(self) -> float:
        """EPOCHS full-batch Adam steps on the training window; returns the last loss."""
        x = self.standardise(torch.stack(list(self.train_x)))  # [W, H]
        levels = torch.tensor(
            [[0 if y[k] is None else level_index(k, y[k]) for k in KEYS] for y in self.train_y]
        )  # [W, D]
        known = torch.tensor([[y[k] is not None for k in KEYS] for y in self.train_y])  # [W, D]
        for _ in range(EPOCHS):
            self.optimizer.zero_grad(set_to_none=True)
            loss = (
                ordinal_loss(self.heads.log_probs(x), levels, known)
                + WEIGHT_DECAY * self.heads.weight.square().sum()
            )
            loss.backward()
            self.optimizer.step()
        return loss.item()

    def agreement(self) -> tuple[dict[str, float], dict[str, float]]:
        """Kappa per dimension and Spearman of each rubric's score (phi, psi) on the held-out window."""
        kappas = {
            k: cohen_kappa([p for p, _ in self.pairs[k]], [v for _, v in self.pairs[k]])
            for k in KEYS
        }
        rhos = {
            k: spearman([p for p, _ in self.pairs[k]], [v for _, v in self.pairs[k]])
            for k in judge_prompts.SCORES
        }
        return kappas, rhos

    def file(self, x: torch.Tensor, predicted: dict, judgement) -> bool:
        """One valid verdict: held out (a seeded HOLDOUT share: a (heads, judge) pair per dimension, and of each
        rubric's score) or kept to train on. The keys of a rubric with rules (judge_prompts.RULES) count only where no
        rule decided them. Returns whether it trains."""
        free = {k: RUBRIC_OF[k] not in judge_prompts.RULES or judgement.rule is None for k in KEYS}
        verdict = {
            k: judgement.scores[k] if free[k] and k in judgement.scores else None for k in KEYS
        }
        if self.rng.random() >= HOLDOUT:
            self.train_x.append(x)
            self.train_y.append(verdict)
            return True
        for k in KEYS:
            if verdict[k] is not None:
                self.pairs[k].append((predicted[k], verdict[k]))
        for rubric, spec in judge_prompts.RUBRICS.items():  # each score, weighted as the table says
            name = spec["score"]
            if all(verdict[k] is not None for k in judge_prompts.keys(rubric)):
                pair = (
                    judge_prompts.weighted(rubric, predicted),
                    judge_prompts.weighted(rubric, verdict),
                )
                self.pairs[name].append(pair)
        return False

    def step(self, trajs: list, feats: list, judged: dict) -> dict[int, dict]:
        """Predict every played trajectory (trajs[i].predicted), hold out a share of the valid verdicts and compare,
        update trust, train on the rest. A trajectory whose features are not finite (a diverged policy) gets no
        prediction and is not learned from: the judge's verdict on it stands, else the batch mean. Returns the
        heads' levels for every predicted trajectory without a valid verdict while trusted, else {}. `judged`:
        index -> Judgement (its scores and the rule that set some of them, if one did)."""
        rate = (
            self.sample_rate()
        )  # the rate this step was judged at (trust as the last step left it)
        played = [i for i, f in enumerate(feats) if f is not None]
        usable = [
            i for i in played if bool(torch.isfinite(feats[i]).all())
        ]  # a diverged policy's NaN, Inf: left out
        x = (
            torch.stack([feats[i] for i in usable])
            if usable
            else torch.zeros(0, self.heads.weight.shape[1])
        )  # [P, H]
        predicted = {}
        for i, raw in zip(usable, self.predict(x)):
            observations, responses = (
                [t.observation for t in trajs[i].turns],
                [t.response for t in trajs[i].turns],
            )
            for (
                rules
            ) in judge_prompts.RULES.values():  # the rules bind the heads as they bind a judge
                raw = rules(observations, responses, raw)[0]
            predicted[i] = raw
            trajs[i].predicted = {"levels": predicted[i], "used": False}
        valid = {i: j for i, j in sorted(judged.items()) if j.scores is not None and i in played}
        trained = sum(
            self.file(feats[i], predicted[i], j) for i, j in valid.items() if i in predicted
        )  # none: the heads stay as they are
        kappas, rhos = self.agreement()
        counts = {k: len(self.pairs[k]) for k in KEYS}
        self.trusted = trusted(
            {k: kappas[k] for k in self.used},
            counts,
            self.args.distill_kappa,
            self.args.distill_window,
        )
        estimates = {i: predicted[i] for i in predicted if i not in valid} if self.trusted else {}
        for i in estimates:
            trajs[i].predicted["used"] = True
        loss = self.train() if trained else float("nan")
        finite = lambda v: None if math.isnan(v) else v  # noqa: E731 - JSON has no nan
        self.report = {
            "trusted": self.trusted,
            "judge_rate": rate,
            "used": self.used,
            "bar": self.args.distill_kappa,
            "scored": {
                "judge": len(valid),
                "heads": len(estimates),
                "imputed": len(played) - len(valid) - len(estimates),
            },
            "kappa": {k: finite(v) for k, v in kappas.items()},
            "holdout": counts,
            "spearman": {k: finite(v) for k, v in rhos.items()},
            "trained_on": len(self.train_x) if trained else 0,
            "train_loss": finite(loss),
        }
        return estimates

    def state_dict(self) -> dict:
        return {
            "heads": self.heads.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self.rng.getstate(),
            "train_x": list(self.train_x),
            "train_y": list(self.train_y),
            "pairs": {k: list(v) for k, v in self.pairs.items()},
            "trusted": self.trusted,
        }

    def load_state_dict(self, state: dict) -> None:
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        self.train_x.extend(state["train_x"])
        self.train_y.extend(state["train_y"])
        for k, v in state["pairs"].items():
            self.pairs[k].extend(v)
        self.trusted = state["trusted"]
