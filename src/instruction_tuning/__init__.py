"""instruction_tuning: supervised fine-tuning (SFT) with a completion-only loss.

    config.py    `SFTConfig`, the YAML schema
    data.py      rows -> (prompt, completion) token ids -> packed (pack) or padded (collate) rows
    losses.py    the SFT losses (registry `LOSSES`)
    evaluate.py  held-out completion loss and task accuracy by generation
    train.py     `train(cfg)`, the loop, read top to bottom

Run: `uv run python -m instruction_tuning.train --config configs/instruction_tuning/tiny_sft.yaml`
"""
