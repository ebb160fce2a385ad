"""Tests of the judge's HTTP transport (machinery/judge_http.py, through openai_client): the
retries it makes itself, their number and their waits, Retry-After cut to RETRY_WAIT_MAX, no
redirect followed; and of scrub(), which keeps credentials out of what a server's text reaches.
Real servers on 127.0.0.1, the real `openai` client."""

from __future__ import annotations

import email.utils
import http.server
import json
import threading
import time

import pytest

from machinery import judge_http, openai_api
from machinery.openai_api import RETRY_WAIT_MAX, JudgeFailure, chat, openai_client, scrub
from tests.common import (  # noqa: F401  (the autouse fixtures apply by being imported)
    completion,
    no_process_left_behind,
    only_the_vllm_tests,
    secret_key_fixture,
)

MESSAGES = [{"role": "user", "content": "Judge this."}]


class Answering:
    """A local HTTP server whose `answer(handler)` -> (status, payload, headers) answers every
    request (GET or POST), the payload JSON or raw bytes; `seen` lists each request's method."""

    def __init__(self, answer):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                seen.append("GET")
                self._reply()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen.append("POST")
                self._reply()

            def _reply(self):
                status, payload, headers = answer(self)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def after(answers: list):
    """Answers the requests with `answers` in turn, then with a verdict."""

    def answer(handler):
        return answers.pop(0) if answers else (200, completion('{"d": 1, "a": 0, "c": 1}'), {})

    return answer


def sleeps_recorded(monkeypatch) -> list[float]:
    """Records each time.sleep (the transport's waits before a retry) instead of sleeping it."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


A_DAY_AWAY = email.utils.formatdate(time.time() + 86_400, usegmt=True)


@pytest.mark.parametrize(
    "asked",
    [{"Retry-After": "100000"}, {"Retry-After": A_DAY_AWAY}, {"Retry-After-Ms": "100000000"}],
    ids=["seconds", "date", "ms"],
)
def test_openai_client_retries_a_429_asking_for_a_day_after_RETRY_WAIT_MAX(
    monkeypatch, secret_key, asked
):
    """A 429 whose Retry-After asks for a day (as seconds, a date or OpenAI's milliseconds): the one
    retry comes after RETRY_WAIT_MAX, the bound judge_seconds counts, and gets the verdict."""
    server = Answering(after([(429, {"error": {"message": "slow down"}}, asked)]))
    slept = sleeps_recorded(monkeypatch)
    try:
        reply, _, _ = chat(
            openai_client(server.url, 10.0, 1, "a test", 64), model="m", messages=MESSAGES
        )
    finally:
        server.close()
    assert slept == [RETRY_WAIT_MAX] and server.seen == ["POST", "POST"] and '"d": 1' in reply


def test_openai_client_waits_no_longer_than_a_RETRY_WAIT_MAX_made_tiny(monkeypatch, secret_key):
    """The same 429 with RETRY_WAIT_MAX at 0.05 s: the wait really slept is that (each sleep is
    cut to 1 s here, so that a wait left uncut fails the test instead of holding it), and the
    retry is made."""
    monkeypatch.setattr(openai_api, "RETRY_WAIT_MAX", 0.05)
    server = Answering(after([(429, {"error": "slow down"}, {"Retry-After": "100000"})]))
    slept, sleep = [], time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), sleep(min(s, 1.0))))
    try:
        reply, _, _ = chat(
            openai_client(server.url, 10.0, 1, "a test", 64), model="m", messages=MESSAGES
        )
    finally:
        server.close()
    assert slept == [0.05] and server.seen == ["POST", "POST"] and '"d": 1' in reply


@pytest.mark.parametrize(
    "status, headers, tries, kind",
    [
        (500, {}, 3, "server_error"),
        (429, {}, 3, "rate_limit"),
        (503, {"x-should-retry": "false"}, 1, "server_error"),
        (400, {}, 1, "http_400"),
        (400, {"x-should-retry": "true"}, 3, "http_400"),
    ],
)
def test_openai_client_tries_judge_retries_plus_one_times_with_backoff(
    monkeypatch, secret_key, status, headers, tries, kind
):
    """--judge-retries 2 against a server that always fails: 3 tries where the answer is worth
    asking again (a 5xx, a 429, or what x-should-retry says), after 0.5 s then 1 s less up to a
    quarter; one try where it is not. The last answer is the failure."""
    server = Answering(lambda handler: (status, {"error": {"message": "no"}}, headers))
    slept = sleeps_recorded(monkeypatch)
    try:
        with pytest.raises(JudgeFailure) as failed:
            chat(openai_client(server.url, 10.0, 2, "a test", 64), model="m", messages=MESSAGES)
    finally:
        server.close()
    assert failed.value.kind == kind and server.seen == ["POST"] * tries
    assert len(slept) == tries - 1 and all(0.75 * w <= s <= w for s, w in zip(slept, [0.5, 1.0]))


def test_openai_client_retries_a_refused_connection_then_fails_as_connection(
    monkeypatch, secret_key
):
    server = Answering(lambda handler: (200, {}, {}))
    server.close()  # nothing listens there now
    slept = sleeps_recorded(monkeypatch)
    with pytest.raises(JudgeFailure) as failed:
        chat(openai_client(server.url, 10.0, 2, "a test", 64), model="m", messages=MESSAGES)
    assert failed.value.kind == "connection" and len(slept) == 2


def test_check_reachable_asks_once_whatever_the_retries(monkeypatch, secret_key):
    """The start-up check is not retried: a models list answered 500 is asked for once, and then the
    client's own requests are retried again."""
    server = Answering(lambda handler: (500, {"error": "down"}, {}))
    slept = sleeps_recorded(monkeypatch)
    try:
        client = openai_client(server.url, 10.0, 3, "a test", 64)
        assert openai_api.check_reachable(client, server.url, 10.0, "judge") is None
        assert server.seen == ["GET"] and slept == []
        with pytest.raises(JudgeFailure):
            chat(client, model="m", messages=MESSAGES)
    finally:
        server.close()
    assert server.seen == ["GET"] + ["POST"] * 4


def test_BoundedClient_send_follows_no_redirect_even_when_the_caller_asks_it_to():
    """A server answering 307 towards a second server: send(follow_redirects=True) returns the 307,
    and the second server gets no request."""
    target = Answering(lambda handler: (200, {"followed": True}, {}))
    source = Answering(lambda handler: (307, b"", {"Location": target.url + "/chat/completions"}))
    try:
        with judge_http.BoundedClient(1 << 20, 2, RETRY_WAIT_MAX) as client:
            request = client.build_request("POST", source.url + "/chat/completions", json={})
            response = client.send(request, follow_redirects=True)
    finally:
        source.close()
        target.close()
    assert response.status_code == 307 and response.headers["Location"].startswith(target.url)
    assert source.seen == ["POST"] and target.seen == []


@pytest.mark.parametrize(
    "text",
    [
        "bad request; you sent Authorization: Basic dXNlcjpwYXNz",
        '{"headers": {"Authorization": "Basic dXNlcjpwYXNz", "accept": "*/*"}}',
        "bad request; you sent Authorization: Bearer sk-live-0a1b2c3d4e5f",
        '{"headers": {"Authorization": "Bearer sk-live-0a1b2c3d4e5f"}}',
    ],
    ids=["basic header", "basic json", "bearer header", "bearer json"],
)
def test_scrub_takes_basic_and_bearer_credentials_out_of_headers_and_echoed_json(monkeypatch, text):
    """Whatever the key in the environment (none here), an Authorization value a server echoes,
    Basic or Bearer, as a header line or in JSON, is gone from what is shown; its scheme is kept."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    shown = scrub(text)
    assert "dXNlcjpwYXNz" not in shown and "sk-live" not in shown and "0a1b2c3d4e5f" not in shown
    assert ("Basic ***" if "Basic" in text else "Bearer ***") in shown
