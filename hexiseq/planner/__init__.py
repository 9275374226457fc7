"""The planner's front: the cluster and the model as the user describes them, and the plan the C core chooses for
them (and its text). The calibration and measurement that tie its predictions to real hardware live above it, in
hexiseq/hardware/."""

from .cluster import DeviceRates, Node, Cluster, gpu_catalog  # noqa: E402,F401
from .model import MODEL_PRESETS, Model, Sharding, Training  # noqa: E402,F401
from .plan import DeviceTable, Layout, Plan, Strategy, compare, evaluate  # noqa: E402,F401
from .batch import BatchPlan, BatchPlanner, plan, plan_batch  # noqa: E402,F401
from .pipeline import PipelinePlan, plan_pipeline  # noqa: E402,F401

__all__ = ["Cluster", "Node", "DeviceRates", "gpu_catalog", "Model", "Training", "Sharding", "MODEL_PRESETS", "Layout",
           "Plan", "DeviceTable", "Strategy", "evaluate", "compare", "plan", "plan_batch", "BatchPlan", "BatchPlanner",
           "plan_pipeline", "PipelinePlan"]
