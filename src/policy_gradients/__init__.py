"""policy_gradients."""
