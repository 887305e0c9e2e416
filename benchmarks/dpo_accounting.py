"""Where a DPO step's work goes, in our trainer and in TRL's, counted and measured on one batch set.

For every timed step of the DPO workload (`benchmarks.workload`: same model, pairs, order, batch
size as `benchmarks.dpo`), this builds the batch each trainer builds (ours: `pack_pairs`, packed
rows [prompt | chosen | rejected] with a 4D mask; TRL: its `DataCollatorForPreference`, 2B
right-padded rows prompt + chosen then prompt + rejected) and

  counts   per step and arm: positions through the transformer body (rows x row length), non-pad
           tokens among them, padding share, LM-head positions (ours: the completion targets; TRL
           on CPU: every position of every row, its fused head scores all of them when Triton is
           absent), attention score entries (rows x L^2: the CPU flash kernel computes the whole
           masked L x L matrix), and converts them to FLOPs: matmul FLOPs 2 x parameters per
           position (body and head apart), attention 4 x heads x head_dim per score entry
           forward; the policy's backward 2x its forward plus the fused heads' recomputation of
           the logits (both arms recompute), the reference one forward (`benchmarks.flops`).
           The ratio TRL / ours of those FLOPs is the speed-up the work alone predicts.
  measures (`--measure`) the same steps in one process, both arms' computations alternating
           batch by batch: policy forward, backward, reference forward and optimizer step
           (clip + fused AdamW), each as process CPU seconds (user + kernel, all threads) and
           wall seconds. Ours calls what our trainer calls (`direct_alignment.reference.
           pair_logps`, `reference_pair_logps`, `rlhf_core.loop.clip_grad_norm`); TRL's arm
           what `DPOTrainer._compute_loss` calls (`model(..., labels=..., fused_lm_head=True)`
           after `trl.trainer.utils.add_fused_lm_head` with DPOTrainer's outputs, the reference
           under `torch.no_grad`, `torch.nn.utils.clip_grad_norm_`). Comparing these with the
           whole trainers' CPU seconds per step (`benchmarks.dpo`) separates the computation
           from what the trainer loops add.

    uv run --group bench python -m benchmarks.dpo_accounting --model real --steps 6 \
        [--micro-batch-size 2] [--measure --rounds 2 --threads 1]

Writes `benchmarks/results/<stamp>-dpo-accounting.{json,md}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.flops import Shapes, segment_score_entries
from benchmarks.measure import machine, median, timestamp, write_results
from benchmarks.workload import MODEL_CHOICES, Workload, model_dir, prepare

#: ours: as shipped (all of a step's pairs in one row, no padding, attention pair by pair:
#: `rlhf_core.attention.fast_attention`); ours_rows: the previous layout (rows no longer than
#: the longest pair, padded, the whole masked (L, L) attention of each row); trl: DPOTrainer's.
ARMS = ("ours", "ours_rows", "trl")
PHASES = ("policy_forward", "backward", "reference_forward", "optimizer")


def batches(w: Workload, workdir: Path) -> dict[str, list[dict]]:
    """The timed steps' batches of each arm, one per micro-batch of `micro_batch_size` pairs
    (the whole step without it): ours (`pack_pairs` as the trainer calls it), ours before
    (`pack_pairs` default rows, no attention segments) and TRL's (its collator)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from direct_alignment.data import build_preference_data
    from rlhf_core.data import DataSource, EpochSampler
    from rlhf_core.models import ModelConfig, load_tokenizer

    tokenizer = load_tokenizer(
        ModelConfig(name_or_path=str(model_dir(w.model))), padding_side="right"
    )
    data = build_preference_data(
        DataSource(path=str(workdir / "hh_subset.jsonl")), tokenizer, fmt="hh",
        max_length=w.max_length, max_prompt_length=w.max_prompt_length, where="benchmark",
    )  # fmt: skip
    order = EpochSampler(len(data.pairs), w.seed).next_batch(len(data.pairs))
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    out: dict[str, list[dict]] = {a: [] for a in ARMS}
    pad = tokenizer.pad_token_id
    micro = w.micro_batch_size or w.batch_size
    for s in range(w.warmup_steps, w.steps):
        pairs = [data.pairs[i] for i in order[s * w.batch_size : (s + 1) * w.batch_size]]
        for m in range(0, len(pairs), micro):  # micro-batches, as both trainers split a step
            add_batches(out, pairs[m : m + micro], collator, pad)
    return out


def add_batches(out: dict[str, list[dict]], step: list, collator: Any, pad: int) -> None:
    """Append each arm's batch of the pairs `step` to `out`."""
    from rlhf_core.fastpath import SEGMENTED_ROW_TOKENS
    from rlhf_core.preference import pack_pairs

    out["ours"].append(pack_pairs(step, pad, row_tokens=SEGMENTED_ROW_TOKENS))
    rows = pack_pairs(step, pad)
    rows.pop("segments")  # no segments: SDPA over each whole row, as before
    out["ours_rows"].append(rows)
    out["trl"].append(collator([
        {"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids,
         "rejected_ids": p.rejected_ids} for p in step
    ]))  # fmt: skip


def count(step: dict[str, dict], sizes: Shapes) -> dict[str, dict[str, float]]:
    """Positions, tokens, head positions, score entries and FLOPs (`benchmarks.flops`) of one
    step, per arm."""
    out = {}
    for arm, b in step.items():
        rows, length = b["input_ids"].shape
        if arm == "trl":
            tokens = int(b["attention_mask"].sum())
            head = rows * (length - 1)  # CPU: every position is scored (no Triton)
        else:
            tokens = int(b["prefix_lengths"].sum() + b["branch_lengths"].sum())
            head = int(b["targets"].numel())
        positions = rows * length
        if "segments" in b:  # attention segment by segment
            scores = segment_score_entries(b["segments"])
        else:
            scores = rows * length * length
        out[arm] = {
            "rows": rows, "row_length": length, "positions": positions, "non_pad_tokens": tokens,
            "padding_share": 1 - tokens / positions, "head_positions": head,
            "score_entries": scores,
            "policy_body_gflop": sizes.train_gflop(positions, 0, scores),
            "policy_head_gflop": sizes.train_gflop(0, head, 0),
            "reference_gflop": sizes.forward_gflop(positions, head, scores),
        }  # fmt: skip
        a = out[arm]
        a["total_gflop"] = a["policy_body_gflop"] + a["policy_head_gflop"] + a["reference_gflop"]
    return out


class Arms:
    """One policy, its frozen reference and a fused AdamW; each arm's step computation."""

    def __init__(self, w: Workload) -> None:
        import torch
        from trl.trainer.utils import add_fused_lm_head

        from rlhf_core.models import ModelConfig, ReferencePolicy, load_policy

        torch.set_num_threads(w.threads)
        torch.manual_seed(w.seed)
        cfg = ModelConfig(name_or_path=str(model_dir(w.model)), dtype="fp32", attention="sdpa")
        self.torch, self.w = torch, w
        self.policy = load_policy(cfg).train()
        self.reference = ReferencePolicy(load_policy(cfg), "frozen")
        # what DPOTrainer patches (its outputs feed its logged metrics); our path does not call
        # model.forward, so the patch changes nothing for our arm
        add_fused_lm_head(self.policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        add_fused_lm_head(self.reference._model)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=w.lr, fused=True)
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)

    def ours_rows(self, batch: dict, clock: Clock) -> float:
        return self.ours(batch, clock)

    def ours(self, batch: dict, clock: Clock) -> float:
        from direct_alignment.reference import pair_logps, reference_pair_logps
        from rlhf_core.loop import clip_grad_norm

        with clock("policy_forward"):
            chosen, rejected = pair_logps(self.policy, batch)
        with clock("reference_forward"):
            ref_c, ref_r = reference_pair_logps(self.reference, batch)
        with clock("backward"):
            loss = self._dpo(chosen, rejected, ref_c, ref_r)
            loss.backward()
        with clock("optimizer"):
            clip_grad_norm(self.accelerator, self.policy, 1.0)
            self._step()
        return float(chosen.sum() + rejected.sum())

    def trl(self, batch: dict, clock: Clock) -> float:
        torch = self.torch
        mask = batch["completion_mask"]
        labels = batch["input_ids"].masked_fill(mask == 0, -100)
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "use_cache": False}  # fmt: skip
        width = mask.shape[1] - 1
        with clock("policy_forward"):
            out = self.policy(**kwargs, labels=labels, fused_lm_head=True)
            chosen, rejected = out.log_probs[:, -width:].sum(1).chunk(2)
        with clock("reference_forward"), torch.no_grad():
            ref = self.reference._model(**kwargs, labels=labels, fused_lm_head=True)
            ref_c, ref_r = ref.log_probs[:, -width:].sum(1).chunk(2)
        with clock("backward"):
            loss = self._dpo(chosen, rejected, ref_c, ref_r)
            loss.backward()
        with clock("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self._step()
        return float(chosen.sum() + rejected.sum())

    def _dpo(self, chosen, rejected, ref_c, ref_r):
        logits = (chosen - ref_c) - (rejected - ref_r)
        return -self.torch.nn.functional.logsigmoid(self.w.beta * logits).mean()

    def _step(self) -> None:
        # lr 0: the weights stay put, so both arms see the same model on every batch
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Clock:
    """Process CPU seconds (user + kernel, all threads) and wall seconds per phase."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.wall: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def __call__(self, phase: str):
        clock = self

        class _Phase:
            def __enter__(self):
                t = os.times()
                self.cpu, self.wall = t.user + t.system, time.perf_counter()

            def __exit__(self, *exc):
                t = os.times()
                clock.cpu[phase] += t.user + t.system - self.cpu
                clock.wall[phase] += time.perf_counter() - self.wall

        return _Phase()


def measure(w: Workload, steps: dict[str, list[dict]], rounds: int) -> dict[str, Any]:
    """Per arm and phase: median over rounds of the CPU and wall seconds per step."""
    arms = Arms(w)
    for arm in ARMS:  # warm-up (optimizer state, first-call costs)
        getattr(arms, arm)(steps[arm][0], Clock())
    per_round: dict[str, list[Clock]] = {a: [] for a in ARMS}
    logps: dict[str, list[float]] = {a: [] for a in ARMS}
    n = len(steps["trl"])
    for r in range(rounds):
        clocks = {a: Clock() for a in ARMS}
        for i in range(n):
            k = (i + r) % len(ARMS)  # rotating order
            for arm in ARMS[k:] + ARMS[:k]:
                value = getattr(arms, arm)(steps[arm][i], clocks[arm])
                if r == 0:
                    logps[arm].append(value)
        for a in ARMS:
            per_round[a].append(clocks[a])
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{a} {sum(c.cpu.values()) / n:.2f} CPU-s/step" for a, c in clocks.items()
        ), flush=True)  # fmt: skip
    steps = n
    out: dict[str, Any] = {"rounds": rounds, "threads": w.threads}
    for a in ARMS:
        out[a] = {
            kind: {p: median([getattr(c, kind)[p] for c in per_round[a]]) / steps for p in PHASES}
            for kind in ("cpu", "wall")
        }
        for kind in ("cpu", "wall"):
            out[a][kind]["step"] = (
                median([sum(getattr(c, kind).values()) for c in per_round[a]]) / steps
            )
    out["cpu_ratio_trl_over"] = {
        a: {p: out["trl"]["cpu"][p] / out[a]["cpu"][p] for p in (*PHASES, "step")}
        for a in ("ours", "ours_rows")
    }
    out["summed_logps_max_abs_diff"] = max(
        abs(x - y)
        for a in ("ours_rows", "trl")
        for x, y in zip(logps["ours"], logps[a], strict=True)
    )
    return out


def run(w: Workload, do_measure: bool, rounds: int) -> dict[str, Any]:
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-acct-") as tmp:
        prep = prepare(w, Path(tmp))
        arm_steps = batches(w, Path(tmp))
    sizes = Shapes.of(AutoConfig.from_pretrained(model_dir(w.model)))
    steps = [count({a: arm_steps[a][i] for a in ARMS}, sizes) for i in range(len(arm_steps["trl"]))]
    totals = {
        a: {k: sum(s[a][k] for s in steps) for k in steps[0][a] if k != "padding_share"}
        for a in ARMS
    }
    for a in ARMS:
        totals[a]["padding_share"] = 1 - totals[a]["non_pad_tokens"] / totals[a]["positions"]
        totals[a].pop("row_length")
    ratios = {
        a: {k: totals["trl"][k] / totals[a][k] for k in totals[a]
            if k != "padding_share" and totals[a][k]}
        for a in ("ours", "ours_rows")
    }  # fmt: skip
    result: dict[str, Any] = {
        "machine": machine(), "workload": dataclasses.asdict(w), "prepare": prep,
        "sizes": dataclasses.asdict(sizes), "steps": steps, "totals": totals,
        "ratios_trl_over_ours": ratios,
        "load_average_before": os.getloadavg()[0],
    }  # fmt: skip
    if do_measure:
        result["measured"] = measure(w, arm_steps, rounds)
        result["load_average_after"] = os.getloadavg()[0]
    return result


def markdown(result: dict[str, Any]) -> str:
    w, t, s = result["workload"], result["totals"], result["sizes"]
    r = result["ratios_trl_over_ours"]
    timed = w["steps"] - w["warmup_steps"]
    micro = w.get("micro_batch_size") or w["batch_size"]
    unit = "step" if micro == w["batch_size"] else f"micro-batch of {micro} pairs"
    lines = [
        f"### DPO step accounting: ours vs TRL (model `{w['model']}`, {timed} timed steps of "
        f"{w['batch_size']} pairs, in micro-batches of {micro})",
        "",
        f"Body {s['body_params'] / 1e6:.1f}M matmul parameters per position, LM head "
        f"{s['head_params'] / 1e6:.1f}M. Totals over the timed steps. `ours`: one row per "
        "micro-batch, no padding, attention pair by pair; `ours_rows`: the previous layout "
        "(rows no longer than the longest pair, whole-row attention).",
        "",
        "| | ours | ours_rows | TRL | TRL / ours | TRL / ours_rows |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, label in (
        ("positions", "body positions (rows x length)"),
        ("non_pad_tokens", "non-pad tokens among them"),
        ("head_positions", "LM-head positions"),
        ("score_entries", "attention score entries"),
        ("policy_body_gflop", "policy body fwd+bwd GFLOP"),
        ("policy_head_gflop", "policy head fwd+bwd GFLOP"),
        ("reference_gflop", "reference fwd GFLOP"),
        ("total_gflop", "total GFLOP"),
    ):
        lines.append(
            f"| {label} | {t['ours'][key]:,.0f} | {t['ours_rows'][key]:,.0f} | "
            f"{t['trl'][key]:,.0f} | {r['ours'][key]:.2f}x | {r['ours_rows'][key]:.2f}x |"
        )
    lines.append(
        "| padding share of positions | "
        + " | ".join(f"{t[a]['padding_share']:.0%}" for a in ARMS)
        + " | | |"
    )
    m = result.get("measured")
    if m:
        lines += [
            "",
            f"Measured in one process, arms rotating batch by batch, {m['threads']} thread(s), "
            f"median of {m['rounds']} rounds, CPU seconds (wall) per {unit} (an optimizer step, "
            f"at lr 0, after each); load average "
            f"{result['load_average_before']:.1f} -> {result['load_average_after']:.1f}:",
            "",
            "| phase | ours CPU-s (wall) | ours_rows CPU-s (wall) | TRL CPU-s (wall) "
            "| TRL / ours CPU | TRL / ours_rows CPU |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in (*PHASES, "step"):
            cells = " | ".join(f"{m[a]['cpu'][p]:.2f} ({m[a]['wall'][p]:.2f})" for a in ARMS)
            ratios = " | ".join(f"{m['cpu_ratio_trl_over'][a][p]:.2f}x"
                                for a in ("ours", "ours_rows"))  # fmt: skip
            lines.append(f"| {p} | {cells} | {ratios} |")
        lines += ["", f"Summed log-probs of the arms agree to "
                      f"{m['summed_logps_max_abs_diff']:.1e} (fp32)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dpo_accounting")
    parser.add_argument("--model", choices=MODEL_CHOICES, default="real")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--micro-batch-size", type=int, default=None,
        help="pairs per forward/backward in both arms (benchmarks.dpo --micro-batch-size "
        "--trl-micro-batches); default: the whole step",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--measure", action="store_true", help="also time both arms' steps")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    w = Workload(model=args.model, steps=args.steps, batch_size=args.batch_size,
                 micro_batch_size=args.micro_batch_size, threads=args.threads)  # fmt: skip
    result = run(w, args.measure, args.rounds)
    text = markdown(result)
    print(text)
    json_path, _ = write_results(f"{timestamp()}-dpo-accounting", result, text)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
