"""Side-by-side speed and memory benchmarks (not tests): `python -m benchmarks.run`."""
