"""The judge's machinery: everything between a trajectory and its verdict that a reader of Algorithm 1 can skip.
stratagem.py's step 3 samples the trajectories, builds each request (stratagem.verdict: the messages, one chat
call, parse_scores), applies the rules code decides and turns the verdicts into phi and psi; this module renders,
sends, caches, budgets, records the money and validates.

    parse_scores    the verdict in a judge's reply (the last JSON object with every key of the rubric)
    aggregate       several verdicts on one rubric (--judge-samples) combined into one
    HeuristicJudge  the offline stand-in (NOT the paper's judge), for CPU runs and tests
    OpenAIJudge     any OpenAI-compatible chat endpoint (the paper: GPT-4), checked at start-up with one probe
    JudgeRunner     the cache, the budget, the money ledger, concurrency; failures counted, never raised

The rubrics themselves (keys, levels, weights, wording, the rules code decides) are judge_prompts.py's table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import judge_prompts
from machinery import UserError, runfiles
from machinery.openai_api import (
    OPENAI_BASE,
    JudgeFailure,
    chat,
    check_reachable,
    clipped,
    concurrently,
    openai_client,
)


@dataclass
class JudgeFlags:
    """Which judge, how its requests travel, what they cost and where verdicts are kept: stratagem.Args's
    judge flags (the paper's model, sample rate and temperature are stratagem.Args's own)."""

    # --- judge ---
    judge: str = "openai"
    """openai (any OpenAI-compatible server) or heuristic (offline stand-in,
    NOT the paper's)"""
    judge_base_url: str = ""
    """OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (default:
    api.openai.com; never OPENAI_BASE_URL, which is refused); the key comes
    from OPENAI_API_KEY"""
    judge_max_tokens: int = 1024
    """longest judge reply (leave room for models that think before the
    JSON)"""
    judge_concurrency: int = 64
    """judge requests in flight at once"""
    judge_timeout: float = 60.0
    """seconds one judge request may take, connect to last byte, per attempt"""
    judge_retries: int = 3
    """retries with backoff on timeouts, 429 and 5xx before a judgement
    counts as failed"""
    judge_samples: int = 1
    """verdicts asked per trajectory and rubric, combined by
    --judge-aggregate"""
    judge_aggregate: str = "majority"
    """how several verdicts combine: majority (per key; ties go to the lower
    level) or mean"""
    judge_price_in: float = -1.0
    """USD per million prompt tokens (cost, --judge-budget); -1: the dated
    price table's for a known --judge-model (machinery/costs.py), else 0"""
    judge_price_out: float = -1.0
    """USD per million completion tokens, as --judge-price-in"""
    judge_budget: float = 0.0
    """stop judging once the estimated cost reaches this (0: no limit);
    imputation goes on"""
    judge_cache: str = ""
    """verdict cache, append-only JSONL (default <out>/judge_cache.jsonl);
    runs may share one"""
    judge_structured: str = "auto"
    """verdicts held to each rubric's JSON schema by the server
    (response_format): auto (where it takes one, as the start-up check
    finds), on, or off (free text, parsed)"""
    judge_shadow: bool = False
    """a judged control for --mode spiral or --no-psi: every rubric is
    asked, and what does not enter A_mod is only logged, on the scale of
    STRATAGEM's runs (priced by --dry-run)"""

    @property
    def judge_kind(self) -> type:
        """The class --judge names: it says what it is (title, words), whether it makes requests
        and its prices, so that nothing compares --judge as a string."""
        return JUDGES[self.judge]


PRICES_DATE = "2025-06"
# USD per million (prompt, completion) tokens: the providers' list prices as of PRICES_DATE.
# --judge-price-in / --judge-price-out override them; a model not listed has no money shown.
PRICES = {
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-2024-08-06": (2.50, 10.00),
    "gpt-4o-2024-11-20": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4-turbo": (10.00, 30.00),
    "gpt-4": (30.00, 60.00),
    "claude-3-5-sonnet-20241022": (3.00, 15.00),
    "gemini-2.0-flash": (0.10, 0.40),
}


def fill_prices(args) -> None:
    """--judge-price-in/out of -1: the price table's for a known paid --judge-model, else 0."""
    table = PRICES.get(args.judge_model, (0.0, 0.0)) if args.judge_kind.requests else (0, 0)
    if args.judge_price_in == -1:
        args.judge_price_in = table[0]
    if args.judge_price_out == -1:
        args.judge_price_out = table[1]


# Numbers as models write them but JSON forbids: a leading "+" ("d": +1, the rubric's own spelling)
# and a bare decimal point ("alpha": .5, -.5). Rewritten to JSON before decoding; only a number right
# after ":", "," or "[" is touched, so keys and quoted strings keep their text.
_LOOSE_NUMBER = re.compile(r"([:,\[]\s*)\+?(-?)(\.?)(?=\d)")


def loosen_numbers(text: str) -> str:
    """'{"d": +1, "a": .5, "c": -.5}' -> '{"d": 1, "a": 0.5, "c": -0.5}' (other text unchanged)."""
    return _LOOSE_NUMBER.sub(lambda m: m.group(1) + m.group(2) + ("0." if m.group(3) else ""), text)


def parse_scores(reply: str, rubric: str) -> dict[str, float]:
    """The last JSON object in `reply` that holds all of the rubric's keys. Thinking, prose and
    ```json fences around it are fine; other keys are ignored; "+1", ".5" and numbers given as
    strings ("0.5", "+1") are read. Failure kinds: no_json (no JSON object at all), missing_keys
    (objects, but none with every key), bad_value (booleans, NaN, or a level outside the rubric's set).
    It raises nothing else, whatever the reply (huge numbers, deep nesting: see the tests' fuzzing)."""
    keys = judge_prompts.keys(rubric)
    tail = loosen_numbers(
        reply[-65536:]
    )  # the verdict comes last; bounding the scan keeps a 1 MB reply cheap
    decoder, partial = json.JSONDecoder(), False
    for pos in reversed([m.start() for m in re.finditer(r"\{", tail)][-256:]):
        try:
            obj, _ = decoder.raw_decode(tail, pos)
        except (ValueError, RecursionError):  # RecursionError: "{" and a thousand "["
            continue
        if not isinstance(obj, dict):
            continue
        if not all(k in obj for k in keys):
            partial = partial or any(k in obj for k in keys)
            continue
        try:
            return {k: judge_prompts.level(rubric, k, obj[k]) for k in keys}
        except ValueError as e:
            raise JudgeFailure("bad_value", str(e)) from None
    raise JudgeFailure(
        "missing_keys" if partial else "no_json", "no JSON object with " + ", ".join(keys)
    )


def aggregate(verdicts: list[dict[str, float]], how: str) -> dict[str, float]:
    """Several valid verdicts on one rubric -> one (--judge-samples > 1): per key, the mean, or the
    most frequent level with ties going to the lower level (an unsure judge does not pay more)."""
    if how == "mean":
        return {k: sum(v[k] for v in verdicts) / len(verdicts) for k in verdicts[0]}
    return {
        k: min({v[k] for v in verdicts}, key=lambda x: (-sum(v[k] == x for v in verdicts), x))
        for k in verdicts[0]
    }


class HeuristicJudge:
    """An offline, deterministic STAND-IN for CPU runs and tests, NOT the paper's judge: it counts surface
    features (general vocabulary, structure, stated reasons, change across turns, actions given) per turn and
    answers in the rubrics' JSON, keeping their rules (judge_prompts: typical_level, evolution_rules; c = 0
    for a repaired lapse), so it exercises the rendering, caching and parsing path of a real judge. Its keys
    are the table's: a dimension it has no feature for (FEATURED) gets its rubric's middle level, and the first
    stand-in made after such a key enters the table names it in one warning line, so a fork's run still runs
    offline but is told that the new dimension grades nothing."""

    name = "heuristic"
    cacheable = False  # free and deterministic: caching it would only grow the file
    requests = False  # it answers in process: nothing is sent, so a run keeps no ledger
    structured = False  # its replies are the rubric's JSON by construction
    title = "heuristic stand-in"

    @staticmethod
    def words(args) -> str:
        """What the start line and the plan call this judge."""
        return "heuristic stand-in (offline, NOT the paper's judge)"

    @staticmethod
    def prices(args) -> tuple[float, float]:
        """USD per million (prompt, completion) tokens: none, nothing is sent."""
        return 0.0, 0.0

    _ABSTRACT = re.compile(
        r"\b(probab\w*|expect\w*|value|cases?|general\w*|strateg\w*|optimal|risk|payoff|"
        r"outcome\w*|if|then|compare\w*)\b",
        re.IGNORECASE,
    )
    _STRUCTURE = re.compile(  # [^\S\n]: blank space within the line, so no match tries more than one line start
        r"(^[^\S\n]*(\d+[.)]|[-*])\s|\b(first|second|next|finally|therefore|step)\b)",
        re.IGNORECASE | re.MULTILINE,
    )
    _REASON = re.compile(
        r"\b(because|since|so that|therefore|thus|in general|always|never|principle)\b",
        re.IGNORECASE,
    )
    _COUNTS = {  # transferability: per turn, the count that sets each dimension's level
        "alpha": lambda x: len({m.lower() for m in HeuristicJudge._ABSTRACT.findall(x)}),
        "sigma": lambda x: len(HeuristicJudge._STRUCTURE.findall(x)),
        "rho": lambda x: len(HeuristicJudge._REASON.findall(x)),
    }
    FEATURED = {"transferability": tuple(_COUNTS), "evolution": ("d", "a", "c")}  # what it scores
    _named: set[tuple[str, str]] = set()  # (rubric, key) it has warned of: each once a process

    def __init__(self):
        unfeatured = [
            (rubric, k)
            for rubric in judge_prompts.RUBRICS
            for k in judge_prompts.keys(rubric)
            if k not in self.FEATURED.get(rubric, ()) and (rubric, k) not in self._named
        ]
        if unfeatured:
            self._named.update(unfeatured)
            names = ", ".join(f"{k} ({rubric})" for rubric, k in unfeatured)
            levels = ", ".join(f"{k} = {self._middle(rubric):g}" for rubric, k in unfeatured)
            runfiles.warn(
                f"the stand-in judge (heuristic) has no feature for {names}: each gets its rubric's "
                f"middle level on every trajectory ({levels}), which grades nothing; teach "
                "HeuristicJudge in machinery/judge.py to score each, or use --judge openai"
            )

    @staticmethod
    def _level(count: int) -> float:
        return 0.0 if count == 0 else 0.5 if count < 3 else 1.0

    @staticmethod
    def _middle(rubric: str) -> float:
        levels = judge_prompts.RUBRICS[rubric]["levels"]
        return levels[len(levels) // 2]

    def scores(self, rubric: str, trajectory_text: str) -> dict[str, float]:
        """The rubric's verdict, by the rubric's name; a rubric it has no features for (a new one in
        the table) gets its middle level on every key."""
        turns = judge_prompts.read_turns(
            trajectory_text
        )  # the renderer's turns; quoted text cannot add one
        featured = {"transferability": self._transferability, "evolution": self._evolution}
        features = featured[rubric](turns) if rubric in featured else {}
        return {k: features.get(k, self._middle(rubric)) for k in judge_prompts.keys(rubric)}

    def _transferability(self, turns: list[dict]) -> dict[str, float]:
        """Each level is the typical turn's (the rubric's rule): counts of general words, structure, reasons."""
        texts = [t["response"] for t in turns]
        return {
            k: judge_prompts.typical_level([self._level(n(x)) for x in texts])
            for k, n in self._COUNTS.items()
        }

    @staticmethod
    def _new_words(texts: list[str]) -> bool:
        """Deepening as new content, not more characters: the last turn's reasoning (its move left out) has a word
        of three letters or more that no earlier turn's had."""
        words = [
            set(re.findall(r"[a-z]{3,}", judge_prompts.reasoning_text(x).lower())) for x in texts
        ]
        return bool(words[-1] - set().union(*words[:-1]))

    @staticmethod
    def _repeated(texts: list[str]) -> bool:
        """Some turn reasons as an earlier one did (an equal judge_prompts.reasoning_key), in one pass over the turns:
        each turn's reasoning_key once, in a set."""
        return len({judge_prompts.reasoning_key(x) for x in texts}) < len(texts)

    def _evolution(self, turns: list[dict]) -> dict[str, float]:
        texts, actions = [t["response"] for t in turns], [t["action"] for t in turns]
        repeated = self._repeated(texts)
        verdict = {
            "d": -1.0 if repeated else (1.0 if len(texts) > 1 and self._new_words(texts) else 0.0),
            "a": -1.0 if repeated else (1.0 if len(set(actions)) > 1 else 0.0),
            "c": 1.0 if all(actions) else (-1.0 if not actions[-1] else 0.0),
        }
        full = {
            k: verdict.get(k, self._middle("evolution")) for k in judge_prompts.keys("evolution")
        }
        return judge_prompts.evolution_rules([t["observation"] for t in turns], texts, full)[0]

    def complete(self, rubric: str, messages: list[dict]) -> tuple[str, int, int]:
        """The reply to build_messages' request: the verdict on the trajectory it quotes."""
        text = judge_prompts.trajectory_in(messages[-1]["content"])
        return json.dumps(self.scores(rubric, text)), 0, 0


# The start-up check: ONE chat request of a few tokens, made as every judge request is made, whose reply must parse
# as a verdict of the rubric PROBE_RUBRIC. It catches, before anything is spent, a base URL without its /v1, a model
# name the server does not serve, a server that is no OpenAI-compatible chat endpoint, and a model that does not
# answer in JSON. Its tokens are said at start-up and are not in the budget or the ledger.
PROBE_RUBRIC = "transferability"
PROBES = (
    3  # replies the check reads before it says that a judge which answers does not answer verdicts
)
ANSWERED = (
    "finish_length",
    "finish_other",
    "empty",
    "bad_response",
)  # it answered: worth asking again


class ProbeFailed(UserError):
    """The start-up check's failure, with its kind (auto's structured probe falls back on some)."""

    def __init__(self, kind: str, line: str):
        super().__init__(line)
        self.kind = kind


PROBE_TEXT = (
    "This is a connection check, not a trajectory to score. "
    "Reply with exactly this JSON object and nothing else:"
)


def probe_verdict() -> dict[str, float]:
    """What the probe asks the judge to say back: every key of PROBE_RUBRIC at its middle level."""
    levels = judge_prompts.RUBRICS[PROBE_RUBRIC]["levels"]
    return dict.fromkeys(judge_prompts.keys(PROBE_RUBRIC), levels[len(levels) // 2])


def probe_messages(structured: bool = False) -> list[dict]:
    """The probe's request. Sent with the schema (`structured`), it asks for one key more, which the schema
    forbids: a server that honours the schema answers without it, one that ignores the schema (its model
    obeying the words) with it, so the reply tells the two apart (follows_schema)."""
    asked = probe_verdict() | ({"unscored": 1} if structured else {})
    return [{"role": "user", "content": f"{PROBE_TEXT} {json.dumps(asked)}"}]


def follows_schema(reply: str, rubric: str) -> bool:
    """A reply that is the rubric's schema (judge_prompts.verdict_schema) and nothing else: one JSON object with
    exactly the schema's keys, each a number among its levels, as a server that constrains the reply writes."""
    schema = judge_prompts.verdict_schema(rubric)
    try:
        obj = json.loads(reply)
    except (ValueError, RecursionError):
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == set(schema["required"])
        and all(
            type(v) in (int, float) and v in schema["properties"][k]["enum"] for k, v in obj.items()
        )
    )


def is_verdict(reply: str) -> bool:
    """A reply to the free-text probe that parses as a verdict of PROBE_RUBRIC."""
    try:
        parse_scores(reply, PROBE_RUBRIC)
    except JudgeFailure:
        return False
    return True


def probe_hint(
    kind: str, status: int, base_url: str, model: str, served: list[str] | None, max_tokens: int
) -> str:
    """What to try when the probe fails as `kind` (HTTP `status`, 0 without one), from what is known: the URL's path
    and the models the server lists."""
    if status in (400, 404, 422) and served is not None and model not in served:
        more = ", ..." if len(served) > 6 else ""
        return f"it lists the models {', '.join(served[:6])}{more}: pass one as --judge-model"
    if (status in (404, 405, 501) or kind == "bad_response") and not base_url.rstrip("/").endswith(
        "/v1"
    ):
        return f"did you mean --judge-base-url {base_url.rstrip('/')}/v1?"
    if status in (405, 501) or kind == "bad_response":
        return "is it an OpenAI-compatible chat endpoint (POST /chat/completions under --judge-base-url)?"
    if 300 <= status < 400:
        return "a redirect is never followed (it would take the key elsewhere): pass the URL it leads to, if trusted"
    return {
        "http_404": "check --judge-base-url (the API's base, which /chat/completions follows) and --judge-model",
        "finish_length": f"the reply was cut at --judge-max-tokens {max_tokens}: raise it",
        "timeout": "a slow model needs a larger --judge-timeout; a dead one, a restart",
        "rate_limit": "wait, or ask for a higher rate limit",
        "not_a_verdict": "the judge must answer in JSON: a chat (instruction-following) model, not a base model",
        "not_structured": "it ignores response_format: pass --judge-structured off (or auto) to ask in free text",
    }.get(kind, "check --judge-base-url, --judge-model and the server's log")


class OpenAIJudge:
    """Any OpenAI-compatible chat endpoint (OpenAI, `vllm serve`, llama.cpp, SGLang, ...), through the
    `openai` client (machinery/openai_api.py: retries with backoff, failures as named kinds). The key
    comes from OPENAI_API_KEY only; it is never logged or saved."""

    cacheable = True
    requests = True  # each verdict is a request, a line of the run's money ledger
    title = "OpenAI-compatible judge"

    @staticmethod
    def words(args) -> str:
        """What the start line and the plan call this judge: its model and where it is asked."""
        return f"{args.judge_model} at {args.judge_base_url or OPENAI_BASE}"

    @staticmethod
    def prices(args) -> tuple[float, float]:
        """USD per million (prompt, completion) tokens: --judge-price-in/out, or the table's."""
        return args.judge_price_in, args.judge_price_out

    def __init__(self, model: str, base_url: str, args):
        self.name, self.base_url, self.args = model, base_url, args
        self.structured = args.judge_structured == "on"  # auto: decided by the start-up check
        self.client = openai_client(
            base_url,
            args.judge_timeout,
            args.judge_retries,
            "--judge openai",
            args.judge_max_tokens,
        )

    def check_reachable(self) -> str:
        """The start-up check (see PROBE_TEXT): the server reachable and the key taken (GET /models), then probe
        requests whose reply must parse as a verdict, structured first (--judge-structured auto or on: with the
        rubric's schema as response_format; auto falls back to free text where that fails). A failure ends in one
        line naming the URL, what came back and a hint; success returns the line that says so, and how verdicts
        come."""
        served = check_reachable(self.client, self.base_url, self.args.judge_timeout, "judge")
        t0, mode = time.perf_counter(), self.args.judge_structured
        if mode != "off":
            try:
                tries, tokens = self._probe(served, structured=True)
                self.structured = True
            except (
                ProbeFailed
            ) as e:  # auto: a server that refuses the schema (or ignores it) gets free text
                if mode == "on" or e.kind not in ANSWERED + (
                    "http_400",
                    "http_422",
                    "not_a_verdict",
                    "not_structured",
                ):
                    raise
        if not self.structured:
            tries, tokens = self._probe(served, structured=False)
        how = (
            "structured (response_format: the rubric's JSON schema)"
            if self.structured
            else "free text, parsed"
        )
        how += f"; --judge-structured {mode}" + (
            ": the server refused or ignored the schema"
            if mode == "auto" and not self.structured
            else ""
        )
        return (
            f"judge check: {self.url} answered a verdict{tries} in {time.perf_counter() - t0:.1f}s "
            f"({tokens[0]} + {tokens[1]} tokens, outside the budget); verdicts: {how}"
        )

    @property
    def url(self) -> str:
        return f"{(self.base_url or OPENAI_BASE).rstrip('/')}/chat/completions"

    def _probe(self, served: list[str] | None, structured: bool) -> tuple[str, list[int]]:
        """Up to PROBES probe requests until one reply is a verdict: (" at try k of N" or "", tokens spent)."""
        tokens = [0, 0]
        fmt = {"response_format": judge_prompts.response_format(PROBE_RUBRIC)} if structured else {}
        where = f"the judge at {self.url} (--judge-model {self.name})"
        for attempt in range(
            1, PROBES + 1
        ):  # a server that cuts one reply short under load is not refused for it
            try:
                reply, p_tok, c_tok = chat(
                    self.client,
                    model=self.name,
                    messages=probe_messages(structured),
                    temperature=self.args.judge_temperature,
                    max_tokens=self.args.judge_max_tokens,
                    **fmt,
                )
            except JudgeFailure as e:
                tokens = [tokens[0] + e.tokens[0], tokens[1] + e.tokens[1]]
                if (
                    e.kind in ANSWERED and attempt < PROBES
                ):  # it answered, but cut short or empty: ask again
                    continue
                status = (
                    int(re.match(r"HTTP (\d+)", e.detail).group(1))
                    if e.detail.startswith("HTTP ")
                    else 0
                )
                what = e.detail if status else f"{e.kind.replace('_', ' ')} ({e.detail or e.kind})"
                what += f"; {PROBES} replies tried" if e.kind in ANSWERED else ""
                base = self.base_url or OPENAI_BASE
                hint = probe_hint(
                    e.kind, status, base, self.name, served, self.args.judge_max_tokens
                )
                if structured and status in (
                    400,
                    422,
                ):  # the schema refused: say how to go without it
                    hint += "; a judge without structured outputs is asked in free text with --judge-structured off"
                raise ProbeFailed(
                    e.kind, f"{where} failed its start-up check: {what}; {hint}"
                ) from None
            tokens = [tokens[0] + p_tok, tokens[1] + c_tok]
            if follows_schema(reply, PROBE_RUBRIC) if structured else is_verdict(reply):
                return ("" if attempt == 1 else f" at try {attempt} of {PROBES}"), tokens
            if attempt == PROBES:
                kind = "not_structured" if structured else "not_a_verdict"
                hint = probe_hint(
                    kind, 200, self.base_url, self.name, served, self.args.judge_max_tokens
                )
                what, none = (
                    ("does not follow the schema sent as response_format", "none in it")
                    if structured
                    else ("is not a verdict", "none a verdict")
                )
                shown = repr(clipped(" ".join(reply.split()), 120))
                raise ProbeFailed(
                    kind,
                    f"{where} failed its start-up check: its reply {what} ({shown}; {PROBES} replies "
                    f"tried, {none}); {hint}",
                )
        raise AssertionError("unreachable")  # the loop returns or raises

    def complete(self, rubric: str, messages: list[dict]) -> tuple[str, int, int]:
        """One chat request (with the rubric's schema where verdicts are structured): the reply and
        its prompt and completion tokens."""
        fmt = {"response_format": judge_prompts.response_format(rubric)} if self.structured else {}
        return chat(
            self.client,
            model=self.name,
            messages=messages,
            temperature=self.args.judge_temperature,
            max_tokens=self.args.judge_max_tokens,
            **fmt,
        )


JUDGES = {"openai": OpenAIJudge, "heuristic": HeuristicJudge}  # --judge's choices


def make_judge(args) -> HeuristicJudge | OpenAIJudge:
    """The judge --judge names, made for this run."""
    if args.judge_kind is HeuristicJudge:
        return HeuristicJudge()
    return OpenAIJudge(args.judge_model, args.judge_base_url, args)


def render_for_judge(traj) -> str:
    return judge_prompts.render_trajectory(
        traj.game, traj.role, [dataclasses.asdict(t) for t in traj.turns]
    )


@dataclass
class Judgement:
    """The judge's word on one trajectory: all requested keys, or a failure kind, or skipped
    (the budget ran out before it was asked: treated as not sampled, not as a failure)."""

    scores: dict | None
    failure: str | None = None
    skipped: bool = False
    rule: str | None = (
        None  # the rule of code that set some levels (stratagem.judge_trajectories), if one did
    )


class JudgeRunner:
    """Everything between trajectories and their scores: rendering, cache, budget, concurrency, n-sample
    aggregation, parsing. Failures are returned and counted, never raised. `totals` rides in checkpoints;
    the `ledger` gets one line per paid request as it is paid: a money record a crash cannot shorten, so
    a resumed run's money totals are read back from it (`totals` restores the checkpoint's others)."""

    def __init__(
        self,
        client,
        args,
        cache: runfiles.JudgeCache,
        ledger: Path | None = None,
        totals: dict | None = None,
    ):
        self.client, self.args, self.cache, self.ledger = client, args, cache, ledger
        self.lock = threading.Lock()
        self.totals = dict.fromkeys(
            ("requests", "cache_hits", "prompt_tokens", "completion_tokens", "cost"), 0
        )
        self.totals.update(totals or {})
        if (
            ledger is not None and ledger.exists()
        ):  # what was really spent, a crashed step's requests included
            self.totals.update(runfiles.ledger_totals(ledger))

    def budget_exhausted(self) -> bool:
        return 0 < self.args.judge_budget <= self.totals["cost"]

    def _request(
        self, verdict, rubric: str, sample: int, text: str, step: dict
    ) -> tuple[dict | None, str | None]:
        """One verdict: from the cache, else `verdict(chat, rubric, text)` (stratagem.verdict), whose one `chat`
        call is sent here, paid and put on the ledger before its reply is read. Returns (levels, failure kind)."""
        key = runfiles.JudgeCache.key(
            self.client.name,
            rubric,
            self.args.judge_temperature,
            self.args.judge_max_tokens,
            sample,
            text,
            getattr(self.client, "structured", False),
        )
        if self.client.cacheable and (hit := self.cache.entries.get(key)) is not None:
            self._count(step, cache_hits=1)
            return hit, None
        if (
            self.budget_exhausted()
        ):  # checked per request: at most judge_concurrency requests overshoot
            return None, "budget"

        def chat(messages: list[dict]) -> str:
            try:
                reply, p_tok, c_tok = self.client.complete(rubric, messages)
            except JudgeFailure as e:
                self._pay(step, rubric, key, e.kind, e.tokens)
                raise
            self._pay(step, rubric, key, None, (p_tok, c_tok))
            return reply

        try:
            scores = verdict(chat, rubric, text)
        except JudgeFailure as e:
            return None, e.kind
        if self.client.cacheable:
            self.cache.put(key, rubric, scores)
        return scores, None

    def _pay(self, step: dict, rubric: str, key: str, kind: str | None, tokens) -> None:
        """A request's tokens and money in the totals and, as paid, on the ledger."""
        p_tok, c_tok = tokens
        cost = p_tok * self.args.judge_price_in / 1e6 + c_tok * self.args.judge_price_out / 1e6
        self._count(step, requests=1, prompt_tokens=p_tok, completion_tokens=c_tok, cost=cost)
        if self.ledger is not None:  # on record as paid before its reply is read at all
            line = {"rubric": rubric, "key": key, "failure": kind, "prompt_tokens": p_tok}
            line |= {"completion_tokens": c_tok, "cost": cost}
            with self.lock:
                runfiles.append_jsonl(self.ledger, line)

    def _count(self, step: dict, **amounts) -> None:
        with self.lock:
            for k, v in amounts.items():
                self.totals[k] += v
                step[k] = step.get(k, 0) + v

    def judge(
        self, trajs: list, rubrics: list[str], verdict, progress=None
    ) -> tuple[list[Judgement], dict]:
        """One Judgement per trajectory, and this call's usage (requests, tokens, cost, cache hits). Each
        trajectory is asked each rubric it has the turns for (evolution needs two), --judge-samples times, the
        requests in flight together; `verdict` makes each (stratagem.verdict). `progress` hears of every request
        answered (cache hits and failures included). The rules code decides are stratagem's to apply."""
        texts = [render_for_judge(t) for t in trajs]
        asked = [
            [r for r in rubrics if len(t.turns) >= judge_prompts.RUBRICS[r]["turns"]] for t in trajs
        ]
        jobs = [
            (i, r, s)
            for i in range(len(trajs))
            for r in asked[i]
            for s in range(self.args.judge_samples)
        ]
        step: dict = {}
        done = itertools.count(1)  # next() on a count is atomic under the GIL: a thread-safe tally

        def request(job):
            result = self._request(verdict, job[1], job[2], texts[job[0]], step)
            if progress is not None:
                progress.phase(f"judge {next(done)}/{len(jobs)} requests")
            return result

        results = concurrently(
            request, jobs, self.args.judge_concurrency
        )  # a stop signal does not wait for them
        judgements = []
        for i in range(len(trajs)):
            scores, kinds = {}, []
            for rubric in asked[i]:
                mine = [res for (j, r, _), res in zip(jobs, results) if j == i and r == rubric]
                valid = [s for s, _ in mine if s is not None]
                if valid:
                    scores.update(aggregate(valid, self.args.judge_aggregate))
                else:
                    kinds.append(next(k for _, k in mine if k))
            failure = next((k for k in kinds if k != "budget"), None)
            skipped = bool(kinds) and failure is None
            judgements.append(Judgement(None if kinds else scores, failure, skipped))
        return judgements, step
