"""`stratagem.py random-model`: a randomly initialised Qwen3 of a real shape, saved offline."""

from __future__ import annotations

import os
from pathlib import Path

from machinery import UserError
from machinery.flags import FriendlyParser
from machinery.runfiles import check_writable_dir
from machinery.watch import quiet_transformers
from stratagem import ARCHS, build_random_model


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py random-model",
        description=(
            "Save a randomly initialised Qwen3 (and the in-memory byte-level tokenizer) to DIR, offline."
        ),
    )
    p.add_argument("dir", help="output directory (must not exist)")
    p.add_argument(
        "--arch",
        choices=list(ARCHS),
        default="tiny",
        help="shape (default: tiny; qwen3-4b = Qwen3-4B-Base)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the weights (default: 1)")
    ns = p.parse_args(argv)
    if os.path.exists(ns.dir):
        raise UserError(f"{ns.dir} already exists")
    check_writable_dir(Path(ns.dir), "dir")
    quiet_transformers()
    build_random_model(ns.dir, ns.seed, ns.arch)
    print(f"saved a random {ns.arch} Qwen3 to {ns.dir}")
    return 0
