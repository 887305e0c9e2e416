"""direct_alignment."""
