"""`stratagem.py warmstart DIR`: the warm start. A small random Qwen3 taught the RULES of the games, not their
strategy, by supervised learning on games of the uniformly random legal player (machinery.matches.RandomPlayer's
policy), so that the RL that follows starts from a policy that plays whole multi-turn games, and wins about as often
as that player, instead of losing every game on its first move. Any gain over it afterwards is the RL's doing. The
shipped one is warmstart/tiny; this command rebuilds it (byte for byte on the kind of CPU it was built on, closely
elsewhere: `machine`), and measures it on held-out games.

Each example is one move of a random-vs-random game: the prompt is exactly the trainer's (its format_prompt on the
mover's observation and seat), the response one short reasoning line, LINE, then \\boxed{[action]} and the end-of-turn
token that stops generation. The loss is the negative log-likelihood of the response tokens, through the learner's own
collate, so the warm start and RL see identical tokens. Where the legal moves differ in one token only (TicTacToe's
square, Kuhn Poker's action) that token's target is the random player's whole distribution, uniform over the legal
moves, rather than the one move it drew: the same expected gradient without the draw's noise (TicTacToe learns in a
third of the steps).

With --model DIR the lesson starts from that pretrained model instead (its own tokenizer and chat template, loaded as
the trainer loads an untrusted folder): the same examples and loss, with the defaults of PRETRAINED, as a pretrained
model needs the format taught, not the language, and fewer, gentler steps keep what it knew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import judge_prompts
from games import check_ids, spy
from machinery import UserError
from machinery.flags import FriendlyParser, field_docs
from machinery.matches import RandomPlayer, random_legal_move, summarize_matches
from machinery.modelfiles import check_folder
from machinery.runfiles import check_writable_dir, follow_umask, write_atomic
from machinery.watch import Lines, Timer, fmt, quiet_transformers, terminal_bar
from stratagem import (
    ARCHS,
    PROMPT,
    Args,
    HFPolicy,
    Rules,
    build_random_model,
    collate,
    format_prompt,
    load_policy,
    make_env,
    play_matches,
    schedule,
)

# ------------------------------------------------------------------------------------ the reasoning styles
# What the warm start says before each move: a style drawn uniformly for every move, independently of the move (which
# stays uniformly random and legal), so that no style is taught to win. Three contents span the transferability
# rubric's levels, scored here by the stand-in judge; each is either static (the same words every turn, which the
# evolution rubric's rule calls stagnation) or reads the state first (STATE: what the observation shows now, in words,
# as the rule ignores digits). Change the table and rebuild: warmstart.json records it.
CONTENTS = {
    "terse": "Just play the move.",  # game lore at most, no steps, no reason: phi 0
    "principle": "In general, because the expected value and the risk of every move are equal, no move is better.",
    # general terms and a stated principle, no steps: phi 0.35 * 1 + 0.30 * 0.5 = 0.5
    "structured": "First, read the state. Next, compare the risk and expected value of each move. Therefore, any move.",
    # general terms, ordered steps and a conclusion: phi 0.35 + 0.35 + 0.30 * 0.5 = 0.85
}
STYLES = [
    f"{content}/{'state' if reads else 'static'}" for content in CONTENTS for reads in (False, True)
]
WORDS = "zero one two three four five six seven eight nine ten".split()


def kuhn_state(observation: str, pid: int) -> str:
    """'Round three, after a bet.': the round, and what the opponent last did in it ('Round three.' before)."""
    rounds = re.findall(r"Starting round (\d+)", observation)
    if not rounds:
        return "The game begins."
    this_round = observation[observation.rfind("Starting round") :]
    last = re.findall(rf"\[Player {1 - pid}\] \[(check|bet)\]", this_round)
    return f"Round {WORDS[int(rounds[-1])]}{f', after a {last[-1]}' if last else ''}."


def tictactoe_state(observation: str, pid: int) -> str:
    """'The opponent took cell six.', or 'The board is empty.' before any mark."""
    taken = re.findall(rf"\[Player {1 - pid}\] \[(\d)\]", observation)
    return f"The opponent took cell {WORDS[int(taken[-1])]}." if taken else "The board is empty."


def negotiation_state(observation: str, pid: int) -> str:
    """'Player one offers Wood for Gold.': the last offer on the table, or 'No offer yet.'"""
    offers = re.findall(
        r"Player (\d) made the following offer to Player \d: Offered items: ([^\n]*?) -> "
        r"Requested items: ([^\n]*)",
        observation,
    )
    if not offers:
        return "No offer yet."
    who, given, asked = offers[-1]
    words = [" and ".join(re.findall(r"[A-Za-z]+", side)) for side in (given, asked)]
    return f"Player {WORDS[int(who)]} offers {words[0]} for {words[1]}."


STATE = {
    "KuhnPoker-v1": kuhn_state,
    "TicTacToe-v0": tictactoe_state,
    "SimpleNegotiation-v1": negotiation_state,
}


def reasoning(style: str, game: str, observation: str, pid: int) -> str:
    """The line a style says before its move: the content, after the state's words for a state-reading style."""
    content, reads = style.split("/")
    state = STATE.get(game, lambda obs, p: "")(observation, pid) if reads == "state" else ""
    return f"{state} {CONTENTS[content]}".strip()


def response_text(line: str, action: str) -> str:
    """A move's whole response: its line, then the action in a box (a SpyRL output has none: its line is all)."""
    return f"{line} \\boxed{{{action}}}" if action else line


def tokenizer_texts(games: list[str]) -> tuple[str, ...]:
    """What the tokenizer learns besides the two-player games' texts: every content and the state's words; with SpyRL's
    game, its prompts and a sample of its texts."""
    if spy.GAME in games:
        sample = [t["text"] for t in spy.default_texts()[::20]]
        return (
            spy.PERFORM,
            spy.VOTE,
            "In short: Not me (Player 0): \\boxed{1} Player 1:\n| ",
            *sample,
        )
    states = [f"Round {w}, after a check. Round {w}, after a bet. Round {w}." for w in WORDS]
    states += [f"The opponent took cell {w}. The board is empty. Player {w} offers" for w in WORDS]
    return (
        *CONTENTS.values(),
        *states,
        "No offer yet. Wood and Gold for Brick and Sheep and Wheat and Ore.",
    )


# ------------------------------------------------------------------------------------ random legal games
@dataclass
class Move:
    game: str
    role: int
    observation: str
    action: str
    legal: tuple[str, ...] = ()  # every legal move, when enumerated
    style: str = STYLES[0]
    line: str = ""  # what the style says here (reasoning)
    template: str = (
        PROMPT  # how the trainer shows the observation (spyrl.py: the observation as it is)
    )


@contextlib.contextmanager
def progress(desc: str, total: int, unit: str, show: bool = True):
    """Where a phase is: a bar on a terminal, a line every 30 s in a log or a pipe (watch.Lines); nothing
    without `show`. Yields the function to call with the count so far."""
    bar = terminal_bar(desc, total, unit + " [{elapsed}<{remaining}]", show)
    lines = Lines(desc, total, unit) if show else None

    def heard(done: int) -> None:
        bar.update(done - bar.n)
        if lines is not None:
            lines(done)

    try:
        yield heard
    finally:
        bar.close()


def random_games(moves_per_game: dict[str, int], seed: int, show: bool = False) -> list[Move]:
    """Whole random-vs-random games of each id until it has >= its count of moves; every move is kept with the mover's
    observation (the trainer's make_env: SPIRAL's observation wrappers) and a style drawn on a stream of its own.
    `show`: where each id's games are (`progress`)."""
    rng, styles = random.Random(seed), random.Random(f"styles:{seed}")
    out: list[Move] = []
    for game, wanted in moves_per_game.items():
        n = 0
        with progress(f"warmstart: random games of {game}", wanted, "moves", show) as heard:
            while n < wanted:
                env = make_env(game, rng.randrange(2**31), 0)
                done = False
                while not done:
                    pid, obs = env.get_observation()
                    action, legal = random_legal_move(env, pid, obs, rng)
                    style = styles.choice(STYLES)
                    out.append(
                        Move(game, pid, obs, action, legal, style, reasoning(style, game, obs, pid))
                    )
                    n += 1
                    done = env.step(action)[0]
                heard(min(n, wanted))
    return out


# SpyRL's game (spyrl.py): the same format taught, no strategy. A seat's output is the first words of its copy's
# first sentence ("In short: ..."), so a spy whose copy lost that sentence writes another; its vote is a seat drawn
# uniformly from the others, after its own seat ("Not me (Player 2): \\boxed{4}": the seat said next to the box is
# the one a small model learns to avoid). Detection starts at the random vote's rate, 1 / (n - 1).
SPY_OUTPUT_WORDS = 8


def spy_output(text: str) -> str:
    return "In short: " + " ".join(text.split(". ")[0].split()[:SPY_OUTPUT_WORDS])


def spy_games(count: int, seed: int) -> list[Move]:
    """`count` whole games of who is the spy (spyrl.py's defaults: 5 players, summaries, a fifth removed): every
    seat's output, then every seat's vote, each with the observation the trainer shows it."""
    rng, texts, out = random.Random(seed), spy.default_texts(), []
    for _ in range(count):
        env = spy.WhoIsTheSpyEnv(texts=texts)
        env.reset(num_players=5, seed=rng.randrange(2**31))
        for phase in spy.PHASES:
            for pid, obs in env.phase_observations():
                others = tuple(str(k) for k in range(env.n) if k != pid)
                vote = rng.choice(others) if phase == "detection" else ""
                line = (
                    spy_output(env.inputs[pid])
                    if phase == "performance"
                    else f"Not me (Player {pid}):"
                )
                move = Move(
                    spy.GAME, pid, obs, vote, others if vote else (), phase, line, "{observation}"
                )
                out.append(move)
                env.step(response_text(move.line, move.action))
    return out


# ------------------------------------------------------------------------------------ examples
def tokenize(moves: list[Move], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) as the trainer's HF generation has them: the prompt tokenized alone without special
    tokens, the response ending with the EOS token that stops generation (cut_at_stop keeps it)."""
    prompts = [format_prompt(tokenizer, m.observation, m.role, m.template) for m in moves]
    p_ids = tokenizer(prompts, add_special_tokens=False).input_ids
    r_ids = tokenizer(
        [response_text(m.line, m.action) for m in moves], add_special_tokens=False
    ).input_ids
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(p_ids, r_ids)]


def soft_targets(moves: list[Move], tokenizer) -> list[tuple[int, list[int]] | None]:
    """Per move, (position in the response, the legal moves' token ids there) when all its legal moves' responses have
    one length and first differ at that position; else None (an offer's many tokens: the drawn move is the target)."""
    out: list[tuple[int, list[int]] | None] = []
    for m in moves:
        texts = [response_text(m.line, a) for a in m.legal]
        ids = tokenizer(texts, add_special_tokens=False).input_ids if m.legal else []
        if len(ids) < 2 or len({len(r) for r in ids}) != 1:
            out.append(None)
            continue
        k = next(k for k in range(len(ids[0])) if len({r[k] for r in ids}) > 1)
        out.append((k, sorted({r[k] for r in ids})))
    return out


def batches(lengths: list[int], batch_size: int, steps: int, rng: random.Random):
    """`steps` batches of indices, made as they are needed, from shuffled passes over the data; inside a window of 16
    batches the items are sorted by length, so that a batch pads little (collate left-pads), and the batches
    shuffled."""
    order: list[int] = []
    made = 0
    while made < steps:
        if len(order) < 16 * batch_size:
            order += rng.sample(range(len(lengths)), len(lengths))
        window, order = (
            sorted(order[: 16 * batch_size], key=lambda i: lengths[i]),
            order[16 * batch_size :],
        )
        chunk = [window[k : k + batch_size] for k in range(0, len(window), batch_size)]
        rng.shuffle(chunk)
        yield from chunk[: steps - made]
        made += len(chunk)


# ------------------------------------------------------------------------------------ supervised learning
def response_logprobs(
    model, ids, attn, mask, rows: list[tuple[int, list[int]] | None]
) -> torch.Tensor:
    """log pi of each response token, as the learner's sequence_logprobs (temperature 1), except that a row's soft
    position gets the mean log-probability of its legal tokens (cross-entropy with the uniform distribution over
    them). ids, attn [B, T]; mask [B, R] -> [B, R]"""
    resp_len = mask.shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T], as sequence_logprobs
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=resp_len + 1
    ).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, R, V]
    out = logp.gather(-1, ids[:, -resp_len:].unsqueeze(-1)).squeeze(-1)  # [B, R]
    soft = [
        (b, resp_len - int(mask[b].sum()) + k, tokens)
        for b, row in enumerate(rows)
        if row
        for k, tokens in [row]
    ]
    if soft:
        out = out.clone()
        for b, col, tokens in soft:
            out[b, col] = logp[b, col, tokens].mean()
    return out


def fit(
    model,
    items: list[tuple[list[int], list[int]]],
    soft: list[tuple[int, list[int]] | None],
    pad_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log=None,
    log_every: int = 50,
) -> list[float]:
    """AdamW (betas 0.9, 0.95, no weight decay) on the mean NLL per response token; lr warmed up over the first 5 %
    of the steps, then cosine down to 10 %. Returns every step's loss."""
    rng = random.Random(seed)
    plan = batches([len(p) + len(r) for p, r in items], batch_size, steps, rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)

    def factor(s: int) -> float:
        return min(1.0, (s + 1) / warm) * (
            0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item())
        )

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    losses = []
    bar = terminal_bar("warm start", steps, "steps [{elapsed}<{remaining}]", show=True)
    for step, idx in enumerate(plan):
        ids, attn, mask = collate([items[i] for i in idx], pad_id)  # [B, T], [B, T], [B, R]
        logps = response_logprobs(model, ids, attn, mask, [soft[i] for i in idx])  # [B, R]
        loss = -(logps * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.update()
        if log is not None and (step + 1) % log_every == 0:
            with tqdm.external_write_mode(file=sys.stderr):
                log(step + 1, sum(losses[-log_every:]) / log_every)
    bar.close()
    model.eval()
    return losses


# ------------------------------------------------------------------------------------ measuring it
class CountingPolicy:
    """A policy that keeps what it was asked and said: its moves (the legal-move rate's denominator), and the
    prompts and responses whose styles `styles_said` reads."""

    def __init__(self, policy):
        self.policy, self.said = policy, []

    @property
    def moves(self) -> int:
        return len(self.said)

    def generate(self, prompts: list[str]):
        out = self.policy.generate(prompts)
        self.said += [(prompt, text) for prompt, (_, _, text) in zip(prompts, out)]
        return out


def style_of(game: str, prompt: str, response: str) -> tuple[str | None, bool | None]:
    """(the style a response's reasoning follows, or None: off the table; for a state-reading one, whether its
    state is the prompt's: the same words the warm start was taught to say there, else None)."""
    line = " ".join(judge_prompts.reasoning_text(response).split())
    pid = int(re.search(r"as Player (\d)", prompt).group(1))
    for name, content in CONTENTS.items():
        if line == content:
            return f"{name}/static", None
        if line.endswith(" " + content) and game in STATE:
            said = line[: -len(content) - 1]
            return f"{name}/state", said == STATE[game](prompt, pid)
    return None, None


def styles_said(game: str, said: list[tuple[str, str]]) -> dict:
    """The share of each style among the responses, off the table included, and of right states."""
    found = [style_of(game, prompt, text) for prompt, text in said]
    shares = {
        style: sum(f == style for f, _ in found) / max(1, len(found)) for style in (*STYLES, None)
    }
    states = [ok for _, ok in found if ok is not None]
    return {
        "styles": {str(k): v for k, v in shares.items()},
        "state_right": sum(states) / len(states) if states else None,
    }


def measure(policy, tokenizer, opponent, games: list[str], n: int, seed: int) -> dict:
    """Per game id: n held-out games against `opponent`, both seats, as the trainer plays them (200-move cap); the
    legal-move rate (1 - the model's invalid moves over its moves; an invalid move ends the game), the mean game length
    in moves (both players) and the win rate with its 95 % Wilson interval."""
    out = {}
    for k, game in enumerate(games):
        counting = CountingPolicy(policy)
        rules = Rules(max_turns=200)
        games = schedule([game], n, random.Random(seed + k))
        with progress(f"warmstart: measuring on {game}", len(games), "games") as heard:
            records = play_matches(counting, tokenizer, opponent, games, rules, 64, heard)
        cell = summarize_matches(records)["games"][game]["both"]
        invalid = sum(r["invalid"] for r in records)
        out[game] = {
            "games": len(records),
            "moves": counting.moves,
            "legal_rate": 1 - invalid / max(1, counting.moves),
            "length": sum(r["turns"] for r in records) / len(records),
            "win_rate": cell["win"]["rate"],
            "win_ci95": cell["win"]["ci95"],
            "draw_rate": cell["draw"]["rate"],
            **styles_said(game, counting.said),
        }
    return out


def measure_spy(policy, tokenizer, n: int, seed: int) -> dict:
    """n held-out games of who is the spy, every seat the policy: the share of valid votes, of outputs in the taught
    form, and the civilians' detection rate beside the random vote's 1 / (n - 1)."""
    rng = random.Random(seed)
    games = [spy.WhoIsTheSpyEnv() for _ in range(n)]
    for env in games:
        env.reset(num_players=5, seed=rng.randrange(2**31))
    prompt = lambda obs: format_prompt(tokenizer, obs, 0, "{observation}")  # noqa: E731 - as spyrl.py shows it
    moves, _ = spy.play(
        games, lambda observations: policy.generate(list(map(prompt, observations))), 16, Timer()
    )
    votes = [v for env in games for k, v in enumerate(env.votes) if k != env.spy]
    said = [moves[g][k, 0][1] for g, env in enumerate(games) for k in range(env.n)]
    return {
        spy.GAME: {
            "games": n,
            "valid_votes": sum(v is not None for env in games for v in env.votes) / (5 * n),
            "outputs_in_form": sum(x.startswith("In short: ") for x in said) / len(said),
            "detection": sum(
                v == env.spy for env in games for k, v in enumerate(env.votes) if k != env.spy
            )
            / len(votes),
            "random_vote_detection": 1 / 4,
        }
    }


# ------------------------------------------------------------------------------------ the whole build
@dataclass
class Recipe:
    """Everything that shapes a warm start (with the code: a cache of warm starts is keyed by these)."""

    seed: int = 2
    """seeds the random weights, the random games and the order of the examples (2: seed 1's TicTacToe stayed at 82 %
    legal moves, docs/learning.md)"""
    games: str = "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    """comma-separated game ids whose rules are taught (SPIRAL's training set)"""
    moves: str = "8000,2500,2500"
    """random-game moves per game id, in --games order, or one count for every id (TicTacToe is the hard one, and its
    prompts are short)"""
    steps: int = 1000
    """AdamW steps"""
    batch_size: int = 16
    """examples (moves) per step"""
    lr: float = 5e-3
    """peak learning rate (warm-up over 5 % of the steps, then cosine down to 10 %)"""
    arch: str = "tiny-warm"
    """shape of the random model (stratagem.ARCHS; none with --model)"""
    model: str = ""
    """a pretrained model folder to start from instead of a random model: its weights, tokenizer and chat template
    (checked as the trainer checks any folder); '': the random model of --arch"""

    def moves_per_game(self) -> dict[str, int]:
        games = self.games.split(",")
        try:
            counts = [int(c) for c in self.moves.split(",")]
        except ValueError:
            raise UserError(
                f"--moves takes comma-separated whole numbers, got {self.moves!r}"
            ) from None
        if len(counts) == 1:  # one count: the same for every game id
            counts *= len(games)
        if len(games) != len(counts):
            raise UserError(f"--moves: {len(counts)} counts for {len(games)} games")
        return dict(zip(games, counts))

    def check(self) -> None:
        """Every field in its range, before anything is built or written (one line, UserError)."""
        counts = self.moves_per_game()
        if two_player := [g for g in counts if g != spy.GAME]:  # SpyRL's game is for five players
            check_ids(",".join(two_player))
        if not all(1 <= c <= 10**6 for c in counts.values()):
            raise UserError(f"--moves must each be in [1, 1000000], got {self.moves}")
        for flag, value, low, high in (
            ("steps", self.steps, 1, 10**6),
            ("batch-size", self.batch_size, 1, 4096),
        ):
            if not low <= value <= high:
                raise UserError(f"--{flag} must be in [{low}, {high}], got {value}")
        if not (0 < self.lr <= 1 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be in (0, 1], got {self.lr}")
        if self.model:  # a missing or refused folder fails here, before DIR is made (load_policy checks it again)
            check_folder(self.model)
        elif self.arch not in ARCHS:
            raise UserError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if not 0 <= self.seed < 2**31:
            raise UserError(f"--seed must be in [0, 2147483647], got {self.seed}")


# The defaults with --model, where a pretrained model starts: it reads and writes already and is taught the format only,
# at a fine-tuning rate (5e-3 would wreck it). SmolLM2-135M-Instruct, --games KuhnPoker-v1 (prompts ~480 tokens), on
# two CPU threads: ~30 s a step at batch 8, its final loss 0.12 after these 40 steps (1222 s), and its games against
# the random player lost on an invalid move from all to 0.13. 12 steps (loss 0.19) left 0.58 lost so, and RL's
# self-play too few legal games to learn from on one seed of two (docs/real-model.md).
PRETRAINED = {"moves": "400", "steps": 40, "batch_size": 8, "lr": 1e-4}


def machine() -> dict:
    """What decides the build's float sums besides the recipe: torch and the CPU's kernels. On one thread the same
    machine gives the same bytes; another CPU (AVX-512 or AVX2, MKL's Intel or AMD path) rounds a few sums
    differently, and 1,000 steps carry that into every weight, closely (docs/learning.md: The warm start)."""
    names = [
        line.split(":", 1)[1].strip() for line in read_cpuinfo() if line.startswith("model name")
    ]
    return {
        "torch": torch.__version__,
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "cpu": names[:1],
    }


def read_cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:  # not Linux: the CPU is then named by its kernels only
        return []


def build(out_dir: str, recipe: Recipe, log=None):
    """The random model of recipe.arch, or the pretrained recipe.model, taught by `fit` on random-game moves and
    saved to out_dir like any checkpoint (fp32, with its tokenizer and chat template). Returns (model, tokenizer,
    losses)."""
    games = recipe.moves_per_game()
    say = functools.partial(print, flush=True)  # where the build is, phase by phase (in a log too)
    say(
        f"warmstart: loading {recipe.model} ..."
        if recipe.model
        else f"warmstart: building a random {recipe.arch} model ..."
    )
    if recipe.model:  # untrusted: load_policy checks it; the EOS it keeps is saved
        model, tokenizer = load_policy(recipe.model, torch.device("cpu"))
    else:
        build_random_model(
            out_dir, recipe.seed, recipe.arch, tokenizer_texts(list(games))
        )  # the lines: a few tokens each
        from transformers import GenerationConfig

        model, tokenizer = load_policy(out_dir, torch.device("cpu"))
        # load_policy keeps a folder's EOS alone; this folder is ours, just built: saved as it was built
        model.generation_config = GenerationConfig.from_pretrained(out_dir)
    spy_count = games.pop(spy.GAME, 0)  # SpyRL's game: its count is of moves too, ten a game
    wanted = ", ".join(f"{n} moves of {g}" for g, n in recipe.moves_per_game().items())
    say(f"warmstart: playing the random legal player's games to learn from: {wanted}")
    moves = random_games(games, recipe.seed, show=True) + spy_games(spy_count // 10, recipe.seed)
    say(f"warmstart: tokenizing {len(moves)} moves")
    items, soft = tokenize(moves, tokenizer), soft_targets(moves, tokenizer)
    every = min(min(50, max(1, recipe.steps // 10)) if recipe.model else 50, recipe.steps)
    say(
        f"warmstart: {recipe.steps} steps of batch {recipe.batch_size}, a line "
        + (f"every {every} steps" if every > 1 else "each step")
        + (" (a step of a pretrained model can take a minute on a CPU)" if recipe.model else "")
    )
    losses = fit(
        model,
        items,
        soft,
        tokenizer.pad_token_id,
        recipe.steps,
        recipe.batch_size,
        recipe.lr,
        recipe.seed,
        log,
        every,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model, tokenizer, losses


def main(argv: list[str]) -> int:
    p = FriendlyParser(prog="stratagem.py warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="output directory (must not exist)")
    defaults = Recipe()
    docs = field_docs(Recipe)
    for f in dataclasses.fields(Recipe):
        value = getattr(defaults, f.name)
        shown = f"{value}; with --model: {PRETRAINED[f.name]}" if f.name in PRETRAINED else value
        p.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(value),
            default=None,  # None: not given, the default of the starting point (below)
            help=f"{docs[f.name][1]} ({shown})".replace("%", "%%"),
        )
    p.add_argument(
        "--eval-n",
        type=int,
        default=0,
        help="held-out games per game id against the random player (0: none)",
    )
    ns = vars(p.parse_args(argv))
    out, eval_n = ns.pop("dir"), ns.pop("eval_n")
    if ns["model"] and ns["arch"]:
        print(
            "warmstart: --arch does not apply with --model (the pretrained model keeps its shape)"
        )
    if ns["model"]:
        ns["arch"] = ""
    start = {**dataclasses.asdict(defaults), **(PRETRAINED if ns["model"] else {})}
    recipe = Recipe(**{k: start[k] if v is None else v for k, v in ns.items()})
    recipe.check()  # before DIR is made: a bad flag leaves nothing behind
    if eval_n < 0 or eval_n > 10**6:
        raise UserError(f"--eval-n must be in [0, 1000000], got {eval_n}")
    if os.path.lexists(out):
        raise UserError(f"{out} already exists")
    check_writable_dir(Path(out), "dir")
    quiet_transformers()
    torch.set_num_threads(
        1
    )  # one thread: the same sums in the same order on one machine (the same bytes), and the
    # fastest for a model this small (two threads were 1.9x slower on 2 cores: docs/learning.md)
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:  # built beside DIR and renamed last: a failed or stopped build leaves no model folder
        build_and_measure(folder, recipe, eval_n)
        follow_umask(folder)  # some writers create 0600 files; a shipped model follows the umask
        folder.rename(final)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def build_and_measure(folder: Path, recipe: Recipe, eval_n: int) -> None:
    """The warm start built in `folder`, measured on eval_n held-out games per id (0: not measured), and
    its warmstart.json (the recipe, the machine, the time taken and the measures) written last."""
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    model, tokenizer, losses = build(
        str(folder),
        recipe,
        lambda step, loss: print(
            f"step {step}/{recipe.steps} loss {loss:.4f} {time.perf_counter() - t0:.0f}s",
            flush=True,
        ),
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time()
    report = {
        "recipe": dataclasses.asdict(recipe),
        "styles": {
            "drawn": STYLES,
            "contents": CONTENTS,
            "states": {g: f.__doc__ for g, f in STATE.items()},
        },
        "build_s": seconds,
        "cpu_s": cpu,
        "load_avg_1min": [load0, os.getloadavg()[0]],
        "final_loss": losses[-1],
        "machine": machine(),
    }
    print(
        f"built in {seconds:.0f}s, {cpu:.0f}s of CPU (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}); "
        f"final loss {losses[-1]:.4f}"
    )
    if eval_n:
        print(
            f"warmstart: measuring it on {eval_n} games of each id against the random legal player",
            flush=True,
        )
        report["measure"] = measure_all(model, tokenizer, recipe, eval_n)
        print_measures(report["measure"])
    write_atomic(Path(folder, "warmstart.json"), json.dumps(report, indent=1).encode())


def measure_all(model, tokenizer, recipe: Recipe, eval_n: int) -> dict:
    """`measure` of every two-player game of the recipe, and `measure_spy` where it has SpyRL's game."""
    policy = HFPolicy(
        model, tokenizer, Args(max_new_tokens=48, temperature=1.0), torch.device("cpu")
    )
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        games = [g for g in recipe.moves_per_game() if g != spy.GAME]
        opponent = RandomPlayer(random.Random(recipe.seed))
        out = measure(policy, tokenizer, opponent, games, eval_n, recipe.seed + 10**6)
        if spy.GAME in recipe.moves_per_game():
            out |= measure_spy(policy, tokenizer, eval_n, recipe.seed + 10**6)
    return out


def print_measures(measures: dict) -> None:
    """A line per game id (the legal-move rate, the length and the win rate), and the styles said."""
    for game, r in measures.items():
        if game == spy.GAME:
            print(f"{game:22} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "games"))
            continue
        print(
            f"{game:22} legal {r['legal_rate']:.3f} ({r['moves']} moves)  length {r['length']:.2f}  "
            f"win {r['win_rate']:.3f} [{r['win_ci95'][0]:.3f}, {r['win_ci95'][1]:.3f}]  draw {r['draw_rate']:.3f}"
        )
        shares = "  ".join(f"{k} {v:.2f}" for k, v in r["styles"].items())
        print(f"{'':22} styles: {shares}  state right {fmt(r['state_right'])}")
