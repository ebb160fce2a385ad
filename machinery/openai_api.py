"""Talking to an OpenAI-compatible server (OpenAI, `vllm serve`, llama.cpp, SGLang, ...) through the
`openai` client: the client, a reachability check at start-up, and one chat completion whose every
failure is a JudgeFailure of a named kind, never an exception that ends a run.

The key comes from OPENAI_API_KEY only; it is never logged or saved, and a base URL that carries a user name or
password is refused (check_base_url). A server's own text (an error's message, a reply that is no verdict) is shown
only through scrub(), which takes out the key and any Authorization value a server may echo.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
from urllib.parse import urlsplit

from machinery import UserError

SECRETS = ("OPENAI_API_KEY", "WANDB_API_KEY")  # the keys this project reads from the environment
# An Authorization header's value (its scheme kept) or a bearer token, as a server echoes one: in a header line,
# a JSON string or a Python repr.
_AUTHORIZATION = re.compile(
    r"(?i)(\bauthorization\b[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?|\bbearer\s+)[^\s\"',;}\]]+"
)


def scrub(text: str) -> str:
    """A server's text made safe to print or write: the value of each key in SECRETS that is set, and whatever
    follows `Authorization:` or `Bearer`, written as ***. A server (or a proxy) that echoes a request's headers
    in its error message shows no key."""
    for name in SECRETS:
        if key := os.environ.get(name):
            text = text.replace(key, "***")
    return _AUTHORIZATION.sub(lambda m: m.group(1) + "***", text)


def clipped(text: str, limit: int) -> str:
    """A server's text, scrubbed first (a key cut in half is still half a key), then cut to `limit` characters."""
    text = scrub(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class JudgeFailure(Exception):
    """A request that did not produce valid scores; `kind` is counted in metrics, `tokens` (prompt,
    completion) are what the failed request was billed, so its cost is still counted. The detail, which
    may quote the server, is scrubbed."""

    def __init__(self, kind: str, detail: str = "", tokens: tuple[int, int] = (0, 0)):
        detail = scrub(detail)
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail, self.tokens = kind, detail, tokens


def check_base_url(url: str, what: str) -> None:
    """A user name or password in a base URL (http://alice:pw@host/v1) would be written to config.json, the start
    line and the plan, and sent as Basic auth in place of the key: refused in one line that does not show it."""
    netloc = urlsplit(url).netloc if "://" in url else url.split("/", 1)[0]
    if "@" in netloc:
        shown = url.replace(netloc, "***@" + netloc.rpartition("@")[2], 1)
        raise UserError(
            f"{what} {shown}: a user name or password in the URL would be written to the run's files and sent in "
            "place of the API key; put the key in OPENAI_API_KEY"
        )


OPENAI_BASE = "https://api.openai.com/v1"  # where a request goes when no base URL is given


def check_env_base_url(base_url: str, what: str, how: str) -> None:
    """OPENAI_BASE_URL in the environment, where no base URL is given, is refused in one line: the `openai`
    client would send every request, and the API key, there, while the start line, the plan and config.json
    say api.openai.com, and a resume from a shell without it would change judge unsaid. `how` says where a
    base URL is given (a base URL is only ever taken from there)."""
    env = os.environ.get("OPENAI_BASE_URL", "")
    if not base_url and env and env.rstrip("/") != OPENAI_BASE:
        raise UserError(
            f"{what}: OPENAI_BASE_URL is set ({clipped(env, 120)}), but requests go only to a base URL given "
            f"({how}), else to {OPENAI_BASE}, so that what is said and recorded is where the API key goes: "
            "give that URL there, or unset OPENAI_BASE_URL"
        )


# The longest the client waits before a retry: a server's Retry-After is honoured up to this, and
# the backoff without one is at most 8 s (machinery/judge_http.py, where the retries are made).
# judge_seconds, and so --dist-timeout's default, count it.
RETRY_WAIT_MAX = 60.0


def openai_client(base_url: str, timeout: float, retries: int, what: str, max_tokens: int):
    """An `openai` client whose HTTP is judge_http.BoundedClient, which makes up to `retries`
    retries itself (openai's own are off), with exponential backoff, on timeouts, connection
    errors, 429 (honouring Retry-After up to RETRY_WAIT_MAX) and 5xx. Each attempt takes at most
    `timeout` seconds as a whole, on a connection of its own, follows no redirect, and a reply may
    not be larger than judge_http.max_reply_bytes(max_tokens) (machinery/judge_http.py). Local
    servers usually take any key; the client insists on one."""
    import openai

    from machinery.judge_http import BoundedClient, max_reply_bytes

    check_base_url(base_url, f"{what}: the base URL")
    check_env_base_url(base_url, what, "--judge-base-url, or openai:MODEL@BASE_URL")
    key = os.environ.get("OPENAI_API_KEY")
    if not key and not base_url:
        raise UserError(
            f"{what} needs OPENAI_API_KEY in the environment or a base URL of a local server"
        )
    return openai.OpenAI(
        api_key=key or "EMPTY",
        base_url=base_url or OPENAI_BASE,  # never None: openai would read OPENAI_BASE_URL
        timeout=timeout,
        max_retries=0,  # BoundedClient retries: openai's own retries change between its releases
        http_client=BoundedClient(max_reply_bytes(max_tokens), retries, RETRY_WAIT_MAX),
    )


def judge_seconds(requests: int, concurrency: int, timeout: float, retries: int) -> float:
    """The longest `requests` requests can take, `concurrency` at a time: each worker makes at most
    ceil(requests / concurrency) of them one after another, each at most retries + 1 attempts of `timeout`
    seconds as a whole (machinery/judge_http.py) with a wait of at most RETRY_WAIT_MAX before each retry."""
    return math.ceil(requests / concurrency) * ((retries + 1) * timeout + retries * RETRY_WAIT_MAX)


def check_reachable(client, base_url: str, timeout: float, what: str) -> list[str] | None:
    """Fail at start-up, with one line, when the server cannot be reached or rejects the key. Returns the ids of the
    models it lists (GET /models), or None when it lists none (some compatible servers have no such route)."""
    import openai

    from machinery.judge_http import ReplyEncoded, tried_once

    try:
        with tried_once():
            listed = client.with_options(timeout=timeout).models.list()
        return [m.id for m in listed.data if isinstance(getattr(m, "id", None), str)] or None
    except ReplyEncoded as e:
        raise UserError(
            f"the {what} at {base_url or 'api.openai.com'} compressed its reply (Content-Encoding: "
            f"{clipped(e.encoding, 40)}) "
            "although asked not to (Accept-Encoding: identity); a compressed reply is never read (its size is not "
            "known before it is decoded): turn compression off on that server or its proxy"
        ) from None
    except openai.AuthenticationError:
        raise UserError(
            f"the {what} rejected the API key (HTTP 401); check OPENAI_API_KEY"
        ) from None
    except openai.APIConnectionError:
        raise UserError(
            f"the {what} at {base_url or 'api.openai.com'} is unreachable; start the server or fix its base URL"
        ) from None
    except openai.APIStatusError as e:
        if 300 <= e.status_code < 400:
            raise UserError(redirected(e, base_url, what)) from None
        return None  # a 404: reachable; what it is, the chat request that follows finds out
    except (AttributeError, TypeError, ValueError):  # a 200 that is not a list
        return None


def redirected(e, base_url: str, what: str) -> str:
    """The line that refuses a server answering with a redirect, which is never followed: it would take the key
    and the trajectories wherever the server says."""
    where = clipped(e.response.headers.get("Location", ""), 120)
    return (
        f"the {what} at {base_url or 'api.openai.com'} answered with a redirect (HTTP {e.status_code}"
        f"{f' to {where}' if where else ''}); a redirect is never followed, since it would take the API key "
        "and the trajectories elsewhere: if you trust where it leads, pass that URL as the base URL"
    )


def came_back(e) -> str:
    """An HTTP error answer in a few words: its status and the server's own message (a JSON error's `message` or
    `detail`, else the body's text without markup), scrubbed and cut to 160 characters."""
    text = getattr(getattr(e, "response", None), "text", "") or ""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        text = str(
            (error.get("message") if isinstance(error, dict) else error)
            or body.get("detail")
            or text
        )
    text = clipped(" ".join(re.sub(r"<[^>]*>", " ", text).split()).rstrip("."), 160)
    return f"HTTP {e.status_code}" + (f": {text}" if text else "")


def chat(client, *, cut_ok: bool = False, **request) -> tuple[str, int, int]:
    """One chat completion -> (reply, prompt tokens, completion tokens); a failure is a JudgeFailure whose
    kind names it: timeout, too_large, encoded, connection, rate_limit, server_error, http_NNN, bad_response,
    empty or finish_* (see chat_reply; `cut_ok`: a reply that did not stop by itself is a reply too)."""
    import openai as oa

    from machinery.judge_http import ReplyEncoded, ReplyTooLarge

    try:
        resp = client.chat.completions.create(**request)
    except (oa.APIError, ValueError) as e:  # ValueError: an HTTP 200 whose body is not JSON at all
        if isinstance(
            e.__cause__, (ReplyTooLarge, ReplyEncoded)
        ):  # an older openai retries it, then wraps it
            e = e.__cause__
        kinds = (
            (oa.APITimeoutError, "timeout"),  # first: a timeout is also an APIConnectionError
            (ReplyTooLarge, "too_large"),
            (ReplyEncoded, "encoded"),
            (oa.APIConnectionError, "connection"),
            (oa.RateLimitError, "rate_limit"),
            (oa.InternalServerError, "server_error"),
        )
        kind = next(
            (k for cls, k in kinds if isinstance(e, cls)),
            f"http_{e.status_code}" if isinstance(e, oa.APIStatusError) else "bad_response",
        )
        raise JudgeFailure(
            kind, came_back(e) if isinstance(e, oa.APIStatusError) else str(e)
        ) from None
    return chat_reply(resp, cut_ok)


# The finish reasons OpenAI documents besides "stop"; any other (or none at all) is "finish_other".
FINISH_KINDS = ("length", "content_filter", "tool_calls", "function_call")


def chat_reply(resp, cut_ok: bool = False) -> tuple[str, int, int]:
    """(reply, prompt tokens, completion tokens), checked field by field: `openai` does not validate what it
    builds, so an HTTP 200 with a broken body (an HTML page, `choices` not a list, `content` a list of
    parts, usage not a count) arrives as odd types. Each is a `bad_response` failure, never an exception.
    A reply that did not finish by itself (finish_reason not "stop": cut off by the token limit, a content
    filter) is a failure of its own kind, finish_length, finish_content_filter, ..., whatever it holds, unless
    `cut_ok` (a player's move, read from whatever it wrote, as the policy's is: an empty one too)."""
    usage = getattr(resp, "usage", None)
    counts = [getattr(usage, k, None) or 0 for k in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise JudgeFailure(
            "bad_response", f"usage is not a token count: {clipped(repr(usage), 80)}"
        )
    tokens = (counts[0], counts[1])
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list):
        raise JudgeFailure(
            "bad_response", f"not a chat completion: {clipped(repr(resp), 80)}", tokens
        )
    if not choices:
        raise JudgeFailure("empty", tokens=tokens)
    finish = getattr(choices[0], "finish_reason", None)
    if (
        finish != "stop" and not cut_ok
    ):  # cut off (length) or filtered: whatever JSON it holds may be quoted, not the verdict
        raise JudgeFailure(
            f"finish_{finish}" if finish in FINISH_KINDS else "finish_other",
            f"finish_reason {clipped(repr(finish), 40)}",
            tokens,
        )
    content = getattr(getattr(choices[0], "message", None), "content", None)
    if content is not None and not isinstance(content, str):
        raise JudgeFailure(
            "bad_response", f"content is not a string: {clipped(repr(content), 80)}", tokens
        )
    if content is None or not (content or cut_ok):  # a player may say nothing: a move of its own
        raise JudgeFailure("empty", tokens=tokens)
    return content, *tokens


def concurrently(fn, items: list, workers: int) -> list:
    """[fn(x) for x in items], `workers` at a time, on daemon threads, so that a stop signal (Ctrl-C,
    SIGTERM), raised in the main thread while it waits here, ends the program at once: the requests still
    in flight are abandoned. (concurrent.futures joins its threads when its pool shuts down and again at
    interpreter exit, holding the exit for as long as a server holds a request.) fn's exception is raised."""
    results, errors, todo, finished = (
        [None] * len(items),
        [],
        queue.SimpleQueue(),
        threading.Semaphore(0),
    )
    for i in range(len(items)):
        todo.put(i)

    def work() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
                errors.append(e)
            finished.release()

    for _ in range(min(workers, len(items))):
        threading.Thread(target=work, daemon=True).start()
    for _ in items:
        finished.acquire()  # a signal interrupts this wait
    if errors:
        raise errors[0]
    return results
