"""What each technique of our DPO step buys, measured one change at a time on the DPO workload.

The unit of work is the DPO step minus the optimizer: the policy's chosen/rejected log-probs with
gradients, the reference's without, the `dpo` loss from `direct_alignment.losses.LOSSES` and the
backward pass, on the first `BATCHES` batches of the `benchmarks.dpo` workload (same model, pairs,
order and batch size). "shipped" is what our trainer does (`direct_alignment.reference.pair_logps`
= one concatenated forward through `rlhf_core.logprobs.causal_lm_token_logprobs`, batches padded
to their longest row by `collate_pairs`, chunked `token_logprobs`, a frozen reference model).
Each other variant changes exactly one thing:

  two_forwards      chosen and rejected rows in two forwards (each half of the batch cut to its
                    own longest row) instead of one concatenated forward
  fixed_padding     rows padded to max_length instead of the batch's longest row
  full_log_softmax  log_softmax over the full (2B, S-1, V) logits, then gather, instead of the
                    chunked logit[y] - logsumexp
  precomputed_ref   reference log-probs looked up from a cache made once by our
                    `precompute_reference` (its one-off cost is reported), no reference model held
  completion_head   the prototype `benchmarks.prototype.completion_pair_logps` (LM head only on
                    completion positions) for the policy and the reference; not in src/

Plus `fused_adamw`: torch AdamW `fused=True` vs the for-loop AdamW our `build_optimizer` makes on
CPU (it asks for fused only on CUDA), timing `optimizer.step()` alone.

Timing: one process, models loaded once, each variant warmed up once, then `rounds` rounds in
which every variant runs once in a rotating order; medians, and ratios as medians of per-round
ratios. Memory: one fresh process per variant, the peak RSS while it runs its batches the first
time (the high-water mark reset just before), both absolute and above the RSS at its start.
Every variant's loss is checked against shipped's before timing.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.dpo import Workload, model_dir
from benchmarks.measure import (
    machine,
    median,
    peak_rss_mb,
    reset_peak_rss,
    rss_mb,
    run_worker,
    write_result_file,
)

BATCHES = 1
VARIANTS = (
    "shipped",
    "two_forwards",
    "fixed_padding",
    "full_log_softmax",
    "precomputed_ref",
    "completion_head",
)
#: (technique, variant with it, variant without it, in src?)
TECHNIQUES = (
    ("concatenated chosen/rejected forward", "shipped", "two_forwards", "yes"),
    ("padding to the batch's longest row", "shipped", "fixed_padding", "yes"),
    ("chunked selective log-softmax", "shipped", "full_log_softmax", "yes"),
    ("precomputed reference log-probs", "precomputed_ref", "shipped", "yes (reference.mode)"),
    ("completion-only LM head (prototype)", "completion_head", "shipped", "no"),
)


# ----------------------------------------------------------------------------- the variants


class Bench:
    """Models, batches and step functions of every variant (built inside a worker process)."""

    def __init__(self, w: Workload, workdir: Path, *, variants: tuple[str, ...]) -> None:
        import torch

        from direct_alignment.data import build_preference_data, collate_pairs
        from direct_alignment.losses import LOSSES
        from rlhf_core.data import DataSource, EpochSampler
        from rlhf_core.models import ModelConfig, load_causal_lm, load_tokenizer
        from rlhf_core.registry import build_from_spec

        torch.set_num_threads(w.threads)
        torch.manual_seed(w.seed)
        self.torch, self.w = torch, w
        cfg = ModelConfig(name_or_path=str(model_dir(w.model)), dtype="fp32", attention="sdpa")
        tokenizer = load_tokenizer(cfg, padding_side="right")
        self.pad_id = tokenizer.pad_token_id
        data = build_preference_data(
            DataSource(path=str(workdir / "hh_subset.jsonl")), tokenizer, fmt="hh",
            max_length=w.max_length, max_prompt_length=w.max_prompt_length, where="benchmark",
        )  # fmt: skip
        order = EpochSampler(len(data.pairs), w.seed).next_batch(len(data.pairs))
        self.pairs = [
            [data.pairs[i] for i in order[b * w.batch_size : (b + 1) * w.batch_size]]
            for b in range(BATCHES)
        ]
        self.batches = [collate_pairs(p, self.pad_id) for p in self.pairs]
        self.tokens = sum(int(b["attention_mask"].sum()) for b in self.batches)
        self.loss_fn = build_from_spec(LOSSES, {"name": "dpo", "beta": w.beta})
        self.policy = load_causal_lm(cfg).train()
        self.reference = None
        self.ref_cache: list[tuple[Any, Any]] | None = None
        self.precompute_s: float | None = None
        if "precomputed_ref" in variants:
            self._precompute(load_causal_lm(cfg), keep=len(variants) > 1)
        elif variants:
            self._load_reference(load_causal_lm(cfg))

    def _load_reference(self, model) -> None:
        from rlhf_core.models import ReferencePolicy

        self.reference = ReferencePolicy(model, "frozen")

    def _precompute(self, model, *, keep: bool) -> None:
        """Our `precompute_reference` over the batches' pairs, timed; the model is kept only if
        other variants need it."""
        from direct_alignment.reference import precompute_reference
        from rlhf_core.models import ReferencePolicy

        reference = ReferencePolicy(model, "frozen")
        start = time.perf_counter()
        self.ref_cache = []
        for pairs in self.pairs:
            cache = precompute_reference(
                reference, pairs, pad_id=self.pad_id, batch_size=self.w.batch_size,
                device=self.torch.device("cpu"),
            )  # fmt: skip
            self.ref_cache.append((cache[:, 0], cache[:, 1]))
        self.precompute_s = time.perf_counter() - start
        if keep:
            self.reference = reference
        else:
            del reference, model
            gc.collect()

    # --- log-prob functions: (model, batch) -> (chosen (B,), rejected (B,))

    @staticmethod
    def shipped_logps(model, batch):
        from direct_alignment.reference import pair_logps

        return pair_logps(model, batch)

    @staticmethod
    def two_forward_logps(model, batch):
        from rlhf_core.logprobs import causal_lm_token_logprobs, masked_sum

        half = batch["input_ids"].shape[0] // 2
        out = []
        for rows in (slice(0, half), slice(half, None)):
            attention = batch["attention_mask"][rows]
            longest = int(attention.sum(-1).max())
            token_logps = causal_lm_token_logprobs(
                model, batch["input_ids"][rows, :longest], attention[:, :longest]
            )
            out.append(masked_sum(token_logps, batch["loss_mask"][rows, : longest - 1], dim=-1))
        return out[0], out[1]

    @staticmethod
    def full_softmax_logps(model, batch):
        import torch

        from rlhf_core.logprobs import masked_sum

        ids, attention = batch["input_ids"], batch["attention_mask"]
        position_ids = (attention.long().cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=position_ids, use_cache=False
        ).logits
        token_logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        token_logps = token_logps.gather(-1, ids[:, 1:, None]).squeeze(-1)
        seq = masked_sum(token_logps, batch["loss_mask"], dim=-1)
        half = seq.shape[0] // 2
        return seq[:half], seq[half:]

    def padded_to_max_length(self, batch):
        import torch.nn.functional as F

        extra = self.w.max_length - batch["input_ids"].shape[1]
        return {
            "input_ids": F.pad(batch["input_ids"], (0, extra), value=self.pad_id),
            "attention_mask": F.pad(batch["attention_mask"], (0, extra)),
            "loss_mask": F.pad(batch["loss_mask"], (0, extra)),
            "lengths": batch["lengths"],
        }

    # --- one variant's unit of work

    def run(self, variant: str) -> list[float]:
        """The DPO step minus the optimizer on every batch; returns the policy's summed
        log-probs (chosen then rejected of each batch), to check the variants agree."""
        from benchmarks.prototype import completion_pair_logps

        logps = {
            "shipped": self.shipped_logps, "two_forwards": self.two_forward_logps,
            "fixed_padding": self.shipped_logps, "full_log_softmax": self.full_softmax_logps,
            "precomputed_ref": self.shipped_logps, "completion_head": completion_pair_logps,
        }[variant]  # fmt: skip
        logps_out: list[float] = []
        for i, batch in enumerate(self.batches):
            if variant == "fixed_padding":
                batch = self.padded_to_max_length(batch)
            chosen, rejected = logps(self.policy, batch)
            if variant == "precomputed_ref":
                ref_c, ref_r = self.ref_cache[i]
            else:
                with self.torch.no_grad(), self.reference.model() as ref:
                    ref_c, ref_r = logps(ref, batch)
            half = chosen.shape[0]
            loss, _ = self.loss_fn(
                chosen, rejected, ref_c, ref_r, chosen_lengths=batch["lengths"][:half],
                rejected_lengths=batch["lengths"][half:],
            )  # fmt: skip
            loss.backward()
            self.policy.zero_grad(set_to_none=True)
            logps_out += chosen.detach().tolist() + rejected.detach().tolist()
        return logps_out

    def adamw_step_s(self, *, fused: bool, repeats: int) -> float:
        """Median seconds of one AdamW step over the policy (gradients set to random values)."""
        torch = self.torch
        params = [p for p in self.policy.parameters() if p.requires_grad]
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        for p in copies:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(copies, lr=1e-6, fused=True if fused else None)
        opt.step()  # state allocation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return median(times)


# ----------------------------------------------------------------------------- workers


def time_worker(w: Workload, workdir: Path, rounds: int) -> dict[str, Any]:
    bench = Bench(w, workdir, variants=VARIANTS)
    shipped = bench.run("shipped")  # also the warm-up of shipped
    check = {}
    for variant in VARIANTS[1:]:
        logps = bench.run(variant)  # warm-up, and the numbers must agree
        check[variant] = max(abs(a - b) for a, b in zip(logps, shipped, strict=True))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            start = time.perf_counter()
            bench.run(variant)
            times[variant].append(time.perf_counter() - start)
    adam = {
        "for_loop_s": bench.adamw_step_s(fused=False, repeats=5 * rounds),
        "fused_s": bench.adamw_step_s(fused=True, repeats=5 * rounds),
    }
    return {
        "tokens_per_call": bench.tokens,
        "batches": BATCHES,
        "times": times,
        "max_abs_logp_diff_vs_shipped": check,
        "precompute_s": bench.precompute_s,
        "precompute_pairs": sum(len(p) for p in bench.pairs),
        "adamw": adam,
        "parameters": sum(p.numel() for p in bench.policy.parameters()),
    }


def memory_worker(w: Workload, workdir: Path, variant: str) -> dict[str, Any]:
    bench = Bench(w, workdir, variants=(variant,))
    gc.collect()
    start_rss = rss_mb()
    reset_peak_rss()
    bench.run(variant)
    peak = peak_rss_mb()
    return {"variant": variant, "rss_at_start_mb": start_rss, "peak_rss_mb": peak}


# ----------------------------------------------------------------------------- the comparison


def compare(w: Workload, rounds: int, *, timeout: float = 900) -> dict[str, Any]:
    host = machine()
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-tech-") as tmp:
        workdir = Path(tmp)
        common = ["--workload", w.to_json(), "--workdir", str(workdir)]
        run_worker("benchmarks.dpo", ["prepare", *common], threads=w.threads, timeout=timeout)
        timing = run_worker(
            "benchmarks.techniques", ["time", *common, "--rounds", str(rounds)],
            threads=w.threads, timeout=timeout,
        )  # fmt: skip
        print(f"  timing done ({timing['process_wall_s']:.0f} s)", flush=True)
        memory = {}
        for variant in VARIANTS:
            memory[variant] = run_worker(
                "benchmarks.techniques", ["memory", *common, "--variant", variant],
                threads=w.threads, timeout=timeout,
            )  # fmt: skip
            print(f"  memory {variant}: {memory[variant]['peak_rss_mb']:.0f} MiB", flush=True)
    return {
        "machine": host, "workload": w.to_json(), "rounds": rounds, "timing": timing,
        "memory": memory, "summary": summarize(timing, memory),
    }  # fmt: skip


def summarize(timing: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    times = timing["times"]
    rounds = len(times["shipped"])
    tokens = timing["tokens_per_call"]
    out: dict[str, Any] = {"variants": {}, "techniques": []}
    for v in VARIANTS:
        out["variants"][v] = {
            "seconds": median(times[v]),
            "tokens_per_s": tokens / median(times[v]),
            "peak_rss_mb": memory[v]["peak_rss_mb"],
            "peak_above_start_mb": memory[v]["peak_rss_mb"] - memory[v]["rss_at_start_mb"],
            "max_abs_logp_diff_vs_shipped": timing["max_abs_logp_diff_vs_shipped"].get(v, 0.0),
        }
    for name, with_, without, in_src in TECHNIQUES:
        a, b = out["variants"][with_], out["variants"][without]
        out["techniques"].append({
            "technique": name, "with": with_, "without": without, "in_src": in_src,
            "speedup": median([times[without][r] / times[with_][r] for r in range(rounds)]),
            "peak_rss_ratio": a["peak_rss_mb"] / b["peak_rss_mb"],
            "peak_above_start_ratio": a["peak_above_start_mb"] / b["peak_above_start_mb"],
        })  # fmt: skip
    adam = timing["adamw"]
    out["adamw"] = adam | {"speedup": adam["for_loop_s"] / adam["fused_s"]}
    return out


def markdown(result: dict[str, Any]) -> str:
    s, t = result["summary"], result["timing"]
    w = Workload.from_json(result["workload"])
    lines = [
        "### What each technique buys (one change at a time)",
        "",
        f"Unit of work: the DPO step without the optimizer (policy forward+backward, reference "
        f"forward, `dpo` loss) on the first {t['batches']} batches of the DPO workload "
        f"({w.batch_size} pairs each, {t['tokens_per_call']} non-pad tokens), model "
        f"`{w.model}`, {w.threads} threads. Time: median of {result['rounds']} rotating rounds "
        "in one process; memory: one fresh process per variant, peak RSS while running the "
        "batches once (absolute, and above the RSS at the start of the work).",
        "",
        "| variant | s | non-pad tokens/s | peak RSS MiB | peak above start MiB | "
        "max abs diff of summed log-probs vs shipped |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, a in s["variants"].items():
        lines.append(
            f"| {v} | {a['seconds']:.2f} | {a['tokens_per_s']:.0f} | {a['peak_rss_mb']:.0f} | "
            f"{a['peak_above_start_mb']:.0f} | {a['max_abs_logp_diff_vs_shipped']:.1e} |"
        )
    lines += [
        "",
        "| technique | in src | speed-up (time without / with) | peak RSS with / without | "
        "peak above start, with / without |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for x in s["techniques"]:
        lines.append(
            f"| {x['technique']} (`{x['with']}` vs `{x['without']}`) | {x['in_src']} | "
            f"{x['speedup']:.2f}x | {x['peak_rss_ratio']:.0%} | {x['peak_above_start_ratio']:.0%} |"
        )
    adam = s["adamw"]
    lines += [
        "",
        f"- Precomputing the reference for these {t['precompute_pairs']} pairs took "
        f"{t['precompute_s']:.2f} s once (our `precompute_reference`).",
        f"- AdamW step over {t['parameters'] / 1e6:.1f}M parameters: for-loop (ours on CPU) "
        f"{adam['for_loop_s'] * 1e3:.1f} ms, fused {adam['fused_s'] * 1e3:.1f} ms "
        f"({adam['speedup']:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.techniques")
    parser.add_argument("what", choices=["time", "memory"])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--result", required=True, type=Path)
    args = parser.parse_args(argv)
    w = Workload.from_json(args.workload)
    if args.what == "time":
        out = time_worker(w, args.workdir, args.rounds)
    else:
        if args.variant is None:
            parser.error("memory needs --variant")
        out = memory_worker(w, args.workdir, args.variant)
    write_result_file(args.result, out)


if __name__ == "__main__":
    main()
