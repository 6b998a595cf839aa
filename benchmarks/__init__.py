"""Benchmarks of lightning-dgc: scripts that print figures and save them under ``benchmarks/results/``.

Each module is a script with a ``main(argv)`` entry (``python -m benchmarks.<name> --help``):

* :mod:`benchmarks.slow_links`: two workers in two network namespaces joined by a rate-limited
  veth pair (1 Gbit/s, 100 Mbit/s); step time and scaling efficiency of ``ddp``, ``ddp`` with
  PowerSGD, ``dgc`` and ``deft`` on ResNet-110 and the PTB LSTM (needs root, ``ip`` and ``tc``).
* :mod:`benchmarks.overhead`: ``dgc`` at density 1 against stock DDP on loopback, and the
  compression ratio of ResNet-20 at density 0.001 counting every byte.
* :mod:`benchmarks.parity`: accuracy parity on real data (CIFAR-10 subset, PTB, spoken digits).
* :mod:`benchmarks.gpu_check`: on a CUDA GPU, every GPU check in one command and one JSON (the CUDA
  tests, GPU fits, the selection, checkpoint-memory and profiling benchmarks on CUDA).
* :mod:`benchmarks.run_all`: everything above (and the selection, traffic and scaling benchmarks
  when present), then :mod:`benchmarks.report`, which writes ``docs/benchmarks/results.md``.

Benchmarks are never part of the test run.
"""
