"""distbench: correctness and performance regression suite for distributed PyTorch training."""

__version__ = "0.1.0"
