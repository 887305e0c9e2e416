"""`rlhf-lab`: a front door to the trainers and the quickstart (the primary interface stays
`python -m <package>.train --config ...`).

    rlhf-lab quickstart [--fast]   SFT -> pairs -> RM -> GRPO, RLOO+RM -> DPO -> report (offline)
    rlhf-lab compare [--config configs/quickstart/compare.yaml] [--fast]
                                   every RL algorithm (and DPO losses) from one SFT model
    rlhf-lab pairs --config FILE [--output-dir DIR]
                                   on-policy preference pairs (a verifier or a reward model judges)
    rlhf-lab eval --model DIR --task NAME | --prompts FILE [--reward-model DIR]
                                   held-out exact match, partial credit, ROUGE, RM score, KL
    rlhf-lab sft|rm|dpo|rl --config FILE [--set k=v ...]   the package trainers
    rlhf-lab data CONFIG [--set k=v ...]   a trainer's data before training: rows, drops,
                                   token lengths, what max_length cuts, examples, histogram
    rlhf-lab tiny [--build]        list (and build) the offline tiny-world presets
    rlhf-lab runs [list|show|compare|prune|snapshot|delete]   manage run directories
    rlhf-lab quantize --model DIR --bits 8|4   quantise an RM or policy, report what it cost
    rlhf-lab chat DIR [DIR ...] [--reward-model DIR]   a browser chat with checkpoints
    rlhf-lab chat --replay RUN_DIR [--trajectory ID]   a multi-turn episode from the rollout log
"""

from __future__ import annotations

import argparse
import importlib
import sys

TRAINERS = {
    "sft": "instruction_tuning.train",
    "rm": "reward_models.train",
    "dpo": "direct_alignment.train",
    "rl": "policy_gradients.train",
    "quickstart": "rlhf_lab.quickstart",
    "compare": "rlhf_lab.compare",
    "pairs": "rlhf_lab.onpolicy",
    "eval": "rlhf_lab.evaluate",
}
# tools (not trainers)
TOOLS = {
    "runs": "rlhf_lab.runs",
    "quantize": "rlhf_lab.quantize",
    "chat": "rlhf_lab.chat",
    "data": "rlhf_lab.data_report",
}


def _tiny(args: list[str]) -> int:
    from rlhf_core.tiny import PRESETS, preset_dir

    parser = argparse.ArgumentParser(prog="rlhf-lab tiny", description="tiny-world presets")
    parser.add_argument("--build", action="store_true", help="build every preset into the cache")
    opts = parser.parse_args(args)
    for name, preset in PRESETS.items():
        where = f" -> {preset_dir(name)}" if opts.build else ""
        print(f"{name:18s} tokenizer={preset.tokenizer:6s} hidden={preset.hidden_size}{where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The console script: user errors become one line and exit code 2 (see rlhf_core.errors)."""
    from rlhf_core.errors import run_main

    return run_main(_dispatch, argv)


def _dispatch(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = sorted([*TRAINERS, *TOOLS, "tiny"])
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: rlhf-lab {{{','.join(commands)}}} [options]\n\n{__doc__}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "tiny":
        return _tiny(rest)
    if command in TOOLS:  # main's run_main reports their errors (and keeps --debug)
        return importlib.import_module(TOOLS[command]).main(rest)
    if command not in TRAINERS:
        from rlhf_core.errors import UserError

        raise UserError(f"rlhf-lab: unknown command {command!r}; choose from {', '.join(commands)}")
    return importlib.import_module(TRAINERS[command]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
