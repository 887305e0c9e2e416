"""Best-checkpoint selection and early stopping on a held-out metric, for every trainer.

    checkpoint:
      best: {metric: eval/loss, mode: min, min_delta: 0.0, patience: 3}

After each periodic evaluation (`train.eval_every`) and the final one, the train loop
(`rlhf_core.bookkeeping`) calls `ModelSelector.observe(step, eval_metrics)`:

  - an improvement (better than the best so far by more than `min_delta`; the first evaluation
    always is) sets `improved`: the loop then saves the model to `<run_dir>/best/`, a plain
    Hugging Face directory like `final/`, and `record()` ({step, metric, value}) to
    `<run_dir>/best.json` (`rlhf_core.checkpoint.save_best`);
  - `patience` evaluations in a row without one return True: the loop stops early (then runs its
    final evaluation and saves `final/` as usual; `summary.json` says where it stopped).

The decision is taken on the main process and broadcast, so every process stops at the same step
and all of them take part in the (collective) save. The selector's state travels in checkpoints,
so a resumed run keeps its best value and patience count.

Not here: writing best/ (`rlhf_core.checkpoint`), keeping the top-k, averaging checkpoints, or
selecting on a training metric.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from accelerate.utils import broadcast_object_list
from pydantic import Field, model_validator

from rlhf_core.config import StrictModel
from rlhf_core.errors import UserError


class SelectionConfig(StrictModel):
    metric: str | None = Field(
        None,
        description="held-out metric that picks <run_dir>/best/ and drives early stopping, as "
        "logged (e.g. eval/loss, eval/greedy_exact_match); null = off",
    )
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher")
    min_delta: float = Field(
        0.0, ge=0, description="an improvement must beat the best by more than this"
    )
    patience: int | None = Field(
        None, ge=1, description="stop after this many evaluations without improvement; null = never"
    )
    save_best: bool = Field(True, description="save the best model to <run_dir>/best/")

    @model_validator(mode="after")
    def _needs_metric(self) -> SelectionConfig:
        if self.metric is None and self.patience is not None:
            raise ValueError("checkpoint.best.patience needs checkpoint.best.metric")
        return self


class ModelSelector:
    """Tracks the best value of `cfg.metric`; says when best/ is due and when to stop."""

    def __init__(self, cfg: SelectionConfig, accelerator: Any, *, periodic_eval: bool) -> None:
        if cfg.metric is not None and not periodic_eval:
            raise UserError(
                f"checkpoint.best.metric {cfg.metric!r} needs periodic held-out evaluation: set "
                "train.eval_every > 0 and give held-out data (data.eval)"
            )
        self.cfg, self.accelerator = cfg, accelerator
        self.improved = False  # whether the last `observe` saw a new best
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0
        self.last_step: int | None = None
        self.stopped_at: int | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.metric is not None

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        delta = self.best - value if self.cfg.mode == "min" else value - self.best
        return delta > self.cfg.min_delta

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Record one evaluation at `step` (every process calls it); `improved` says whether it
        is a new best (the caller saves best/). True = stop now."""
        self.improved = False
        if not self.enabled or step == self.last_step:
            return False
        self.last_step = step
        decision = [None]
        if self.accelerator.is_main_process:
            if self.cfg.metric not in metrics:
                known = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
                raise UserError(
                    f"checkpoint.best.metric {self.cfg.metric!r} is not among the evaluation's "
                    f"metrics: {known or '(none)'}"
                )
            value = float(metrics[self.cfg.metric])
            improved = math.isfinite(value) and self._improves(value)
            decision = [(improved, value)]
        if self.accelerator.num_processes > 1:
            decision = broadcast_object_list(decision, from_process=0)
        improved, value = decision[0]
        if improved:
            self.best, self.best_step, self.bad_evals, self.improved = value, step, 0, True
        else:
            self.bad_evals += 1
        if self.cfg.patience is not None and self.bad_evals >= self.cfg.patience:
            self.stopped_at = step
            if self.accelerator.is_main_process:
                print(
                    f"early stop at step {step}: {self.cfg.metric} did not improve on "
                    f"{self.best:.6g} (step {self.best_step}) for {self.bad_evals} evaluations",
                    flush=True,
                )
            return True
        return False

    def record(self) -> dict[str, Any]:
        """The best evaluation so far, as best.json holds it."""
        return {"step": self.best_step, "metric": self.cfg.metric, "value": self.best}

    def summary(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {
            "best/metric": self.cfg.metric, "best/value": self.best, "best/step": self.best_step,
            "early_stopped_at": self.stopped_at,
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals,
                "last_step": self.last_step}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.best, self.best_step = state["best"], state["best_step"]
            self.bad_evals, self.last_step = state["bad_evals"], state["last_step"]
