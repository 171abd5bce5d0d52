"""`make bench`: throughput figures printed as ratios against a reference measured on the same machine.

Never part of the test suite: figures depend on the machine and its load.
"""
