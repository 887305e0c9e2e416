"""Where a GRPO step's time goes, and what each of its techniques buys, one part at a time.

`benchmarks.grpo` times whole steps against TRL; this times the two big parts of our step on the
same workload (the benchmark model, reasoning-gym spell_backward prompts rendered with the chat
template, `prompts_per_step` prompts x `group_size` samples, `max_new_tokens` tokens), each with
and without its technique, alternating the variants in one process:

    generate  repeated   `decode` of the N x G repeated prompts (every row prefills its prompt)
              shared     `decode(group_size=G)`: each prompt prefilled once, its KV cache shared
                         (the same tokens: tested in tests/rlhf_core/test_generation.py)
    train     flat       the loss forward + backward on [prompt | completion] rows (the LM head
                         on completion positions only, `causal_lm_selected_logprobs`)
              shared     the same through `shared_prompt_logprobs`: each prompt encoded once
                         for its group (the same log-probs and gradients: tests/rlhf_core/
                         test_logprobs.py)

Reported: median seconds per call and the peak RSS during the calls of each variant (the
high-water mark restarted before each call; it includes the resident model). For the two training
variants also where the time goes: the FLOPs of the call (`benchmarks.flops`: matmuls of the
decoder's linear layers over every position the variant computes, padding included, the LM head
over completion tokens, attention scores and values; forward + backward, the fused head's
recomputation of its logits included; before this count moved to `benchmarks.flops` it took
3 x the forward for all of it, ~9% less for the GRPO workload), the process CPU-seconds of the
call (all threads; robust to other work on the machine, unlike wall time), and the share of this
machine's matmul rate those FLOPs reach (GFLOP per CPU-second of one fp32 matmul of the same
width, measured in the same process). A variant near 100% is compute-bound: only fewer FLOPs
make it faster.

    uv run --group bench python -m benchmarks.grpo_parts --model real --threads 2 --repeats 2

`--dtype bf16` loads the model in bf16 (the matmul rate is then bf16's), `--micro-batch 32` runs the
training variants in micro-batches of 32 rows as the trainer does (gradients accumulated), and
`--profile` adds one profiled call of each shipped variant: its CPU time by operator.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.flops import Shapes
from benchmarks.measure import (
    median,
    peak_rss_mb,
    reset_peak_rss,
    timestamp,
    write_results,
)
from benchmarks.workload import MODEL_CHOICES, model_dir

PROFILE_ROWS = 12  # operators listed per profiled part


def measure(model_name: str, prompts_per_step: int, group_size: int, max_new_tokens: int,
            threads: int, repeats: int, dtype: str = "fp32", micro_batch: int = 0,
            profile: bool = False) -> dict[str, Any]:  # fmt: skip
    import os
    import resource

    import torch

    from rlhf_core.chat import render_prompt
    from rlhf_core.data import ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.generation import Sampling, decode, row_generators
    from rlhf_core.logprobs import causal_lm_selected_logprobs
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
    from rlhf_core.prefix import shared_prompt_logprobs

    torch.set_num_threads(threads)
    cfg = ModelConfig(name_or_path=str(model_dir(model_name)), dtype=dtype)
    tok = load_tokenizer(cfg, padding_side="left")
    torch.manual_seed(0)
    model = load_policy(cfg)
    entries = list(reasoning_gym_dataset(ReasoningGymSource(task="spell_backward", size=512,
                                                            seed=1)))  # fmt: skip
    prompts = [
        render_prompt(tok, [{"role": "user", "content": e["question"]}], where="bench")
        for e in entries[:prompts_per_step]
    ]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    g = group_size
    seeds = list(range(prompts_per_step * g))
    args = {"max_new_tokens": max_new_tokens, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "sampling": Sampling(temperature=1.0)}  # fmt: skip
    model.eval()

    def gen_repeated():
        ids, mask = (x.repeat_interleave(g, 0) for x in (enc["input_ids"], enc["attention_mask"]))
        return decode(model, ids, mask, generator=row_generators(seeds, "cpu"), **args)

    def gen_shared():
        return decode(model, enc["input_ids"], enc["attention_mask"], group_size=g,
                      generator=row_generators(seeds, "cpu"), **args)  # fmt: skip

    with torch.no_grad():
        out = gen_shared()
    p = enc["input_ids"].shape[1]
    completion = out[:, p:]
    is_eos = completion == tok.eos_token_id
    c_mask = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
    c_ids = completion.masked_fill(c_mask == 0, tok.pad_token_id)
    p_ids, p_mask = (x.repeat_interleave(g, 0) for x in (enc["input_ids"], enc["attention_mask"]))
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    target = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    target[:, p - 1 :] = c_mask.bool()

    rows = ids.shape[0]
    slices = [slice(s, s + (micro_batch or rows)) for s in range(0, rows, micro_batch or rows)]

    def train_flat():  # gradients accumulated over the micro-batches, as in the trainer
        model.zero_grad(set_to_none=True)
        for s in slices:
            lp, h = causal_lm_selected_logprobs(model, ids[s], mask[s], target[s],
                                                with_entropy=True)  # fmt: skip
            (lp.sum() + 0.01 * h.sum()).backward()

    def train_shared():
        model.zero_grad(set_to_none=True)
        for s in slices:
            lp, h = shared_prompt_logprobs(model, p_ids[s], p_mask[s], c_ids[s], c_mask[s],
                                           with_entropy=True)  # fmt: skip
            (lp.sum() + 0.01 * h.sum()).backward()

    flops = {
        "flat": train_flops(model, rows=ids.shape[0], queries=ids.shape[1],
                            keys=ids.shape[1], head_tokens=int(c_mask.sum())),
        "shared": train_flops(model, rows=len({tuple(r) for r in enc["input_ids"].tolist()}),
                              queries=p, keys=p, head_tokens=int(c_mask.sum()))
        + train_flops(model, rows=c_ids.shape[0], queries=c_ids.shape[1],
                      keys=p + c_ids.shape[1], head_tokens=0),
    }  # fmt: skip
    matmul_rate = matmul_gflop_per_cpu_s(model.config.hidden_size, dtype=model.dtype)
    variants = {
        ("generate", "repeated"): gen_repeated, ("generate", "shared"): gen_shared,
        ("train", "flat"): train_flat, ("train", "shared"): train_shared,
    }  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
    cpu: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
    sys_s: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
    faults: dict[tuple[str, str], list[int]] = {k: [] for k in variants}
    peaks: dict[tuple[str, str], float] = dict.fromkeys(variants, 0.0)
    for r in range(repeats):
        for part in ("generate", "train"):
            names = ("repeated", "shared") if part == "generate" else ("flat", "shared")
            for name in names if r % 2 == 0 else names[::-1]:
                fn = variants[(part, name)]
                model.train(part == "train")
                reset_peak_rss()
                start, start_cpu = time.perf_counter(), time.process_time()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                if part == "generate":
                    with torch.no_grad():
                        fn()
                else:
                    fn()
                times[(part, name)].append(time.perf_counter() - start)
                cpu[(part, name)].append(time.process_time() - start_cpu)
                after = resource.getrusage(resource.RUSAGE_SELF)
                sys_s[(part, name)].append(after.ru_stime - usage.ru_stime)
                faults[(part, name)].append(after.ru_minflt - usage.ru_minflt)
                peaks[(part, name)] = max(peaks[(part, name)], peak_rss_mb())
                print(f"  {part:8s} {name:8s} {times[(part, name)][-1]:.2f} s", flush=True)
    profiles = {}
    if profile:  # where the shipped variants' CPU time goes, by operator
        for part, fn in (("generate", gen_shared), ("train", train_shared)):
            model.train(part == "train")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                if part == "generate":
                    with torch.no_grad():
                        fn()
                else:
                    fn()
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in ops)
            profiles[part] = [
                {"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count,
                 "share": e.self_cpu_time_total / total}
                for e in ops[:PROFILE_ROWS]
            ]  # fmt: skip
    return {
        "dtype": dtype, "micro_batch": micro_batch or rows, "profiles": profiles,
        "model": model_name, "prompts_per_step": prompts_per_step, "group_size": g,
        "max_new_tokens": max_new_tokens, "threads": threads, "repeats": repeats,
        "prompt_tokens_nonpad": int(enc["attention_mask"].sum()), "prompt_width": p,
        "completion_tokens": int(c_mask.sum()), "load_average": os.getloadavg(),
        "matmul_gflop_per_cpu_s": matmul_rate,
        "parts": [
            {"part": k[0], "variant": k[1], "s_median": median(v), "s": v,
             "cpu_s_median": median(cpu[k]), "peak_rss_mb": peaks[k],
             "sys_s_median": median(sys_s[k]), "minor_faults_median": median(faults[k]),
             **({"gflop": flops[k[1]] / 1e9} if k[0] == "train" else {})}
            for k, v in times.items()
        ],
    }  # fmt: skip


def train_flops(model: Any, *, rows: int, queries: int, keys: int, head_tokens: int) -> float:
    """Forward + backward FLOPs of `rows` rows of `queries` positions attending to `keys`
    positions each, the LM head on `head_tokens` (`benchmarks.flops.Shapes.train_gflop`: the
    fused head recomputes its logits, attention's backward recomputes the scores)."""
    shapes = Shapes.of(model.config)
    return 1e9 * shapes.train_gflop(rows * queries, head_tokens, rows * queries * keys)


def matmul_gflop_per_cpu_s(
    hidden: int, positions: int = 2048, repeats: int = 5, dtype: Any = None
) -> float:
    """This machine's matmul rate per CPU-second (all threads) at the model's width, in `dtype`
    (default fp32): the best of `repeats` products (positions x hidden) @ (hidden x 3 hidden)."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(positions, hidden, dtype=dtype)
    b = torch.randn(hidden, 3 * hidden, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(10):
            a @ b
        best = min(best, (time.process_time() - start) / 10)
    return 2 * positions * hidden * 3 * hidden / best / 1e9


def markdown(result: dict[str, Any]) -> str:
    r = result
    lines = [
        f"### GRPO step parts: model `{r['model']}`, {r['prompts_per_step']} prompts x "
        f"{r['group_size']} samples x {r['max_new_tokens']} tokens, {r['threads']} threads, "
        f"{r.get('dtype', 'fp32')}, training in micro-batches of "
        f"{r.get('micro_batch', 'all')} rows",
        "",
        f"Prompts: {r['prompt_tokens_nonpad']} non-pad tokens for {r['prompts_per_step']} "
        f"prompts (width {r['prompt_width']}); {r['completion_tokens']} completion tokens; "
        f"load average {', '.join(f'{x:.1f}' for x in r['load_average'])}.",
        "",
        "| part | variant | s (median) | CPU-s (median) | of which system | minor page faults "
        "| peak RSS MiB | GFLOP | GFLOP per CPU-s | of the matmul rate |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(p["part"], p["variant"]): p for p in r["parts"]}
    rate = r["matmul_gflop_per_cpu_s"]
    for p in r["parts"]:
        cells = ["", "", ""]
        if "gflop" in p:
            achieved = p["gflop"] / p["cpu_s_median"]
            cells = [f"{p['gflop']:.0f}", f"{achieved:.1f}", f"{achieved / rate:.0%}"]
        lines.append(f"| {p['part']} | {p['variant']} | {p['s_median']:.2f} | "
                     f"{p['cpu_s_median']:.2f} | {p.get('sys_s_median', float('nan')):.2f} | "
                     f"{p.get('minor_faults_median', float('nan')):,.0f} | "
                     f"{p['peak_rss_mb']:.0f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    dtype = r.get("dtype", "fp32")
    lines += ["", f"One {dtype} matmul at the model's width: {rate:.1f} GFLOP per CPU-second."]
    gen = by[("generate", "repeated")]["s_median"] / by[("generate", "shared")]["s_median"]
    train = by[("train", "flat")]["s_median"] / by[("train", "shared")]["s_median"]
    lines += ["", f"Shared prompt KV in generation: {gen:.2f}x; shared prompt in the training "
              f"forward/backward: {train:.2f}x.", ""]  # fmt: skip
    for part, ops in r.get("profiles", {}).items():
        lines += [
            f"Where `{part} shared` spends its CPU time (`torch.profiler`, one call, self "
            f"CPU time by operator, the top {len(ops)}):",
            "",
            "| operator | self CPU s | calls | share |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [f"| `{o['op']}` | {o['self_cpu_s']:.3f} | {o['calls']} | {o['share']:.1%} |"
                  for o in ops]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grpo_parts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=MODEL_CHOICES, default="real")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="training rows per forward/backward (0: all at once)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one call of each shipped variant by operator",
    )
    a = parser.parse_args(argv)
    result = measure(a.model, a.prompts_per_step, a.group_size, a.max_new_tokens, a.threads,
                     a.repeats, dtype=a.dtype, micro_batch=a.micro_batch,
                     profile=a.profile)  # fmt: skip
    text = markdown(result)
    paths = write_results(f"{timestamp()}-grpo-parts", result, text, latest=False)
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
