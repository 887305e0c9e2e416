"""reward_models: preference (Bradley-Terry), outcome (ORM) and process (PRM) reward models.

    config.py      `RMConfig`, the YAML schema
    models.py      `BaseRewardModel` and its three kinds over `rlhf_core.scalar_head`
    build_data.py  offline builders of labelled ORM / PRM data from reasoning-gym tasks
    data.py        rows -> token ids -> batches (its collates)
    losses.py      the reward-model losses (registry `LOSSES`)
    evaluate.py    held-out accuracy with the baselines to read it against
    train.py       `train(cfg)`, the loop, read top to bottom

A trained model is a plain directory that `policy_gradients` loads through `rlhf_core`.

Run: `uv run python -m reward_models.train --config configs/reward_models/tiny_preference.yaml`
"""
