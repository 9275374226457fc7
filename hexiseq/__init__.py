"""HexiSeq: asymmetric context (ring) and head (Ulysses) parallelism for long-context training on
heterogeneous GPU clusters, chosen by a cost model and executed exactly."""

from . import errors  # noqa: F401  (the extension maps its status codes onto these classes)
from . import _core
from .runtime import ops
from .planner.cluster import Cluster, Node, gpu_catalog
from .errors import HexiseqError, InvalidArgumentError, MemoryFitError
from .planner.model import Model, Training
from .planner.plan import Layout, Plan, compare, evaluate
from .planner.batch import BatchPlanner, plan
from . import planner  # noqa: F401  (hexiseq.planner: the planner's other public names)
from .hardware.calibration import calibrate  # PyTorch is imported on the first call, not here
from .hardware.measurement import Measurement, measure
from ._aliases import install_module_aliases

__version__ = _core.VERSION

# The root holds what a user reaches for first; the rest lives in named sub-modules: hexiseq.errors (every error
# class), hexiseq.planner (the planner's other types and plan_batch), hexiseq.nn, hexiseq.states, hexiseq.hf, ...
__all__ = [
    "__version__",
    "build_info",
    "cuda_device_count",
    "gpu_catalog",
    "Cluster",
    "Node",
    "Model",
    "Training",
    "Layout",
    "Plan",
    "plan",
    "BatchPlanner",
    "evaluate",
    "compare",
    "calibrate",
    "measure",
    "Measurement",
    "HexiseqError",
    "InvalidArgumentError",
    "MemoryFitError",
    "ops",
    "shard_states",
    "full_state_dict",
    "load_full_state_dict",
]

# Names the root held before, answered from their sub-modules with a DeprecationWarning that names the new home.
MOVED = {"UnknownGPUError": "errors", "LayoutError": "errors", "RankMismatchError": "errors",
         "UnsupportedError": "errors", "CudaError": "errors", "InternalError": "errors", "plan_batch": "planner",
         "DeviceTable": "planner", "DeviceRates": "planner", "MODEL_PRESETS": "planner", "Sharding": "planner",
         "Strategy": "planner", "BatchPlan": "planner"}

# The public modules by their short names (`import hexiseq.nn`, `from hexiseq.hf import patch_model`): each is the
# module of its sub-package itself, loaded on first use (nn, states and hf need PyTorch or transformers).
PUBLIC_MODULES = {"ops": "runtime.ops", "nn": "runtime.nn", "states": "runtime.states", "hf": "integrations.hf",
                  "trainer": "integrations.trainer", "elastic": "integrations.elastic", "group": "integrations.group",
                  "rebalance": "integrations.rebalance", "plotting": "planner.plotting",
                  "checkpoint": "runtime.checkpoint"}
install_module_aliases(__name__, PUBLIC_MODULES)

_LAZY = {"shard_states": "runtime.states", "full_state_dict": "runtime.states", "load_full_state_dict": "runtime.states"}


def __getattr__(name):
    """The names that need PyTorch load their module on first use, so `import hexiseq` works without it."""
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in MOVED:
        import warnings

        warnings.warn(f"hexiseq.{name} is hexiseq.{MOVED[name]}.{name}; the root keeps the names a user reaches for "
                      "first", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f".{MOVED[name]}", __name__), name)
    if name in PUBLIC_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_info() -> dict:
    """What this installation was built with: version, cuda (bool: CUDA kernels compiled), cuda_runtime (the CUDA
    version they were compiled against, e.g. 13000; 0 without), compiler, openmp (bool)."""
    return _core.build_info()


def cuda_device_count() -> int:
    """CUDA devices the kernels can use (0 without a driver or GPU, or on a build without CUDA). Loads the CUDA
    kernels library, which is otherwise loaded only when a CUDA tensor reaches hexiseq.ops."""
    return _core.cuda_device_count()
