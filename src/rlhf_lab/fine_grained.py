"""Fine-grained vs holistic RLHF on the offline long-form task, from one SFT model.

    uv run python -m rlhf_lab.fine_grained [--steps 20] [--seeds 0 1] [--out outputs/longform]
        [--segment-encoder DIR] [--sampled-draws 5]

Stages (each the trainer a user runs by hand with the named YAML; a stage whose `final/` exists
under `--out` is reused):
  sft              configs/instruction_tuning/tiny_t5_sft_longform.yaml   imperfect answers
  feedback         the SFT model's own answers to the training prompts, graded by the exact
                   grader (the paper collects all its feedback on SFT samples): per segment
                   <out>/feedback/{relevance,factuality}.jsonl, and pairs of answers to one
                   prompt {completeness,preference}.jsonl; every reward model's data
  lm_facts_cosine  configs/instruction_tuning/tiny_lm_facts_cosine.yaml   the segment reward
  lm_facts         configs/instruction_tuning/tiny_lm_facts.yaml          models' backbone,
                   pre-trained as a language model on <out>/reading/ (new questions with correct
                   answers) in two runs; what it learned is checked
                   (`fine_grained_diag.reading_accuracy`, <out>/lm_facts/reading.json)
  rm_relevance     configs/reward_models/tiny_segment_relevance_lm.yaml   per sub-sentence,
                   starting from lm_facts
  rm_factuality    configs/reward_models/tiny_segment_factuality.yaml     per sentence, starting
                   from lm_facts
  rm_completeness  configs/reward_models/tiny_completeness.yaml           preference, last token
  rm_holistic      configs/reward_models/tiny_holistic.yaml               preference, last token
                   (each trained on 90% of its feedback rows, the rest held out)
  fine_grained_ppo / holistic_ppo (configs/policy_gradients/), per seed, `--steps` steps each

The relevance feedback holds, besides the SFT model's answers, its greedy answers with irrelevant
clauses put in (`rlhf_core.longform.edit_answer`: about another person, or a value of another
attribute: what fine-grained PPO's greedy answers get wrong; docs/algorithms/fine_grained_rlhf.md,
"Edited feedback"). `--no-edited-feedback` leaves them out and trains the relevance reward model
from random init with configs/reward_models/tiny_segment_relevance.yaml; use another `--out`.

`--segment-encoder DIR` trains the two segment reward models on a bidirectional encoder instead
(a BERT / DeBERTa / Longformer-family checkpoint directory, or an encoder-decoder's such as the
SFT T5 model's, whose vocabulary fits the task's tokenizer: `model.name_or_path=DIR`,
`encoder_only: true`), the paper's setting; use another `--out`, since finished stages are
reused.

Then every model is evaluated on the same held-out prompts (data/longform/heldout.jsonl): greedy
and sampled (T=1, seeded; the mean of `--sampled-draws` draws) answers graded exactly by
`rlhf_core.longform.grade` (each error type's rate), ROUGE-L / ROUGE-1 F1 against the reference
answers (`rlhf_core.scoring.rouge_scores`), answer length in tokens, and the per-token KL (k3) to
the SFT model on the sampled answers. Writes `<out>/compare.md` and `compare.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rlhf_core.longform import EDITS, write_reading_corpus
from rlhf_lab.fine_grained_diag import check_reading

CONFIGS = Path("configs")
STAGES = {
    "sft": ("instruction_tuning", "tiny_t5_sft_longform"),
    "lm_facts_cosine": ("instruction_tuning", "tiny_lm_facts_cosine"),
    "lm_facts": ("instruction_tuning", "tiny_lm_facts"),
    "rm_relevance": ("reward_models", "tiny_segment_relevance"),
    "rm_factuality": ("reward_models", "tiny_segment_factuality"),
    "rm_completeness": ("reward_models", "tiny_completeness"),
    "rm_holistic": ("reward_models", "tiny_holistic"),
}
ARMS = ("fine_grained_ppo", "holistic_ppo")
#: new questions with correct answers: the factuality reward model's backbone's language-model text
READING_ROWS = 80_000
#: each reward model's rows in <out>/feedback (`collect_feedback`)
FEEDBACK_OF = {"rm_relevance": "relevance", "rm_factuality": "factuality",
               "rm_completeness": "completeness", "rm_holistic": "preference"}  # fmt: skip


def _trainer(package: str) -> tuple[Any, Any]:
    if package == "instruction_tuning":
        from instruction_tuning.config import SFTConfig as Config
        from instruction_tuning.train import train
    elif package == "reward_models":
        from reward_models.config import RMConfig as Config
        from reward_models.train import train
    else:
        from policy_gradients.config import PGConfig as Config
        from policy_gradients.train import train
    return Config, train


def run_stage(package: str, name: str, out: Path, overrides: list[str]) -> float:
    """Train `configs/<package>/<name>.yaml` into `out` unless `out/final` exists; seconds (of
    the earlier run, from its summary, when it is reused)."""
    from rlhf_core.config import RunArgs, load_config

    if (out / "final").is_dir():
        summary = out / "summary.json"
        return json.loads(summary.read_text()).get("wall_time_s", 0.0) if summary.is_file() else 0.0
    config_cls, train = _trainer(package)
    path = CONFIGS / package / f"{name}.yaml"
    start = time.perf_counter()
    code = train(
        load_config(config_cls, path, overrides), RunArgs(config_path=path, output_dir=out)
    )
    if code != 0:
        raise RuntimeError(f"{package}/{name} exited with {code}")
    return time.perf_counter() - start


# The temperature of each answer to a training prompt: one greedy, two sampled at T=1 (a fourth at
# T=0.7 was measured and not kept: docs/algorithms/fine_grained_rlhf.md, "Also tried")
FEEDBACK_TEMPERATURES = (0.0, 1.0, 1.0)
FEEDBACK_FILES = ("relevance", "factuality", "completeness", "preference")


def answer_pairs(prompt: str, answers: dict[str, Any], score: Any) -> list[dict[str, str]]:
    """Preference rows {"prompt", "chosen", "rejected"} from every two distinct answers to
    `prompt` (answer -> its grade) whose `score(grade)` differs; chosen = the higher."""
    texts = list(answers)
    return [
        {"prompt": prompt, "chosen": a, "rejected": b} if score(answers[a]) > score(answers[b])
        else {"prompt": prompt, "chosen": b, "rejected": a}
        for i, a in enumerate(texts) for b in texts[i + 1 :]
        if score(answers[a]) != score(answers[b])
    ]  # fmt: skip


def collect_feedback(
    sft: Path, prompts: Path, out: Path, *,
    temperatures: tuple[float, ...] = FEEDBACK_TEMPERATURES, edits: tuple[str, ...] = (),
    max_new_tokens: int = 40, chunk: int = 250,
) -> float:  # fmt: skip
    """Feedback on the SFT model's own answers, as the paper collects it: an answer to every
    prompt of `prompts` at each of `temperatures` (0: greedy; the others seeded), graded by
    the exact grader `rlhf_core.longform.grade` and written shuffled to `out/`:
    `relevance.jsonl` / `factuality.jsonl` (per sub-sentence irrelevant / per sentence
    unverifiable or wrong: the segment reward models' rows), `completeness.jsonl` (pairs of two
    answers to one prompt, chosen = the one stating more of the target's facts correctly) and
    `preference.jsonl` (chosen = the higher `holistic_score`, the holistic baseline's). `edits`
    (kinds of `rlhf_core.longform.edit_answer`): each greedy answer is also written to the
    relevance rows once per kind with that irrelevant text put in, mixed in with an rng of their
    own so that the other files stay as without them. Reused when all four exist and
    `out/settings.json` (missing: the defaults) names the same temperatures and edits; other
    settings are an error naming the file. Seconds."""
    import random

    import torch

    from policy_gradients.rollout import generate_rollouts, load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.generation import Sampling
    from rlhf_core.longform import edit_answer, grade, holistic_score, question_from_prompt
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer

    if unknown := [kind for kind in edits if kind not in EDITS]:
        raise ValueError(f"collect_feedback: edits {unknown}: expected kinds of {', '.join(EDITS)}")
    if edits and 0.0 not in temperatures:
        raise ValueError(f"collect_feedback: edits apply to greedy answers, and temperatures "
                         f"{list(temperatures)} have none (0.0)")  # fmt: skip
    files = {name: out / f"{name}.jsonl" for name in FEEDBACK_FILES}
    settings = {"temperatures": list(temperatures), "edits": list(edits)}
    if all(path.is_file() for path in files.values()):
        kept = out / "settings.json"
        found = json.loads(kept.read_text()) if kept.is_file() else {
            "temperatures": list(FEEDBACK_TEMPERATURES), "edits": []}  # fmt: skip
        if found != settings:
            raise ValueError(f"{kept}: the feedback there was collected with {found}, this run "
                             f"asks for {settings}: use another output directory")  # fmt: skip
        return 0.0
    start = time.perf_counter()
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(sft)), padding_side="left")
    items = load_prompts(
        DataSource(path=str(prompts)), tokenizer, prompt_column="prompt", answer_column="answer",
        prompt_template="{question}", system_prompt=None, where="feedback prompts",
    ).items  # fmt: skip
    policy = load_policy(ModelConfig(name_or_path=str(sft))).eval()
    rows: dict[str, list[dict]] = {name: [] for name in FEEDBACK_FILES}
    graded: list[dict[str, Any]] = [{} for _ in items]  # per prompt: answer -> its grade
    edited_rows: list[dict] = []  # relevance rows of the edited greedy answers
    for k, temperature in enumerate(temperatures):
        for first in range(0, len(items), chunk):
            part = items[first : first + chunk]
            with torch.no_grad():
                ro = generate_rollouts(
                    policy, tokenizer, [it["prompt"] for it in part], group_size=1,
                    max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temperature),
                    seeds=[10_000 * (k + 1) + first + i for i in range(len(part))],
                )  # fmt: skip
            for i, (item, answer) in enumerate(zip(part, ro.completions, strict=True)):
                question = item["messages"][-1]["content"]
                q = question_from_prompt(question)
                g = grade(q, answer)
                graded[first + i][answer] = g
                for name, labels in (("relevance", g.subsentence_irrelevant),
                                     ("factuality", g.sentence_factual)):  # fmt: skip
                    if labels:
                        rows[name].append(
                            {"prompt": question, "completion": answer, "labels": labels}
                        )
                for kind in edits if temperature == 0 else ():
                    edited = edit_answer(random.Random(f"{first + i} {kind}"), q, answer, kind)
                    if edited is not None:
                        labels = grade(q, edited).subsentence_irrelevant
                        edited_rows.append({"prompt": question, "completion": edited,
                                            "labels": labels})  # fmt: skip
    for item, answers in zip(items, graded, strict=True):
        rows["completeness"] += answer_pairs(item["messages"][-1]["content"], answers,
                                             lambda g: g.covered)  # fmt: skip
        rows["preference"] += answer_pairs(item["messages"][-1]["content"], answers,
                                           holistic_score)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for name, path in files.items():
        rng.shuffle(rows[name])
        if name == "relevance" and edited_rows:  # mixed in with an rng of their own
            rows[name] += edited_rows
            random.Random(1).shuffle(rows[name])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
    (out / "settings.json").write_text(json.dumps(settings) + "\n")
    return time.perf_counter() - start


def evaluate_models(
    models: dict[str, Path], sft: Path, heldout: Path, *, size: int, max_new_tokens: int,
    draws: int = 1,
) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:  # fmt: skip
    """Error rates, ROUGE, length and KL to `sft` of each model on `size` held-out prompts, and
    each model's first three sampled answers. The sampled figures are means over `draws` draws
    (seeds offset by 100,000 a draw, as `fine_grained_diag --sampling-seeds`): one draw's
    sampled error rate varies by more than most differences between the models."""
    import collections

    import torch

    from policy_gradients.rollout import completion_logprobs, generate_rollouts, load_prompts
    from rlhf_core.data import DataSource
    from rlhf_core.generation import Sampling
    from rlhf_core.kl import kl_estimate
    from rlhf_core.logprobs import masked_mean
    from rlhf_core.longform import error_rates, question_from_prompt
    from rlhf_core.models import ModelConfig, load_policy, load_tokenizer
    from rlhf_core.scoring import rouge_scores

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(sft)), padding_side="left")
    prompts = load_prompts(
        DataSource(path=str(heldout), limit=size), tokenizer, prompt_column="prompt",
        answer_column="answer", prompt_template="{question}", system_prompt=None,
        where="heldout",
    )  # fmt: skip
    items = prompts.items
    questions = [question_from_prompt(it["messages"][-1]["content"]) for it in items]
    references = [it["answer"] for it in items]
    reference = load_policy(ModelConfig(name_or_path=str(sft))).eval()
    results, examples = {}, {}
    for name, path in models.items():
        policy = load_policy(ModelConfig(name_or_path=str(path))).eval()
        row: dict[str, float] = collections.defaultdict(float)
        passes = [("greedy", 0.0, 0)] + [("sampled", 1.0, k) for k in range(draws)]
        for mode, temperature, k in passes:
            with torch.no_grad():
                ro = generate_rollouts(
                    policy, tokenizer, [it["prompt"] for it in items], group_size=1,
                    max_new_tokens=max_new_tokens, sampling=Sampling(temperature=temperature),
                    seeds=[100_000 * k + i for i in range(len(items))],
                )  # fmt: skip
            share = 1 / draws if mode == "sampled" else 1.0  # this pass's weight in the mean
            for key, v in error_rates(list(zip(questions, ro.completions, strict=True))).items():
                row[f"{mode}/{key}"] += share * v
            rouge = rouge_scores(ro.completions, references, ("rouge1", "rougeL"))
            row[f"{mode}/rougeL"] += share * sum(rouge["rougeL"]) / len(items)
            row[f"{mode}/rouge1"] += share * sum(rouge["rouge1"]) / len(items)
            row[f"{mode}/length"] += share * float(ro.action_mask.sum(-1).float().mean())
            row[f"{mode}/truncated"] += share * float(ro.truncated.float().mean())
            if mode == "sampled":
                args = (ro.sequence_ids, ro.attention_mask, ro.prompt_length)
                with torch.no_grad():
                    logp = completion_logprobs(policy, *args, temperature=1.0)
                    ref = completion_logprobs(reference, *args, temperature=1.0)
                kl = masked_mean(kl_estimate(logp, ref, "k3"), ro.action_mask, dim=-1)
                row["sampled/kl_k3"] += share * float(kl.mean())
                if k == 0:
                    examples[name] = ro.completions[:3]
        results[name] = dict(row)
    return results, examples


COLUMNS = [
    ("irrelevant", "irrelevant_rate"),
    ("unverifiable/wrong", "factual_error_rate"),
    ("missing", "missing_rate"),
    ("ROUGE-L", "rougeL"),
    ("ROUGE-1", "rouge1"),
    ("length", "length"),
]


def write_report(out: Path, figures: dict[str, Any]) -> Path:
    lines = ["# Fine-grained vs holistic RLHF (tiny T5, offline long-form QA)", ""]
    lines.append(
        f"SFT model `{figures['sft']}`; {figures['steps']} PPO steps per run; seeds "
        f"{figures['seeds']}; {figures['size']} held-out prompts; error rates graded exactly by "
        "`rlhf_core.longform.grade` (irrelevant: share of sub-sentences; unverifiable/wrong: share "
        "of sentences; missing: mean share of the target's facts not stated correctly)."
    )
    draws = figures.get("draws", 1)
    for mode in ("greedy", "sampled"):
        lines += ["", f"## {mode} answers", ""]
        if mode == "sampled" and draws > 1:
            lines += [f"T=1; each figure the mean over {draws} draws (seeds 100,000 apart).", ""]
        header = "| model | " + " | ".join(c for c, _ in COLUMNS)
        header += " | KL to SFT (k3/token) |" if mode == "sampled" else " |"
        lines += [header, "|---" * (len(COLUMNS) + 1 + (mode == "sampled")) + "|"]
        for name, row in figures["eval"].items():
            cells = " | ".join(f"{row[f'{mode}/{k}']:.3f}" for _, k in COLUMNS)
            kl = f" | {row['sampled/kl_k3']:.3f} |" if mode == "sampled" else " |"
            lines.append(f"| {name} | {cells}{kl}")
    lines += ["", "## Reward models (held-out)", ""]
    if figures.get("reading"):
        r = figures["reading"]
        lines.append(
            f"- lm_facts (the factuality reward model's backbone) picks the target's value for "
            f"{r['all']:.3f} of held-out facts, {r['bind']:.3f} of those only the name tells "
            f"apart (the other person's: {r['distractor']:.3f})"
        )
    for name, summary in figures["rms"].items():
        keys = [k for k in summary if k.startswith("eval/")]
        lines.append(f"- {name}: " + ", ".join(f"{k[5:]} {summary[k]:.3f}" for k in keys))
    lines += ["", "## Sampled answers to the first held-out prompt", ""]
    lines += [f"- {name}: {texts[0]!r}" for name, texts in figures["examples"].items()]
    lines += ["", "## Wall time (s)", ""]
    lines += [f"- {k}: {v:.0f}" for k, v in figures["times_s"].items()]
    path = out / "compare.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "compare.json").write_text(json.dumps(figures, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/longform"))
    parser.add_argument("--steps", type=int, default=20, help="PPO steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts to evaluate")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument(
        "--sampled-draws", type=int, default=5, metavar="K",
        help="draws of the sampled answers the report averages (one draw is noisy)",
    )  # fmt: skip
    parser.add_argument(
        "--segment-encoder", type=Path, default=None,
        help="an encoder checkpoint directory for the segment reward models (encoder_only)",
    )  # fmt: skip
    parser.add_argument(
        "--edited-feedback", action=argparse.BooleanOptionalAction, default=True,
        help="relevance feedback with edited greedy answers, and its reward model from lm_facts "
        "(default); --no-edited-feedback: the answers only, the reward model from random init",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.sampled_draws < 1:
        parser.error(f"--sampled-draws: expected an integer >= 1, got {args.sampled_draws}")
    if args.edited_feedback and args.segment_encoder is not None:
        parser.error("--edited-feedback (the default) starts the relevance reward model from "
                     "lm_facts, --segment-encoder from an encoder: add --no-edited-feedback "
                     "to use the encoder")  # fmt: skip
    out: Path = args.out
    times: dict[str, float] = {}
    encoder = args.segment_encoder
    reading_figures: dict[str, float] = {}
    for stage, (package, name) in STAGES.items():
        overrides = []
        if stage.startswith("lm_facts") and encoder is not None:
            continue  # the segment reward models start from the encoder instead
        if stage.startswith("lm_facts"):
            reading = out / "reading" / "reading.jsonl"
            if not reading.is_file():
                write_reading_corpus(reading, READING_ROWS)
            n_train = READING_ROWS - 1000
            overrides = [f"data.train.path={reading}", f"data.train.limit={n_train}",
                         f"data.eval.path={reading}", f"data.eval.offset={n_train}"]  # fmt: skip
            if stage == "lm_facts":  # the second run continues the first
                overrides.append(f"model.name_or_path={out / 'lm_facts_cosine' / 'final'}")
        elif stage != "sft":
            if "feedback" not in times:
                times["feedback"] = collect_feedback(
                    out / "sft" / "final", Path("data/longform/prompts.jsonl"), out / "feedback",
                    edits=EDITS if args.edited_feedback else (), max_new_tokens=args.max_new_tokens,
                )  # fmt: skip
            rows = out / "feedback" / f"{FEEDBACK_OF[stage]}.jsonl"
            n_train = int(0.9 * sum(1 for _ in rows.open()))
            overrides = [f"data.train.path={rows}", f"data.train.limit={n_train}",
                         f"data.eval.path={rows}", f"data.eval.offset={n_train}"]  # fmt: skip
            if stage == "rm_factuality" or (stage == "rm_relevance" and args.edited_feedback):
                overrides.append(f"model.name_or_path={out / 'lm_facts' / 'final'}")
            if stage == "rm_relevance" and args.edited_feedback:
                name = "tiny_segment_relevance_lm"
        if encoder is not None and name.startswith("tiny_segment_"):
            overrides += [f"model.name_or_path={encoder}", "encoder_only=true"]
        times[stage] = run_stage(package, name, out / stage, overrides)
        if stage == "lm_facts":
            reading_figures = check_reading(out, n_train)
    rms = {
        stage: json.loads((out / stage / "summary.json").read_text())
        for stage in STAGES if stage.startswith("rm_")
    }  # fmt: skip
    models = {"sft": out / "sft" / "final"}
    for seed in args.seeds:
        for arm in ARMS:
            run = out / f"{arm}-seed{seed}"
            overrides = [f"seed={seed}", f"train.max_steps={args.steps}", "data.eval=null",
                         f"model.name_or_path={out / 'sft' / 'final'}"]  # fmt: skip
            for k, stage in enumerate(("rm_relevance", "rm_factuality", "rm_completeness")):
                if arm == "fine_grained_ppo":
                    overrides.append(f"rewards.{k}.path={out / stage / 'final'}")
            if arm == "holistic_ppo":
                overrides.append(f"rewards.0.path={out / 'rm_holistic' / 'final'}")
            times[run.name] = run_stage("policy_gradients", arm, run, overrides)
            models[run.name] = run / "final"
    results, examples = evaluate_models(
        models, out / "sft" / "final", Path("data/longform/heldout.jsonl"), size=args.heldout,
        max_new_tokens=args.max_new_tokens, draws=args.sampled_draws,
    )  # fmt: skip
    figures = {
        "sft": str(out / "sft" / "final"), "steps": args.steps, "seeds": args.seeds,
        "size": args.heldout, "draws": args.sampled_draws, "times_s": times, "rms": rms,
        "reading": reading_figures, "eval": results, "examples": examples,
    }  # fmt: skip
    print(write_report(out, figures).read_text())
    return 0


if __name__ == "__main__":
    from rlhf_core.errors import run_main

    sys.exit(run_main(main))
