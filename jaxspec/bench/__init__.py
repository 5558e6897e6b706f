"""Benchmarks run as `jaxspec bench <name>`: each reports a ratio against a baseline measured in the
same run (matmul rate, copy bandwidth, or a peer implementation) and writes JSON."""
