"""Rollout generation: our `rlhf_core.generation.decode` against plain transformers `generate`.

The workload: the GRPO benchmark's model (`tiny-qwen3-gpt2`: a Qwen3 built from config, hidden 64,
2 layers, the real GPT-2 tokenizer, vocab 50,257), fp32, CPU, `threads` torch threads; 8
reasoning-gym spell_backward prompts rendered with the chat template, each repeated 8 times (64
rows, left-padded), `max_new_tokens` new tokens, KV cache in both.

  greedy   temperature 0: the tokens must be identical (checked, every row, every token)
  sampled  temperature 1 (no top-k/top-p): `generate` draws with `torch.multinomial`, `decode`
           inverts the CDF with one uniform per row; the draws differ (other random numbers),
           the distribution is the same (tested in tests/rlhf_core/test_generation.py)

Each arm runs `repeats` times, alternating (ours, generate, ours, ...), in one process after one
untimed warm-up call each; we report medians and the ratio of generate's median time to ours
(> 1: ours is faster). Last, greedy `generate(use_cache=False)`: what the KV cache buys.

    uv run --group bench python -m benchmarks.generation [--repeats 5] [--max-new-tokens 32]
writes `benchmarks/results/<time>-generation.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.measure import RESULTS_DIR, machine, median, timestamp

PRESET = "tiny-qwen3-gpt2"


def run(repeats: int, max_new_tokens: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from rlhf_core.chat import render_prompt
    from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.generation import Sampling, decode
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
    ids = enc["input_ids"].repeat_interleave(8, 0)
    mask = enc["attention_mask"].repeat_interleave(8, 0)
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}

    def ours(temperature: float) -> torch.Tensor:
        return decode(model, ids, mask, max_new_tokens=max_new_tokens,
                      sampling=Sampling(temperature=temperature),
                      **special)  # fmt: skip

    def theirs(temperature: float) -> torch.Tensor:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, use_cache=True,
            **(sampling if temperature > 0 else {"do_sample": False}), **special,
        )  # fmt: skip

    def no_cache() -> torch.Tensor:  # what the KV cache buys: every step re-reads the prefix
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, use_cache=False,
            do_sample=False, **special,
        )  # fmt: skip

    out: dict[str, Any] = {"rows": ids.shape[0], "prompt_tokens": ids.shape[1]}
    with torch.no_grad():
        for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            torch.manual_seed(0)
            a, b = ours(temperature), theirs(temperature)  # warm-up (and the greedy check)
            if label == "greedy":
                n = min(a.shape[1], b.shape[1])
                out["greedy_identical"] = bool(
                    torch.equal(a[:, :n], b[:, :n]) and (b[:, n:] == special["pad_token_id"]).all()
                )
            times: dict[str, list[float]] = {"ours": [], "generate": []}
            new_tokens: dict[str, list[int]] = {"ours": [], "generate": []}
            for _ in range(repeats):
                for arm, fn in (("ours", ours), ("generate", theirs)):
                    start = time.perf_counter()
                    result = fn(temperature)
                    times[arm].append(time.perf_counter() - start)
                    new_tokens[arm].append(result.shape[1] - ids.shape[1])
            out[label] = {
                "seconds": {k: median(v) for k, v in times.items()},
                "all_seconds": times,
                "new_tokens_per_row": new_tokens,
                "speed_ratio": median(times["generate"]) / median(times["ours"]),
            }
        no_cache_times = []
        for _ in range(max(1, repeats // 2)):
            start = time.perf_counter()
            no_cache()
            no_cache_times.append(time.perf_counter() - start)
        out["greedy_without_kv_cache_s"] = median(no_cache_times)
    return out


def render(result: dict[str, Any]) -> str:
    r = result["generation"]
    lines = [
        "### Generation: `rlhf_core.generation.decode` vs transformers `generate`",
        "",
        f"Model `{PRESET}` (vocab 50,257), {r['rows']} rows (8 prompts x 8), prompt width "
        f"{r['prompt_tokens']} (left-padded), {result['max_new_tokens']} max new tokens, KV cache, "
        f"fp32, CPU, {result['threads']} thread(s); medians of {result['repeats']} alternating "
        f"calls; load average at start {result['machine']['load_average_at_start'][0]}.",
        "",
        "| mode | ours s | generate s | generate / ours |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label in ("greedy", "sampled"):
        s = r[label]
        lines.append(
            f"| {label} | {s['seconds']['ours']:.3f} | {s['seconds']['generate']:.3f} | "
            f"{s['speed_ratio']:.2f}x |"
        )
    lines += [
        "",
        f"What the KV cache buys: greedy `generate(use_cache=False)` takes "
        f"{r['greedy_without_kv_cache_s']:.3f} s, "
        f"{r['greedy_without_kv_cache_s'] / r['greedy']['seconds']['generate']:.2f}x the "
        "cached call.",
        "",
        f"Greedy tokens identical to `generate`: {r['greedy_identical']}. Target >= 0.95x "
        f"generate's speed: {r['greedy']['speed_ratio'] >= 0.95 and r['sampled']['speed_ratio'] >= 0.95}.",  # noqa: E501
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.generation", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    result = {
        "machine": machine(), "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "generation": run(args.repeats, args.max_new_tokens, args.threads),
    }  # fmt: skip
    text = render(result)
    stamp = timestamp()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stamp}-generation.json").write_text(json.dumps(result, indent=1))
    (RESULTS_DIR / f"{stamp}-generation.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
