"""policy_gradients: RL from verifiable or learned rewards (REINFORCE, RLOO, PPO, GRPO, Dr. GRPO,
GSPO, CISPO, DAPO), each a named combination of advantage estimator, per-token loss and
aggregation.

    config.py      `PGConfig`, the YAML schema
    rollout.py     prompts, batched rollouts, per-token log-probs and values, the rollout log
    rewards.py     reward components (registry `REWARDS`) and their weighted sum
    advantages.py  advantage estimators (registry `ADVANTAGES`)
    experience.py  `Experience` and the `ReplayBuffer`
    collect.py     one step's experience: rollouts -> rewards -> log-probs -> advantages
    environments.py  multi-turn environments (registry `ENVIRONMENTS`), two tiny-world ones
    tools.py       tools (registry `TOOLS`), `<tool_call>` parsing, safe calls with a timeout
    episodes.py    multi-turn rollouts: sampled ids kept, environment tokens masked out
    losses.py      per-token policy losses (`LOSSES`) and PPO's value loss
    evaluate.py    held-out greedy and sampled evaluation
    train.py       `train(cfg)`, the loop, read top to bottom

Run: `uv run python -m policy_gradients.train --config configs/policy_gradients/tiny_grpo.yaml`
"""
