"""The `rlhf-lab compare` config (`CompareConfig`) and how each of its runs' trainer config is
built from it: the base config, the preset's algorithm (or loss) block, then the overrides
(the rules: `rlhf_lab.compare`'s docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from rlhf_core.config import StrictModel
from rlhf_core.data import DataSource
from rlhf_lab.compare_report import RM_LABEL


class RunSpec(StrictModel):
    preset: str = Field(
        description="a shipped config whose `algorithm` (policy gradients) or `loss` (direct "
        "alignment) block this run uses"
    )
    set: list[str] = Field(default_factory=list, description="overrides for this run only")


class CompareConfig(StrictModel):
    name: str = Field("compare", description="run name (the output dir is compare-<time>)")
    sft_model: str | None = Field(
        None, description="the SFT model dir every run starts from; null: train sft_config first"
    )
    sft_config: str = Field(
        "configs/quickstart/sft.yaml", description="SFT config trained when sft_model is null"
    )
    base: str = Field(
        "configs/quickstart/grpo.yaml", description="policy-gradient config that sets the shared "
        "budget: model, data (prompts and their format), rewards, rollout, train, optim",
    )  # fmt: skip
    set: list[str] = Field(
        default_factory=list, description="overrides applied to every policy-gradient run"
    )
    algorithms: dict[str, RunSpec] = Field(description="policy-gradient runs: name -> preset")
    dpo_base: str = Field(
        "configs/quickstart/dpo.yaml", description="direct-alignment config for the DPO family"
    )
    direct_alignment: dict[str, RunSpec] = Field(
        default_factory=dict, description="optional DPO-family runs: name -> loss preset"
    )
    reward_model: str | None = Field(
        None, description="a reward model dir (saved by reward_models): held-out mean score and "
        "win rate against the SFT model, and the judge of the DPO family's pairs when there is "
        "no verifier",
    )  # fmt: skip
    verifier: list[dict[str, Any]] = Field(
        default_factory=list, description="reward components that grade held-out completions "
        "(e.g. {name: reasoning_gym, extract: full, label: task}): mean and accuracy (share "
        "scoring 1.0), greedy and sampled",
    )  # fmt: skip
    eval_prompts: DataSource | None = Field(
        None, description="held-out prompts, read with the base's data format, columns and "
        "template; null = the base's data.eval",
    )  # fmt: skip
    eval_size: int = Field(
        200, gt=0, description="held-out prompts (reasoning-gym: the size; a file: at most this "
        "many rows)",
    )  # fmt: skip
    seeds: list[int] | None = Field(
        None, description="training seeds: every run once per seed (`seed=<k>`, run dirs "
        "<name>-seed<k>), and the table and plot per algorithm over them (mean, min-max, gain "
        "over the SFT model); null = each run once, at its config's seed",
    )  # fmt: skip
    jobs: int = Field(
        1, ge=1, description="runs trained (and models evaluated) at once, each in its own "
        "worker process; 1 = one after another in this process",
    )  # fmt: skip
    threads: int | None = Field(
        None, gt=0, description="torch threads of each run (its train.threads), the pairs and "
        "the evaluation; null = 1 when jobs > 1, else each trainer's default (the free cores)",
    )  # fmt: skip
    pairs: int = Field(512, gt=0, description="training prompts for the on-policy pairs")
    pair_samples: int = Field(4, ge=2, description="SFT samples per prompt for the pairs")
    pairs_judge: Literal["auto", "verifier", "reward_model"] = Field(
        "auto", description="who picks chosen and rejected (rlhf_lab.onpolicy); auto = the "
        "task's verifier on reasoning-gym prompts with a verifier configured, else reward_model",
    )  # fmt: skip

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
            raise ValueError(f"expected distinct integers (or null), got {seeds}")
        return seeds

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from policy_gradients.rewards import REWARDS
        from rlhf_core.registry import validate_spec

        out = []
        for i, spec in enumerate(specs):
            core = {k: v for k, v in spec.items() if k != "label"}
            checked = validate_spec(REWARDS, core, where=f"verifier.{i}")
            if getattr(REWARDS.get(checked["name"]), "learned", False):
                raise ValueError(
                    f"verifier.{i}: {checked['name']!r} is a learned reward; set it as "
                    "reward_model, verifier lists graders (reasoning_gym, gsm8k, exact_match)"
                )
            out.append({**checked, "label": spec.get("label", checked["name"])})
        labels = [s["label"] for s in out]
        if len(set(labels)) != len(labels) or RM_LABEL in labels:
            raise ValueError(f"verifier: labels must be unique and not {RM_LABEL!r}: {labels}")
        return out


def run_threads(cfg: CompareConfig) -> int | None:
    """Each run's torch threads: `threads`, else 1 with jobs > 1, else None (trainer default)."""
    return cfg.threads if cfg.threads is not None else (1 if cfg.jobs > 1 else None)


def _seeded(cfg: CompareConfig, name: str) -> list[tuple[str, int | None]]:
    """(run name, seed) of each run of `name`: one per seed in `seeds`, else one."""
    return [(f"{name}-seed{k}", k) for k in cfg.seeds] if cfg.seeds else [(name, None)]


def _pg_config(
    cfg: CompareConfig, name: str, spec: RunSpec | None, sft: Path, fast: bool,
    seed: int | None = None,
):  # fmt: skip
    """The policy-gradient config of run `name` (spec None: the base with the shared overrides,
    whose data and rollout settings the pairs and the evaluation use); `seed` set last."""
    from policy_gradients.config import PGConfig
    from rlhf_core.config import apply_overrides, read_yaml, validate_config

    data = read_yaml(cfg.base)
    if spec is not None:
        data["algorithm"] = read_yaml(spec.preset)["algorithm"]
    data["name"] = f"{cfg.name}_{name}"
    data["model"]["name_or_path"] = str(sft)
    overrides = [*cfg.set, *(spec.set if spec else [])] + (["train.max_steps=2"] if fast else [])
    overrides += [] if seed is None else [f"seed={seed}"]
    overrides += [] if run_threads(cfg) is None else [f"train.threads={run_threads(cfg)}"]
    data = apply_overrides(data, overrides)
    preset = f" + algorithm of {spec.preset}" if spec else ""
    source = f"{cfg.base}{preset} (with --set {', '.join(overrides)})"
    return validate_config(PGConfig, data, source)


def _da_config(
    cfg: CompareConfig, name: str, spec: RunSpec, sft: Path, pairs: Path, fast: bool,
    seed: int | None = None,
):  # fmt: skip
    from direct_alignment.config import DAConfig
    from rlhf_core.config import apply_overrides, read_yaml, validate_config

    data = read_yaml(cfg.dpo_base)
    data["loss"] = read_yaml(spec.preset)["loss"]
    data["name"] = f"{cfg.name}_{name}"
    data["model"]["name_or_path"] = str(sft)
    data["data"]["train"] = {"path": str(pairs / "train.jsonl")}
    data["data"]["eval"] = {"path": str(pairs / "eval.jsonl")}
    overrides = list(spec.set) + (["train.max_steps=2"] if fast else [])
    overrides += [] if seed is None else [f"seed={seed}"]
    overrides += [] if run_threads(cfg) is None else [f"train.threads={run_threads(cfg)}"]
    data = apply_overrides(data, overrides)
    return validate_config(DAConfig, data, f"{cfg.dpo_base} + loss of {spec.preset}")


def _pg_cost(pg_cfg: Any) -> float:
    """A policy-gradient run's rough relative training time, only to start the longest first:
    per step one rollout and `ppo_epochs` passes, each doubled when a value model trains too."""
    alg = pg_cfg.algorithm
    return pg_cfg.train.max_steps * (1 + alg.ppo_epochs * (2 if alg.value_loss else 1))
