"""DPO step memory at a 152k vocabulary: ours against Liger-Kernel's chunked DPO loss.

At a Qwen-sized vocabulary (151,669 tokens) the LM head's logits dominate a DPO step's memory:
(2B x S x V) floats, 0.6 GB per 1,000 positions in float32. Liger-Kernel's answer is
`LigerFusedLinearDPOLoss` (liger_kernel.chunked_loss), which runs the head and the DPO loss a chunk
of rows at a time; TRL uses it with `use_liger_kernel`. Ours is the fused completion-only head of
`rlhf_core.logprobs` (`linear_token_logprobs`) on packed rows (`rlhf_core.layout`). The arms,
each one fresh process per round, rounds alternating, on the same batches:

  ours        `direct_alignment.reference.pair_logps` on `pack_pairs` batches (as shipped)
  ours_flat   the same on `collate_pairs` batches (2B flat rows): packing's own share
  liger       the decoder on the 2B flat rows (as TRL's concatenated forward), then
              `LigerFusedLinearDPOLoss` (sigmoid, beta, summed log-probs, the reference's hidden
              states and head as `ref_input` / `ref_weight`; `compiled=False`: torch.compile of
              its chunk on CPU is not what is measured here)

Unit of work: one DPO step without the optimizer (the policy's forward and backward, the
reference's forward without gradients, the loss) on `steps` batches of `batch_size` HH pairs; the
first batch is a warm-up. The model is the benchmark's `real` body (hidden 512, 22 layers, GQA
8/4, MLP 1536) with the Qwen2 tokenizer's vocabulary, tied embeddings, fp32, SDPA: 146.9M
parameters, 53% of them the embedding / LM head (151,669 x 512). Reported per arm: the
process's peak RSS (VmHWM) and each step's working memory (the peak above the RSS at the step's
start, after `malloc_trim`), wall seconds per step, and the policy's summed log-probs of every
completion (the arms must agree: Liger returns them beside its loss).

    uv run --group bench python -m benchmarks.liger_memory [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    machine,
    malloc_trim,
    median,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    run_worker,
    spread,
    timestamp,
    write_result_file,
    write_results,
)
from benchmarks.workload import HH_PATH, QWEN2_TOKENIZER_DIR, model_dir

TOKENIZER_DIR = QWEN2_TOKENIZER_DIR
ARMS = ("ours", "ours_flat", "liger")


def worker(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from direct_alignment.data import build_preference_data
    from direct_alignment.losses import LOSSES
    from direct_alignment.reference import pair_logps
    from rlhf_core.data import DataSource
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
    from rlhf_core.preference import collate_pairs, pack_pairs
    from rlhf_core.registry import build_from_spec

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(
        name_or_path=str(model_dir("real", vocab="qwen2")), dtype="fp32", attention="sdpa"
    )
    tokenizer = load_tokenizer(cfg, padding_side="right")
    data = build_preference_data(
        DataSource(path=str(HH_PATH)), tokenizer, fmt="hh", max_length=args.max_length,
        max_prompt_length=args.max_prompt_length, where="benchmark",
        limit=args.batch_size * args.steps + 16,
    )  # fmt: skip
    pairs = data.pairs[: args.batch_size * args.steps]
    batches = [pairs[i : i + args.batch_size] for i in range(0, len(pairs), args.batch_size)]
    policy = load_policy(cfg).train()
    reference = load_policy(cfg).eval().requires_grad_(False)
    pad_id = tokenizer.pad_token_id
    vocab = policy.get_output_embeddings().weight.shape[0]

    if arm == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        liger = LigerFusedLinearDPOLoss(beta=args.beta, compiled=False, use_ref_model=True)

        def step(chunk):
            batch = collate_pairs(chunk, pad_id)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            labels = torch.where(batch["loss_mask"], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
            hidden = policy.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                  use_cache=False).last_hidden_state  # fmt: skip
            with torch.no_grad():
                ref_hidden = reference.model(input_ids=ids, attention_mask=mask,
                                             position_ids=positions, use_cache=False
                                             ).last_hidden_state  # fmt: skip
            out = liger(
                policy.lm_head.weight, hidden[:, :-1].contiguous(), labels,
                ref_input=ref_hidden[:, :-1].contiguous(), ref_weight=reference.lm_head.weight,
            )  # fmt: skip
            loss, (chosen, rejected, *_) = out
            loss.backward()
            return torch.cat([chosen, rejected]).detach().tolist()
    else:
        loss_fn = build_from_spec(LOSSES, {"name": "dpo", "beta": args.beta})
        collate = pack_pairs if arm == "ours" else collate_pairs

        def step(chunk):
            batch = collate(chunk, pad_id)
            chosen, rejected = pair_logps(policy, batch)
            with torch.no_grad():
                ref_c, ref_r = pair_logps(reference, batch)
            loss, _ = loss_fn(chosen, rejected, ref_c, ref_r)
            loss.backward()
            return torch.cat([chosen, rejected]).detach().tolist()

    logps, seconds, working = [], [], []
    for chunk in batches:
        gc.collect()
        malloc_trim()
        start_rss = rss_mb()
        reset_peak_rss()
        start = time.perf_counter()
        logps += step(chunk)
        seconds.append(time.perf_counter() - start)
        working.append(peak_rss_mb() - start_rss)
        policy.zero_grad(set_to_none=True)
    return {
        "arm": arm,
        "vocab": vocab,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "logps": logps,
        "step_s": seconds,
        "working_mb": working,
        "positions_flat": [int(collate_pairs(c, pad_id)["input_ids"].numel()) for c in batches],
        "positions_packed": [int(pack_pairs(c, pad_id)["input_ids"].numel()) for c in batches],
        "tokens": [int(collate_pairs(c, pad_id)["attention_mask"].sum()) for c in batches],
        "peak_rss_mb": _vmhwm_mb(),
    }


def _vmhwm_mb() -> float:
    """The process's lifetime peak RSS (ru_maxrss is not reset by `reset_peak_rss`)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compare(args: argparse.Namespace) -> dict[str, Any]:
    model_dir("real", vocab="qwen2")  # built once, outside the measured processes
    passed = ("batch_size", "steps", "max_length", "max_prompt_length", "beta", "threads")
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in passed]
    runs = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for arm in order:
            out = run_worker("benchmarks.liger_memory", ["--arm", arm, *common],
                             threads=args.threads, timeout=1200)  # fmt: skip
            print(f"  round {r + 1} {arm:9s}: peak {out['peak_rss_mb']:.0f} MiB, step working "
                  f"{median(out['working_mb'][1:]):.0f} MiB, {median(out['step_s'][1:]):.1f} s",
                  flush=True)  # fmt: skip
            runs.append(out)
    arms = {}
    for arm in ARMS:
        mine = [x for x in runs if x["arm"] == arm]
        arms[arm] = {
            "peak_rss_mb": median([x["peak_rss_mb"] for x in mine]),
            "peak_rss_range": spread([x["peak_rss_mb"] for x in mine]),
            "working_mb": median([median(x["working_mb"][1:]) for x in mine]),
            "step_s": median([median(x["step_s"][1:]) for x in mine]),
            "logps": mine[0]["logps"],
        }
    ref = arms["liger"]["logps"]
    for arm in ARMS:
        arms[arm]["max_abs_logp_diff_vs_liger"] = max(
            abs(a - b) for a, b in zip(arms[arm]["logps"], ref, strict=True)
        )
    return {"machine": machine(), "args": vars(args), "runs": runs, "arms": arms}


def markdown(result: dict[str, Any]) -> str:
    a, run0, args = result["arms"], result["runs"][0], result["args"]
    lines = [
        "## DPO step memory at a 152k vocabulary: ours vs Liger's chunked DPO loss",
        "",
        f"Model: the `real` body with the Qwen2 vocabulary ({run0['vocab']:,} rows), "
        f"{run0['parameters'] / 1e6:.1f}M parameters, fp32, SDPA; {args['batch_size']} HH pairs "
        f"per step ({sum(run0['tokens'][1:])} non-pad tokens in the {args['steps'] - 1} measured "
        f"steps; {sum(run0['positions_flat'][1:])} positions as flat rows, "
        f"{sum(run0['positions_packed'][1:])} packed), {args['threads']} threads, "
        f"{args['rounds']} alternating rounds of fresh processes. Unit: one DPO step without "
        "the optimizer (policy forward + backward, reference forward, loss).",
        "",
        "| arm | peak RSS MiB (range) | step working memory MiB | s per step | max abs diff "
        "of summed log-probs vs liger |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for arm in ARMS:
        x = a[arm]
        lines.append(
            f"| {arm} | {x['peak_rss_mb']:.0f} ({x['peak_rss_range']}) | {x['working_mb']:.0f} | "
            f"{x['step_s']:.1f} | {x['max_abs_logp_diff_vs_liger']:.1e} |"
        )
    lines += [
        "",
        f"Ours / Liger: peak RSS {a['ours']['peak_rss_mb'] / a['liger']['peak_rss_mb']:.0%}, "
        f"step working memory {a['ours']['working_mb'] / a['liger']['working_mb']:.0%}; "
        f"load average before each process: "
        f"{', '.join(str(r['load_average_before']) for r in result['runs'])}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.liger_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arm", choices=ARMS, help="(worker) measure one arm")
    parser.add_argument("--result", type=Path, help="(worker) where to write the result")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="batches; the first is a warm-up")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--max-prompt-length", type=int, default=192)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.arm is not None:
        if args.result is None:
            parser.error("--arm needs --result")
        write_result_file(args.result, worker(args.arm, args))
        return
    del args.arm, args.result
    result = compare(args)
    text = markdown(result)
    write_results(f"{timestamp()}-liger_memory", result, text)
    print(text)


if __name__ == "__main__":
    main()
