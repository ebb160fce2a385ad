"""`stratagem.py serve-judge`: the heuristic stand-in judge behind a local OpenAI-compatible API,
for offline dry runs of the --judge openai path; or, with --teacher tokens, a synthetic teacher for the
--distill demonstration (docs/distill.md). Neither is the paper's judge."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import json
import math
import random
import re
import socket
import sys
import tempfile
import threading
import time

import torch

import judge_prompts
from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.judge import PROBE_TEXT, HeuristicJudge, probe_verdict
from machinery.watch import quiet_transformers
from stratagem import (
    TINY_DEFAULTS,
    Args,
    HFPolicy,
    build_random_model,
    format_prompt,
    load_policy,
    make_env,
)


class TokenTeacher:
    """--teacher tokens: a synthetic judge whose verdict is a known function of the text, for the --distill
    demonstration on a CPU. It grades no reasoning. Per dimension alpha, sigma, rho a number
    z = (the response's mean token score, standardised) + 2 * (the game's offset), cut into levels 0, 0.5, 1 at
    its tertiles over 96 responses of the untrained tiny policy to the training games' openings (a third each at
    the start). Token scores: the tiny model of `seed` (what `--tiny --seed SEED` trains) lends its tokenizer and
    embedding table, each token's embedding projected on a seeded direction. Offsets: OFFSETS, each dimension a
    different order of
    SPIRAL's three games (0 for other games). Turns combine as the rubric says (the typical turn); the evolution rubric
    is the heuristic's. Why the offsets: a rule on the response's tokens alone reaches kappa <= 0.45 even with
    1,000 examples, because decoding and re-tokenising loses the sampled segmentation and a random 64-wide model
    keeps little else; the game is plain in the hidden states (docs/distill.md)."""

    OFFSETS = {
        "TicTacToe-v0": (1, 1, 0),
        "KuhnPoker-v1": (0, -1, 1),
        "SimpleNegotiation-v1": (-1, 0, -1),
    }  # phi differs too
    _HEAD = re.compile(r"Game: (.+?)\. The player is Player")

    def __init__(self, seed: int):
        with tempfile.TemporaryDirectory() as folder:
            build_random_model(folder, seed)
            model, self.tokenizer = load_policy(folder, torch.device("cpu"))
        self.lock = (
            threading.Lock()
        )  # the server answers in threads; a fast tokenizer is not to be shared by them
        self.table = model.get_input_embeddings().weight.detach() @ torch.randn(
            model.config.hidden_size, 3, generator=torch.Generator().manual_seed(seed)
        )  # [V, 3]
        args = dataclasses.replace(Args(), **TINY_DEFAULTS)
        state = random.getstate()  # make_env reseeds the global `random`; leave it as it was
        games = [g for g in args.games.split(",") for _ in range(32)]
        prompts = [
            format_prompt(self.tokenizer, make_env(g, k, 0).get_observation()[1], 0)
            for k, g in enumerate(games)
        ]
        random.setstate(state)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            texts = [
                text
                for _, _, text in HFPolicy(
                    model, self.tokenizer, args, torch.device("cpu")
                ).generate(prompts)
            ]
        means = torch.tensor([self.mean_scores(t) for t in texts])  # [96, 3]
        self.mean, self.std = means.mean(0), means.std(0)  # [3] each
        z = torch.tensor([self.z(t, g) for t, g in zip(texts, games)])  # [96, 3]
        self.cuts = torch.quantile(z, torch.tensor([1 / 3, 2 / 3]), dim=0).T.tolist()  # [3, 2]

    def mean_scores(self, response: str) -> list[float]:
        with self.lock:
            ids = self.tokenizer(response, add_special_tokens=False).input_ids
        return self.table[ids].mean(0).tolist() if ids else [0.0, 0.0, 0.0]

    def z(self, response: str, game: str) -> list[float]:
        standard = (torch.tensor(self.mean_scores(response)) - self.mean) / self.std
        return (standard + 2 * torch.tensor(self.OFFSETS.get(game, (0, 0, 0)))).tolist()

    def scores(self, rubric: str, trajectory_text: str) -> dict[str, float]:
        if rubric != "transferability":
            return HeuristicJudge().scores(rubric, trajectory_text)
        head = self._HEAD.match(trajectory_text)
        game = head.group(1) if head else ""  # no game named: no game's offset
        turns = [self.z(t["response"], game) for t in judge_prompts.read_turns(trajectory_text)]
        keys = judge_prompts.keys(
            rubric
        )  # the first three are taught; any other gets the middle level
        levels = {
            k: judge_prompts.typical_level(
                [0.0 if z[dim] < low else 0.5 if z[dim] < high else 1.0 for z in turns]
            )
            for dim, (k, (low, high)) in enumerate(zip(keys, self.cuts))
        }
        return {k: levels.get(k, 0.5) for k in keys}


# The largest request body read, in bytes. A trainer's biggest request (a 50-turn game of 4096-token
# responses, ~1 MB rendered, its non-ASCII characters escaped in JSON) fits several times over; a
# longer Content-Length is answered 413 before a byte of the body is read, so that no client can
# make the server hold a body of its choosing in memory.
MAX_BODY = 8 << 20


class JudgeHTTPServer(http.server.ThreadingHTTPServer):
    """A threading server no client can hold: at most `threads` connections are served at once (more
    wait in the backlog for a free thread), no read or write waits more than `read_seconds` for the
    peer, and a connection whose handler started its clock (`start_clock`) must deliver its request
    within `read_seconds`, or is cut: an idle or trickling client cannot keep a thread."""

    request_queue_size = (
        256  # the default backlog of 5 drops bursts of concurrent judge connections
    )
    threads = 64  # --judge-concurrency's default: a run's burst is served at once (docs/speed.md)
    # A trainer sends its request in milliseconds; MAX_BODY takes 30 s at 2 Mbit/s.
    read_seconds = 30.0

    def __init__(self, address, handler):
        self.slots = threading.BoundedSemaphore(self.threads)
        self.deadlines: dict[socket.socket, float] = {}
        self.closed = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._cut_late_requests, daemon=True).start()

    def get_request(self):
        conn, address = super().get_request()
        conn.settimeout(self.read_seconds)
        return conn, address

    def process_request(self, request, client_address):
        self.slots.acquire()  # beyond `threads`, the next connection waits for a thread to end
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.stop_clock(request)
            self.slots.release()

    def start_clock(self, conn: socket.socket) -> None:
        self.deadlines[conn] = time.monotonic() + self.read_seconds

    def stop_clock(self, conn: socket.socket) -> None:
        self.deadlines.pop(conn, None)

    def _cut_late_requests(self) -> None:
        """Shuts every connection still reading its request past its deadline: its handler reads
        the end of the input."""
        while not self.closed.wait(min(1.0, self.read_seconds / 4)):
            now = time.monotonic()
            for conn, until in list(self.deadlines.items()):
                if until < now:
                    self.stop_clock(conn)
                    with contextlib.suppress(OSError):  # closed meanwhile
                        conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):
        """A client that went away, was too slow or was cut is no error of the server's: nothing on
        stderr."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def server_close(self):
        self.closed.set()
        super().server_close()


def make_judge_server(
    host: str,
    port: int,
    noise: float,
    seed: int,
    delay: float = 0.0,
    judge: HeuristicJudge | TokenTeacher | None = None,
) -> JudgeHTTPServer:
    """`judge` (default: the heuristic stand-in) behind an OpenAI-compatible API (GET /v1/models,
    POST /v1/chat/completions; any other path is a 404, as on a real server), answering whatever model is named
    and the trainer's start-up probe (machinery/judge.py) as a real judge would.
    With `noise`, each level is replaced by a random one with that probability (seeded by the request),
    so it can play a second, disagreeing judge; `delay` seconds before each answer imitate a slow
    model. Usage counts ~4 characters per token. A body longer than MAX_BODY is answered 413
    unread, and the request must arrive within JudgeHTTPServer.read_seconds."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _no_route(self) -> bool:
            """A path the API does not have gets a 404, as from a real server (a base URL without /v1, say)."""
            if self.path.split("?")[0] in ("/v1/models", "/v1/chat/completions"):
                return False
            self._send(
                404, {"error": {"message": f"no route {self.command} {self.path}", "code": 404}}
            )
            return True

        def setup(self):
            super().setup()
            self.server.start_clock(self.connection)  # the request must arrive within read_seconds

        def do_GET(self):
            self.server.stop_clock(self.connection)
            if self._no_route():
                return
            self._send(
                200,
                {
                    "object": "list",
                    "data": [{"id": "heuristic", "object": "model", "owned_by": "stratagem"}],
                },
            )

        def _body(self) -> bytes | None:
            """The request's body, read once its Content-Length is known to be at most MAX_BODY;
            None, with the refusal sent (400: no number; 413: too long, left unread), for others."""
            length = self.headers.get("Content-Length", "0")
            if not length.isascii() or not length.isdigit():
                self._send(400, {"error": {"message": "Content-Length is not a number of bytes"}})
                return None
            digits = length.lstrip("0") or "0"  # its length first: int() of 5,000 digits raises
            if len(digits) > len(str(MAX_BODY)) or int(digits) > MAX_BODY:
                self._send(413, {"error": {"message": f"the body is longer than {MAX_BODY} bytes"}})
                return None
            body = self.rfile.read(int(digits))
            self.server.stop_clock(self.connection)
            return body

        def _chat_request(self, raw: bytes) -> tuple[dict, str] | None:
            """The request's JSON body and its last message's text; None for anything else (not
            JSON, not a chat request), which is answered 400."""
            try:
                body = json.loads(raw or b"{}")
                content = body["messages"][-1]["content"]
            except (ValueError, RecursionError, KeyError, IndexError, TypeError):
                return None
            return (body, content) if isinstance(content, str) else None

        def do_POST(self):
            if self._no_route():
                return
            raw = self._body()
            if raw is None:
                return
            request = self._chat_request(raw)
            body, content = request or ({}, "")
            if content.startswith(
                PROBE_TEXT
            ):  # the trainer's start-up check: it asks for a verdict, and gets it
                return self._answer(body, json.dumps(probe_verdict()))
            rubric = next(
                (r for r in judge_prompts.RUBRICS if judge_prompts.rubric_text(r) in content), None
            )
            if rubric is None or judge_prompts.TRAJECTORY_OPEN not in content:
                return self._send(
                    400,
                    {
                        "error": {
                            "message": "not a stratagem rubric request"
                            if request
                            else "not a JSON chat completion request"
                        }
                    },
                )
            text = judge_prompts.trajectory_in(content)
            if not judge_prompts.read_turns(text):  # a trainer never asks of a game without a turn
                return self._send(400, {"error": {"message": "the trajectory has no turns"}})
            scores = (judge or HeuristicJudge()).scores(rubric, text)
            draw = random.Random(hashlib.sha256(f"{seed}:{content}".encode()).digest())
            levels = judge_prompts.RUBRICS[rubric]["levels"]
            scores = {
                k: (draw.choice(levels) if draw.random() < noise else v) for k, v in scores.items()
            }
            self._answer(body, json.dumps(scores))

        def _answer(self, body: dict, reply: str) -> None:
            time.sleep(delay)
            prompt_tokens = (
                sum(len(str(m.get("content", ""))) for m in body["messages"] if isinstance(m, dict))
                // 4
            )
            self._send(
                200,
                {
                    "id": "heuristic",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": reply},
                        }
                    ],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": len(reply) // 4,
                        "total_tokens": prompt_tokens + len(reply) // 4,
                    },
                },
            )

    return JudgeHTTPServer((host, port), Handler)


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py serve-judge",
        description=(
            "Serve the heuristic stand-in judge as an OpenAI-compatible endpoint, for offline dry runs of the "
            "--judge openai path (cost, cache, agreement); or a synthetic teacher for --distill. "
            "Neither is the paper's judge."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port (default: 8001)")
    p.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="probability of replacing each level by a random one",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the noise (default: 0)")
    p.add_argument(
        "--delay", type=float, default=0.0, help="seconds to wait before each answer (default: 0)"
    )
    p.add_argument(
        "--teacher",
        choices=("heuristic", "tokens"),
        default="heuristic",
        help="heuristic: the stand-in "
        "judge (default); tokens: the synthetic teacher of the --distill demonstration (docs/distill.md)",
    )
    p.add_argument(
        "--teacher-seed",
        type=int,
        default=1,
        help="tokens: the --seed of the --tiny run it teaches (default: 1)",
    )
    ns = p.parse_args(argv)
    if not (0 <= ns.noise <= 1 and 0 <= ns.delay < math.inf):
        raise UserError("--noise must be in [0, 1] and --delay >= 0")
    if not 0 <= ns.port <= 65535:
        raise UserError(f"--port must be in [0, 65535] (0: any free port), got {ns.port}")
    quiet_transformers()  # --teacher tokens loads a model: no progress bars before the ready line
    try:
        server = make_judge_server(
            ns.host,
            ns.port,
            ns.noise,
            ns.seed,
            ns.delay,
            TokenTeacher(ns.teacher_seed) if ns.teacher == "tokens" else None,
        )
    except OSError as e:
        raise UserError(f"cannot listen on {ns.host}:{ns.port}: {e.strerror}") from None
    try:  # the line inside: a Ctrl-C right after it is a stop too, not a traceback
        print(
            f"{ns.teacher} judge on http://{ns.host}:{server.server_address[1]}/v1 (Ctrl-C to stop)",
            flush=True,
        )
        server.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the normal way to stop a server
        print("serve-judge: stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
