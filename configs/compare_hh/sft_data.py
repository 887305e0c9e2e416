"""The SFT rows of the GPT-2 + HH workflow (docs/workflows/gpt2_hh.md): the chosen reply of each
of the first 2,000 vendored Anthropic HH pairs (data/hh-rlhf/harmless-base-test.jsonl.gz, the
workflow's training rows; rows 2,000-2,111 are the reward model's held-out pairs and the last 200
the held-out prompts), as {"prompt": [messages], "completion": reply}: the SFT trainer reads
prompt/completion rows and messages, not HH transcripts. Pairs whose chosen reply is empty are
skipped and counted.

    uv run python configs/compare_hh/sft_data.py   # writes outputs/compare_hh/data/sft.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlhf_core.chat import split_hh_pair
from rlhf_core.data import DataSource, load_rows

SOURCE = DataSource(path="data/hh-rlhf/harmless-base-test.jsonl.gz", limit=2000)
OUT = Path("outputs/compare_hh/data/sft.jsonl")


def main() -> int:
    rows, empty = [], 0
    for i, row in enumerate(load_rows(SOURCE)):
        where = f"{SOURCE.describe()} row {i}"
        prompt, chosen, _ = split_hh_pair(row["chosen"], row["rejected"], where=where)
        if not chosen.strip():
            empty += 1
            continue
        rows.append({"prompt": prompt, "completion": chosen})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{OUT}: {len(rows)} rows ({empty} pairs with an empty chosen reply skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
