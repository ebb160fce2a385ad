"""The warm start: a small random Qwen3 taught the RULES of the games, not their strategy, by supervised learning on
games of the uniformly random legal player (machinery.matches.RandomPlayer's policy), so that the RL that follows
starts from a policy that plays whole multi-turn games, and wins about as often as that player, instead of losing every
game on its first move. Any gain over it afterwards is the RL's doing.

Each example is one move of a random-vs-random game: the prompt is exactly the trainer's (its format_prompt on the
mover's observation and seat), the response one short reasoning line, LINE, then \\boxed{[action]} and the end-of-turn
token that stops generation. The loss is the negative log-likelihood of the response tokens, through the learner's own
collate, so the warm start and RL see identical tokens. Where the legal moves differ in one token only (TicTacToe's
square, Kuhn Poker's action) that token's target is the random player's whole distribution, uniform over the legal
moves, rather than the one move it drew: the same expected gradient without the draw's noise (TicTacToe learns in a
third of the steps). Nothing here imports stratagem.py: what it needs of the trainer is passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from machinery import UserError
from machinery.matches import random_legal_move

# What a uniformly random player can honestly say. The stand-in judge counts "strategy", "expected" and "value" as
# general vocabulary and "because" as a stated reason: phi = 0.35 + 0.15 = 0.5 instead of a terse answer's 0, which
# would zero the game's advantage in A_mod = A_game * phi + beta * psi (docs/learning.md).
LINE = "No strategy yet, because every legal move has the same expected value."


def response_text(action: str) -> str:
    return f"{LINE} \\boxed{{{action}}}"


# ----------------------------------------------------------------------------------- random legal games
@dataclass
class Move:
    game: str
    role: int
    observation: str
    action: str
    legal: tuple[str, ...] = ()  # every legal move, when enumerated


def random_games(make_env, moves_per_game: dict[str, int], seed: int) -> list[Move]:
    """Whole random-vs-random games of each id until it has >= its count of moves; every move is kept with the mover's
    observation. `make_env(game_id, seed, error_allowance)` is the trainer's (SPIRAL's observation wrappers)."""
    rng = random.Random(seed)
    out: list[Move] = []
    for game, wanted in moves_per_game.items():
        n = 0
        while n < wanted:
            env = make_env(game, rng.randrange(2**31), 0)
            done = False
            while not done:
                pid, obs = env.get_observation()
                action, legal = random_legal_move(env, pid, obs, rng)
                out.append(Move(game, pid, obs, action, legal))
                n += 1
                done = env.step(action)[0]
    return out


# ----------------------------------------------------------------------------------- examples
def tokenize(moves: list[Move], tokenizer, format_prompt) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) as the trainer's HF generation has them: the prompt tokenized alone without special
    tokens, the response ending with the EOS token that stops generation (cut_at_stop keeps it)."""
    prompts = [format_prompt(tokenizer, m.observation, m.role) for m in moves]
    p_ids = tokenizer(prompts, add_special_tokens=False).input_ids
    r_ids = tokenizer([response_text(m.action) for m in moves], add_special_tokens=False).input_ids
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(p_ids, r_ids)]


def soft_targets(moves: list[Move], tokenizer) -> list[tuple[int, list[int]] | None]:
    """Per move, (position in the response, the legal moves' token ids there) when all its legal moves' responses have
    one length and first differ at that position; else None (an offer's many tokens: the drawn move is the target)."""
    out: list[tuple[int, list[int]] | None] = []
    for m in moves:
        ids = tokenizer([response_text(a) for a in m.legal], add_special_tokens=False).input_ids if m.legal else []
        if len(ids) < 2 or len({len(r) for r in ids}) != 1:
            out.append(None)
            continue
        k = next(k for k in range(len(ids[0])) if len({r[k] for r in ids}) > 1)
        out.append((k, sorted({r[k] for r in ids})))
    return out


def batches(lengths: list[int], batch_size: int, steps: int, rng: random.Random) -> list[list[int]]:
    """`steps` batches of indices from shuffled passes over the data; inside a window of 16 batches the items are
    sorted by length, so that a batch pads little (collate left-pads to its longest), and the batches shuffled."""
    out: list[list[int]] = []
    order: list[int] = []
    while len(out) < steps:
        if len(order) < 16 * batch_size:
            order += rng.sample(range(len(lengths)), len(lengths))
        window, order = sorted(order[: 16 * batch_size], key=lambda i: lengths[i]), order[16 * batch_size :]
        chunk = [window[k : k + batch_size] for k in range(0, len(window), batch_size)]
        rng.shuffle(chunk)
        out += chunk
    return out[:steps]


# ----------------------------------------------------------------------------------- supervised learning
def response_logprobs(model, ids, attn, mask, rows: list[tuple[int, list[int]] | None]) -> torch.Tensor:
    """log pi of each response token, as the learner's sequence_logprobs (temperature 1), except that a row's soft
    position gets the mean log-probability of its legal tokens (cross-entropy with the uniform distribution over
    them). ids, attn [B, T]; mask [B, R] -> [B, R]"""
    resp_len = mask.shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, T], as sequence_logprobs
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=resp_len + 1).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, R, V]
    out = logp.gather(-1, ids[:, -resp_len:].unsqueeze(-1)).squeeze(-1)  # [B, R]
    soft = [(b, resp_len - int(mask[b].sum()) + k, tokens) for b, row in enumerate(rows) if row for k, tokens in [row]]
    if soft:
        out = out.clone()
        for b, col, tokens in soft:
            out[b, col] = logp[b, col, tokens].mean()
    return out


def fit(
    model,
    items: list[tuple[list[int], list[int]]],
    soft: list[tuple[int, list[int]] | None],
    collate,
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
        return min(1.0, (s + 1) / warm) * (0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item()))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    losses = []
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
        if log is not None and (step + 1) % log_every == 0:
            log(step + 1, sum(losses[-log_every:]) / log_every)
    model.eval()
    return losses


# ----------------------------------------------------------------------------------- measuring it
class CountingPolicy:
    """A policy that counts the responses it generates: the model's moves, the denominator of its legal-move rate."""

    def __init__(self, policy):
        self.policy, self.moves = policy, 0

    def generate(self, prompts: list[str]):
        out = self.policy.generate(prompts)
        self.moves += len(out)
        return out


def measure(policy, tokenizer, play_matches, summarize_matches, opponent, games: list[str], n: int, seed: int) -> dict:
    """Per game id: n held-out games against `opponent`, both seats; the legal-move rate (1 - the model's invalid moves
    over its moves; an invalid move ends the game), the mean game length in moves (both players) and the win rate with
    its 95 % Wilson interval. `play_matches(policy, tokenizer, games, n, opponent, rng)` is the trainer's."""
    out = {}
    for k, game in enumerate(games):
        counting = CountingPolicy(policy)
        records = play_matches(counting, tokenizer, [game], n, opponent, random.Random(seed + k))
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
        }
    return out


# ----------------------------------------------------------------------------------- the whole build
@dataclass
class Recipe:
    """Everything that shapes a warm start (with the code: a cache of warm starts is keyed by these)."""

    seed: int = 2
    """seeds the random weights, the random games and the order of the examples (2: seed 1's TicTacToe stayed at 82 %
    legal moves, docs/learning.md)"""
    games: str = "TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1"
    """comma-separated game ids whose rules are taught (SPIRAL's training set)"""
    moves: str = "6000,2500,2500"
    """random-game moves per game id, in --games order (TicTacToe is the hard one, and its prompts are short)"""
    steps: int = 700
    """AdamW steps"""
    batch_size: int = 16
    """examples (moves) per step"""
    lr: float = 5e-3
    """peak learning rate (warm-up over 5 % of the steps, then cosine down to 10 %)"""
    arch: str = "tiny-warm"
    """shape of the random model (stratagem.ARCHS)"""

    def moves_per_game(self) -> dict[str, int]:
        games, counts = self.games.split(","), [int(c) for c in self.moves.split(",")]
        if len(games) != len(counts):
            raise UserError(f"--moves: {len(counts)} counts for {len(games)} games")
        return dict(zip(games, counts))


def build(out_dir: str, recipe: Recipe, build_random_model, load_policy, make_env, format_prompt, collate, log=None):
    """The random model of recipe.arch, taught by `fit` on random-game moves and
    saved to out_dir like any checkpoint. The trainer's pieces are passed in. Returns (model, tokenizer, losses)."""
    build_random_model(out_dir, recipe.seed, recipe.arch, (LINE,))  # its tokenizer learns LINE: a few tokens
    model, tokenizer = load_policy(out_dir, torch.device("cpu"))
    moves = random_games(make_env, recipe.moves_per_game(), recipe.seed)
    items, soft = tokenize(moves, tokenizer, format_prompt), soft_targets(moves, tokenizer)
    losses = fit(
        model,
        items,
        soft,
        collate,
        tokenizer.pad_token_id,
        recipe.steps,
        recipe.batch_size,
        recipe.lr,
        recipe.seed,
        log,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model, tokenizer, losses
