"""Benchmarks you can run on your own machine: ``mlxbatch bench SECTION [options]`` (or ``python -m mlxbatch.bench``).

Every figure is a ratio against baselines (mlx-lm, mlx-vlm, the direct way) run in the same process on the same
model object; the method is in docs/benchmarks.md. Modules, top-down (nothing imports upward):

- ``cli`` / ``__main__``: which sections or subcommand run, the JSON file; ``options``: the options.
- ``engine`` (a workload vs B0/B1/B2, decode at fixed concurrency), ``tasks`` (``nsample``, ``score``), ``suite``
  (``gpu``: every GPU target in one run, one JSON + one Markdown file), ``job`` (job layer overhead) with
  ``stream`` (streaming memory; the child process is ``stream_child``): the in-process sections.
- subcommands with their own options (each ``main(argv)``): ``userjob`` (the user's job through the CLI against
  mlx-lm and the hardware floor), ``runs`` (engine A/B runs by configuration; CUDA's decisions on a CPU),
  ``kernels`` (CUDA kernels by device time, needs torch), ``invariance`` (batch invariance: cost, agreement),
  ``ray_runs`` (``ray``: the Ray executor's runs and partitioner), ``constraints`` (+ ``constraint_libs``,
  ``constraints_engine``) and ``vlm``.
- ``meta`` (machine / software / git header), ``harness`` (Table, Run, Measured, MemoryProbe, Bench, baselines,
  the section registry), ``workloads`` and ``jobdata`` (inputs from a seed), ``memory`` (RSS on Linux and macOS),
  ``procs`` (child processes by module name).

This package imports nothing on its own, so ``python -m mlxbatch.bench.stream_child`` stays free of MLX.
"""
