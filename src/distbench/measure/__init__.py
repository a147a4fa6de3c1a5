"""Measurement: step timing, throughput, FLOPs/MFU, memory, NVML sampling, collective bandwidth, benchmarks.

Everything that runs inside a rank takes a RankContext and synchronizes the device around what it times;
everything that aggregates is a pure function of plain numbers, so it can be unit-tested on CPU.
"""
