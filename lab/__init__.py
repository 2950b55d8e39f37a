"""The lab: benchmarks, measurements, GPU queues and their results. Not installed with miniverl; it imports
miniverl, and miniverl never imports it (tests/test_layout.py)."""
