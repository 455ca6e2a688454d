"""SlideDP: host-streaming synchronous data-parallel full-parameter fine-tuning.

One task graph, built from (hardware, workload, plan), is read by the analytic model
(`slidedp.model`), the discrete-event simulator (`slidedp.sim`) and the executor
(`slidedp.exec`), so that predictions and measurements describe the same schedule.
"""

__version__ = "0.1.0"
