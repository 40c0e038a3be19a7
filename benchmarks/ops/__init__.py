"""Op microbenchmarks on CUDA (``python -m benchmarks.ops.bench_<op>``), all timed by ``benchmarks.ops.timing``."""
