"""`rlhf-lab quantize`: quantise a trained reward model or policy with bitsandbytes, and measure
what it cost.

    rlhf-lab quantize --model outputs/reward_models/rm-*/final --bits 8
    rlhf-lab quantize --model outputs/policy_gradients/grpo-*/final --bits 4 [--eval-config FILE]

The model is loaded a second time through transformers' `BitsAndBytesConfig` (8 = LLM.int8(),
4 = NF4 with double quantisation; `rlhf_core.quantization`), compared with the original on held-out
data, and saved to `quantized_int8/` or `quantized_nf4/` next to the source directory. That folder
loads with plain transformers (`AutoModelForCausalLM.from_pretrained`, or `AutoModel` for a
reward model's backbone: its config.json carries the quantization config) and with
`ScalarHeadModel.from_pretrained` for a reward model. `quantize_report.md` / `.json` go with it.

Held-out data: the `data.eval` block of the run's `config.yaml` (the directory above `--model`),
or `--eval-config FILE`, or for a reward model `--pairs FILE` ({prompt, chosen, rejected} rows).

Reward model (preference): pairwise accuracy before and after, preference agreement (share of
pairs whose preferred side is unchanged), mean |reward_after - reward_before| over every scored
completion, and the same in units of the original rewards' standard deviation.
Policy: per-token KL(original || quantised), exact over the vocabulary, on completions sampled
from the original model (T = 1) for the held-out prompts; greedy and sampled task score and
exact match before and after (when the prompts come from reasoning-gym, which has a verifier).
Both: size of the weights on disk and in memory (`get_memory_footprint`).

Not here: LoRA adapter directories (merge the adapter first), ORM/PRM reward models, GPTQ/AWQ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rlhf_core.errors import UserError, run_main
from rlhf_core.output_dir import check_output_path, claim_output_path
from rlhf_core.quantization import QuantizationConfig, folder_name, quantized_linear_count


def weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def check_weights_readable(directory: Path) -> None:
    """Every `*.safetensors` file's header reads and its tensors fit the file (a damaged or
    truncated file is a one-line UserError naming it, not a traceback from the loader)."""
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as fh:
                list(fh.keys())
        except Exception as exc:  # safetensors raises its own error types for a bad file
            raise UserError(
                f"quantize: {path} is damaged ({str(exc).splitlines()[0][:120]}); save the "
                "model again"
            ) from None


def model_kind(directory: Path) -> str:
    """'reward' (a scalar-head or ...ForSequenceClassification directory) or 'policy'."""
    if (directory / "adapter_config.json").is_file():
        raise UserError(
            f"quantize: {directory} is a LoRA adapter; merge it into its base first "
            "(peft: model.merge_and_unload().save_pretrained(dir)) and quantise that"
        )
    if (directory / "scalar_head.json").is_file():
        return "reward"
    config = directory / "config.json"
    if not config.is_file():
        raise UserError(f"quantize: {directory} has no config.json: not a model directory")
    fields = json.loads(config.read_text())
    if fields.get("is_encoder_decoder"):
        raise UserError(
            f"quantize: {directory} is an encoder-decoder ({fields.get('model_type')}) model; "
            "quantize takes decoder-only policies and reward models"
        )
    archs = fields.get("architectures") or []
    return "reward" if any(a.endswith("ForSequenceClassification") for a in archs) else "policy"


def eval_config(model_dir: Path, given: Path | None) -> dict[str, Any] | None:
    import yaml

    path = given or model_dir.resolve().parent / "config.yaml"
    if not path.is_file():
        if given is not None:
            raise UserError(f"quantize: --eval-config {given} does not exist")
        return None
    return yaml.safe_load(path.read_text())


# ----------------------------------------------------------------------------- reward models


def held_out_pairs(cfg: dict[str, Any] | None, pairs: Path | None, limit: int) -> list[tuple]:
    """(prompt, chosen, rejected) triples: --pairs rows, or the RM config's data.eval."""
    from reward_models.data import source_rows
    from rlhf_core.data import DataSource, load_rows
    from rlhf_core.preference import preference_row

    if pairs is not None:
        rows, fmt = load_rows(DataSource(path=str(pairs)), field="--pairs"), "preference"
    else:
        if cfg is None or not (cfg.get("data") or {}).get("eval"):
            raise UserError(
                "quantize: no held-out pairs: pass --pairs FILE or --eval-config (an RM config "
                "with data.eval), or keep the run's config.yaml above the model directory"
            )
        from reward_models.config import RMConfig

        rm = RMConfig.model_validate(cfg)
        rows, fmt = source_rows(rm.data.eval, "preference", rm.data, "data.eval")
    out = []
    for index, row in enumerate(rows):
        prompt, chosen, rejected, *_ = preference_row(row, index, fmt, "held-out pairs")
        out.append((prompt, chosen, rejected))
        if len(out) >= limit:
            break
    return out


def compare_reward_models(original, quantized, pairs: list[tuple]) -> dict[str, float]:
    prompts = [p for p, _, _ in pairs]
    scores = {}
    for name, model in (("before", original), ("after", quantized)):
        chosen = model.score(prompts, [c for _, c, _ in pairs])
        rejected = model.score(prompts, [r for _, _, r in pairs])
        scores[name] = (chosen.float(), rejected.float())
    (c0, r0), (c1, r1) = scores["before"], scores["after"]
    before, after = torch.cat([c0, r0]), torch.cat([c1, r1])
    delta = (after - before).abs()
    return {
        "pairs": len(pairs),
        "accuracy_before": float((c0 > r0).float().mean()),
        "accuracy_after": float((c1 > r1).float().mean()),
        "preference_agreement": float(((c0 > r0) == (c1 > r1)).float().mean()),
        "mean_abs_delta_reward": float(delta.mean()),
        "max_abs_delta_reward": float(delta.max()),
        "mean_abs_delta_in_reward_std": float(delta.mean() / before.std().clamp(min=1e-12)),
    }


def quantize_reward_model(src: Path, q: QuantizationConfig, args, cfg) -> tuple[dict, Any]:
    from rlhf_core.scalar_head import ScalarHeadModel

    pairs = held_out_pairs(cfg, args.pairs, args.limit)
    original = ScalarHeadModel.from_pretrained(src)
    quantized = ScalarHeadModel.from_pretrained(src, quantization=q)
    figures = compare_reward_models(original, quantized, pairs)
    figures["memory_bytes_before"] = original.backbone.get_memory_footprint() + _head_bytes(
        original
    )
    figures["memory_bytes_after"] = quantized.backbone.get_memory_footprint() + _head_bytes(
        quantized
    )
    figures["quantized_layers"] = quantized_linear_count(quantized)
    return figures, quantized


def _head_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.head.parameters())


# ----------------------------------------------------------------------------- policies


@torch.no_grad()
def token_kl(original, quantized, sequence_ids, attention_mask, action_mask, prompt_length: int):
    """Per-token KL(original || quantised) over the full vocabulary at every completion position,
    (B, T); positions outside `action_mask` are 0."""
    positions = slice(prompt_length - 1, sequence_ids.shape[1] - 1)
    kls = []
    for model in (original, quantized):
        logits = model(sequence_ids, attention_mask=attention_mask).logits[:, positions].float()
        kls.append(torch.log_softmax(logits, -1))
    logp, logq = kls
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return kl * action_mask


def quantize_policy(src: Path, q: QuantizationConfig, args, cfg) -> tuple[dict, Any]:
    from transformers import AutoModelForCausalLM

    from policy_gradients.evaluate import evaluate_policy
    from policy_gradients.rewards import CombinedReward
    from policy_gradients.rollout import generate_rollouts, load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.generation import Sampling
    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_core.quantization import quantized_load_kwargs

    data = (cfg or {}).get("data") or {}
    if not data.get("eval"):
        raise UserError(
            "quantize: no held-out prompts: pass --eval-config (a config with data.eval), or keep "
            "the run's config.yaml above the model directory"
        )
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(src)), padding_side="left")
    prompts = load_prompts(
        DataSource.model_validate(data["eval"]), tokenizer,
        prompt_column=data.get("prompt_column", "prompt"),
        answer_column=data.get("answer_column", "answer"),
        prompt_template=data.get("prompt_template", "{question}"),
        system_prompt=data.get("system_prompt"), where="data.eval", limit=args.limit,
    )  # fmt: skip
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, **quantized_load_kwargs(q, torch.float32, torch.device("cpu"))
    ).eval()
    figures: dict[str, Any] = {"prompts": len(prompts.items)}
    # KL on completions sampled from the original model
    kl_sum, tokens = 0.0, 0
    torch.manual_seed(0)
    for start in range(0, len(prompts.items), 32):
        texts = [it["prompt"] for it in prompts.items[start : start + 32]]
        ro = generate_rollouts(original, tokenizer, texts, group_size=1,
                               max_new_tokens=args.max_new_tokens,
                               sampling=Sampling(temperature=1.0))  # fmt: skip
        kl = token_kl(original, quantized, ro.sequence_ids, ro.attention_mask,
                      ro.action_mask, ro.prompt_length)  # fmt: skip
        kl_sum += float(kl.sum())
        tokens += int(ro.action_mask.sum())
    figures["kl_per_token"] = kl_sum / max(1, tokens)
    figures["kl_tokens"] = tokens
    if prompts.scorer is not None:
        reward = CombinedReward([{"name": "reasoning_gym", "extract": args.extract,
                                  "label": "task"}])  # fmt: skip
        for name, model in (("before", original), ("after", quantized)):
            result = evaluate_policy(
                model, None, tokenizer, prompts, reward, max_new_tokens=args.max_new_tokens,
                temperature=1.0, batch_size=32, seed=0,
            )  # fmt: skip
            for key in ("greedy_task", "greedy_task_exact", "sampled_task", "sampled_task_exact"):
                figures[f"{key}_{name}"] = result[f"eval/{key}"]
    figures["memory_bytes_before"] = original.get_memory_footprint()
    figures["memory_bytes_after"] = quantized.get_memory_footprint()
    figures["quantized_layers"] = quantized_linear_count(quantized)
    quantized.generation_config.do_sample = False
    return figures, (quantized, tokenizer)


# ----------------------------------------------------------------------------- report


def write_report(out: Path, figures: dict[str, Any]) -> None:
    (out / "quantize_report.json").write_text(json.dumps(figures, indent=2) + "\n")
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    lines = [
        f"# Quantisation report: {figures['source']}",
        "",
        f"{figures['kind']} model, {figures['mode']} (bitsandbytes {figures['bitsandbytes']}), "
        f"{figures['seconds']:.1f} s; saved to `{figures['output']}`.",
        "",
        "| | original | quantised |",
        "| --- | --- | --- |",
        f"| weights on disk | {mib(figures['disk_bytes_before'])} | "
        f"{mib(figures['disk_bytes_after'])} |",
        f"| weights in memory | {mib(figures['memory_bytes_before'])} | "
        f"{mib(figures['memory_bytes_after'])} |",
    ]
    pairs = [(k[: -len("_before")], k) for k in figures if k.endswith("_before")]
    for base, key in pairs:
        if "bytes" in base:
            continue
        lines.append(f"| {base} | {figures[key]:.4f} | {figures[base + '_after']:.4f} |")
    lines.append("")
    for key in ("preference_agreement", "mean_abs_delta_reward", "max_abs_delta_reward",
                "mean_abs_delta_in_reward_std", "kl_per_token"):  # fmt: skip
        if key in figures:
            lines.append(f"- {key}: {figures[key]:.6f}")
    lines.append(f"- quantised layers: {figures['quantized_layers']}")
    (out / "quantize_report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlhf-lab quantize", description="quantise a reward model or policy (bitsandbytes)"
    )
    parser.add_argument("--model", type=Path, required=True, help="a saved model directory")
    parser.add_argument("--bits", type=int, choices=[8, 4], required=True, help="8 or 4 (NF4)")
    parser.add_argument("--eval-config", type=Path, help="config whose data.eval is held out")
    parser.add_argument("--pairs", type=Path, help="reward model: {prompt,chosen,rejected} file")
    parser.add_argument("--limit", type=int, default=200, help="held-out rows to use")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="policy: sample length")
    parser.add_argument("--extract", choices=["full", "answer_tag"], default="full",
                        help="policy: what the verifier scores")  # fmt: skip
    parser.add_argument("--output", type=Path, help="default: quantized_int8|nf4 next to --model")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="move an existing --output aside (<dir>.old-<time>)",
    )
    args = parser.parse_args(argv)
    import bitsandbytes

    src = args.model
    if not src.is_dir():
        raise UserError(f"quantize: --model {src} is not a directory")
    q = QuantizationConfig(bits=args.bits)
    out = args.output or src.resolve().parent / folder_name(args.bits)
    check_output_path(out, overwrite=args.overwrite, command="quantize")  # before minutes of work
    kind = model_kind(src)
    check_weights_readable(src)
    cfg = eval_config(src, args.eval_config)
    start = time.time()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        if kind == "reward":
            figures, model = quantize_reward_model(src, q, args, cfg)
        else:
            figures, model = quantize_policy(src, q, args, cfg)
    claim_output_path(out, overwrite=args.overwrite, command="quantize")  # moved, not deleted
    if kind == "reward":
        model.save_pretrained(out)
    else:
        model[0].save_pretrained(out)
        model[1].save_pretrained(out)
    figures = {
        "source": str(src), "output": str(out), "kind": kind,
        "mode": "LLM.int8()" if args.bits == 8 else "NF4 + double quantisation",
        "bits": args.bits, "bitsandbytes": bitsandbytes.__version__,
        "seconds": round(time.time() - start, 2),
        "disk_bytes_before": weights_bytes(src), "disk_bytes_after": weights_bytes(out), **figures,
    }  # fmt: skip
    write_report(out, figures)
    print((out / "quantize_report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
