"""The analytic step-time model: resource lower bounds, the f(v) recurrence, C / H / E, memory.

Pure Python + numpy: this package imports neither torch, simpy nor ortools (a test guards it).
"""

from slidedp.model.predict import Prediction, predict

__all__ = ["Prediction", "predict"]
