"""rlhf_core: the plumbing two or more chapter packages share, and nothing else.

Configs and registries (`config`, `registry`, `user_modules`, `errors`), models and tokenizers
(`models`, `tiny`, `chat`), reward-model heads (`scalar_head`, `scalar_head_format`,
`scalar_head_scoring`, `sequence_classification`, `lm_likelihood`), data sources, column
mapping and text encoding (`data`, `columns`, `preference`, `wrong_answers`, `encoding`), batch
layouts and log-probs (`layout`, `prefix`, `sequences`, `logprobs`, `kl`), generation and scoring
(`generation`, `scoring`), the speed plan and the CPU attention it picks (`fastpath`,
`attention`, `lean`), and the loop's shared steps (`loop`, `optim`, `checkpoint`,
`disk_space`, `stop_signal`, `tracking`, `runtime`, `rundir`, `output_dir`, and `fault_points`,
the kill-soak's named SIGKILL points). The four packages import it and never each other;
docs/where_things_live.md maps each concern to its module.

It has no entry point of its own; `uv run rlhf-lab tiny --build` builds the offline tiny world.
"""
