"""GRPO side by side: our `policy_gradients.train.train` against `trl.GRPOTrainer` (no vLLM).

The workload (the same for both):
  model       `--model real` (the headline: a Qwen3 with Qwen3-0.6B's proportions, hidden 512,
              22 layers, 95.0M parameters, LM head ~27% of forward FLOPs), `wide` (a second
              real-proportion shape: hidden 768, 16 layers, GQA 12/3, head ~26%), `small`, or `tiny`
              (the preset `tiny-qwen3-gpt2`, hidden 64, 2 layers: head-dominated), all with the
              real GPT-2 tokenizer (`benchmarks.workload.model_dir`), fp32 (`--dtype bf16`: both
              arms load the weights in bf16 and train them so, AdamW state included, no autocast:
              how a bf16 checkpoint trains on a GPU), CPU, `threads` torch threads (default 1)
  prompts     reasoning-gym spell_backward (size 512, seed 1) questions as one user message each,
              rendered with the chat template; TRL gets the same messages in a `prompt` column, in
              the order of our sampler's first epoch, with `shuffle_dataset=False`, so both arms
              see the same `prompts_per_step` prompts at every step
  rollout     `group_size` completions per prompt, `max_new_tokens` new tokens at most,
              temperature 1.0 (top-p 1, top-k off), HF `generate` with the KV cache in both
  reward      reasoning-gym's own `score_answer` on the whole stripped completion (ours:
              `rewards: [{name: reasoning_gym, extract: full}]`; TRL: a reward function calling
              the same dataset's `score_answer` on the same entry)
  algorithm   GRPO advantages (group mean / std), clipped ratio loss eps 0.2, no KL (beta 0),
              one optimizer step per rollout batch, by default the whole batch in one
              micro-batch (ours `ppo_epochs: 1, micro_batch_size: 64`; TRL `num_iterations=1,
              per_device_train_batch_size=64, generation_batch_size=64,
              gradient_accumulation_steps=1`); `--micro-batch 32` gives both arms two
              micro-batches of 32 rows per step (ours `micro_batch_size: 32`; TRL
              `per_device_train_batch_size=32, gradient_accumulation_steps=2`, still one
              generation of 64 per step), aggregation seq-mean-token-mean (TRL
              `loss_type="grpo"`), AdamW lr 1e-6 constant, no warmup, clip 1.0, no eval, no
              checkpoints, logging every step

What is timed: seconds per optimizer step (generation, rewards, forward/backward, optimizer,
logging), the median over steps warmup_steps+1..steps, measured between the ends of consecutive
optimizer steps (ours: `rlhf_core.loop.optimizer_step` wrapped in `policy_gradients.train`; TRL: a
`TrainerCallback.on_step_end`). Tokens: non-pad prompt + completion tokens fed to the training
forward. Sampling differs between the arms (different RNG streams), so completion lengths differ;
the mean completion length of the timed steps is reported for each arm. Our arm also reports
where its timed steps went (generation, reward scoring, old/reference log-probs, the training
forward/backward + optimizer), from its own `time/` metrics.

    uv run --group bench python -m benchmarks.grpo [--model real] [--rounds 2] [--steps 6]
runs alternating fresh processes `ours` / `trl` and writes
`benchmarks/results/<time>-grpo.{json,md}`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    PeakRSS,
    machine,
    median,
    rss_mb,
    run_worker,
    spread,
    timestamp,
    write_result_file,
    write_results,
)
from benchmarks.workload import (
    MODEL_CHOICES,
    TORCH_DTYPES,
    JsonDataclass,
    StepClock,
    clock_steps,
    count_params,
    model_dir,
    run_our_trainer,
    trl_clock,
    worker_parser,
    worker_result,
)

ARMS = ("ours", "trl")
LABELS = {"ours": "ours (policy_gradients, GRPO)", "trl": "TRL GRPOTrainer"}


@dataclass(frozen=True)
class Workload(JsonDataclass):
    model: str = "tiny"  # benchmarks.workload.MODEL_CHOICES: tiny, small, real
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    steps: int = 6
    warmup_steps: int = 1
    threads: int = 1
    lr: float = 1e-6
    temperature: float = 1.0
    dataset_size: int = 512
    dataset_seed: int = 1
    seed: int = 0
    micro_batch: int = 0  # rows per forward/backward in both arms; 0 = the whole batch at once
    dtype: str = "fp32"  # the weights (and so AdamW state) of both arms: fp32, or bf16 (pure)

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def micro(self) -> int:
        return self.micro_batch or self.batch


def _rg_source(w: Workload) -> dict[str, Any]:
    return {"task": "spell_backward", "size": w.dataset_size, "seed": w.dataset_seed}


def prepare(w: Workload, workdir: Path) -> dict[str, Any]:
    """Build (or find) the benchmark model; describe it."""
    from transformers import AutoConfig

    path = model_dir(w.model)
    config = AutoConfig.from_pretrained(path)
    name = "tiny-qwen3-gpt2" if w.model == "tiny" else f"qwen3-gpt2-{w.model}"
    return {
        "model_dir": str(path),
        "model": {"name": name, "parameters": count_params(config),
                  "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                  "layers": config.num_hidden_layers},
        "work": work(w, path, config),
    }  # fmt: skip


def work(w: Workload, path: Path, config: Any) -> dict[str, Any]:
    """What each arm computes per timed step (`benchmarks.flops`), every completion taken at
    the `max_new_tokens` cap (an untrained model never stops early; both arms report their
    mean completion length to check it), P the step's padded prompt width:

    - generation, both: C - 1 single-token forwards of the N x G rows after the prefill
      (`decode_gflop`); the prefill: ours N rows (each prompt once, its KV cache shared by its
      G samples), TRL's `generate` the N x G repeated prompts;
    - training, per micro-batch of m rows: ours (`shared_prompt_logprobs`, groups contiguous)
      its m / G prompts once, then m rows of C completion positions attending to P + C, the
      head on the m x C targets; TRL m rows of P + C positions, the whole (P + C)^2 attention,
      the head on every position (its fused head, `fused_lm_head=True`, scores all of them
      without Triton)."""
    from benchmarks.flops import Shapes
    from rlhf_core.chat import render_prompt
    from rlhf_core.data import EpochSampler, ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.models import ModelConfig, load_tokenizer

    shapes = Shapes.of(config)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(path)), padding_side="left")
    entries = list(reasoning_gym_dataset(ReasoningGymSource(**_rg_source(w))))
    order = EpochSampler(len(entries), w.seed).next_batch(w.prompts_per_step * w.steps)
    n, g, c, m = w.prompts_per_step, w.group_size, w.max_new_tokens, w.micro
    parts = {a: {"generation": 0.0, "training": 0.0} for a in ARMS}
    for s in range(w.warmup_steps, w.steps):
        texts = [
            render_prompt(tokenizer, [{"role": "user", "content": entries[i]["question"]}])
            for i in order[s * n : (s + 1) * n]
        ]
        p = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
        decode = shapes.decode_gflop(n * g, p, c)
        parts["ours"]["generation"] += shapes.forward_gflop(n * p, n, n * p * p) + decode
        parts["trl"]["generation"] += shapes.forward_gflop(n * g * p, n * g, n * g * p * p) + decode
        for _ in range(n * g // m):
            u = max(m // g, 1)  # the micro-batch's distinct prompts
            parts["ours"]["training"] += shapes.train_gflop(
                u * p + m * c, m * c, u * p * p + m * c * (p + c)
            )
            parts["trl"]["training"] += shapes.train_gflop(
                m * (p + c), m * (p + c - 1), m * (p + c) ** 2
            )
    timed = w.steps - w.warmup_steps
    return {
        a: {k: v / timed for k, v in {**d, "step": sum(d.values())}.items()}
        for a, d in parts.items()
    }


def run_ours(w: Workload, workdir: Path) -> dict[str, Any]:
    memory = PeakRSS()

    import policy_gradients.train as pg_train
    from policy_gradients.config import PGConfig

    after_imports = rss_mb()
    clock = StepClock(w.warmup_steps, memory)
    cfg = PGConfig.model_validate({
        "name": "bench_grpo", "seed": w.seed,
        "model": {"name_or_path": str(model_dir(w.model)), "dtype": w.dtype},
        "data": {"train": {"reasoning_gym": _rg_source(w)}},
        "rewards": [{"name": "reasoning_gym", "extract": "full"}],
        "algorithm": {
            "name": "grpo",
            "advantage": {"name": "grpo", "eps": 1e-6, "scale_rewards": True},
            "loss": {"name": "clipped", "eps_low": 0.2, "eps_high": 0.2,
                     "aggregation": "seq-mean-token-mean", "kl_beta": 0.0},
            "kl_in_reward": {"beta": 0.0}, "value_loss": None, "ppo_epochs": 1,
            "dynamic_sampling": False,
        },
        "rollout": {"prompts_per_step": w.prompts_per_step, "group_size": w.group_size,
                    "max_new_tokens": w.max_new_tokens, "temperature": w.temperature},
        "train": {"max_steps": w.steps, "micro_batch_size": w.micro, "threads": w.threads,
                  "device": "cpu", "eval_every": 0},
        "optim": {"lr": w.lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                  "max_grad_norm": 1.0, "master_weights": False},  # TRL's bf16 arm is pure bf16
        "checkpoint": {"save_every": 0, "save_final": False},
        "tracking": {"log_every": 1, "plot_every": 10_000},
    })  # fmt: skip
    import policy_gradients.update as pg_update  # the training forward's owner

    original_logprobs = pg_update.completion_logprobs

    def counted_logprobs(model, ids, attention_mask, *args, **kwargs):  # the training forward
        clock.count(attention_mask)
        return original_logprobs(model, ids, attention_mask, *args, **kwargs)

    clock_steps(pg_update, clock)  # policy_gradients.update calls optimizer_step
    pg_update.completion_logprobs = counted_logprobs
    metrics = run_our_trainer(pg_train, cfg, workdir, "benchmarks/grpo.py")
    per_step = [m for m in metrics if "train/length/mean" in m]
    timed = per_step[w.warmup_steps :]
    phases = {k: sum(m.get(k, 0.0) for m in timed) / len(timed)
              for k in sorted({k for m in timed for k in m if "time/" in k})}  # fmt: skip
    return {
        **worker_result("ours", clock, memory, after_imports),
        "completion_length_per_step": [m["train/length/mean"] for m in per_step],
        "completion_length_mean": sum(m["train/length/mean"] for m in timed) / len(timed),
        "reward_per_step": [m.get("train/reward/total") for m in per_step],
        "phase_s_mean": phases,
    }  # fmt: skip


def run_trl(w: Workload, workdir: Path) -> dict[str, Any]:
    memory = PeakRSS()
    import torch

    torch.set_num_threads(w.threads)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.data import EpochSampler, ReasoningGymSource, reasoning_gym_dataset
    from rlhf_core.models import ModelConfig, load_tokenizer

    after_imports = rss_mb()
    clock = StepClock(w.warmup_steps, memory)
    path = str(model_dir(w.model))
    # our loader: the same tokenizer and chat template as our arm (the preset has none of its own)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=path), padding_side="left")
    scorer = reasoning_gym_dataset(ReasoningGymSource(**_rg_source(w)))
    entries = list(scorer)
    # our sampler's first-epoch order, so both arms see the same prompts at every step
    order = EpochSampler(len(entries), w.seed).next_batch(w.prompts_per_step * w.steps)
    rows = [
        {"prompt": [{"role": "user", "content": entries[i]["question"]}], "entry_index": i}
        for i in order
    ]

    def spell_backward_reward(prompts, completions, entry_index, **kwargs):
        out = []
        for completion, i in zip(completions, entry_index, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            out.append(float(scorer.score_answer(text.strip(), entries[i])))
        return out

    out_dir = workdir / f"trl-run-{time.time_ns()}"
    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=w.micro,
        generation_batch_size=w.batch, gradient_accumulation_steps=w.batch // w.micro,
        num_generations=w.group_size, num_iterations=1, max_completion_length=w.max_new_tokens,
        temperature=w.temperature, top_p=1.0, top_k=0, beta=0.0, loss_type="grpo",
        scale_rewards="group", epsilon=0.2, max_steps=w.steps, learning_rate=w.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False,
        shuffle_dataset=False, seed=w.seed, model_init_kwargs={"dtype": TORCH_DTYPES[w.dtype]},
        logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip

    trainer = GRPOTrainer(
        model=path, reward_funcs=spell_backward_reward, args=args,
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=[trl_clock(clock)],
    )  # fmt: skip
    original_compute_loss = trainer.compute_loss

    def counted_loss(model, inputs, *rest, **kwargs):
        clock.add(int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()))
        return original_compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = counted_loss
    trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    timed = logs[w.warmup_steps :]
    return {
        **worker_result("trl", clock, memory, after_imports), "optimizer": str(args.optim),
        "completion_length_per_step": [h["completions/mean_length"] for h in logs],
        "completion_length_mean": sum(h["completions/mean_length"] for h in timed) / len(timed),
        "reward_per_step": [h.get("reward") for h in logs],
    }  # fmt: skip


def compare(w: Workload, rounds: int, timeout: float = 600) -> dict[str, Any]:
    """Prepare once, then `rounds` rounds of one fresh process per arm, alternating the order."""
    host = machine()
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-grpo-") as tmp:
        common = ["--workload", w.to_json(), "--workdir", tmp]
        module = "benchmarks.grpo"
        prep = run_worker(module, ["prepare", *common], threads=w.threads, timeout=timeout)
        runs = []
        for r in range(rounds):
            for impl in ARMS if r % 2 == 0 else ARMS[::-1]:
                out = run_worker(module, [impl, *common], threads=w.threads, timeout=timeout)
                out["round"] = r
                runs.append(out)
                print(f"  round {r + 1}/{rounds} {impl:5s}: {out['step_s_median']:.3f} s/step, "
                      f"completion length {out['completion_length_mean']:.1f}, "
                      f"peak RSS {out['peak_rss_mb']:.0f} MiB", flush=True)  # fmt: skip
    keys = ("step_s_median", "tokens_per_s", "tokens_per_cpu_s", "completion_length_mean",
            "peak_rss_mb", "peak_rss_timed_mb", "process_wall_s")  # fmt: skip
    arms = {a: {k: median([r[k] for r in runs if r["impl"] == a]) for k in keys} for a in ARMS}
    for a in ARMS:
        arms[a]["step_s_range"] = spread([r["step_s_median"] for r in runs if r["impl"] == a])
    by_round: dict[int, dict[str, Any]] = {r["round"]: {} for r in runs}
    for r in runs:
        by_round[r["round"]][r["impl"]] = r
    speedup = median([p["trl"]["step_s_median"] / p["ours"]["step_s_median"]
                      for p in by_round.values()])  # fmt: skip
    ours = [r for r in runs if r["impl"] == "ours"]
    done = prep["work"]
    # CPU-seconds per step = step seconds x tokens/s / tokens per CPU-second
    cpu_s = {a: arms[a]["step_s_median"] * arms[a]["tokens_per_s"] / arms[a]["tokens_per_cpu_s"]
             for a in ARMS}  # fmt: skip
    work_summary = {
        "trl_over_ours_gflop": done["trl"]["step"] / done["ours"]["step"],
        "gflop_per_cpu_s": {a: done[a]["step"] / cpu_s[a] for a in ARMS},
    }
    return {
        "machine": host, "workload": asdict(w), "prepare": prep, "runs": runs,
        "summary": {
            "arms": arms,
            "step_rate_ratio_ours_over_trl": speedup,
            "tokens_per_s_ratio_ours_over_trl": median(
                [p["ours"]["tokens_per_s"] / p["trl"]["tokens_per_s"] for p in by_round.values()]
            ),
            "peak_rss_ratio_ours_over_trl": median(
                [p["ours"]["peak_rss_mb"] / p["trl"]["peak_rss_mb"] for p in by_round.values()]
            ),
            "target_step_rate_3x": speedup >= 3.0,
            "target_peak_rss_half": median(
                [p["ours"]["peak_rss_mb"] / p["trl"]["peak_rss_mb"] for p in by_round.values()]
            ) <= 0.5,
            "ours_phase_s_mean": {
                k: median([r["phase_s_mean"].get(k, 0.0) for r in ours])
                for k in ours[0]["phase_s_mean"]
            },
            "load_average_range": spread([r["load_average_before"] for r in runs]),
            "work": work_summary,
        },
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    w, s, m = result["workload"], result["summary"], result["prepare"]["model"]
    rounds = len({r["round"] for r in result["runs"]})
    batch = w["prompts_per_step"] * w["group_size"]
    micro_batches = batch // (w.get("micro_batch") or batch)
    lines = [
        f"### GRPO: ours vs `trl.GRPOTrainer` {result['machine']['versions']['trl']} (no vLLM)",
        "",
        f"Model `{m['name']}` ({m['parameters'] / 1e6:.1f}M parameters), reasoning-gym "
        f"spell_backward, {w['prompts_per_step']} prompts x {w['group_size']} completions per "
        f"step, {w['max_new_tokens']} max new tokens, temperature {w['temperature']}, no KL, one "
        f"update per batch in {micro_batches} micro-batch(es) in both arms, "
        f"{w.get('dtype', 'fp32')} weights (pure, no autocast), CPU, "
        f"{w['threads']} thread(s); {w['steps']} steps "
        f"({w['steps'] - w['warmup_steps']} timed), {rounds} rounds; "
        f"load average {s['load_average_range']}.",
        "",
        "| arm | s/step (median, range) | steps/s | tokens/s | tokens/CPU-s "
        "| mean completion length | peak RSS MiB (timed steps) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, label in LABELS.items():
        a = s["arms"][arm]
        lines.append(
            f"| {label} | {a['step_s_median']:.3f} ({a['step_s_range']}) | "
            f"{1 / a['step_s_median']:.2f} | {a['tokens_per_s']:.0f} | "
            f"{a['tokens_per_cpu_s']:.0f} | {a['completion_length_mean']:.1f} | "
            f"{a['peak_rss_mb']:.0f} ({a['peak_rss_timed_mb']:.0f}) |"
        )
    lines += [
        "",
        f"ours / TRL (median of per-round ratios): step rate "
        f"{s['step_rate_ratio_ours_over_trl']:.2f}x, tokens/s "
        f"{s['tokens_per_s_ratio_ours_over_trl']:.2f}x, peak RSS "
        f"{s['peak_rss_ratio_ours_over_trl']:.2f}x.",
        "",
        f"Targets (issue 15): >= 3x TRL step rate: {s['target_step_rate_3x']}; <= 50% of its "
        f"peak RSS: {s['target_peak_rss_half']}.",
        "",
        "Where our timed steps go (mean s/step): "
        + ", ".join(f"{k.split('time/')[-1]} {v:.2f}" for k, v in s["ours_phase_s_mean"].items())
        + ".",
        "",
    ]
    done, ws = result["prepare"]["work"], s["work"]
    lines += [
        "Work per timed step (`benchmarks.flops`; every completion at the cap; generation "
        "includes the prefill, training is forward + backward) and the rate each arm did it "
        "at. The step-rate ratio is about the work ratio times the rate ratio: where the work "
        "ratio is below a target, only less work or a slower peer meets it.",
        "",
        "| arm | generation GFLOP | training GFLOP | step GFLOP | GFLOP per CPU-s |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {LABELS[a]} | {done[a]['generation']:.0f} | {done[a]['training']:.0f} | "
            f"{done[a]['step']:.0f} | {ws['gflop_per_cpu_s'][a]:.1f} |"
            for a in ARMS
        ),
        "",
        f"TRL / ours work: {ws['trl_over_ours_gflop']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser("python -m benchmarks.grpo", __doc__, ARMS, rounds=2)
    parser.add_argument(
        "--model",
        choices=MODEL_CHOICES,
        default="tiny",
        help="benchmark model (real: Qwen3-0.6B proportions, the headline; wide: a second "
        "real-proportion shape)",
    )
    fields = (
        "model", "prompts_per_step", "group_size", "max_new_tokens", "steps", "threads",
        "micro_batch", "dtype",
    )  # fmt: skip
    defaults = Workload()
    for field in fields[1:]:
        value = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    if args.command is not None:  # a measured worker process
        w = Workload.from_json(args.workload)
        worker = {"prepare": prepare, "ours": run_ours, "trl": run_trl}[args.command]
        write_result_file(args.result, worker(w, args.workdir))
        return 0
    w = replace(defaults, **{f: getattr(args, f) for f in fields})
    if w.micro_batch < 0 or (w.micro_batch and w.batch % w.micro_batch):
        parser.error(f"--micro-batch {w.micro_batch} must divide the batch of {w.batch} rows")
    if w.dtype not in TORCH_DTYPES:
        parser.error(f"--dtype {w.dtype!r}: expected one of {', '.join(TORCH_DTYPES)}")
    print(f"GRPO vs TRL: {w}, {args.rounds} rounds", flush=True)
    result = compare(w, args.rounds)
    text = markdown(result)
    payload = {"grpo": result, "command": sys.argv}
    paths = write_results(f"{timestamp()}-grpo", payload, text, latest=False)
    print("\n" + text + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
