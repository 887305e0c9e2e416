"""What recording the sampler's log-probs costs: `decode(..., with_logprobs=True)` against
`decode(...)`, same tokens.

The workload of `benchmarks.generation` (`tiny-qwen3-gpt2`: hidden 64, 2 layers, the real GPT-2
tokenizer, vocab 50,257, fp32, CPU; 8 spell_backward prompts x 8 rows = 64 rows), where the
per-token sampling step is the largest share of a decode step that any model gives (a big
vocabulary on a tiny network), so the relative overhead is an upper bound. Two samplings:
temperature 1, and temperature 1 with top-p 0.9. The arms alternate (off, on, off, ...) after one
untimed warm-up each; medians of wall and of CPU time (the steadier one on a busy machine; one
torch thread). The tokens of the two arms are checked equal.

    uv run --group bench python -m benchmarks.behaviour_logprobs [--repeats 7] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.measure import median

PRESET = "tiny-qwen3-gpt2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from rlhf_core.chat import render_prompt
    from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.generation import Sampling, decode, row_generators
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
    from rlhf_core.tiny import preset_dir

    cfg = ModelConfig(name_or_path=str(preset_dir(PRESET)), dtype="fp32")
    tokenizer = load_tokenizer(cfg, padding_side="left")
    model = load_policy(cfg).eval()
    entries = reasoning_gym_dataset(ReasoningGymSource(task="spell_backward", size=8, seed=1))
    prompts = [
        render_prompt(tokenizer, [{"role": "user", "content": e["question"]}], where="bench")
        for e in entries
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}

    for sampling in (Sampling(temperature=1.0), Sampling(temperature=1.0, top_p=0.9)):

        def call(with_logprobs: bool, sampling: Sampling = sampling):
            return decode(
                model, enc["input_ids"], enc["attention_mask"], group_size=8,
                max_new_tokens=args.max_new_tokens, sampling=sampling,
                generator=row_generators(range(64), "cpu"), with_logprobs=with_logprobs,
                **special,
            )  # fmt: skip

        tokens = call(False)
        recorded, _ = call(True)
        assert torch.equal(tokens, recorded), "recording the log-probs changed a token"
        wall: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for arm in (False, True):
                t0, c0 = time.perf_counter(), time.process_time()
                call(arm)
                wall[arm].append(time.perf_counter() - t0)
                cpu[arm].append(time.process_time() - c0)
        shape = f"{tokens.shape[0]} rows x {tokens.shape[1] - enc['input_ids'].shape[1]} tokens"
        for name, times in (("wall", wall), ("CPU", cpu)):  # CPU time: steadier on a busy host
            off, on = median(times[False]), median(times[True])
            print(
                f"{sampling}: {shape}, {name} time: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} "
                f"ms, overhead {100 * (on - off) / off:+.2f}% (medians of {args.repeats})"
            )


if __name__ == "__main__":
    main()
