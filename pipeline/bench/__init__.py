"""``pipeline bench``: measurements, each side by side in one run (docs/benchmarks.md).

``ops`` times each method against one block, ``throughput`` whole models against the unmodified one,
``kernels`` the CUDA kernels, ``loop`` the training loop against its bare step, ``loader`` the data
loaders; ``timing`` and ``profiling`` are what they share (and what the evaluate stage times with).
Nothing is imported here: the GPU machines import the model benchmarks without FFCV.
"""
