"""`rlhf-lab data CONFIG`: a trainer's data through its own loaders, on the vendored HH pairs and
the tiny world: row counts, drops, token lengths checked against an independent tokenization,
what the limits cut, examples as the model sees them, the histogram."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from conftest import REPO

from rlhf_core.chat import render_prompt, split_hh_pair
from rlhf_core.config import ConfigError
from rlhf_core.models import ModelConfig, load_tokenizer
from rlhf_lab.cli import main as cli_main
from rlhf_lab.data_report import build_report

HH = REPO / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
DPO = REPO / "configs" / "direct_alignment" / "dpo.yaml"
GPT2 = "model.name_or_path=tiny-qwen3-gpt2"


def hh_rows(n: int) -> list[dict]:
    with gzip.open(HH, "rt", encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def test_hh_dpo_report_matches_an_independent_tokenization(tmp_path):
    overrides = [GPT2, "data.train.limit=48", "data.eval.limit=12", "data.max_prompt_length=64",
                 "data.max_length=160"]  # fmt: skip
    report = build_report(DPO, overrides, trainer=None, out=tmp_path / "out", chars=300)
    assert report["trainer"] == "dpo"
    train, heldout = report["splits"]["train"], report["splits"]["eval"]
    assert train["rows_in_source"] == 48 and heldout["rows_in_source"] == 12

    # the prompt and completion lengths before truncation, by hand: the HH split, the chat
    # template, the tokenizer, eos after each completion
    tok = load_tokenizer(ModelConfig(name_or_path="tiny-qwen3-gpt2"), padding_side="right")
    prompts, chosen = [], []
    for i, row in enumerate(hh_rows(48)):
        messages, good, _ = split_hh_pair(row["chosen"], row["rejected"], where=f"row {i}")
        prompts.append(len(tok(render_prompt(tok, messages), add_special_tokens=False).input_ids))
        chosen.append(len(tok(good, add_special_tokens=False).input_ids) + 1)
    lengths = train["lengths_before_truncation"]
    assert lengths["prompt"]["max"] == max(prompts)
    assert lengths["prompt"]["p90"] == pytest.approx(np.percentile(prompts, 90))
    assert lengths["chosen"]["p50"] == pytest.approx(np.percentile(chosen, 50))

    # what the limits cut: prompts over 64 tokens, and what the loader itself counted
    cut = train["cut_by_limits"]
    assert cut["prompt_cut"] == sum(n > 64 for n in prompts) > 0
    assert cut["prompt_cut"] == train["loader_counts"]["truncated_prompts"]
    assert cut["completion_cut"] == train["loader_counts"]["truncated"] > 0
    assert any("prompts were cut to their last 64 tokens" in w for w in train["warnings"])
    assert train["examples_kept"] + train["loader_counts"]["dropped_identical"] == 48

    # examples as the model sees them: the template's turns, eos after each completion
    example = train["examples"][0]
    assert len(train["examples"]) == 3 and set(example) == {"prompt", "chosen", "rejected"}
    assert example["prompt"].endswith("\n\nAssistant:")
    assert example["chosen"].endswith(tok.eos_token)

    out = tmp_path / "out"
    assert (out / "lengths.png").stat().st_size > 10_000
    assert json.loads((out / "report.json").read_text())["splits"]["train"] == train


def test_overlong_drop_is_reported_as_drops(tmp_path):
    overrides = [GPT2, "data.train.limit=48", "data.eval=null", "data.max_length=128",
                 "data.overlong=drop"]  # fmt: skip
    report = build_report(DPO, overrides, trainer="dpo", out=tmp_path / "o", chars=100)
    train = report["splits"]["train"]
    dropped = train["loader_counts"]["dropped_overlong"]
    assert dropped == train["cut_by_limits"]["rows_cut"] > 0
    assert train["examples_kept"] == 48 - dropped - train["loader_counts"]["dropped_identical"]
    assert set(report["splits"]) == {"train"}


def test_every_trainer_config_and_the_cli(tmp_path, capsys):
    configs = REPO / "configs"
    sft = build_report(
        configs / "instruction_tuning" / "tiny_sft.yaml",
        ["data.train.reasoning_gym.size=40", "data.eval.reasoning_gym.size=8"],
        trainer=None, out=tmp_path / "sft", chars=200,
    )  # fmt: skip
    assert sft["trainer"] == "sft"
    assert sft["splits"]["train"]["examples_kept"] == 40
    assert sft["splits"]["eval"]["examples_kept"] == 8
    assert set(sft["splits"]["train"]["lengths_before_truncation"]) == {
        "prompt", "completion", "total"
    }  # fmt: skip

    rm = build_report(
        configs / "reward_models" / "tiny_preference.yaml",
        ["data.train.reasoning_gym.size=32", "data.eval=null"],
        trainer=None, out=tmp_path / "rm", chars=200,
    )  # fmt: skip
    assert rm["trainer"] == "rm" and rm["splits"]["train"]["examples_kept"] > 0
    assert rm["splits"]["train"]["cut_by_limits"]["rows"] == rm["splits"]["train"]["examples_kept"]

    prompts = tmp_path / "rl.yaml"
    prompts.write_text(
        (configs / "policy_gradients" / "grpo.yaml").read_text()
        .replace("Qwen/Qwen3-0.6B", "tiny-qwen3-gpt2")
    )  # fmt: skip
    code = cli_main([
        "data", str(prompts), "--set", "data.train.limit=10", "--set", "data.eval.limit=4",
        "--out", str(tmp_path / "rl"),
    ])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "(rl trainer, tokenizer tiny-qwen3-gpt2)" in text
    assert "rows: 10 in the source, 10 examples kept" in text
    assert "limits: rollout.max_new_tokens 1024" in text
    rl = json.loads((tmp_path / "rl" / "report.json").read_text())
    # GSM8K prompts keep their reference answers, reported as a second length
    assert set(rl["splits"]["train"]["lengths_before_truncation"]) == {"prompt", "answer", "total"}
    assert "Reason step by step" in rl["splits"]["train"]["examples"][0]["prompt"]


def test_a_config_of_no_trainer_is_refused_and_nothing_is_written(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {train: {path: data/gsm8k/test.jsonl}}\n")
    with pytest.raises(ConfigError, match="not a config of any trainer"):
        build_report(bad, [], trainer=None, out=tmp_path / "out", chars=100)
    assert not (tmp_path / "out").exists()
    assert cli_main(["data", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_a_column_mapped_file_is_read_as_the_trainer_reads_it(tmp_path):
    """An orca-style {system, question, chosen, rejected} file under data.columns: the report's
    examples show the system turn and the question rendered by the chat template."""
    rows = [{"system": "Answer in one word.", "question": f"Colour {i}?", "chosen": "Blue.",
             "rejected": f"Red {i}."} for i in range(6)]  # fmt: skip
    path = tmp_path / "orca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [GPT2, f"data.train.path={path}", "data.train.limit=null", "data.eval=null",
                 "data.format=preference", "data.columns.prompt=question"]  # fmt: skip
    report = build_report(DPO, overrides, trainer=None, out=tmp_path / "o", chars=200)
    train = report["splits"]["train"]
    assert train["rows_in_source"] == 6 == train["examples_kept"]
    assert train["examples"][0]["prompt"] == "Answer in one word.\n\nHuman: Colour 0?\n\nAssistant:"
    assert train["examples"][0]["rejected"] == "Red 0.<|endoftext|>"
