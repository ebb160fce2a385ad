"""The HTTP under the judge's `openai` client: every attempt of a request is bounded as a whole.

httpx's timeouts bound each wait for bytes, not a request: a server that sends its body one byte a second,
or never ends it, holds a request (and the step, and every rank waiting on the step) without limit. Here
an attempt has a deadline, its timeout (openai passes --judge-timeout) after it starts, that bounds the
whole of it: the wait for a pooled connection aside, every socket operation (connect, TLS, send, the
headers and the whole body) waits at most until the deadline, after which the attempt is httpx's
ReadTimeout, which the client retries and counts as a timeout. A body larger than `max_bytes` is refused
as it arrives (ReplyTooLarge, not retried): a 50 MB reply is never read into memory; a compressed one is
refused unread (ReplyEncoded, not retried).

A redirect is never followed (the key and the trajectories go only where the base URL says): a 3xx is an error
answer like a 4xx. No connection is used twice: a reply a server leaves behind on a kept-alive connection (a
second answer to one request) cannot be read as the answer to the next.

The retries are made here, not by openai (its client gets max_retries=0, so that no release of
it changes them): after a timeout, a connection error or an answer worth asking again (see
worth_retrying), up to `retries` times, each after an exponential backoff or the wait that a
server's Retry-After asks, cut to `wait_max` (openai_api passes RETRY_WAIT_MAX, the bound that
judge_seconds and --dist-timeout count on).

Imported only when an OpenAI-compatible server is used (it imports httpx, httpcore and openai).
"""

from __future__ import annotations

import contextlib
import email.utils
import random
import threading
import time

import httpcore
import httpx
import openai

# .deadline: time.monotonic() by which this thread's current attempt ends;
# .once: this thread's requests are not retried (tried_once)
_attempt = threading.local()
_jitter = random.Random()  # its own generator: retries leave the seeded global one as it was


def _wait(timeout: float | None, late: type[Exception]) -> float | None:
    """How long one socket operation may wait: its own timeout, cut to what is left of the attempt."""
    deadline = getattr(_attempt, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the request took longer than its timeout as a whole")
    return left if timeout is None else min(timeout, left)


class _BoundedStream(httpcore.NetworkStream):
    """A connection whose every read and write ends by the deadline of the attempt using it."""

    def __init__(self, stream: httpcore.NetworkStream):
        self.stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, _wait(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, _wait(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> _BoundedStream:
        return _BoundedStream(
            self.stream.start_tls(
                ssl_context, server_hostname, _wait(timeout, httpcore.ConnectTimeout)
            )
        )

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class _BoundedBackend(httpcore.NetworkBackend):
    """httpcore's network backend, its connections bounded by the deadline of the attempt that opens them."""

    def __init__(self, backend: httpcore.NetworkBackend):
        self.backend = backend

    def connect_tcp(
        self, host, port, timeout=None, local_address=None, socket_options=None
    ) -> _BoundedStream:
        return _BoundedStream(
            self.backend.connect_tcp(
                host, port, _wait(timeout, httpcore.ConnectTimeout), local_address, socket_options
            )
        )

    def connect_unix_socket(self, path, timeout=None, socket_options=None) -> _BoundedStream:
        return _BoundedStream(
            self.backend.connect_unix_socket(
                path, _wait(timeout, httpcore.ConnectTimeout), socket_options
            )
        )

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


class ReplyTooLarge(openai.APIConnectionError):
    """A reply body over the cap, never retried; an openai error the client passes on as it is
    (openai >= 2) or wraps (older), either way never an exception that ends a run."""

    def __init__(self, request, max_bytes: int):
        super().__init__(message=f"the reply is larger than {max_bytes} bytes", request=request)


class ReplyEncoded(openai.APIConnectionError):
    """A compressed reply, though the client asked for none (Accept-Encoding: identity): refused before a byte of it
    is decoded, since a 0.2 MB gzip body can inflate to 200 MB and the cap counts the bytes on the wire. Not
    retried (the same server compresses again); at start-up, check_reachable says so in one line."""

    def __init__(self, request, encoding: str):
        super().__init__(
            message=f"the reply is compressed (Content-Encoding: {encoding})", request=request
        )
        self.encoding = encoding


class _CappedBody(httpx.SyncByteStream):
    def __init__(self, stream, request, max_bytes: int):
        self.stream, self.request, self.max_bytes, self.size = stream, request, max_bytes, 0

    def __iter__(self):
        for chunk in self.stream:
            self.size += len(chunk)
            if self.size > self.max_bytes:
                raise ReplyTooLarge(self.request, self.max_bytes)
            yield chunk

    def close(self) -> None:
        self.stream.close()


def worth_retrying(response: httpx.Response) -> bool:
    """Whether an answer is one to ask again, as openai's own client judges: an error that the
    server's x-should-retry header says is, or else a request timeout (408), a lock timeout (409),
    a rate limit (429) or a server error (5xx)."""
    if response.is_success:
        return False
    said = response.headers.get("x-should-retry")
    if said in ("true", "false"):
        return said == "true"
    return response.status_code in (408, 409, 429) or response.status_code >= 500


def retry_after(headers: httpx.Headers) -> float | None:
    """The seconds a server asks to wait before a retry: Retry-After-Ms (OpenAI's), or Retry-After
    in seconds or as an HTTP date; None where it asks for nothing readable."""
    for name, unit in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * unit
        except (KeyError, ValueError):
            continue
    date = email.utils.parsedate_tz(headers.get("retry-after", ""))
    try:
        return None if date is None else email.utils.mktime_tz(date) - time.time()
    except (OverflowError, ValueError):  # a date no clock can hold
        return None


def backoff(retry: int) -> float:
    """The wait before retry number `retry` + 1 where the server asks for none: 0.5 s doubling, at
    most 8 s, less up to a quarter at random (clients that failed together come back apart)."""
    return min(0.5 * 2.0**retry, 8.0) * (1 - 0.25 * _jitter.random())


@contextlib.contextmanager
def tried_once():
    """Inside, the requests this thread sends are tried once, whatever the client's retries (the
    start-up check: a server that cannot be reached is said so at once)."""
    _attempt.once = True
    try:
        yield
    finally:
        _attempt.once = False


class BoundedClient(httpx.Client):
    """An httpx client (proxies and TLS as httpx sets them up from the environment) whose every
    send() is up to `retries` + 1 bounded attempts, each on a connection of its own, following no
    redirect, see the module's docstring. The body is read inside send(), as openai reads a reply
    that is not streamed. The server is asked not to compress, and a compressed reply is refused
    unread (ReplyEncoded), so the cap counts the bytes as they will be parsed. (Decoding it as it
    streams, with a running count, would need a bounded output from every decoder httpx may use,
    gzip, deflate, br, zstd; a server that honours Accept-Encoding: identity, as HTTP asks of it,
    never needs one.)"""

    def __init__(self, max_bytes: int, retries: int, wait_max: float):
        super().__init__(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0),
            follow_redirects=False,
            headers={"Accept-Encoding": "identity"},
        )  # openai's own limit on connections; none kept alive: a connection a request of its own
        self.max_bytes, self.retries, self.wait_max = max_bytes, retries, wait_max
        for transport in [
            self._transport,
            *self._mounts.values(),
        ]:  # httpx takes no network backend (encode/httpx#3749)
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                pool._network_backend = _BoundedBackend(pool._network_backend)

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs) -> httpx.Response:
        """The answer to `request`, retried as the module's docstring says: the last attempt's
        answer (an error answer among them) or its exception."""
        kwargs["follow_redirects"] = False  # whatever a caller's options say
        retries = 0 if getattr(_attempt, "once", False) else self.retries
        retry = 0
        while True:
            try:
                response = self._one_attempt(request, stream, kwargs)
            except httpx.TransportError:  # a timeout, a refused or broken connection, ...
                if retry == retries:
                    raise
                wait = backoff(retry)
            else:
                if retry == retries or not worth_retrying(response):
                    return response
                response.close()
                # NaN, or a time already past, is no wait asked; an endless one is cut to wait_max.
                asked = retry_after(response.headers)
                wait = asked if asked is not None and asked > 0 else backoff(retry)
            time.sleep(min(wait, self.wait_max))
            retry += 1

    def _one_attempt(self, request: httpx.Request, stream: bool, kwargs: dict) -> httpx.Response:
        waits = [t for t in (request.extensions.get("timeout") or {}).values() if t is not None]
        _attempt.deadline = time.monotonic() + max(waits) if waits else None
        try:
            response = super().send(request, stream=True, **kwargs)
            try:
                length = response.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > self.max_bytes:
                    raise ReplyTooLarge(request, self.max_bytes)
                encoding = response.headers.get("Content-Encoding", "").strip()
                if encoding.lower() not in ("", "identity"):
                    raise ReplyEncoded(request, encoding)
                response.stream = _CappedBody(response.stream, request, self.max_bytes)
                if not stream:
                    response.read()
            except BaseException:
                response.close()
                raise
            return response
        finally:
            _attempt.deadline = None


def max_reply_bytes(max_tokens: int) -> int:
    """The cap on a judge reply's body: 4 MiB, or 32 bytes a token of --judge-max-tokens if that is more (a
    token is about 4 characters, at most 6 bytes each as JSON escapes them; the rest is room to spare)."""
    return max(4 << 20, 32 * max_tokens)
