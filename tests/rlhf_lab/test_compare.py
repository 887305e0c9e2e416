"""`rlhf-lab compare` shortened: two policy-gradient presets and one DPO-family loss from the same
SFT model; every run trains and is evaluated, and the table, JSON and plot are written."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_core.config import ConfigError, load_config
from rlhf_lab.compare import CompareConfig, _pg_config, run_compare


def test_fast_compare_runs_each_configured_algorithm_once_per_seed(
    sft_checkpoint, tmp_path, monkeypatch
):
    import yaml
    from conftest import REPO

    monkeypatch.chdir(REPO)
    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", [
        f"sft_model={sft_checkpoint}", "eval_size=16", "seeds=[3, 4]",
    ])  # fmt: skip
    cfg = cfg.model_copy(update={
        "algorithms": {k: cfg.algorithms[k] for k in ("rloo", "dr_grpo")},
        "direct_alignment": {"ipo": cfg.direct_alignment["ipo"]},
    })  # fmt: skip
    out = tmp_path / "cmp"
    report = run_compare(cfg, out, fast=True)
    names = [f"{a}-seed{k}" for a in ("rloo", "dr_grpo", "ipo") for k in (3, 4)]
    assert list(report["runs"]) == ["sft", *names] and report["seeds"] == [3, 4]
    for name in names:
        run = report["runs"][name]
        assert (out / name / "final" / "config.json").is_file()
        # each run trained at its own seed, read back from the config its trainer saved
        assert yaml.safe_load((out / name / "config.yaml").read_text())["seed"] == run["seed"]
        assert run["seed"] == int(name[-1]) and run["algorithm"] == name.split("-")[0]
        assert math.isfinite(run["eval"]["eval/sampled_task"]), name
        assert run["eval"]["eval/sampled_kl_k3"] >= 0
    assert report["runs"]["rloo-seed3"]["tokens_generated"] > 0
    assert report["runs"]["ipo-seed3"]["tokens_generated"] is None
    # the per-algorithm summary is the runs' own figures
    summary = report["summary"]
    assert list(summary) == ["rloo", "dr_grpo", "ipo"]
    sft = report["runs"]["sft"]["eval"]["eval/sampled_task_exact"]
    for algorithm, s in summary.items():
        values = [report["runs"][f"{algorithm}-seed{k}"]["eval"]["eval/sampled_task_exact"]
                  for k in (3, 4)]  # fmt: skip
        assert s["values"] == values and s["seeds"] == [3, 4]
        assert s["gain"] == pytest.approx(sum(values) / 2 - sft)
        assert s["spread"] == pytest.approx(max(values) - min(values))
    # the run used the preset's algorithm block plus the YAML's overrides, nothing else
    saved = json.loads(json.dumps(report["config"]))
    assert saved["algorithms"]["dr_grpo"]["set"] == [
        "algorithm.loss.normalizer=16",
        "optim.lr=5.0e-5",
    ]
    text = (out / "compare.md").read_text()
    assert (
        "| dr_grpo-seed4 | policy_gradients |" in text and "| dr_grpo | policy_gradients |" in text
    )
    assert "## Per algorithm over seeds [3, 4]" in text
    assert (out / "compare.png").stat().st_size > 0
    # a second pass with --resume reuses every finished run (its figures come back unchanged)
    again = run_compare(cfg, out, fast=True, resume=True)
    assert again["runs"]["rloo-seed4"]["eval"] == report["runs"]["rloo-seed4"]["eval"]


def _two_arms(sft_checkpoint, extra: list[str] = (), dpo: bool = True) -> CompareConfig:
    """The shipped compare with one policy-gradient arm (grpo) and, with `dpo`, one DPO-family
    arm (ipo), each at seeds 0 and 1, on 16 held-out prompts."""
    from conftest import REPO

    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", [
        f"sft_model={sft_checkpoint}", "eval_size=16", "seeds=[0, 1]", *extra,
    ])  # fmt: skip
    return cfg.model_copy(update={
        "algorithms": {"grpo": cfg.algorithms["grpo"]},
        "direct_alignment": {"ipo": cfg.direct_alignment["ipo"]} if dpo else {},
    })  # fmt: skip


def test_compare_jobs_2_gives_each_run_what_it_gets_alone(sft_checkpoint, tmp_path, monkeypatch):
    """--jobs 2 (1 thread per run by default) against --jobs 1 --threads 1: every run's summary,
    final weights and held-out figures are equal, bit for bit."""
    import yaml
    from conftest import REPO
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO)
    one = run_compare(
        _two_arms(sft_checkpoint, ["jobs=1", "threads=1"]), tmp_path / "one", fast=True
    )
    two = run_compare(_two_arms(sft_checkpoint, ["jobs=2"]), tmp_path / "two", fast=True)
    assert (one["jobs"], one["threads"], two["jobs"], two["threads"]) == (1, 1, 2, 1)
    names = ["grpo-seed0", "grpo-seed1", "ipo-seed0", "ipo-seed1"]
    assert list(two["runs"]) == ["sft", *names]
    for name in names:
        a, b = (
            json.loads((tmp_path / d / name / "summary.json").read_text()) for d in ("one", "two")
        )
        key = "last_train_reward" if name.startswith("grpo") else "final_train_loss"
        assert a[key] == b[key] and a["threads"] == b["threads"] == 1, name
        config = yaml.safe_load((tmp_path / "two" / name / "config.yaml").read_text())
        assert config["train"]["threads"] == 1 and config["seed"] == int(name[-1])
        wa, wb = (
            load_file(tmp_path / d / name / "final" / "model.safetensors") for d in ("one", "two")
        )
        assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa), name
        # each worker's output went to its own log, not to the terminal
        assert (
            f"run dir: {tmp_path / 'two' / name}"
            in (tmp_path / "two" / "logs" / f"{name}.log").read_text()
        )
    for name in ["sft", *names]:  # the evaluation, split over the two workers, is the same too
        assert two["runs"][name]["eval"] == one["runs"][name]["eval"], name
    assert (tmp_path / "two" / "samples.jsonl").read_text() == (
        tmp_path / "one" / "samples.jsonl"
    ).read_text()
    assert not (tmp_path / "one" / "logs").exists()
    assert two["wall_s"] > 0 and set(two["phases_s"]) == {
        "policy_gradients", "pairs", "direct_alignment", "evaluation",
    }  # fmt: skip
    text = (tmp_path / "two" / "compare.md").read_text()
    assert "(2 run(s) at a time, 1 torch thread(s) each)." in text


def test_compare_jobs_a_failed_run_is_named_and_the_others_kept(
    sft_checkpoint, tmp_path, monkeypatch, capsys
):
    """A run that fails in a worker (its model directory is missing): exit 1, one line naming it
    and its log; the run beside it finishes, and --resume reuses it (not retrained) once the
    cause is fixed."""
    import shutil

    from conftest import REPO

    from rlhf_lab.compare import main

    monkeypatch.chdir(REPO)
    later, out = tmp_path / "later", tmp_path / "cmp"
    grpo = "{preset: configs/policy_gradients/grpo.yaml"
    argv = [
        "--fast", "--jobs", "2", "--seeds", "0", "--output-dir", str(out),
        "--set", f"sft_model={sft_checkpoint}", "--set", "eval_size=16",
        "--set", "direct_alignment={}", "--set",
        f"algorithms={{grpo: {grpo}}}, late: {grpo}, set: [model.name_or_path={later}]}}}}",
    ]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    log = out / "logs" / "late-seed0.log"
    assert "error: compare: 1 run(s) failed: late-seed0 (" in err
    assert f"; log {log})" in err and "--resume" in err
    assert "Traceback" in log.read_text() and str(later) in log.read_text()
    finished = out / "grpo-seed0" / "summary.json"
    assert finished.is_file() and not (out / "compare.json").exists()
    stamp = finished.stat().st_mtime_ns
    shutil.copytree(sft_checkpoint, later)  # the cause fixed
    assert main([*argv, "--resume"]) == 0
    assert finished.stat().st_mtime_ns == stamp  # reused, not trained again
    report = json.loads((out / "compare.json").read_text())
    assert report["resumed"] and report["jobs"] == 2 and report["threads"] == 1
    assert (out / "late-seed0" / "final" / "config.json").is_file()
    assert math.isfinite(report["runs"]["late-seed0"]["eval"]["eval/sampled_task"])


def test_compare_jobs_threads_and_the_longest_runs_first(tmp_path, monkeypatch):
    from conftest import REPO

    from rlhf_lab.compare import main
    from rlhf_lab.compare_config import _pg_cost, run_threads

    monkeypatch.chdir(REPO)
    path = REPO / "configs/quickstart/compare.yaml"
    cfg = load_config(CompareConfig, path)
    assert (cfg.jobs, cfg.threads, run_threads(cfg)) == (1, None, None)
    pg = _pg_config(cfg, "grpo", cfg.algorithms["grpo"], tmp_path, fast=False)
    assert pg.train.threads is None  # one job: the trainer's default, as before
    two = load_config(CompareConfig, path, ["jobs=2"])
    assert run_threads(two) == 1
    assert _pg_config(two, "grpo", two.algorithms["grpo"], tmp_path, fast=False).train.threads == 1
    assert run_threads(load_config(CompareConfig, path, ["jobs=2", "threads=3"])) == 3
    # PPO (4 epochs and a value model) starts first, then the 2-epoch arms
    costs = {n: _pg_cost(_pg_config(cfg, n, s, tmp_path, fast=False))
             for n, s in cfg.algorithms.items()}  # fmt: skip
    order = sorted(costs, key=lambda n: -costs[n])
    assert order[0] == "ppo" and set(order[1:3]) == {"gspo", "cispo"}
    with pytest.raises(ConfigError, match=r"jobs"):
        main(["--jobs", "0", "--output-dir", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_compare_seeds_are_distinct_and_come_from_the_command_line(tmp_path, monkeypatch):
    from conftest import REPO

    from rlhf_lab.compare import _seeded, main

    monkeypatch.chdir(REPO)
    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", ["seeds=[0, 1]"])
    assert _seeded(cfg, "grpo") == [("grpo-seed0", 0), ("grpo-seed1", 1)]
    pg = _pg_config(cfg, "grpo-seed1", cfg.algorithms["grpo"], tmp_path, fast=False, seed=1)
    assert pg.seed == 1 and pg.name == "compare_grpo-seed1"
    one = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", ["seeds=null"])
    assert _seeded(one, "grpo") == [("grpo", None)]
    for bad in ("[1, 1]", "[]"):
        with pytest.raises(ConfigError, match=r"field 'seeds': expected distinct integers"):
            load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml", [f"seeds={bad}"])
    # --seeds reaches the config: a repeated seed is refused before anything runs
    with pytest.raises(
        ConfigError, match=r"'seeds': expected distinct integers \(or null\), got \[2, 2\]"
    ):
        main(["--seeds", "2", "2", "--output-dir", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def _report(values: dict[str, list[float]], sft: float) -> dict:
    runs = {"sft": {"family": "sft", "eval": {"eval/sampled_task_exact": sft}}}
    for algorithm, per_seed in values.items():
        for k, v in enumerate(per_seed):
            runs[f"{algorithm}-seed{k}"] = {
                "family": "policy_gradients", "algorithm": algorithm, "seed": k, "wall_s": 10.0,
                "eval": {"eval/sampled_task_exact": v, "eval/greedy_task_exact": 0.5 + v,
                         "eval/sampled_kl_k3": 0.1 * k},
            }  # fmt: skip
    return {"verifiers": ["task"], "seeds": [0, 1], "runs": runs, "fast": False,
            "sft_model": "sft", "eval_prompts": 4}  # fmt: skip


def test_seed_summary_gain_against_spread():
    """improves = the mean gain over SFT is larger than max - min over the seeds."""
    from rlhf_lab.compare_report import seed_summary

    s = seed_summary(_report({"a": [0.30, 0.26], "b": [0.30, 0.10], "c": [0.19, 0.17]}, 0.20))
    assert s["a"]["mean"] == pytest.approx(0.28) and s["a"]["spread"] == pytest.approx(0.04)
    assert s["a"]["gain"] == pytest.approx(0.08) and s["a"]["improves"] is True
    # a gain (0.0) no larger than its spread (0.2), and a loss, do not count
    assert s["b"]["gain"] == pytest.approx(0.0) and s["b"]["improves"] is False
    assert s["c"]["gain"] == pytest.approx(-0.02) and s["c"]["improves"] is False
    assert s["a"]["means"]["eval/greedy_task_exact"] == pytest.approx(0.78)
    assert s["a"]["means"]["eval/sampled_kl_k3"] == pytest.approx(0.05)
    assert s["a"]["wall_s"] == 20.0 and s["a"]["runs"] == ["a-seed0", "a-seed1"]


def test_compare_table_and_plot_show_every_seed(tmp_path, monkeypatch):
    """compare.md: a row per algorithm with each seed's figure; compare.png: each seed a dot on
    the held-out panel with a bar from min to max, and the training curves' min-max band."""
    import matplotlib.axes

    from rlhf_lab.compare_report import plot_curves, seed_summary, write_table

    report = _report({"grpo": [0.30, 0.26], "rloo": [0.18, 0.22]}, 0.20)
    report["summary"] = seed_summary(report)
    for name in ("grpo-seed0", "grpo-seed1", "rloo-seed0", "rloo-seed1"):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "train/reward/total": 0.1 * s + (0.05 if name.endswith("1") else 0)}
                for s in (1, 2, 3)]  # fmt: skip
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_table(tmp_path, report)
    text = (tmp_path / "compare.md").read_text()
    assert "| grpo | policy_gradients | 0.300, 0.260 | 0.280 | 0.040 | +0.080 | yes |" in text
    assert "| rloo | policy_gradients | 0.180, 0.220 | 0.200 | 0.040 | +0.000 | **no** |" in text
    assert "| grpo-seed1 | policy_gradients |" in text
    drawn = {"scatter": [], "vlines": [], "fill_between": [], "axhline": []}
    for method in drawn:
        real = getattr(matplotlib.axes.Axes, method)

        def spy(self, *args, _real=real, _name=method, **kwargs):  # the real call, recorded
            drawn[_name].append(args)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(matplotlib.axes.Axes, method, spy)
    plot_curves(tmp_path, report)
    assert [list(a[1]) for a in drawn["scatter"]] == [[0.30, 0.26], [0.18, 0.22]]
    assert [a[1:] for a in drawn["vlines"]] == [(0.26, 0.30), (0.18, 0.22)]
    assert drawn["axhline"] == [(0.20,)]
    assert len(drawn["fill_between"]) == 2  # one band per algorithm: steps, min, max
    for steps, lo, hi in drawn["fill_between"]:
        assert list(steps) == [1, 2, 3] and lo == pytest.approx([0.1, 0.2, 0.3])
        assert hi == pytest.approx([0.15, 0.25, 0.35])
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_compare_run_config_is_the_preset_algorithm_on_the_base(tmp_path, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    cfg = load_config(CompareConfig, REPO / "configs/quickstart/compare.yaml")
    pg = _pg_config(cfg, "gspo", cfg.algorithms["gspo"], tmp_path / "sft", fast=False)
    assert pg.algorithm.loss["name"] == "gspo" and pg.rollout.max_new_tokens == 16
    assert pg.train.max_steps == 26 and pg.optim.lr == 1e-4 and pg.name == "compare_gspo"
    assert pg.optim.warmup_steps == 3 and cfg.seeds == [0, 1] and cfg.eval_size == 500
    # an arm's own `set` comes after the shared one: half the lr for cispo, dr_grpo and rloo
    lrs = {n: _pg_config(cfg, n, s, tmp_path / "sft", fast=False).optim.lr
           for n, s in cfg.algorithms.items()}  # fmt: skip
    assert {n for n, lr in lrs.items() if lr == 5e-5} == {"cispo", "dr_grpo", "rloo"}
    assert all(lr == 1e-4 for n, lr in lrs.items() if n not in ("cispo", "dr_grpo", "rloo"))
    bad = cfg.model_copy(update={"set": ["algorithm.loss.no_such_key=1"]})
    with pytest.raises(ConfigError):
        _pg_config(bad, "gspo", cfg.algorithms["gspo"], tmp_path / "sft", fast=False)


# ----------------------------------------------------------------------- any prompt set, an RM


@pytest.fixture(scope="module")
def gpt2_rm(tmp_path_factory):
    """A real scalar-head reward model on the tiny-gpt2 backbone (untrained; its head spread wide
    so samples never tie), saved as reward_models saves one."""
    import torch

    from rlhf_core.models import ModelConfig, load_tokenizer
    from rlhf_core.scalar_head import ScalarHeadInfo, ScalarHeadModel

    torch.manual_seed(0)
    mcfg = ModelConfig(name_or_path="tiny-gpt2")
    tokenizer = load_tokenizer(mcfg, padding_side="right")
    rm = ScalarHeadModel.from_config(
        mcfg, ScalarHeadInfo(kind="preference", chat_template=tokenizer.chat_template)
    )
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    rm.tokenizer = tokenizer
    out = tmp_path_factory.mktemp("gpt2_rm")
    rm.save_pretrained(out)
    return out


def _hh_compare(gpt2_rm, extra: list[str] = ()) -> CompareConfig:
    from conftest import REPO

    from rlhf_core.tiny import preset_dir

    base_set = [
        f"rewards=[{{name: reward_model, weight: 1.0, path: {gpt2_rm}}}]",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
        "train.micro_batch_size=4", "train.eval_size=4",  # each arm's own final evaluation
    ]  # fmt: skip
    return load_config(CompareConfig, REPO / "configs/compare_hh/compare.yaml", [
        f"sft_model={preset_dir('tiny-gpt2')}", f"reward_model={gpt2_rm}",
        f"set={json.dumps(base_set)}", "pairs=8", "pair_samples=2", "eval_size=6", *extra,
    ])  # fmt: skip


def test_fast_compare_on_hh_prompts_with_an_rm_only_reward(gpt2_rm, tmp_path, monkeypatch):
    """GPT-2 + HH at toy size: PPO and GRPO with the RM as their only reward, DPO on on-policy
    pairs the RM judged; every arm gets a finite RM mean score, win rate against the SFT model and
    KL; the SFT model against itself (the same samples) wins exactly half."""
    from conftest import REPO

    from rlhf_core.scalar_head import ScalarHeadModel

    monkeypatch.chdir(REPO)
    cfg = _hh_compare(gpt2_rm)
    cfg = cfg.model_copy(update={"algorithms": {k: cfg.algorithms[k] for k in ("ppo", "grpo")}})
    out = tmp_path / "cmp"
    report = run_compare(cfg, out, fast=True)
    assert list(report["runs"]) == ["sft", "ppo", "grpo", "dpo"]
    assert report["eval_prompts"] == 6 and report["verifiers"] == []
    for name, run in report["runs"].items():
        ev = run["eval"]
        for key in ("eval/sampled_rm", "eval/win_rate", "eval/win_rate_se", "eval/sampled_kl_k3"):
            assert math.isfinite(ev[key]), (name, key)
        assert 0.0 <= ev["eval/win_rate"] <= 1.0 and ev["eval/sampled_kl_k3"] >= 0
        assert "eval/sampled_rm_exact" not in ev  # a score, not a grade
    sft = report["runs"]["sft"]["eval"]
    assert sft["eval/win_rate"] == 0.5 and sft["eval/sampled_kl_k3"] == pytest.approx(0, abs=1e-6)
    # the DPO pairs: HH prompts (multi-turn ones as messages), chosen scored above rejected by
    # the reward model that judged them
    rows = [json.loads(x) for x in (out / "pairs" / "train.jsonl").read_text().splitlines()]
    assert rows and report["runs"]["dpo"]["pairs"] == len(rows)
    rm = ScalarHeadModel.from_pretrained(gpt2_rm)
    chosen = rm.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = rm.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert bool((chosen > rejected).all())
    # the held-out samples: one line per prompt with every model's completion and RM score
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and set(samples[0]) == {"prompt", "sft", "ppo", "grpo", "dpo"}
    assert samples[0]["prompt"].startswith("\n\nHuman:")
    text = (out / "compare.md").read_text()
    assert (
        "| RM score (sampled) | win rate vs SFT |" in text and "| ppo | policy_gradients |" in text
    )


def test_compare_refuses_heldout_prompts_that_overlap_training(gpt2_rm, tmp_path, monkeypatch):
    from conftest import REPO

    from rlhf_core.errors import UserError
    from rlhf_lab.compare import _heldout_sources

    monkeypatch.chdir(REPO)
    cfg = _hh_compare(gpt2_rm, ["eval_prompts={path: data/hh-rlhf/harmless-base-test.jsonl.gz, "
                                "offset: 1900}"])  # fmt: skip
    base = _pg_config(cfg, "base", None, tmp_path, fast=False)
    with pytest.raises(UserError, match="overlap the training prompts"):
        _heldout_sources(cfg, base, 200)
    # no reward model and no verifier: refused before anything trains
    no_judge = _hh_compare(gpt2_rm, ["reward_model=null"])
    with pytest.raises(UserError, match="need a judge"):
        run_compare(no_judge, tmp_path / "x", fast=True)
    assert not (tmp_path / "x" / "ppo").exists()
