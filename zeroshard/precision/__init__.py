"""Mixed precision: parameter dtypes and dynamic loss scaling."""
from zeroshard.precision.loss_scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler"]
