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
second answer to one request) cannot be read as the answer to the next. And the client waits at most
RETRY_WAIT_MAX before a retry, whatever Retry-After asks (CappedRetries).

Imported only when an OpenAI-compatible server is used (it imports httpx, httpcore and openai).
"""

from __future__ import annotations

import threading
import time

import httpcore
import httpx
import openai

from machinery.openai_api import RETRY_WAIT_MAX

_attempt = (
    threading.local()
)  # .deadline: time.monotonic() by which this thread's current attempt ends


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
    """A reply body over the cap; an openai error the client passes on without retrying (openai >= 2) or
    wraps after its retries (older), either way never an exception that ends a run."""

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


class BoundedClient(httpx.Client):
    """An httpx client (proxies and TLS as httpx sets them up from the environment) whose every send() is one
    bounded attempt on a connection of its own that follows no redirect, see the module's docstring. The body
    is read inside send(), as openai reads a reply that is not streamed. The server is asked not to compress,
    and a compressed reply is refused unread (ReplyEncoded), so the cap counts the bytes as they will be parsed.
    (Decoding it as it streams, with a running count, would need a bounded output from every decoder httpx may
    use, gzip, deflate, br, zstd; a server that honours Accept-Encoding: identity, as HTTP asks of it, never
    needs one.)"""

    def __init__(self, max_bytes: int):
        super().__init__(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0),
            follow_redirects=False,
            headers={"Accept-Encoding": "identity"},
        )  # openai's own limit on connections; none kept alive: a connection a request of its own
        self.max_bytes = max_bytes
        for transport in [
            self._transport,
            *self._mounts.values(),
        ]:  # httpx takes no network backend (encode/httpx#3749)
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                pool._network_backend = _BoundedBackend(pool._network_backend)

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs) -> httpx.Response:
        waits = [t for t in (request.extensions.get("timeout") or {}).values() if t is not None]
        _attempt.deadline = time.monotonic() + max(waits) if waits else None
        kwargs["follow_redirects"] = False  # whatever a caller's options say
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


class CappedRetries(openai.OpenAI):
    """openai's client, its wait before a retry cut to RETRY_WAIT_MAX: openai honours a Retry-After of up to
    120 s (60 s in older releases), which would break the bound judge_seconds and --dist-timeout count on."""

    def _calculate_retry_timeout(self, *args, **kwargs) -> float:
        return min(super()._calculate_retry_timeout(*args, **kwargs), RETRY_WAIT_MAX)
