"""Benchmarks of torchlevels against torch.func, measured in one process; see run.py."""
