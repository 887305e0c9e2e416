"""reward_models."""
