"""What fastddp's tests and benchmarks share: spawning ranks (``spawn``), network namespaces
as nodes (``netns``, over the userspace ``wire``), restart cases (``restarts``), the simulated
NCCL backend (``nccl_sim``) with its notional CUDA streams (``sim_streams``), the CUDA grid
emulator with its checks and cases (``emu``, ``emu_checks``, ``emu_cases``), hang guards
scaled to the machine (``slack``), free ports for their jobs (``ports``) and a pytest plugin
that lists the tests that cost the most CPU time (``cpu_report``)."""
