"""The GPU path at a real model size: tokens/s and model FLOPs utilisation (MFU) of our SFT and DPO
steps at 2,048 tokens, and the time split of a GRPO step, on a model built from the Qwen3-0.6B
config (random init: speed does not depend on the weights; nothing is downloaded).

    uv run python -m benchmarks.gpu                 # on a CUDA machine (bf16, SDPA or flash-attn 2)
    uv run python -m benchmarks.gpu --smoke         # a tiny config on the CPU: checks the script
    python -m benchmarks.gpu --out DIR              # gpu.json / gpu.md to DIR (gpu_proof.sh)

What one step is (the library's own functions, as the trainers call them):
  SFT   `rlhf_core.logprobs.causal_lm_selected_logprobs` over `batch` rows of `seq_len` tokens (the
        LM head fused with the log-softmax on the completion positions: the second half of each
        row), masked NLL normalised by the completion tokens, backward, fused AdamW step
  SFT, ragged  2 x `batch` examples of ragged lengths batched as the SFT trainer does: padded
        rows against the packed layout the model takes (`rlhf_core.fastpath.speed_plan` layout:
        flash attention's varlen row, or rows with a 4D mask under SDPA)
  DPO   the same forward on `batch` chosen + `batch` rejected rows in one concatenated batch, the
        reference forward (a frozen bf16 copy, no grad), the DPO sigmoid loss, backward, AdamW
  GRPO  `policy_gradients.rollout.generate_rollouts` (our KV-cache decode loop) of
        `prompts x group` completions, a stand-in reward (length-based: the scoring cost of a real
        verifier is CPU string work and is reported separately as `score_s`), GRPO advantages,
        the clipped loss over the rollouts in micro-batches, backward, AdamW; reported as seconds
        and shares, generated tokens/s (through each row's first eos) and training tokens/s
        (prompt + completion tokens of the update)
  decode vs generate  greedy decoding of the GRPO prompts by our loop and by transformers'
        `generate` on the same model: tokens/s of each and the share of rows that agree

MFU = achieved model FLOPs / peak. Model FLOPs per token: 6 x N for a trained forward+backward
and 2 x N per no-grad forward (the DPO reference), N = parameters doing matmuls (the LM head
counted once with tied embeddings; attention's score FLOPs left out, the usual approximation,
so MFU is slightly understated at 2,048 tokens). The peak is *measured* on the device: the best
of several large bf16 matmuls (so MFU is relative to what the device delivers here, typically
~70-80% of the datasheet figure). Results go to benchmarks/results/<time>-gpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

QWEN3_0P6B = {  # Qwen/Qwen3-0.6B config.json (architecture only)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip

SMOKE = {**QWEN3_0P6B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


@dataclass
class Settings:
    seq_len: int = 2048
    batch: int = 4  # rows per SFT step; DPO: pairs per step (2x rows + reference)
    steps: int = 6
    warmup: int = 2
    grpo_prompts: int = 16
    grpo_group: int = 8
    grpo_prompt_len: int = 128
    grpo_new_tokens: int = 256
    grpo_micro_batch: int = 16
    gradient_checkpointing: bool = False
    smoke: bool = False


def measured_peak_tflops(device, dtype) -> float:
    import torch

    if device.type != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 20 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def build_model(s: Settings, device, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_core.models import ModelConfig, resolve_attention

    spec = SMOKE if s.smoke else QWEN3_0P6B
    config = AutoConfig.for_model(**{k: v for k, v in spec.items() if k != "architectures"})
    attention = resolve_attention(ModelConfig(name_or_path="x", attention="auto"), device)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model = model.to(device)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, attention


def matmul_params(model) -> int:
    seen, total = set(), 0
    for name, p in model.named_parameters():
        # an untied input embedding is a lookup (no matmul); a tied one is the LM head
        untied_lookup = "embed_tokens" in name and not model.config.tie_word_embeddings
        if id(p) in seen or untied_lookup:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, s: Settings, device) -> list[float]:
    times = []
    for i in range(s.warmup + s.steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        if i >= s.warmup:
            times.append(time.perf_counter() - start)
    return times


def bench_sft_dpo(s: Settings, device, dtype, peak: float) -> dict[str, Any]:
    import copy

    import torch

    from rlhf_core.fastpath import speed_plan
    from rlhf_core.logprobs import causal_lm_selected_logprobs, masked_sum
    from rlhf_core.optim import OptimConfig, build_optimizer

    model, attention = build_model(s, device, dtype)
    n_params = matmul_params(model)
    vocab = model.config.vocab_size
    opt = build_optimizer(model, OptimConfig(lr=1e-6, weight_decay=0.0))
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rows(n):
        ids = torch.randint(10, vocab, (n, s.seq_len), generator=gen).to(device)
        mask = torch.ones_like(ids)
        target = torch.zeros(n, s.seq_len - 1, dtype=torch.bool, device=device)
        target[:, s.seq_len // 2 :] = True  # the second half is the completion
        return ids, mask, target

    out: dict[str, Any] = {"attention": attention, "matmul_parameters": n_params}
    out["speed_plan"] = speed_plan(model).describe()  # what the trainers would take here
    sft_batch = rows(s.batch)

    def sft_step():
        ids, mask, target = sft_batch
        logps = causal_lm_selected_logprobs(model, ids, mask, target)
        loss = -masked_sum(logps, target) / target.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps(sft_step, s, device)
    tokens = s.batch * s.seq_len
    step_s = sorted(times)[len(times) // 2]
    out["sft"] = {
        "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        "mfu": 6 * n_params * tokens / step_s / (peak * 1e12),
    }  # fmt: skip
    if device.type == "cuda":
        out["sft"]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    out["sft_ragged"] = bench_sft_ragged(s, model, opt, device, gen)

    reference = copy.deepcopy(model).eval().requires_grad_(False)
    dpo_batch = rows(2 * s.batch)

    def dpo_step():
        ids, mask, target = dpo_batch
        with torch.no_grad():
            ref = masked_sum(causal_lm_selected_logprobs(reference, ids, mask, target), target, -1)
        pol = masked_sum(causal_lm_selected_logprobs(model, ids, mask, target), target, -1)
        logits = (pol[: s.batch] - ref[: s.batch]) - (pol[s.batch :] - ref[s.batch :])
        loss = -torch.nn.functional.logsigmoid(0.1 * logits).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps(dpo_step, s, device)
    tokens = 2 * s.batch * s.seq_len
    step_s = sorted(times)[len(times) // 2]
    out["dpo"] = {
        "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        "mfu": (6 + 2) * n_params * tokens / step_s / (peak * 1e12),
    }  # fmt: skip
    if device.type == "cuda":
        out["dpo"]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def bench_sft_ragged(s: Settings, model, opt, device, gen) -> dict[str, Any]:
    """SFT on 2 x `batch` examples of ragged lengths (uniform in [seq_len / 8, seq_len], half
    prompt, half completion) as the trainer batches them: padded rows (`collate`) against the
    packed layout the model takes (its `rlhf_core.fastpath.speed_plan` layout: the varlen row
    under flash attention, rows with a 4D mask under SDPA). Tokens/s count the examples' tokens,
    not padding."""
    import torch

    from instruction_tuning.data import SFTExample, collate, pack
    from instruction_tuning.losses import CompletionNLLLoss
    from rlhf_core.fastpath import speed_plan
    from rlhf_core.sequences import sequence_logprobs

    vocab = model.config.vocab_size
    lengths = torch.randint(s.seq_len // 8, s.seq_len + 1, (2 * s.batch,), generator=gen).tolist()

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    examples = [SFTExample(ids(n // 2), ids(n - n // 2), "", "") for n in lengths]
    layout = {"segmented": "mask", "mask": "mask", "flat": "flat"}.get(speed_plan(model).layout)
    batches = {"padded": collate(examples, 0)}
    if layout is not None:
        batches[f"packed ({layout})"] = pack(examples, 0, flat=layout == "flat")
    completion_tokens = float(sum(n - n // 2 for n in lengths))
    out: dict[str, Any] = {"layout": layout, "tokens": sum(lengths), "lengths": lengths}
    for name, batch in batches.items():
        batch = {k: v.to(device) for k, v in batch.items()}

        def step(batch=batch):
            logps = sequence_logprobs(model, batch)
            loss, _ = CompletionNLLLoss()(logps, batch["loss_mask"], completion_tokens)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_s = sorted(time_steps(step, s, device))[s.steps // 2]
        out[name] = {
            "step_s": step_s, "tokens_per_s": out["tokens"] / step_s,
            "positions": batch["input_ids"].numel(),
        }  # fmt: skip
    return out


def bench_grpo(s: Settings, device, dtype) -> dict[str, Any]:
    import torch

    from policy_gradients.advantages import ADVANTAGES
    from policy_gradients.experience import Experience
    from policy_gradients.losses import LOSSES
    from policy_gradients.rollout import completion_logprobs
    from rlhf_core.generation import Sampling, decode
    from rlhf_core.optim import OptimConfig, build_optimizer

    model, _ = build_model(s, device, dtype)
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    opt = build_optimizer(model, OptimConfig(lr=1e-6, weight_decay=0.0))
    estimator = ADVANTAGES.get("grpo")()
    loss_fn = LOSSES.get("clipped")(aggregation="seq-mean-token-mean", normalizer=None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = torch.randint(10, vocab, (s.grpo_prompts, s.grpo_prompt_len), generator=gen)
    ids = prompts.repeat_interleave(s.grpo_group, 0).to(device)
    mask = torch.ones_like(ids)
    split: dict[str, list[float]] = {"generate_s": [], "score_s": [], "train_s": []}
    generated, trained = [], []
    for i in range(s.warmup + s.steps):
        sync(device)
        t0 = time.perf_counter()
        model.eval()
        seqs = decode(model, ids, mask, max_new_tokens=s.grpo_new_tokens, eos_token_id=eos,
                      pad_token_id=0, sampling=Sampling(temperature=1.0))  # fmt: skip
        model.train()
        sync(device)
        t1 = time.perf_counter()
        completion = seqs[:, ids.shape[1] :]
        is_eos = completion == eos
        action = ((is_eos.long().cumsum(-1) - is_eos.long()) == 0).long()
        reward = action.sum(-1).float() / action.shape[1]  # stand-in: relative length
        group = torch.arange(s.grpo_prompts, device=device).repeat_interleave(s.grpo_group)
        adv, _ = estimator(reward, action_mask=action, group_ids=group, values=None)
        attn = torch.cat([mask, action], 1)
        sync(device)
        t2 = time.perf_counter()
        total = torch.tensor(float(len(seqs)), device=device)
        for start in range(0, len(seqs), s.grpo_micro_batch):
            sl = slice(start, start + s.grpo_micro_batch)
            logps = completion_logprobs(model, seqs[sl], attn[sl], ids.shape[1], temperature=1.0,
                                        action_mask=action[sl])  # fmt: skip
            exp = Experience(sequence_ids=seqs[sl], attention_mask=attn[sl],
                             action_mask=action[sl], log_probs_old=logps.detach(),
                             advantages=adv[sl])  # fmt: skip
            loss, _ = loss_fn(logps, exp, total_sequences=total)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        if i >= s.warmup:
            generated.append(int(action.sum()))  # completion tokens through the first eos
            trained.append(int(attn.sum()))  # prompt + completion tokens the update reads
            split["generate_s"].append(t1 - t0)
            split["score_s"].append(t2 - t1)
            split["train_s"].append(t3 - t2)
    med = {k: sorted(v)[len(v) // 2] for k, v in split.items()}
    total_s = sum(med.values())
    return {
        **med, "step_s": total_s, "share": {k: v / total_s for k, v in med.items()},
        "rollouts": len(ids), "new_tokens": s.grpo_new_tokens,
        "generated_tokens_per_s": sum(generated) / sum(split["generate_s"]),
        "training_tokens_per_s": sum(trained) / sum(split["train_s"]),
        "decode_vs_generate": bench_decode_vs_generate(s, model, ids, mask, device),
    }  # fmt: skip


def bench_decode_vs_generate(s: Settings, model, ids, mask, device) -> dict[str, Any]:
    """Greedy decoding of the GRPO prompts by our KV-cache loop (`rlhf_core.generation.decode`)
    against transformers' `generate`, on the same model and device: tokens/s of each (positions
    decoded, rows x steps; a random-init model rarely draws its eos) and whether they agree.
    bf16 greedy decoding may part at near-ties, so agreement is reported as the share of rows
    equal throughout, not asserted; the float32 test of the same thing is
    `tests/cuda/test_cuda_engines.py`."""
    import torch

    from rlhf_core.generation import decode

    eos = model.config.eos_token_id
    model.eval()
    out: dict[str, Any] = {"rows": len(ids), "new_tokens": s.grpo_new_tokens}
    tokens = {}
    for name in ("decode", "generate"):
        times = []
        for i in range(1 + max(1, s.steps // 2)):
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                if name == "decode":
                    seqs = decode(model, ids, mask, max_new_tokens=s.grpo_new_tokens,
                                  eos_token_id=eos, pad_token_id=0)  # fmt: skip
                else:
                    seqs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=s.grpo_new_tokens, eos_token_id=eos,
                                          pad_token_id=0)  # fmt: skip
            sync(device)
            if i > 0:
                times.append(time.perf_counter() - start)
        tokens[name] = seqs[:, ids.shape[1] :]
        step_s = sorted(times)[len(times) // 2]
        out[name] = {"s": step_s, "tokens_per_s": tokens[name].numel() / step_s}
    model.train()
    n = min(tokens["decode"].shape[1], tokens["generate"].shape[1])
    equal = (tokens["decode"][:, :n] == tokens["generate"][:, :n]).all(-1)
    out["rows_equal"] = float(equal.float().mean())
    out["speedup"] = out["decode"]["tokens_per_s"] / out["generate"]["tokens_per_s"]
    out["parting"] = parting_margins(model, ids, mask, tokens["decode"][:, :n],
                                     tokens["generate"][:, :n], eos)  # fmt: skip
    return out


def parting_margins(model, ids, mask, ours, theirs, eos: int) -> dict[str, Any]:
    """Where two greedy decodings of the same rows part, and by how much: for each row that
    differs, the first position p at which it does and `generate`'s own logit gap at p between
    its token and ours (one more untimed `generate` of the same batch that returns its scores).
    A gap within two bf16 spacings of the top logit (2 x 2^(floor(log2|top|) - 7)) is a near-tie
    that rounding alone can flip; a wide gap would be a bug in one of the two loops. A row whose
    rerun differs from `theirs` (`generate` not repeatable) is counted in `unrepeatable`."""
    import math

    import torch

    rows = (ours != theirs).any(-1).nonzero().flatten().tolist()
    out: dict[str, Any] = {"rows": len(rows), "first_position": [], "gap": [], "near_tie": 0,
                           "unrepeatable": 0}  # fmt: skip
    if not rows:
        return out
    model.eval()
    with torch.no_grad():
        scored = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=ours.shape[1], eos_token_id=eos, pad_token_id=0,
                                output_scores=True, return_dict_in_generate=True)  # fmt: skip
    model.train()
    again = scored.sequences[:, ids.shape[1] :]
    n = min(again.shape[1], ours.shape[1])
    for r in rows:
        parted = (ours[r, :n] != theirs[r, :n]).nonzero()
        if not torch.equal(again[r, :n], theirs[r, :n]) or len(parted) == 0:
            out["unrepeatable"] += 1
            continue
        p = int(parted[0])
        logits = scored.scores[p][r].float()
        top = float(logits[theirs[r, p]])
        gap = top - float(logits[ours[r, p]])
        out["first_position"].append(p)
        out["gap"].append(gap)
        out["near_tie"] += int(gap <= 2 * 2.0 ** (math.floor(math.log2(abs(top) or 1.0)) - 7))
    if out["gap"]:
        out["median_first_position"] = sorted(out["first_position"])[len(out["gap"]) // 2]
        out["median_gap"] = sorted(out["gap"])[len(out["gap"]) // 2]
        out["max_gap"] = max(out["gap"])
    return out


def parting_text(d: dict[str, Any]) -> str:
    """One sentence on where the differing rows part (`parting_margins`)."""
    p = d.get("parting") or {}
    if not p.get("gap"):
        return ""
    return (
        f"Rows that differ part at token {p['median_first_position']} (median) where "
        f"`generate`'s logits put its token {p['median_gap']:.3f} (median; max "
        f"{p['max_gap']:.3f}) above ours: {p['near_tie']} of {len(p['gap'])} within two bf16 "
        "spacings of the top logit (a near-tie)"
        + (f"; {p['unrepeatable']} not repeatable by `generate` itself." if p.get("unrepeatable")
           else ".")
    )  # fmt: skip


def render(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"### GPU path: Qwen3-0.6B architecture (random init) on {r['device_name']}",
        "",
        f"{r['dtype']}, attention `{r['sft_dpo']['attention']}`, {r['sft_dpo']['matmul_parameters'] / 1e6:.0f}M "  # noqa: E501
        f"matmul parameters, gradient checkpointing {s['gradient_checkpointing']}; measured bf16 "
        f"matmul peak {r['peak_tflops']:.0f} TFLOP/s; medians of {s['steps']} steps after "
        f"{s['warmup']} warm-up steps.",
        "",
        "| step | rows x tokens | step s | tokens/s | MFU | peak memory GiB |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, rows in (("sft", s["batch"]), ("dpo", 2 * s["batch"])):
        m = r["sft_dpo"][name]
        lines.append(
            f"| {name.upper()} | {rows} x {s['seq_len']} | {m['step_s']:.3f} | "
            f"{m['tokens_per_s']:.0f} | {m['mfu']:.1%} | {m.get('peak_memory_gib', float('nan')):.1f} |"  # noqa: E501
        )
    ragged = r["sft_dpo"]["sft_ragged"]
    lines += [
        "",
        f"SFT on {len(ragged['lengths'])} ragged examples ({ragged['tokens']} tokens, "
        f"{s['seq_len'] // 8}-{s['seq_len']} each), as the trainer batches them:",
        "",
        "| batch | positions | step s | tokens/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, m in ragged.items():
        if isinstance(m, dict):
            lines.append(
                f"| {name} | {m['positions']} | {m['step_s']:.3f} | {m['tokens_per_s']:.0f} |"
            )
    g = r["grpo"]
    lines += [
        "",
        f"GRPO step ({g['rollouts']} rollouts x {g['new_tokens']} new tokens): "
        f"{g['step_s']:.2f} s = "
        f"generation {g['generate_s']:.2f} s ({g['share']['generate_s']:.0%}), scoring "
        f"{g['score_s']:.3f} s ({g['share']['score_s']:.0%}), training {g['train_s']:.2f} s "
        f"({g['share']['train_s']:.0%}); generated {g['generated_tokens_per_s']:.0f} tokens/s, "
        f"training {g['training_tokens_per_s']:.0f} tokens/s.",
        "",
        f"Greedy decoding of {g['decode_vs_generate']['rows']} rows x "
        f"{g['decode_vs_generate']['new_tokens']} tokens: our decode "
        f"{g['decode_vs_generate']['decode']['tokens_per_s']:.0f} tokens/s, transformers "
        f"`generate` {g['decode_vs_generate']['generate']['tokens_per_s']:.0f} tokens/s "
        f"({g['decode_vs_generate']['speedup']:.2f}x); rows equal throughout "
        f"{g['decode_vs_generate']['rows_equal']:.0%}. {parting_text(g['decode_vs_generate'])}",
        "",
        f"Target >= 40% MFU for SFT/DPO: SFT {r['sft_dpo']['sft']['mfu'] >= 0.4}, "
        f"DPO {r['sft_dpo']['dpo']['mfu'] >= 0.4}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    defaults = Settings()
    for field, value in asdict(defaults).items():
        if isinstance(value, bool):
            parser.add_argument(f"--{field.replace('_', '-')}", action="store_true")
        else:
            parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", type=Path, default=None,
                        help="write gpu.json and gpu.md here (default: benchmarks/results/, "
                        "not in --smoke)")  # fmt: skip
    args = parser.parse_args(argv)
    s = Settings(**{f: getattr(args, f) for f in asdict(defaults)})
    if s.smoke:
        s.seq_len, s.batch, s.steps, s.warmup = 64, 2, 2, 1
        s.grpo_prompts, s.grpo_group, s.grpo_prompt_len, s.grpo_new_tokens = 2, 2, 8, 8
        s.grpo_micro_batch = 2

    import torch

    from benchmarks.measure import RESULTS_DIR, machine, timestamp

    if not s.smoke and not torch.cuda.is_available():
        print(
            "benchmarks.gpu: no CUDA device here (torch.cuda.is_available() is False); this "
            "benchmark measures MFU at the Qwen3-0.6B size and would take hours on a CPU. Run it "
            "on a GPU machine, or add --smoke to check the script with a tiny config on the CPU.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if not s.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = {
        "settings": asdict(s), "dtype": str(dtype).removeprefix("torch."),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
        "versions": {"torch": torch.__version__}, "machine": machine(),
        "peak_tflops": measured_peak_tflops(device, dtype),
    }  # fmt: skip
    result["sft_dpo"] = bench_sft_dpo(s, device, dtype, result["peak_tflops"])
    result["grpo"] = bench_grpo(s, device, dtype)
    text = render(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu.md").write_text(text)
    elif not s.smoke:
        stamp = timestamp()
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{stamp}-gpu.json").write_text(json.dumps(result, indent=1))
        (RESULTS_DIR / f"{stamp}-gpu.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
