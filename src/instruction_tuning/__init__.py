"""instruction_tuning."""
