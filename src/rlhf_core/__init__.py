"""rlhf_core: the plumbing two or more chapter packages share, and nothing else.

Configs and registries (`config`, `registry`, `errors`), models and tokenizers (`models`, `tiny`,
`scalar_head`, `chat`), data sources and text encoding (`data`), batch layouts and log-probs
(`layout`, `prefix`, `sequences`, `logprobs`, `kl`), generation and scoring (`generation`,
`scoring`), the speed plan and the CPU attention it picks (`fastpath`, `attention`, `lean`), and
the loop's shared steps (`loop`, `optim`, `checkpoint`, `tracking`, `runtime`). The four packages import it and never each other;
docs/where_things_live.md maps each concern to its module.

It has no entry point of its own; `uv run rlhf-lab tiny --build` builds the offline tiny world.
"""
