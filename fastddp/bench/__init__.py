"""Benchmarks: ``python -m fastddp.bench allreduce`` and ``python -m fastddp.bench ddp``."""
