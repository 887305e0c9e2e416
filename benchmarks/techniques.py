"""What each technique of our DPO step buys, measured one change at a time on the DPO workload.

The unit of work is the DPO step minus the optimizer: the policy's chosen/rejected log-probs with
gradients, the reference's without, the `dpo` loss from `direct_alignment.losses.LOSSES` and the
backward pass, on one batch of the DPO workload (`benchmarks.workload`: same model, pairs, order and
batch size): the batch of median padded size among the workload's steps. "shipped" is what our
trainer does (`direct_alignment.reference.pair_logps` on `pack_pairs` batches: each pair packed as
[prompt | chosen | rejected] with a 4D mask, its prompt encoded once, all of a step's pairs in one
row with no padding and attention computed pair by pair, `rlhf_core.layout`; the LM head only on
completion positions, fused with the log-softmax; a frozen reference model). "flat_rows" is what
it did before packing (`collate_pairs`: 2B rows,
prompt + chosen then prompt + rejected, padded to the batch's longest, one concatenated forward
through `rlhf_core.logprobs.causal_lm_selected_logprobs`). Each other variant changes exactly one
thing, of shipped or of flat_rows:

  padded_rows       shipped without segmented attention: rows no longer than the longest pair,
                    padded, attention over each whole masked row (what the trainer did before)
  one_pair_per_row  padded_rows without packing: each pair's [prompt | chosen | rejected] in a
                    row of its own (the prompt still shared)
  flat_rows         one_pair_per_row without the shared prompt (see above)
  two_forwards      flat_rows' chosen and rejected rows in two forwards (each half of the batch
                    cut to its own longest row) instead of one concatenated forward
  fixed_padding     flat_rows padded to max_length instead of the batch's longest row
  full_log_softmax  flat_rows with log_softmax over the full (2B, S-1, V) logits, then gather,
                    instead of the fused completion-only logit[y] - logsumexp
  precomputed_ref   reference log-probs looked up from a cache made once by our
                    `precompute_reference` (its one-off cost is reported), no reference model held
  full_lm_head      flat_rows with the LM head on every position of the batch
                    (`causal_lm_token_logprobs`, then the completion positions picked), instead of
                    the completion-only head

Plus two things outside the step's code. THP: the same worker run again in a process started with
`THP_MEM_ALLOC_ENABLE=1`, which makes PyTorch's CPU allocator back tensors of 2 MiB and more with
transparent huge pages (fewer page faults when the large logits tensors are allocated afresh every
step; read once, so it must be in the environment before torch allocates); compared across the
two processes. AdamW: torch's default (for-loop) AdamW on CPU vs `fused=True`, which our
`build_optimizer` asks for on CPU and CUDA, timing `optimizer.step()` alone.

Timing: one process, models loaded once, each variant warmed up once (its summed log-probs are
checked against shipped's then), then `rounds` rounds in which every variant runs once in a
rotating order; medians, and speed-ups as medians of per-round ratios. Memory, in the same
process after the timing: for each variant, free heap memory is returned to the kernel
(`malloc_trim`), the RSS high-water mark is reset, the variant runs once, and the peak above the
RSS at its start is its working memory. (Both models stay loaded throughout, so for
`precomputed_ref` the reference's parameters, which it would not hold, are reported separately.)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from contextlib import contextmanager
from functools import partial
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
    write_result_file,
)
from benchmarks.workload import MODEL_CHOICES, Workload, model_dir, prepare

VARIANTS = (
    "shipped",
    "padded_rows",
    "one_pair_per_row",
    "flat_rows",
    "two_forwards",
    "fixed_padding",
    "full_log_softmax",
    "precomputed_ref",
    "full_lm_head",
    "not_lean",
)
#: (technique, variant with it, variant without it, in src?)
TECHNIQUES = (
    ("one row, no padding, attention pair by pair", "shipped", "padded_rows",
     "yes (CPU SDPA)"),
    ("packing several pairs per row", "padded_rows", "one_pair_per_row", "yes (train.packing)"),
    ("shared prompt, encoded once per pair", "one_pair_per_row", "flat_rows",
     "yes (train.packing)"),
    ("concatenated chosen/rejected forward", "flat_rows", "two_forwards", "yes"),
    ("padding to the batch's longest row", "flat_rows", "fixed_padding", "yes"),
    ("fused completion-only log-softmax", "flat_rows", "full_log_softmax", "yes"),
    ("precomputed reference log-probs", "precomputed_ref", "shipped", "yes (reference.mode)"),
    ("completion-only LM head", "flat_rows", "full_lm_head", "yes"),
    ("lean MLP and RMSNorm (recomputed in the backward)", "shipped", "not_lean",
     "yes (model.lean_activations)"),
)  # fmt: skip


# ----------------------------------------------------------------------------- the variants


class Bench:
    """Models, batches and step functions of every variant (built inside a worker process)."""

    def __init__(self, w: Workload, workdir: Path) -> None:
        import torch

        from direct_alignment.data import build_preference_data
        from direct_alignment.losses import LOSSES
        from direct_alignment.reference import precompute_reference
        from rlhf_core.data import DataSource, EpochSampler
        from rlhf_core.fastpath import SEGMENTED_ROW_TOKENS
        from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy, load_tokenizer
        from rlhf_core.preference import collate_pairs, pack_pairs
        from rlhf_core.registry import build_from_spec

        torch.set_num_threads(w.threads)
        torch.manual_seed(w.seed)
        self.torch, self.w = torch, w
        cfg = ModelConfig(name_or_path=str(model_dir(w.model)), dtype=w.dtype, attention="sdpa")
        tokenizer = load_tokenizer(cfg, padding_side="right")
        self.pad_id = tokenizer.pad_token_id
        data = build_preference_data(
            DataSource(path=str(workdir / "hh_subset.jsonl")), tokenizer, fmt="hh",
            max_length=w.max_length, max_prompt_length=w.max_prompt_length, where="benchmark",
        )  # fmt: skip
        order = EpochSampler(len(data.pairs), w.seed).next_batch(len(data.pairs))
        steps = [
            [data.pairs[i] for i in order[b * w.batch_size : (b + 1) * w.batch_size]]
            for b in range(w.steps)
        ]
        # The workload's batch of median padded size (a typical step, not the longest one).
        sizes = [collate_pairs(p, self.pad_id)["input_ids"].numel() for p in steps]
        self.batch_index = sorted(range(len(steps)), key=lambda i: (sizes[i], i))[len(steps) // 2]
        self.pairs = [steps[self.batch_index]]
        self.batches = [collate_pairs(p, self.pad_id) for p in self.pairs]
        # shipped: one row per step and attention segments; the previous layouts without them
        self.packed = {
            "True": [
                pack_pairs(p, self.pad_id, row_tokens=SEGMENTED_ROW_TOKENS) for p in self.pairs
            ],
            "padded": [_whole_rows(pack_pairs(p, self.pad_id)) for p in self.pairs],
            "False": [_whole_rows(pack_pairs(p, self.pad_id, pack=False)) for p in self.pairs],
        }
        self.tokens = sum(int(b["attention_mask"].sum()) for b in self.batches)
        self.loss_fn = build_from_spec(LOSSES, {"name": "dpo", "beta": w.beta})
        self.policy = load_policy(cfg).train()
        self.reference = ReferencePolicy(load_policy(cfg), "frozen")
        self.reference_mb = sum(p.numel() * p.element_size() for p in self.policy.parameters())
        self.reference_mb /= 2**20
        one_row = partial(pack_pairs, row_tokens=SEGMENTED_ROW_TOKENS)
        # Our `precompute_reference` over the batch's pairs (timed: a one-off cost per pair).
        start = time.perf_counter()
        self.ref_cache = []
        for pairs in self.pairs:
            cache = precompute_reference(
                self.reference, pairs, pad_id=self.pad_id, batch_size=w.batch_size,
                device=torch.device("cpu"), collate=one_row,
            )  # fmt: skip
            self.ref_cache.append((cache[:, 0], cache[:, 1]))
        self.precompute_s = time.perf_counter() - start

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
    def full_head_logps(model, batch):
        from rlhf_core.logprobs import causal_lm_token_logprobs, masked_sum

        token_logps = causal_lm_token_logprobs(model, batch["input_ids"], batch["attention_mask"])
        seq = masked_sum(token_logps, batch["loss_mask"], dim=-1)
        half = seq.shape[0] // 2
        return seq[:half], seq[half:]

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
        logps = {
            "shipped": self.shipped_logps, "one_pair_per_row": self.shipped_logps,
            "padded_rows": self.shipped_logps,
            "flat_rows": self.shipped_logps, "two_forwards": self.two_forward_logps,
            "fixed_padding": self.shipped_logps, "full_log_softmax": self.full_softmax_logps,
            "precomputed_ref": self.shipped_logps, "full_lm_head": self.full_head_logps,
            "not_lean": self.shipped_logps,
        }[variant]  # fmt: skip
        if variant == "not_lean":  # the policy's MLPs and norms as transformers runs them
            with _not_lean(self.policy):
                return self.run_batches("shipped", logps)
        return self.run_batches(variant, logps)

    def run_batches(self, variant: str, logps) -> list[float]:
        """`run`'s loop over the batches, with the log-prob function `logps`."""
        logps_out: list[float] = []
        for i, batch in enumerate(self.batches):
            if variant == "fixed_padding":
                batch = self.padded_to_max_length(batch)
            elif variant in ("shipped", "precomputed_ref"):
                batch = self.packed["True"][i]
            elif variant in ("padded_rows", "one_pair_per_row"):
                batch = self.packed["padded" if variant == "padded_rows" else "False"][i]
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

    def adamw_step_s(self, rounds: int) -> dict[str, float]:
        """Median seconds of one AdamW step over copies of the policy's parameters (random
        gradients): torch's default (for-loop) AdamW on CPU vs `fused=True`, which
        `rlhf_core.optim` uses, alternating."""
        torch = self.torch
        optimizers = {}
        for name, fused in (("for_loop_s", None), ("fused_s", True)):
            copies = [p.detach().clone().requires_grad_(True) for p in self.policy.parameters()]
            for p in copies:
                p.grad = torch.randn_like(p)
            optimizers[name] = torch.optim.AdamW(copies, lr=1e-6, fused=fused)
            optimizers[name].step()  # state allocation
        times: dict[str, list[float]] = {name: [] for name in optimizers}
        for _ in range(rounds):
            for name, opt in optimizers.items():
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        return {name: median(t) for name, t in times.items()}


def _whole_rows(batch: dict) -> dict:
    """A packed batch without its attention segments: SDPA over each whole masked row."""
    batch.pop("segments")
    return batch


# ----------------------------------------------------------------------------- the worker


@contextmanager
def _not_lean(model):
    """`model` without `rlhf_core.lean`'s patches (each module's class forward) inside."""
    patched = [m for m in model.modules() if "forward" in vars(m)]
    saved = [vars(m).pop("forward") for m in patched]
    try:
        yield
    finally:
        for module, forward in zip(patched, saved, strict=True):
            module.forward = forward


def worker(w: Workload, workdir: Path, rounds: int) -> dict[str, Any]:
    bench = Bench(w, workdir)
    shipped = bench.run("shipped")  # also the warm-up of shipped
    check = {"shipped": 0.0}
    for variant in VARIANTS[1:]:
        logps = bench.run(variant)  # warm-up, and the numbers must agree
        check[variant] = max(abs(a - b) for a, b in zip(logps, shipped, strict=True))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            start, start_cpu = time.perf_counter(), time.process_time()
            bench.run(variant)
            times[variant].append(time.perf_counter() - start)
            cpu[variant].append(time.process_time() - start_cpu)
    memory = {}
    for variant in VARIANTS:
        gc.collect()
        malloc_trim()
        start_rss = rss_mb()
        reset_peak_rss()
        bench.run(variant)
        memory[variant] = peak_rss_mb() - start_rss
    return {
        "batch_index": bench.batch_index,
        "pairs": sum(len(p) for p in bench.pairs),
        "tokens_per_call": bench.tokens,
        "padded_positions": sum(int(b["attention_mask"].numel()) for b in bench.batches),
        "packed_positions": {
            pack: sum(int(b["input_ids"].numel()) for b in batches)
            for pack, batches in bench.packed.items()
        },
        "times": times,
        "cpu_times": cpu,
        "working_memory_mb": memory,
        "max_abs_logp_diff_vs_shipped": check,
        "precompute_s": bench.precompute_s,
        "reference_params_mb": bench.reference_mb,
        "adamw": bench.adamw_step_s(10 * rounds),
        "parameters": sum(p.numel() for p in bench.policy.parameters()),
    }


# ----------------------------------------------------------------------------- the comparison


def compare(w: Workload, rounds: int, *, timeout: float = 900) -> dict[str, Any]:
    """Prepare the DPO workload's data, then measure every variant in one fresh process."""
    host = machine()
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-tech-") as tmp:
        workdir = Path(tmp)
        common = ["--workload", w.to_json(), "--workdir", str(workdir)]
        run_worker("benchmarks.dpo", ["prepare", *common], threads=w.threads, timeout=timeout)
        runs = {}
        for name, env in (("default", {}), ("thp", {"THP_MEM_ALLOC_ENABLE": "1"})):
            runs[name] = run_worker(
                "benchmarks.techniques", [*common, "--rounds", str(rounds)], threads=w.threads,
                timeout=timeout, env=env,
            )  # fmt: skip
            print(f"  {name} allocator: done ({runs[name]['process_wall_s']:.0f} s)", flush=True)
    return {
        "machine": host, "workload": w.to_json(), "rounds": rounds, "measured": runs["default"],
        "measured_thp": runs["thp"], "summary": summarize(runs["default"], runs["thp"]),
    }  # fmt: skip


def summarize(m: dict[str, Any], thp: dict[str, Any]) -> dict[str, Any]:
    times, cpu, memory = m["times"], m["cpu_times"], m["working_memory_mb"]
    rounds = len(times["shipped"])
    out: dict[str, Any] = {"variants": {}, "techniques": []}
    for v in VARIANTS:
        out["variants"][v] = {
            "seconds": median(times[v]),
            "cpu_seconds": median(cpu[v]),
            "tokens_per_s": m["tokens_per_call"] / median(times[v]),
            "working_memory_mb": memory[v],
            "max_abs_logp_diff_vs_shipped": m["max_abs_logp_diff_vs_shipped"][v],
        }
    for name, with_, without, in_src in TECHNIQUES:
        out["techniques"].append({
            "technique": name, "with": with_, "without": without, "in_src": in_src,
            "speedup": median([times[without][r] / times[with_][r] for r in range(rounds)]),
            "cpu_speedup": median([cpu[without][r] / cpu[with_][r] for r in range(rounds)]),
            "working_memory_ratio": memory[with_] / memory[without],
        })  # fmt: skip
    out["thp"] = {
        v: {
            "seconds": median(thp["times"][v]),
            "speedup": median(times[v]) / median(thp["times"][v]),
            "cpu_speedup": median(cpu[v]) / median(thp["cpu_times"][v]),
            "working_memory_ratio": thp["working_memory_mb"][v] / memory[v],
        }
        for v in ("shipped", "flat_rows")
    }
    adam = m["adamw"]
    out["adamw"] = adam | {"speedup": adam["for_loop_s"] / adam["fused_s"]}
    return out


def markdown(result: dict[str, Any]) -> str:
    s, m = result["summary"], result["measured"]
    w = Workload.from_json(result["workload"])
    lines = [
        "### What each technique buys (one change at a time)",
        "",
        f"Unit of work: one DPO step without the optimizer (policy forward+backward, reference "
        f"forward, `dpo` loss) on batch {m['batch_index'] + 1} of the DPO workload (the median "
        f"padded size: {m['pairs']} pairs, {m['tokens_per_call']} non-pad tokens in "
        f"{m['padded_positions']} positions as flat rows; packed: "
        f"{m['packed_positions']['True']} positions, padded rows "
        f"{m['packed_positions'].get('padded', '-')}, one pair per row "
        f"{m['packed_positions']['False']}), model `{w.model}`, {w.threads} threads. Time: "
        f"median of {result['rounds']} rotating rounds in one process (CPU s: user + kernel time "
        "of all threads). Working memory: the peak "
        "RSS above the RSS at the start of the work (after `malloc_trim`).",
        "",
        "| variant | wall s | CPU s | non-pad tokens/s | working memory MiB | max abs diff of "
        "summed log-probs vs shipped |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v, a in s["variants"].items():
        lines.append(
            f"| {v} | {a['seconds']:.2f} | {a['cpu_seconds']:.2f} | {a['tokens_per_s']:.0f} | "
            f"{a['working_memory_mb']:.0f} | {a['max_abs_logp_diff_vs_shipped']:.1e} |"
        )
    lines += [
        "",
        "| technique | in src | speed-up, wall (without / with) | speed-up, CPU time | "
        "working memory with / without |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for x in s["techniques"]:
        lines.append(
            f"| {x['technique']} (`{x['with']}` vs `{x['without']}`) | {x['in_src']} | "
            f"{x['speedup']:.2f}x | {x['cpu_speedup']:.2f}x | {x['working_memory_ratio']:.0%} |"
        )
    for v, x in s["thp"].items():
        lines.append(
            f"| `THP_MEM_ALLOC_ENABLE=1` on `{v}` (environment; a second process) | no | "
            f"{x['speedup']:.2f}x | {x['cpu_speedup']:.2f}x | {x['working_memory_ratio']:.0%} |"
        )
    adam = s["adamw"]
    lines += [
        "",
        f"- Precomputed reference: computing it for these {m['pairs']} pairs took "
        f"{m['precompute_s']:.2f} s once (our `precompute_reference`), and no reference model "
        f"is held: {m['reference_params_mb']:.0f} MiB of parameters for this model.",
        f"- AdamW step over {m['parameters'] / 1e6:.1f}M parameters: torch's default for-loop "
        f"{adam['for_loop_s'] * 1e3:.1f} ms, fused (ours) {adam['fused_s'] * 1e3:.1f} ms "
        f"({adam['speedup']:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def profile(w: Workload, variants: list[str], rows: int) -> None:
    """Where the time of one DPO step goes: a torch.profiler table per variant (operators with
    the most self CPU time, one profiled run after a warm-up) and its user/kernel CPU split, on
    the workload's median batch. Prints; writes nothing to benchmarks/results/."""
    import os

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-prof-") as tmp:
        prepare(w, Path(tmp))
        bench = Bench(w, Path(tmp))
    print(
        f"batch {bench.batch_index + 1}: {bench.tokens} non-pad tokens, "
        f"{bench.batches[0]['input_ids'].numel()} positions as flat rows, "
        f"{bench.packed['True'][0]['input_ids'].numel()} packed, {w.threads} thread(s)"
    )
    for variant in variants:
        bench.run(variant)  # warm-up
        before = os.times()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            bench.run(variant)
        after = os.times()
        user, system = after.user - before.user, after.system - before.system
        print(f"\n== {variant}: CPU {user + system:.2f} s ({system / (user + system):.0%} kernel)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    """The worker `compare` starts (`--workload --workdir --result`), or, with `--profile`, a
    profile of chosen variants on the default workload:

        uv run --group bench python -m benchmarks.techniques --profile [--variants shipped ...]
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.techniques", description=main.__doc__
    )
    parser.add_argument("--workload", help="benchmarks.workload.Workload as JSON")
    parser.add_argument("--workdir", type=Path, help="prepared by benchmarks.workload.prepare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["shipped", "flat_rows"])
    parser.add_argument("--threads", type=int, default=Workload().threads, help="with --profile")
    parser.add_argument("--rows", type=int, default=12, help="operators shown per variant")
    parser.add_argument("--steps", type=int, default=Workload().steps, help="with --profile")
    parser.add_argument(
        "--model", choices=MODEL_CHOICES, default=Workload().model, help="with --profile"
    )
    args = parser.parse_args(argv)
    if args.profile:
        w = dataclasses.replace(
            Workload.from_json(args.workload) if args.workload else Workload(),
            threads=args.threads, steps=args.steps, model=args.model,
        )  # fmt: skip
        profile(w, args.variants, args.rows)
        return
    if args.workload is None or args.workdir is None or args.result is None:
        parser.error("the worker needs --workload, --workdir and --result (or use --profile)")
    out = worker(Workload.from_json(args.workload), args.workdir, args.rounds)
    write_result_file(args.result, out)


if __name__ == "__main__":
    main()
