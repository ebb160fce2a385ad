"""Talking to an OpenAI-compatible server (OpenAI, `vllm serve`, llama.cpp, SGLang, ...) through the
`openai` client: the client, a reachability check at start-up, and one chat completion whose every
failure is a JudgeFailure of a named kind, never an exception that ends a run.

The key comes from OPENAI_API_KEY only; it is never logged or saved.
"""

from __future__ import annotations

import os

from machinery import UserError


class JudgeFailure(Exception):
    """A request that did not produce valid scores; `kind` is counted in metrics, `tokens` (prompt,
    completion) are what the failed request was billed, so its cost is still counted."""

    def __init__(self, kind: str, detail: str = "", tokens: tuple[int, int] = (0, 0)):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.tokens = kind, tokens


def openai_client(base_url: str, timeout: float, retries: int, what: str):
    """An `openai` client, whose built-in retries back off exponentially on timeouts, connection errors,
    429 (honouring Retry-After) and 5xx. Local servers usually take any key; the client insists on one."""
    import openai

    key = os.environ.get("OPENAI_API_KEY")
    if not key and not base_url:
        raise UserError(f"{what} needs OPENAI_API_KEY in the environment or a base URL of a local server")
    return openai.OpenAI(api_key=key or "EMPTY", base_url=base_url or None, timeout=timeout, max_retries=retries)


def check_reachable(client, base_url: str, timeout: float, what: str) -> None:
    """Fail at start-up, with one line, when the server cannot be reached or rejects the key."""
    import openai

    try:
        client.with_options(max_retries=0, timeout=min(timeout, 10)).models.list()
    except openai.AuthenticationError:
        raise UserError(f"the {what} rejected the API key (HTTP 401); check OPENAI_API_KEY") from None
    except openai.APIConnectionError:
        raise UserError(f"the {what} at {base_url or 'api.openai.com'} is unreachable; start the server or "
                        "fix its base URL") from None
    except openai.APIStatusError:
        pass  # reachable; some compatible servers simply have no /models route


def chat(client, **request) -> tuple[str, int, int]:
    """One chat completion -> (reply, prompt tokens, completion tokens); a failure is a JudgeFailure whose
    kind names it: timeout, connection, rate_limit, server_error, http_NNN, bad_response or empty."""
    import openai as oa

    try:
        resp = client.chat.completions.create(**request)
    except (oa.APIError, ValueError) as e:  # ValueError: an HTTP 200 whose body is not JSON at all
        kinds = ((oa.APITimeoutError, "timeout"),  # first: a timeout is also an APIConnectionError
                 (oa.APIConnectionError, "connection"), (oa.RateLimitError, "rate_limit"),
                 (oa.InternalServerError, "server_error"))
        kind = next((k for cls, k in kinds if isinstance(e, cls)),
                    f"http_{e.status_code}" if isinstance(e, oa.APIStatusError) else "bad_response")
        raise JudgeFailure(kind, str(e)) from None
    return chat_reply(resp)


def chat_reply(resp) -> tuple[str, int, int]:
    """(reply, prompt tokens, completion tokens), checked field by field: `openai` does not validate what it
    builds, so an HTTP 200 with a broken body (an HTML page, `choices` not a list, `content` a list of
    parts, usage not a count) arrives as odd types. Each is a `bad_response` failure, never an exception."""
    usage = getattr(resp, "usage", None)
    counts = [getattr(usage, k, None) or 0 for k in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise JudgeFailure("bad_response", f"usage is not a token count: {usage!r:.80}")
    tokens = (counts[0], counts[1])
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list):
        raise JudgeFailure("bad_response", f"not a chat completion: {resp!r:.80}", tokens)
    if not choices:
        raise JudgeFailure("empty", tokens=tokens)
    content = getattr(getattr(choices[0], "message", None), "content", None)
    if content is not None and not isinstance(content, str):
        raise JudgeFailure("bad_response", f"content is not a string: {content!r:.80}", tokens)
    if not content:
        raise JudgeFailure("empty", tokens=tokens)
    return content, *tokens
