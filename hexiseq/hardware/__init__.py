"""Hardware measurement: the calibration that describes the devices and links at hand as a Cluster
(`calibration.py`: `hexiseq.calibrate`), and the measurement that runs a plan's layer and puts each phase next to
the cost model's prediction (`measurement.py`: `hexiseq.measure`), over what both run on the ranks (`harness.py`).

Above the planner and the runtime: it plans with the one and times the other's kernels and layers, and neither
imports it. PyTorch is imported on first use, so `import hexiseq` works without it."""
