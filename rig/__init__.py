"""The test and demonstration rig: demos, benchmarks and the local kubelet. Not product code.

The operator and the worker never import this package (the import contracts in pyproject.toml enforce
it), and the images need not ship it: `disagg demo` and `disagg bench` are registered only where it is
installed.
"""
