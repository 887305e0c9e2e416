"""rlhf_lab: the application layer over the four packages (it may import all of them).

    cli.py               `rlhf-lab`, the front door: quickstart, compare, sft|rm|dpo|rl, tiny
    quickstart.py        SFT -> on-policy pairs -> RM -> GRPO and RLOO+RM -> DPO -> report
    compare.py           every RL algorithm and DPO losses from one SFT model, side by side
    onpolicy.py          on-policy preference pairs sampled from a model and graded
    config_reference.py  generates docs/configuration.md from the config classes

Run: `uv run rlhf-lab quickstart` (or `uv run rlhf-lab --help`).
"""
