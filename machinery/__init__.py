"""The machinery around stratagem.py's algorithm: what a reader of Algorithm 1 can skip.

    lifecycle.py     a run's life cycle around Algorithm 1's loop: set-up and resume, the step's metrics line and
                     checkpoint, the end of the run (train() in stratagem.py and spyrl.py calls each in one line)
    judge.py         the judge's machinery: the stand-in and OpenAI-compatible judges, verdict parsing, and
                     JudgeRunner (cache, budget, money ledger, concurrency)
    flags.py         the Args dataclass as a command line (field docstrings become --help text), the layering of
                     defaults, presets and a resumed run's config, a resumed folder's checks; stratagem.py's
                     choices, bounds and checks of its flags (validate)
    modulation.py    step 3's extensions, each one call in train() after modulate(): after the judge budget,
                     --centre-psi, the scores of rubrics that do not enter A_mod (logged, --judge-shadow)
    distributed.py   torchrun / FSDP2 data parallelism (even micro-batches, the sharded gradient norm) and the
                     choice of device
    vllm_engine.py   the vLLM generation engine and the weight sync into it
    runfiles.py      run files: JSONL logs and their repair, atomic writes, checkpoints, resume state,
                     the run folder's lock and config history, the judge's verdict cache and money
                     ledger, checks that outputs can be written
    watch.py         watching a run: start and step lines, progress bar, TensorBoard / W&B, alarms, timers
    openai_api.py    talking to an OpenAI-compatible server: client, reachability, failures as named kinds,
                     requests in flight on threads a stop signal does not wait for
    judge_http.py    the HTTP under that client: a deadline per request attempt, a cap on the reply's size
    matches.py       the evaluation's random legal opponent and the statistics of a set of matches
    perfect.py       perfect players for the evaluation: TicTacToe's minimax, Kuhn Poker's exact best response
                     to the policy's play (its exploitability)
    opponents.py     --opponents: self-play's games against the policy itself, a pool of past policies or the
                     random legal player
    coverage.py      the coverage guard: the decision spots self-play reaches, its moves' entropy there, and
                     warnings when a spot empties or an evaluation loses on invalid moves
    costs.py         what the judge will cost, known before it is paid: the price table, the projection, --dry-run
    cli.py           a script's entry point (stratagem.py's and spyrl.py's main): one-line errors, stop signals
    adaptive_beta.py --beta-share: the controller that holds the evolution term's share of A_mod
    distill.py       --distill: heads on the policy's hidden states that learn the judge, their holdout and trust;
                     Cohen's kappa and Spearman's rho (also `agree`'s)

Imports walk one way, tools/ and spyrl.py -> stratagem.py -> machinery/: nothing here imports stratagem.py, and
what a module needs of the trainer (its arguments, a validator) is passed in.
"""

import unicodedata


class UserError(Exception):
    """Something the user can fix (a flag, a path, a server). machinery/cli.main() prints it as one line."""


def visible(text: str, lines: bool = True) -> str:
    """`text` with its control and format characters written as escapes (ESC as \\x1b, a bidi override as
    \\u202e), so that what a file or a policy holds cannot move the cursor, recolour or retitle the terminal;
    newlines and tabs stay where `lines` (a page of `show`), else they are escaped too (an error line)."""
    keep = "\n\t" if lines else ""
    return "".join(
        ch
        if ch in keep or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp")
        else ch.encode("unicode_escape", "backslashreplace").decode()
        for ch in text
    )
