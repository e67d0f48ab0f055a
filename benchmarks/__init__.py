"""The benchmark scripts. Each runs on its own (``python benchmarks/bench_core.py [--quick]``)
and prints one JSON object; installed with the package as ``kvtier.tools.bench.scripts`` so that
``kvtier bench`` finds them after a plain ``pip install``."""
