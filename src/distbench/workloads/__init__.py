"""Models and synthetic data."""

from .models import MODELS, ModelSpec, count_params, get_model

__all__ = ["MODELS", "ModelSpec", "count_params", "get_model"]
