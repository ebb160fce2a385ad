"""The machinery around stratagem.py's algorithm: what a reader of Algorithm 1 can skip.

Imports walk one way: tools/ -> spyrl.py -> stratagem.py -> games/ -> machinery/ -> judge_prompts.py. Nothing
here imports a module above it; what a module needs from above (how the policy loads, a game's decision spots)
is passed in (lifecycle.Pieces). Inside machinery/ the modules stand in layers, each importing only modules of
the layers below it (CI's .ci/imports.py reads this table and fails on a cycle, an arrow running back up, within a
layer, or a module the table does not place):

  0  flags.py         the Args dataclasses as a command line (field docstrings become --help), the layering of
                      defaults, presets and a resumed config, the flags' choices and bounds
     matches.py       the evaluation's random legal opponent, the statistics of a set of matches; EvalFlags
     coverage.py      the coverage guard's arithmetic: the spots self-play reaches (games/spots.py reads them),
                      their moves' entropy, warnings when a spot empties or an evaluation loses on invalid moves
     modulation.py    step 3's extensions' parts (stratagem.final_a_mod calls them): after the judge budget,
                      --centre-psi's centre, the scores of rubrics that do not enter A_mod; ModulationFlags
     distill.py       --distill: heads on the policy's hidden states that learn the judge; Cohen's kappa, Spearman
     adaptive_beta.py --beta-share: the controller that holds the evolution term's share of A_mod
     judge_http.py    the HTTP under the judge's client: a deadline per attempt, a cap on the reply's size
     truth.py         the judge checked against Kuhn Poker's best reply: the judged means each evaluation
                      carries, the warning where the judge rewards what the game punishes
  1  openai_api.py    talking to an OpenAI-compatible server: client, reachability, failures as named kinds
     opponents.py     --opponents: self-play against the policy, a pool of past policies or the random player
  2  distributed.py   torchrun / FSDP2 data parallelism and the choice of device
     memory.py        will it fit: the memory per device a run takes, --micro-batch-size auto; EngineFlags
  3  runfiles.py      run files: JSONL logs, atomic writes, checkpoints, resume state, the lock, the judge's cache
                      and ledger, checks that outputs can be written
  4  judge.py         the judges (stand-in, OpenAI-compatible), verdict parsing, JudgeRunner; JudgeFlags
     watch.py         watching a run: start and step lines, progress bars, TensorBoard / W&B, alarms, timers
     modelfiles.py    a model folder read as untrusted: config sizes checked, weights whole or refused
     saved_config.py  a run's config.json read back and checked as its flags would be
  5  costs.py         what the judge will cost, known before it is paid: the projection, --dry-run's plan
     lora.py          LoRA through PEFT (--lora-rank): adapters, merged weights for the engine; LoraFlags
     cli.py           a script's entry point: one-line errors, stop signals, the tools run by name
  6  vllm_engine.py   the vLLM generation engine and the weight sync into it
     overlap.py       --async-level 1: the next batch played on a second copy while the learner updates
  7  checks.py        stratagem.py's flags checked before any work (games/ checks the games' own)
     lifecycle.py     a run's life cycle around Algorithm 1's loop: set-up and resume, the step's metrics line
                      and checkpoint, the end of the run; RunFlags
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
