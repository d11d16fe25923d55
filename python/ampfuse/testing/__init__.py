"""Test support for ampfuse's own suites (present in test builds, ``make build``).

:mod:`ampfuse.testing.cuemu` is the emulated CUDA device.
"""
