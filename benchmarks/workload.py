"""The workload the DPO, reward-model and techniques benchmarks share, and the step clock.

    Workload       model, batch, steps, lengths, threads, lr, beta, seed (a frozen dataclass, passed
                   to worker processes as JSON)
    model_dir      the benchmark model's directory (`tiny` = the preset tiny-qwen3-gpt2, the others
                   (`BENCH_MODELS`: `small`, `real`, `wide`) built once into the rlhf-lab cache)
    prepare        select the HH pairs neither trainer truncates and write both trainers' inputs
    count_params   parameters of a tied-embedding Qwen3 config
    StepClock      optimizer-step end times, CPU times and non-pad tokens of a timed window
    clock_steps, count_batch_tokens, run_our_trainer
                   what every arm of ours shares: its step clock, its tokens, its run
    trl_inputs, trl_arguments, trl_clock, count_trl_tokens, last_logged_loss
                   what every TRL arm shares: its inputs, TrainingArguments, step clock, tokens
    worker_parser  the command line every side-by-side benchmark module shares
    round_ratios, run_checks, arm_rows, ratio_line
                   what their reports share: per-round ratios, the runs' checks, table rows

See `benchmarks.dpo` for what is timed and why the pairs are selected as they are.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.measure import (
    REPO_ROOT,
    PeakRSS,
    median,
    peak_rss_mb,
    rss_mb,
    run_worker,
    spread,
)

HH_PATH = REPO_ROOT / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"

#: Architectures beyond the tiny preset (built with `rlhf_core.tiny.build_tiny_model`, GPT-2
#: vocabulary, tied embeddings). `tiny` and `small` are head-dominated: most of their FLOPs are the
#: LM head, so a trainer that skips the head on prompt positions looks far faster than it would on
#: a real model. `real` has Qwen3-0.6B's proportions: its LM head is ~27% of forward FLOPs
#: (Qwen3-0.6B: ~26%), 95.0M parameters (hidden 512, 22 layers, GQA 8/4 heads, MLP 3x hidden).
#: `wide` is a second real-proportion shape, wider, shallower and with a higher GQA ratio than
#: `real` (hidden 768, 16 layers, GQA 12/3 heads, MLP 3x hidden): its LM head is ~26% of forward
#: FLOPs, 147M parameters; speed rules tuned on `real` are checked on it.
BENCH_MODELS: dict[str, dict[str, int]] = {
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 768,
        "max_position_embeddings": 1024,
    },
    "real": {
        "hidden_size": 512,
        "num_hidden_layers": 22,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
        "max_position_embeddings": 1024,
    },
    "wide": {
        "hidden_size": 768,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "intermediate_size": 2304,
        "max_position_embeddings": 1024,
    },
}
MODEL_CHOICES = ("tiny", *BENCH_MODELS)


class JsonDataclass:
    """A dataclass passed to a worker process as JSON (`--workload`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls(**json.loads(text))


#: A workload's `dtype` as transformers' `from_pretrained(dtype=...)` spells it (the TRL arms).
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Workload(JsonDataclass):
    model: str = "tiny"  # one of MODEL_CHOICES: "tiny" (preset tiny-qwen3-gpt2) or BENCH_MODELS
    batch_size: int = 4
    # ours (DPO): the step's pairs in micro-batches of this many, gradients accumulated (same
    # effective batch and loss); None = one forward per step, like the TRL arm
    micro_batch_size: int | None = None
    # with micro_batch_size: TRL's DPO arm gets the same micro-batches (per_device_train_batch_size
    # = micro_batch_size, gradient accumulation over the step), like for like
    trl_micro_batches: bool = False
    steps: int = 8
    warmup_steps: int = 1  # steps before the timed window
    max_length: int = 256
    max_prompt_length: int = 192
    threads: int = 1
    lr: float = 1e-6
    beta: float = 0.1
    seed: int = 0
    log_every: int = 10
    # the weights (and so gradients and AdamW state) of every arm: "fp32", or "bf16" trained
    # as bf16 with no autocast (how a bf16 checkpoint trains on a GPU)
    dtype: str = "fp32"
    # our arm's `train.speed` switches (rlhf_core.fastpath.SpeedConfig), e.g. {"segmented_rows":
    # false}: to time the speed plan's decisions one at a time on a shape (empty = the plan)
    speed: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.warmup_steps < self.steps:
            raise ValueError(f"need 1 <= warmup_steps < steps: {self.warmup_steps}/{self.steps}")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(TORCH_DTYPES)}")

    @property
    def pairs(self) -> int:
        return self.batch_size * self.steps


#: The vendored Qwen2 tokenizer (151,669 tokens), for measurements at a Qwen-sized vocabulary.
QWEN2_TOKENIZER_DIR = REPO_ROOT / "benchmarks" / "assets" / "qwen2"


def model_dir(name: str, vocab: str = "gpt2") -> Path:
    """The model directory of workload model `name`, built once into the rlhf-lab cache, with
    the GPT-2 vocabulary or (`vocab="qwen2"`) the vendored Qwen2 one."""
    from rlhf_core.tiny import (
        TinyPreset,
        build_gpt2_tokenizer,
        build_tiny_model,
        cache_root,
        preset_dir,
    )

    if name == "tiny" and vocab == "gpt2":
        return preset_dir("tiny-qwen3-gpt2")
    if name not in BENCH_MODELS or vocab not in ("gpt2", "qwen2"):
        raise ValueError(f"unknown benchmark model {name!r} / vocabulary {vocab!r}; expected one "
                         f"of {tuple(BENCH_MODELS)} / gpt2, qwen2")  # fmt: skip
    import transformers
    from transformers import AutoTokenizer

    preset = TinyPreset(tokenizer=vocab, **BENCH_MODELS[name])
    spec = json.dumps({"preset": asdict(preset), "tf": transformers.__version__})
    target = (
        cache_root()
        / "bench"
        / f"qwen3-{vocab}-{name}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"
    )
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{vocab}-{name}-", dir=target.parent))
    try:
        if vocab == "gpt2":
            tokenizer = build_gpt2_tokenizer()
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(QWEN2_TOKENIZER_DIR))
        build_tiny_model(preset, tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare(w: Workload, workdir: Path) -> dict[str, Any]:
    """Select the pairs and write the inputs of both trainers into `workdir`:

    hh_subset.jsonl   the selected raw HH rows (our trainer reads this with format hh)
    trl_rows.jsonl    prompt/chosen/rejected strings in our sampler's first-epoch order
    expected.json     our token ids of those rows, and the non-pad tokens of each step's batch
    """
    import torch

    from direct_alignment.data import build_preference_data
    from rlhf_core.chat import render_prompt
    from rlhf_core.data import DataSource, EpochSampler
    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_core.preference import collate_pairs, preference_row

    path = model_dir(w.model)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(path)), padding_side="right")
    eos = tokenizer.eos_token_id
    rows, texts, skipped = [], [], {"too_long": 0, "identical": 0, "joint_tokenization": 0}
    with gzip.open(HH_PATH, "rt") as fh:
        for index, line in enumerate(fh):
            row = json.loads(line)
            prompt, chosen, rejected = preference_row(row, index, "hh", str(HH_PATH))
            prompt_text = render_prompt(tokenizer, prompt)
            p, c, r = (
                tokenizer(t, add_special_tokens=False)["input_ids"]
                for t in (prompt_text, chosen, rejected)
            )
            if len(p) > w.max_prompt_length or len(p) + max(len(c), len(r)) + 1 > w.max_length:
                skipped["too_long"] += 1
                continue
            if c == r:
                skipped["identical"] += 1
                continue
            # TRL tokenizes prompt + completion in one call; keep rows where that splits the same
            joint = [
                tokenizer(prompt_text + t + tokenizer.eos_token, add_special_tokens=False)
                for t in (chosen, rejected)
            ]
            if joint[0]["input_ids"] != p + c + [eos] or joint[1]["input_ids"] != p + r + [eos]:
                skipped["joint_tokenization"] += 1
                continue
            rows.append(row)
            texts.append({"prompt": prompt_text, "chosen": chosen, "rejected": rejected})
            if len(rows) == w.pairs:
                break
    if len(rows) < w.pairs:
        raise ValueError(f"only {len(rows)} HH pairs fit max_length {w.max_length}")
    workdir.mkdir(parents=True, exist_ok=True)
    subset = workdir / "hh_subset.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # Our pipeline on the subset must keep every pair untouched, in file order.
    data = build_preference_data(
        DataSource(path=str(subset)), tokenizer, fmt="hh", max_length=w.max_length,
        max_prompt_length=w.max_prompt_length, where="benchmark",
    )  # fmt: skip
    if len(data.pairs) != w.pairs or data.truncated or data.dropped_identical:
        raise RuntimeError(f"our pipeline changed the selected pairs: {data}")
    order = EpochSampler(w.pairs, w.seed).next_batch(w.pairs)
    (workdir / "trl_rows.jsonl").write_text("".join(json.dumps(texts[i]) + "\n" for i in order))
    expected = [
        {"prompt_ids": data.pairs[i].prompt_ids, "chosen_ids": data.pairs[i].chosen_ids,
         "rejected_ids": data.pairs[i].rejected_ids}
        for i in order
    ]  # fmt: skip
    step_tokens, step_padded = [], []
    for s in range(w.steps):
        batch = collate_pairs(
            [data.pairs[i] for i in order[s * w.batch_size : (s + 1) * w.batch_size]], 0
        )
        step_tokens.append(int(batch["attention_mask"].sum()))
        step_padded.append(int(batch["attention_mask"].numel()))
    (workdir / "expected.json").write_text(
        json.dumps({"pairs": expected, "step_tokens": step_tokens})
    )
    lengths = [len(p.prompt_ids) + len(p.chosen_ids) for p in data.pairs] + [
        len(p.prompt_ids) + len(p.rejected_ids) for p in data.pairs
    ]
    completion = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in data.pairs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    params = count_params(config)
    return {
        "model_dir": str(path),
        "model": {"name": w.model, "parameters": params, "vocab_size": config.vocab_size,
                  "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
                  "intermediate_size": config.intermediate_size},
        "rows_scanned": index + 1,
        "rows_skipped": skipped,
        "pairs": w.pairs,
        "sequence_tokens": {"mean": sum(lengths) / len(lengths), "max": max(lengths)},
        "completion_token_share": completion / sum(lengths),
        "step_tokens": step_tokens,
        "padding_share": 1 - sum(step_tokens) / sum(step_padded),
        "torch_threads_default": torch.get_num_threads(),
    }  # fmt: skip


def count_params(config) -> int:
    """Parameters of a tied-embedding Qwen3 config (embedding + layers + final norm)."""
    h, v, m, layers = (
        config.hidden_size, config.vocab_size, config.intermediate_size, config.num_hidden_layers
    )  # fmt: skip
    d = config.head_dim
    attn = h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2) + 2 * d
    per_layer = attn + 3 * h * m + 2 * h
    return v * h + layers * per_layer + h


# ----------------------------------------------------------------------------- the step clock


class StepClock:
    """Optimizer-step end times (wall and process CPU) and per-step non-pad tokens; resets the
    RSS high-water mark at the start of the timed window."""

    def __init__(self, warmup_steps: int, memory: PeakRSS) -> None:
        self.warmup_steps = warmup_steps
        self.memory = memory
        self.tokens: list[int] = []  # per optimizer step (all its forwards: micro-batches)
        self._pending = 0
        self.ends: list[float] = []
        self.cpu: list[tuple[float, float]] = []  # (user, system) CPU seconds, all threads
        self.start = time.perf_counter()

    def count(self, attention_mask) -> None:
        self.add(int(attention_mask.sum()))

    def add(self, tokens: int) -> None:
        """Count `tokens` towards the current optimizer step."""
        self._pending += tokens

    def step_done(self) -> None:
        if len(self.ends) + 1 == self.warmup_steps:
            self.memory.phase("setup_and_warmup")
        self.tokens.append(self._pending)
        self._pending = 0
        cpu = os.times()
        self.cpu.append((cpu.user, cpu.system))
        self.ends.append(time.perf_counter())

    def summary(self) -> dict[str, Any]:
        w = self.warmup_steps
        window = self.ends[-1] - self.ends[w - 1]
        tokens = sum(self.tokens[w:])
        steps = [b - a for a, b in zip(self.ends[w - 1 : -1], self.ends[w:], strict=True)]
        user = self.cpu[-1][0] - self.cpu[w - 1][0]
        system = self.cpu[-1][1] - self.cpu[w - 1][1]
        return {
            "steps": len(self.ends),
            "timed_steps": len(self.ends) - w,
            "timed_s": window,
            "timed_tokens": tokens,
            "tokens_per_s": tokens / window,
            "timed_cpu_user_s": user,
            "timed_cpu_system_s": system,
            "tokens_per_cpu_s": tokens / (user + system),
            "system_share_of_cpu": system / (user + system),
            "step_s_median": median(steps),
            "step_s": steps,
            "step_tokens": self.tokens,
            "to_first_step_end_s": self.ends[0] - self.start,
        }


def trl_clock(clock: StepClock) -> Any:
    """A transformers `TrainerCallback` that ends a `clock` step at each optimizer step's end
    (the TRL arms' step clock)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done()

    return Clock()


def trl_arguments(w: Any, out_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The TrainingArguments keywords the TRL arms share (`w`: a Workload): the workload's batch,
    steps, learning rate and seed; a cosine schedule with no warm-up and no weight decay; clip at
    1.0; the workload's dtype (no autocast), SDPA on the CPU; the rows in order; no saving,
    evaluation, progress bar or data workers. `overrides` add or replace the trainer's own (e.g.
    DPO's beta)."""
    return {
        "output_dir": str(out_dir), "per_device_train_batch_size": w.batch_size,
        "gradient_accumulation_steps": 1, "max_steps": w.steps, "learning_rate": w.lr,
        "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "max_length": w.max_length, "bf16": False, "fp16": False,
        "gradient_checkpointing": False, "use_cpu": True, "seed": w.seed,
        "train_sampling_strategy": "sequential",
        "model_init_kwargs": {"dtype": TORCH_DTYPES[w.dtype], "attn_implementation": "sdpa"},
        "logging_steps": w.log_every, "report_to": "none", "save_strategy": "no",
        "eval_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0, **overrides,
    }  # fmt: skip


def clock_steps(trainer: Any, clock: StepClock) -> None:
    """End a `clock` step after every optimizer step of our `trainer` module (its `train.py`:
    wraps the `optimizer_step` it calls)."""
    original_step = trainer.optimizer_step

    def timed_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        clock.step_done()
        return out

    trainer.optimizer_step = timed_step


def count_batch_tokens(clock: StepClock, batch: dict[str, Any]) -> None:
    """Count a batch's non-pad tokens on `clock`; a packed batch counts those of the rows it
    stands for (a shared prompt once per completion reading it), so packing does not inflate a
    tokens/s figure."""
    from rlhf_core.layout import is_packed, unpacked_tokens

    if is_packed(batch):
        clock.add(unpacked_tokens(batch))
    else:
        clock.count(batch["attention_mask"])


def run_our_trainer(trainer: Any, cfg: Any, workdir: Path, config_path: str) -> list[dict]:
    """Run our `trainer` module's `train(cfg)` into a fresh run dir under `workdir`; returns the
    metrics it logged (the run dir is removed)."""
    from rlhf_core.config import RunArgs

    run_dir = workdir / f"ours-run-{time.time_ns()}"
    code = trainer.train(cfg, RunArgs(Path(config_path), output_dir=run_dir))
    if code != 0:
        raise RuntimeError(f"our trainer exited with {code}")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return metrics


def start_trl_arm(w: Any, *names: str) -> tuple[PeakRSS, StepClock, float, list[Any]]:
    """The start of a TRL arm: the peak-RSS sampler, torch's threads, then the imports the arm
    pays for (datasets and transformers, which `trl_inputs` uses, and the named `trl` classes)
    before the after-imports RSS is read, then the step clock. Returns (memory, clock, RSS after
    the imports in MiB, the classes in the order named)."""
    memory = PeakRSS()
    import torch

    torch.set_num_threads(w.threads)
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    import trl

    classes = [getattr(trl, name) for name in names]
    after_imports = rss_mb()
    return memory, StepClock(w.warmup_steps, memory), after_imports, classes


def trl_inputs(w: Any, workdir: Path, rows_file: str) -> tuple[str, Any, Any, Path]:
    """A TRL arm's inputs, after its imports: the benchmark model's directory, its tokenizer
    (transformers `AutoTokenizer`), the training rows (JSON lines `rows_file` in `workdir`, as
    a `datasets.Dataset`) and a fresh output directory under `workdir`."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    path = str(model_dir(w.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(x) for x in (workdir / rows_file).read_text().splitlines()]
    return path, tokenizer, Dataset.from_list(rows), workdir / f"trl-run-{time.time_ns()}"


def count_trl_tokens(trainer: Any, clock: StepClock) -> None:
    """Count every TRL training step's non-pad tokens on `clock` (wraps `trainer.training_step`;
    a padding-free batch, one flat row without an attention mask, counts every position)."""
    original_training_step = trainer.training_step

    def counted_training_step(model, inputs, *rest, **kwargs):
        if "attention_mask" in inputs:
            clock.count(inputs["attention_mask"])
        else:  # padding-free: one flat row, every position a real token
            clock.add(int(inputs["input_ids"].numel()))
        return original_training_step(model, inputs, *rest, **kwargs)

    trainer.training_step = counted_training_step


def last_logged_loss(trainer: Any) -> float | None:
    """The last training loss a transformers Trainer logged (None if it logged none)."""
    return next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None)


def worker_parser(prog: str, doc: str | None, arms: tuple[str, ...], rounds: int):
    """The command line of a side-by-side benchmark module: with no command it runs the rounds;
    `prepare` or an arm (worker mode, `run_worker`) reads the workload and the shared directory
    and writes its result file."""
    parser = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="?", choices=["prepare", *arms], help="(worker mode)")
    parser.add_argument("--workload", default=None, help="(worker) Workload as JSON")
    parser.add_argument("--workdir", type=Path, default=None, help="(worker) shared directory")
    parser.add_argument("--result", type=Path, default=None, help="(worker) where to write JSON")
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds")
    return parser


def worker_result(
    impl: str, clock: StepClock, memory: PeakRSS, after_imports: float
) -> dict[str, Any]:
    """What every benchmark worker reports: its arm, the clock's figures, RSS after the imports,
    overall and in the timed window, and the torch threads used."""
    import torch

    return {
        "impl": impl, **clock.summary(), "rss_after_imports_mb": after_imports,
        "peak_rss_mb": memory.overall(), "peak_rss_timed_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
    }  # fmt: skip


def run_rounds(
    module: str, arms: tuple[str, ...], w: Workload, rounds: int, timeout: float, prefix: str
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], dict[int, dict[str, Any]]]:
    """Prepare once, then `rounds` rounds of one fresh worker process per arm (`module`'s
    worker mode), the order rotating each round and reversed every other round. Returns the
    preparation, every run, each arm's medians (and tokens/s range), and the runs by round."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        common = ["--workload", w.to_json(), "--workdir", tmp]
        prep = run_worker(module, ["prepare", *common], threads=w.threads, timeout=timeout)
        runs = []
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for impl in order if r % 2 == 0 else order[::-1]:
                out = run_worker(module, [impl, *common], threads=w.threads, timeout=timeout)
                out["round"] = r
                runs.append(out)
                print(f"  round {r + 1}/{rounds} {impl:16s}: {out['tokens_per_s']:8.1f} tok/s, "
                      f"peak RSS {out['peak_rss_mb']:6.0f} MiB", flush=True)  # fmt: skip
    keys = ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb", "peak_rss_timed_mb",
            "step_s_median", "process_wall_s")  # fmt: skip
    medians = {a: {k: median([r[k] for r in runs if r["impl"] == a]) for k in keys} for a in arms}
    for a in arms:
        medians[a]["tokens_per_s_range"] = spread(
            [r["tokens_per_s"] for r in runs if r["impl"] == a]
        )
    by_round: dict[int, dict[str, Any]] = {r["round"]: {} for r in runs}
    for r in runs:
        by_round[r["round"]][r["impl"]] = r
    return prep, runs, medians, by_round


# ----------------------------------------------------------------------------- the reports

RATIO_KEYS = ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_mb")


def round_ratios(by_round: dict[int, dict[str, Any]], arm: str, peer: str) -> dict[str, float]:
    """`arm` over `peer` in tokens/s, tokens/CPU-s and peak RSS: the median of per-round ratios
    (each round's arms ran back to back, so a ratio within a round cancels the machine's load)."""
    return {k: median([p[arm][k] / p[peer][k] for p in by_round.values()]) for k in RATIO_KEYS}


def run_checks(w: Any, prep: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every run timed the tokens `prepare` expects and read our token ids, and the
    load average the runs started under."""
    expected = sum(prep["step_tokens"][w.warmup_steps :])
    return {
        "timed_tokens_match": all(r["timed_tokens"] == expected for r in runs),
        "tokens_identical": all(r.get("tokens_identical_to_ours", True) for r in runs),
        "load_average_range": spread([r["load_average_before"] for r in runs]),
    }


def arm_rows(arms: dict[str, dict[str, Any]], labels: dict[str, str]) -> list[str]:
    """The markdown table rows of each arm's medians: | label | tokens/s (range) | tokens/CPU-s
    | peak RSS (timed steps) | step s |."""
    return [
        f"| {label} | {a['tokens_per_s']:.0f} ({a['tokens_per_s_range']}) | "
        f"{a['tokens_per_cpu_s']:.0f} | {a['peak_rss_mb']:.0f} ({a['peak_rss_timed_mb']:.0f}) "
        f"| {a['step_s_median']:.3f} |"
        for label, a in ((labels[arm], arms[arm]) for arm in labels)
    ]


def ratio_line(arm: str, peer: str, r: dict[str, float]) -> str:
    """One report line: `arm` / `peer` in the three `round_ratios`."""
    return (
        f"{arm} / {peer} (median of per-round ratios): tokens/s {r['tokens_per_s']:.2f}x, "
        f"tokens/CPU-s {r['tokens_per_cpu_s']:.2f}x, peak RSS {r['peak_rss_mb']:.2f}x."
    )
