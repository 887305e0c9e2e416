"""rlhf_core."""
