"""WhoIsTheSpy-v0: SpyRL's "who is the spy" game (RLSVR: *From RLVR to RLSVR: Task Transformation Induces
Self-Verifiable Rewards for Open-Ended LLM Self-Improvement*, Wang et al., 2026, arXiv 2607.23802), as a TextArena
environment that any TextArena agent can play, and what spyrl.py needs of it.

A game takes one task input x (a document to summarise, a writing prompt, a maths problem). n players,
all played by the same policy, do the task; the environment draws the spy u uniformly from the seats.
The civilians see x, the spy sees g(x): x with a fraction of its sentences (or, in a short text, of its
words) removed, leaving no marker. Nobody is told its role; every prompt says that one copy is incomplete.

    performance  every seat writes its output y_i (seats do not see one another's outputs)
    detection    every seat sees its own input and all n outputs and votes \\boxed{k} for another seat

Rewards (s_k: seat k's share of the valid votes, the spy's vote included; s_c: the civilians' mean):
    detection    r_i^D = 1[v_i = u] for a civilian (an unparsable vote, or one for itself: 0, not counted);
                 the spy's vote is paid nothing and not trained
    performance  r_u^P = beta (s_c - s_u)  and  r_cj^P = -r_u^P / (n - 1) - lambda (s_cj - s_c)
                 (RECONSTRUCTED: the paper names beta, lambda and the zero-sum property, its formula images are
                 missing), so the rewards of a game sum to exactly 0: the spy is paid for drawing less
                 suspicion than the civilians, the civilians as a team when it is found, and a civilian that
                 looks more suspicious than its peers is charged.

TextArena's interface: reset(num_players, seed), get_observation() -> (seat, prompt), step(response) ->
(done, info), close() -> (rewards = r^P, game_info). Seats move in order, first every output, then every
vote; since no seat sees another's move of the same phase, phase_observations() hands a trainer the whole
phase at once (one batched generation for all seats of all games). results() lists what a trainer learns
from: one record per seat and paid phase.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import stat

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY, register

from machinery import UserError, runfiles

GAME = "WhoIsTheSpy-v0"
PHASES = ("performance", "detection")
MASKS = {
    "summarize": 0.2,
    "write": 0.2,
    "math": 0.4,
}  # the paper's fraction removed for the spy, per task
# task -> (what every player is given, what it writes, its plural, the instruction); --spy-task
TASKS = {
    "summarize": (
        "document",
        "summary",
        "summaries",
        "Write a summary of the document: its main points, concisely, in your own words.",
    ),
    "write": ("writing prompt", "story", "stories", "Write a short story for the writing prompt."),
    "math": (
        "problem",
        "solution",
        "solutions",
        "Solve the problem. Reason step by step and end with the final answer.",
    ),
}

PERFORM = """\
You are Player {seat} in a game of Who Is the Spy with {n} players. Every player was given a copy of the \
same {thing}, but one copy is incomplete: part of it was removed, leaving no trace. Nobody is told whose copy \
that is; it may be yours. The player with the incomplete copy is the spy. When everyone has written, every \
player reads all the {outputs} and votes for the player they believe is the spy.

{instruction} Write the {output} only.

The {thing}:
{text}"""

VOTE = """\
You are Player {seat} in a game of Who Is the Spy with {n} players. Every player was given a copy of the \
same {thing}, but one copy was incomplete (part of it was removed, leaving no trace), and each player wrote a \
{output} from their copy. The player whose copy was incomplete is the spy; it may be you.

Your copy of the {thing}:
{text}

The {outputs}, every line of each quoted with "| ":

{written}

Which other player is the spy? Compare the {outputs} with your copy and with one another, reason briefly, \
then give that player's number within \\boxed{{}}, e.g. \\boxed{{{example}}}. You cannot vote for yourself \
(Player {seat})."""


# ------------------------------------------------------------------ the task data
def default_texts() -> list[dict]:
    """The offline default (--tiny; ta.make without texts): the prose paragraphs of Python's own help
    topics (pydoc_data.topics, shipped with Python), 300 to 700 characters each; no references."""
    from pydoc_data.topics import topics

    paragraphs = (
        " ".join(p.split())
        for name in sorted(topics)
        for p in topics[name].split("\n\n")
        if p.strip() and not p.startswith(" ")
    )  # indented blocks are code and grammar
    return [{"text": p} for p in paragraphs if 300 <= len(p) <= 700 and p.count(". ") >= 2]


def text_room(context: int, task: str, players: int, max_new_tokens: int, count=None) -> int:
    """Tokens a task text may take so that every prompt of a game fits the model's context with its response: a
    vote prompt holds the text, the template, and every player's output quoted ("| " opens each of its lines:
    at most three tokens an output token, a newline and its "| "). `count` gives a text's tokens (default: its
    UTF-8 bytes, at least the tokens of a byte-level tokenizer such as the tiny model's)."""
    count = count or (lambda text: len(text.encode("utf-8")))
    thing, output, outputs, _ = TASKS[task]
    written = "\n\n".join(f"Player {k}:\n| " for k in range(players))
    frame = VOTE.format(
        seat=players - 1,
        n=players,
        thing=thing,
        output=output,
        outputs=outputs,
        text="",
        written=written,
        example=0,
    )
    return context - count(frame) - max_new_tokens * (3 * players + 1)


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of `text` as an escape ("\\ud800"), or None: JSON's "\\ud800" decodes to one, which
    is no character: no tokenizer takes it."""
    bad = next((c for c in text if 0xD800 <= ord(c) <= 0xDFFF), None)
    return None if bad is None else f"\\u{ord(bad):04x}"


# The most bytes a --spy-data file may hold: its texts stay in memory for the whole run.
# GovReport's training split, the largest that docs/spyrl.md turns into one, is about 1 GB.
DATA_LIMIT = 4 << 30


def _too_large(path: str) -> UserError:
    return UserError(
        f"--spy-data {path}: larger than {DATA_LIMIT:,} bytes, more text than a run holds in "
        "memory: give it a part of the file"
    )


def open_data(path: str):
    """--spy-data opened to be read, if it is a plain file (a link to one is followed) of at most
    DATA_LIMIT bytes: a fifo is never waited on (O_NONBLOCK), a device never read."""
    try:
        f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))
    except OSError as e:
        raise UserError(f"--spy-data {path}: {e.strerror}") from None
    info = os.fstat(f.fileno())
    if stat.S_ISREG(info.st_mode) and info.st_size <= DATA_LIMIT:
        return f
    f.close()
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"--spy-data {path}: not a plain file (a fifo, a device or a socket)")
    raise _too_large(path)


def _blank_lines(f) -> int:
    """Skips the blank lines at the reader's position a buffer at a time, so that a file of newlines
    is read at the speed of its bytes, not of a loop turn per line; returns how many it skipped."""
    skipped = 0
    while ahead := f.peek():
        # past the last newline before the first byte that is not blank space
        end = ahead.rfind(b"\n", 0, len(ahead) - len(ahead.lstrip())) + 1
        if not end:
            break
        skipped += ahead.count(b"\n", 0, end)
        f.read(end)
    return skipped


def numbered_lines(f):
    """(number, line, whole) of the file's lines, as runfiles.lines gives them (whole False for one
    longer than LINE_LIMIT, read in bounded chunks and not kept), runs of blank lines skipped by
    _blank_lines."""
    number, lines = 1, runfiles.lines(f)
    while True:
        number += _blank_lines(f)
        if (got := next(lines, None)) is None:
            return
        yield number, *got
        number += 1


def load_texts(
    path: str, mask: float, tiny: bool, room: int | None = None, count=None
) -> list[dict]:
    """--spy-data: one JSON object per line, {"text": ..., "reference": ... (optional)}. Every flaw
    ends in one line naming the file and the line: not there, not a plain file, larger than
    DATA_LIMIT, a line longer than runfiles.LINE_LIMIT, not UTF-8, not a JSON object (or nested too
    deeply to read), no "text", a text too short for --spy-mask to remove anything, a reference that
    is not a string, a lone surrogate, a text longer than `room` tokens (text_room; `count` counts
    them, default: UTF-8 bytes), no texts at all. The whole file is checked before a run starts,
    read line by line in bounded memory."""
    if not path:
        if not tiny:
            raise UserError(
                "spyrl.py needs --spy-data FILE.jsonl (docs/spyrl.md turns a hub dataset into one); "
                "only --tiny has an offline default"
            )
        return default_texts()
    texts = []
    with open_data(path) as f:
        for number, line, whole in numbered_lines(f):
            where = f"--spy-data {path}, line {number}"
            if f.tell() > DATA_LIMIT:  # a file that grew while it was read
                raise _too_large(path)
            if not whole:
                raise UserError(
                    f"{where}: longer than {runfiles.LINE_LIMIT:,} bytes, more than a game's "
                    "prompts hold"
                )
            if line.strip():  # blank lines are allowed
                texts.append(_text(where, line, mask, room, count))
    if not texts:
        raise UserError(f"--spy-data {path}: no texts in it")
    if any("reference" in t for t in texts):
        rouge_scorer()  # the references are scored with ROUGE-L: the package must be there before any work
    return texts


def _text(where: str, line: bytes, mask: float, room: int | None, count) -> dict:
    """One line of --spy-data as a text (and its reference), or one line saying what is wrong."""
    try:
        item = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(
            f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
        ) from None
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({e})") from None
    except RecursionError:  # "[[[[..." a hundred thousand deep
        raise UserError(f"{where}: nested too deeply to be read as JSON") from None
    if (
        not isinstance(item, dict)
        or not isinstance(item.get("text"), str)
        or not item["text"].strip()
    ):
        raise UserError(f'{where}: needs an object with a non-empty "text" string')
    if not isinstance(item.get("reference", ""), str):
        raise UserError(f'{where}: "reference" must be a string')
    for field in ("text", "reference"):
        if bad := lone_surrogate(item.get(field, "")):
            raise UserError(
                f"{where}: the {field} holds a lone surrogate ({bad}), which is not text"
            )
    text = item["text"].strip()
    size = len(
        text.encode("utf-8")
    )  # at least its tokens (a byte-level tokenizer's at most a token a byte)
    if room is not None and size > room and (n := count(text) if count else size) > room:
        raise UserError(
            f"{where}: the text takes up to {n} tokens, and a game's prompts leave it room for "
            f"{room} (the model's context less every player's output: --spy-players, "
            "--max-new-tokens)"
        )
    units = split_units(text)
    if not 1 <= removed_count(len(units), mask) < len(units):
        raise UserError(
            f"{where}: the text is too short to degrade ({len(units)} word(s); --spy-mask {mask} "
            f"would remove {removed_count(len(units), mask)})"
        )
    return {"text": text, **({"reference": item["reference"]} if "reference" in item else {})}


# ------------------------------------------------------------------ the degradation g(x)
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
_WORD_END = re.compile(r"\s+")


def split_units(text: str, sentences: bool = False) -> list[tuple[int, int]]:
    """(start, end) of each sentence (or word) of `text`, its trailing whitespace included: they tile the text."""
    cuts = [m.end() for m in (_SENTENCE_END if sentences else _WORD_END).finditer(text)]
    bounds = [0, *cuts, len(text)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def removed_count(units: int, fraction: float) -> int:
    """How many of `units` the mask removes: the fraction, rounded half up."""
    return math.floor(fraction * units + 0.5)


def degrade(text: str, fraction: float, rng: random.Random) -> tuple[str, list[tuple[int, int]]]:
    """g(x): `text` without `fraction` of its sentences when it has at least 1/fraction of them (one sentence
    is then at most that fraction), else without that fraction of its words. The pieces go with their
    trailing whitespace, so nothing marks where they were; what is left is a subsequence of the text.
    Returns the spy's text and the (start, end) spans removed from `text`, in order."""
    units = split_units(text, sentences=True)
    if len(units) < 1 / fraction or removed_count(len(units), fraction) == len(units):
        units = split_units(text)
    gone = sorted(rng.sample(range(len(units)), removed_count(len(units), fraction)))
    kept = "".join(text[a:b] for i, (a, b) in enumerate(units) if i not in gone)
    return kept.rstrip(), [units[i] for i in gone]


# ------------------------------------------------------------------ votes and rewards (pure)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_SEAT = re.compile(  # a longer number is no seat (nor int()); never two \s* in a row: linear
    r"\s*(?:player\s*)?(?:\[\s*)?(\d{1,100})\s*(?:\]\s*)?", re.IGNORECASE
)


def visible_output(response: str) -> str:
    """What the other players read of a response: the text after a thinking block (Qwen3's <think>...</think>)."""
    return response.rsplit("</think>", 1)[-1].strip()


def parse_vote(response: str, seat: int, n: int) -> int | None:
    """The seat named in the last \\boxed{} ("3", "Player 3", "[3]"), or None: no box, not a seat, or the voter's
    own."""
    boxes = _BOXED.findall(visible_output(response))
    m = _SEAT.fullmatch(boxes[-1]) if boxes else None
    vote = int(m.group(1)) if m else None
    return vote if vote is not None and vote < n and vote != seat else None


def vote_shares(votes: list[int | None], n: int) -> list[float]:
    """s_k: seat k's share of the valid votes (the spy's vote included); all 0 when no vote is valid."""
    valid = [v for v in votes if v is not None]
    return [sum(v == k for v in valid) / len(valid) if valid else 0.0 for k in range(n)]


def performance_rewards(shares: list[float], spy: int, beta: float, lam: float) -> list[float]:
    """r^P (reconstructed, zero-sum): r_u = beta (s_c - s_u); r_cj = -r_u / (n - 1) - lam (s_cj - s_c)."""
    n = len(shares)
    s_c = sum(s for k, s in enumerate(shares) if k != spy) / (n - 1)
    r_spy = beta * (s_c - shares[spy])
    return [r_spy if k == spy else -r_spy / (n - 1) - lam * (s - s_c) for k, s in enumerate(shares)]


def detection_rewards(votes: list[int | None], spy: int) -> list[float | None]:
    """r^D = 1[v_i = u] for the civilians (an invalid vote earns 0); None for the spy, whose vote is not paid."""
    return [None if k == spy else float(v == spy) for k, v in enumerate(votes)]


def caught(votes: list[int | None], spy: int) -> bool:
    """The spy drew strictly more valid votes than any other seat (a tie at the top does not catch it)."""
    tally = [sum(v == k for v in votes) for k in range(len(votes))]
    return all(tally[spy] > t for k, t in enumerate(tally) if k != spy)


@functools.cache
def rouge_scorer():
    try:
        from rouge_score import rouge_scorer as rs
    except ImportError:
        raise UserError(
            "--spy-data has references, scored with ROUGE-L: pip install rouge-score"
        ) from None
    return rs.RougeScorer(["rougeL"], use_stemmer=True)


def quote(text: str) -> str:
    """Every line of a player's text prefixed with "| ": its lines can never pass for the prompt's own."""
    return "\n".join("| " + line for line in (text.splitlines() or [""]))


# ------------------------------------------------------------------ the environment
class WhoIsTheSpyEnv(ta.Env):
    """The game as a TextArena Env (registered as WhoIsTheSpy-v0; ta.make passes these keywords).
    texts: [{"text", "reference"?}] (default: default_texts()); mask: the fraction removed for the spy
    (default: the task's, MASKS); beta, lam: the performance reward's beta and lambda (the trainer passes
    its --spy-* flags). Its draws come from its own Random(seed): the global `random` is left alone."""

    def __init__(
        self,
        texts: list[dict] | None = None,
        task: str = "summarize",
        mask: float | None = None,
        beta: float = 1.0,
        lam: float = 0.5,
    ):
        self.texts = texts if texts is not None else default_texts()
        self.task, self.mask, self.beta, self.lam = (
            task,
            MASKS[task] if mask is None else mask,
            beta,
            lam,
        )

    def reset(self, num_players: int = 5, seed: int | None = None) -> None:
        if num_players < 3:
            raise ValueError(f"who is the spy needs at least 3 players, got {num_players}")
        rng = random.Random(seed)
        self.item = rng.choice(self.texts)
        self.n, self.seed, self.spy = num_players, seed, rng.randrange(num_players)
        spy_text, self.removed = degrade(self.item["text"], self.mask, rng)
        self.inputs = [spy_text if k == self.spy else self.item["text"] for k in range(num_players)]
        self.phase, self.current, self.outputs, self.votes = PHASES[0], 0, [], []
        self.done, self.rewards = False, None

    def observation(self, seat: int) -> str:
        thing, output, outputs, instruction = TASKS[self.task]
        fill = dict(
            seat=seat, n=self.n, thing=thing, output=output, outputs=outputs, text=self.inputs[seat]
        )
        if self.phase == "performance":
            return PERFORM.format(instruction=instruction, **fill)
        written = "\n\n".join(f"Player {k}:\n{quote(y)}" for k, y in enumerate(self.outputs))
        return VOTE.format(written=written, example=(seat + 1) % self.n, **fill)

    def get_observation(self) -> tuple[int, str]:
        return self.current, self.observation(self.current)

    def phase_observations(self) -> list[tuple[int, str]]:
        """Every seat still to move in this phase, with what it sees: none of them sees another's move of
        the phase, so all may be generated at once and then stepped in seat order."""
        return [(k, self.observation(k)) for k in range(self.current, self.n)]

    def step(self, action: str) -> tuple[bool, dict]:
        if self.phase == "performance":
            self.outputs.append(visible_output(action))
        else:
            self.votes.append(parse_vote(action, self.current, self.n))
        self.current += 1
        if self.current == self.n and self.phase == "performance":
            self.phase, self.current = PHASES[1], 0
        elif self.current == self.n:
            self.done = True
            self.rewards = dict(
                enumerate(
                    performance_rewards(
                        vote_shares(self.votes, self.n), self.spy, self.beta, self.lam
                    )
                )
            )
        return self.done, {}

    def close(self) -> tuple[dict[int, float], dict[int, dict]]:
        """TextArena's (rewards, game_info): r^P per seat; each seat's role, vote and detection reward."""
        detection = detection_rewards(self.votes, self.spy)
        return self.rewards, {
            k: {
                "role": "spy" if k == self.spy else "civilian",
                "vote": self.votes[k],
                "invalid_move": self.votes[k] is None,
                "detection_reward": detection[k],
            }
            for k in range(self.n)
        }

    def results(self) -> list[tuple[int, int, float, dict]]:
        """What a trainer learns from: (seat, phase index, reward, info) per seat and paid phase (the spy's
        vote is not paid). `info` holds the phase, the role, the RAE key (task, role) of an output, the GRPO
        group of a vote (the detection rewards of the game's civilians), and the game as a whole."""
        rewards, info = self.close()
        detection = [i["detection_reward"] for i in info.values()]
        shares = vote_shares(self.votes, self.n)
        game = {
            "task": self.task,
            "seed": self.seed,
            "spy": self.spy,
            "votes": self.votes,
            "shares": shares,
            "caught": caught(self.votes, self.spy),
            "zero_sum_residual": abs(sum(rewards.values())),
            "removed": self.removed,
        }
        scorer = rouge_scorer() if "reference" in self.item else None
        out = []
        for k in range(self.n):
            role = info[k]["role"]
            rouge = (
                {
                    "rouge_l": scorer.score(self.item["reference"], self.outputs[k])[
                        "rougeL"
                    ].fmeasure
                }
                if scorer is not None and role == "civilian"
                else {}
            )
            out.append(
                (
                    k,
                    0,
                    rewards[k],
                    {
                        "phase": PHASES[0],
                        "role": role,
                        "seat": k,
                        "key": f"{self.task}/{role}",
                        **rouge,
                        **game,
                    },
                )
            )
        out += [
            (
                k,
                1,
                r,
                {
                    "phase": PHASES[1],
                    "role": "civilian",
                    "seat": k,
                    "group": [r for r in detection if r is not None],
                    **game,
                },
            )
            for k, r in enumerate(detection)
            if r is not None
        ]
        return out


def play(games: list[WhoIsTheSpyEnv], generate, wave: int, timer) -> tuple[list[dict], int]:
    """Lockstep play, `wave` games at a time: TWO generate calls a wave, each for every seat of every game in
    it: all outputs (no seat sees another's first), then all votes. `generate(prompts)` returns (prompt ids,
    response ids, text) per prompt, like the trainer's engines; `timer` splits generation from the game.
    Returns each game's moves {(seat, phase index): (observation, response, action, prompt ids, response
    ids)} (the fields of stratagem.Turn; the action is the vote read, "[k]", or "" for an output) and the calls."""
    moves: list[dict] = [{} for _ in games]
    calls = 0
    for first in range(0, len(games), wave):
        for phase in range(len(PHASES)):
            seats = [
                (g, pid, obs)
                for g in range(first, min(first + wave, len(games)))
                for pid, obs in games[g].phase_observations()
            ]
            with timer("generate"):
                outputs = generate([obs for _, _, obs in seats])
            calls += 1
            with timer("game"):
                for (g, pid, obs), (prompt_ids, response_ids, text) in zip(seats, outputs):
                    games[g].step(text)
                    vote = games[g].votes[-1] if phase else None
                    moves[g][pid, phase] = (
                        obs,
                        text,
                        "" if vote is None else f"[{vote}]",
                        prompt_ids,
                        response_ids,
                    )
    return moves, calls


def new_game(texts: list[dict], args, seed: int) -> WhoIsTheSpyEnv:
    """A game as the trainer plays it, from its flags (--spy-task, --spy-mask, --spy-beta, --spy-lambda,
    --spy-players)."""
    env = ta.make(
        GAME,
        texts=texts,
        task=args.spy_task,
        mask=args.spy_mask,
        beta=args.spy_beta,
        lam=args.spy_lambda,
    )
    env.reset(num_players=args.spy_players, seed=seed)
    return env


def trained_phases(step: int, alternate: int) -> tuple[str, ...]:
    """--spy-alternate K: K steps train the outputs, then K steps the votes, and so on (0: both, every step)."""
    return PHASES if alternate == 0 else (PHASES[(step - 1) // alternate % 2],)


def games_needed(target: int, n: int, phases: tuple[str, ...]) -> int:
    """Games whose turns of `phases` (n outputs, n - 1 civilian votes a game) reach `target`."""
    return math.ceil(
        target / ((n if "performance" in phases else 0) + (n - 1 if "detection" in phases else 0))
    )


def outcomes(trajs: list) -> dict:
    """The step's outcome counts in metrics.jsonl's `games` shape, by role: the spy wins when r^P > 0 (it
    drew less suspicion than the civilians), loses when < 0; `invalid` counts invalid votes. The spy row
    counts every game once."""
    counts = {
        GAME: {
            role: dict.fromkeys(("win", "draw", "loss", "invalid"), 0)
            for role in ("spy", "civilian")
        }
    }
    for t in trajs:
        if t.info["phase"] == "performance":
            c = counts[GAME][t.info["role"]]
            c["win" if t.reward > 0 else "loss" if t.reward < 0 else "draw"] += 1
            c["invalid"] += t.info["votes"][t.info["seat"]] is None
    return counts


def step_metrics(trajs: list, phases: tuple[str, ...]) -> dict:
    """metrics.jsonl's `spy` entry: the phase(s) trained and their turns, detection accuracy (the civilians'
    votes on the spy), the spy-caught rate, the invalid-vote rate, the mean reward and advantage per role
    (spy, civilian: outputs; vote: the civilians' votes), the largest zero-sum residual and the civilians'
    mean ROUGE-L (null without references)."""

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else None

    games = [t.info for t in trajs if t.info["phase"] == "performance" and t.info["role"] == "spy"]
    groups = {
        "spy": [t for t in trajs if t.info["role"] == "spy"],
        "civilian": [
            t for t in trajs if t.info["role"] == "civilian" and t.info["phase"] == "performance"
        ],
        "vote": [t for t in trajs if t.info["phase"] == "detection"],
    }
    return {
        "trained": "+".join(phases),
        "games": len(games),
        "trained_transitions": sum(len(t.turns) for t in trajs if t.info["phase"] in phases),
        "detection_accuracy": mean(t.reward for t in groups["vote"]),
        "caught_rate": mean(g["caught"] for g in games),
        "invalid_vote_rate": mean(v is None for g in games for v in g["votes"]),
        "reward": {k: mean(t.reward for t in ts) for k, ts in groups.items()},
        "advantage": {k: mean(t.a_mod for t in ts) for k, ts in groups.items()},
        "zero_sum_residual": max((g["zero_sum_residual"] for g in games), default=0.0),
        "rouge_l": mean(t.info["rouge_l"] for t in groups["civilian"] if "rouge_l" in t.info),
    }


if GAME not in ENV_REGISTRY:  # a second import of this module must not register it twice
    register(GAME, entry_point=WhoIsTheSpyEnv)
