"""rlhf_lab: the application layer (CLI front door, quickstart) over the four packages."""
