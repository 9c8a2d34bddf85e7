"""What fastddp's tests and benchmarks share: jobs to launch and the harness that runs them."""
