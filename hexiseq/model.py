"""Model shapes and the training setting the cost model needs."""

import enum
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

from . import _core
from ._validate import integer, number
from .errors import InvalidArgumentError

__all__ = ["Model", "Training", "Sharding", "MODEL_PRESETS"]


def hf_sliding_window(config):
    """The attention window a Hugging Face config applies, or None for full causal attention: `sliding_window`
    counts unless `use_sliding_window` is false (Qwen2 keeps a window size it does not use), or when some
    `layer_types` entry is "sliding_attention" (Gemma-style alternating layers). config: a dict or an object."""
    get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
        lambda k, default=None: getattr(config, k, default))
    window = get("sliding_window")
    if window is None:
        return None
    if get("use_sliding_window", True) or "sliding_attention" in (get("layer_types") or []):
        return window
    return None


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's shape. `gated_mlp` selects SwiGLU (3 matrices) over a GELU MLP (2).

    `sliding_window`: the attention window of a model that uses one (e.g. Mistral 7B v0.1's 4096), None for full
    causal attention. The cost model and the runtime compute full causal attention only, which equals windowed
    attention when no sequence is longer than the window: planning a longer sequence is refused (hexiseq.plan),
    rather than pricing and running attention the model does not use."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype_bytes: int = 2
    gated_mlp: bool = False
    name: str = "custom"
    sliding_window: Optional[int] = None

    def __post_init__(self):
        for f in fields(self):
            if f.name in ("name", "gated_mlp") or (f.name == "sliding_window" and self.sliding_window is None):
                continue
            object.__setattr__(self, f.name, integer(getattr(self, f.name), f"model.{f.name}"))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise InvalidArgumentError(f"model.sliding_window must be a positive token count or None, got "
                                       f"{self.sliding_window}")
        if not isinstance(self.gated_mlp, (bool, int)):
            raise InvalidArgumentError(f"model.gated_mlp must be a bool, got {self.gated_mlp!r}")
        object.__setattr__(self, "gated_mlp", bool(self.gated_mlp))
        _core.model_params(self._as_core())  # range checks, heads % kv_heads

    @property
    def params(self) -> float:
        """Parameter count, embeddings and an untied output head included."""
        return _core.model_params(self._as_core())

    def _as_core(self):
        return (self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab,
                self.dtype_bytes, int(self.gated_mlp))

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["sliding_window"] is None:  # absent, as before the field existed: older plan files keep their hash
            del d["sliding_window"]
        return d

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse a sequence longer than the model's attention window (see the class comment)."""
        if self.sliding_window is not None and seq_len > self.sliding_window:
            raise InvalidArgumentError(
                f"model.sliding_window is {self.sliding_window} but seq_len is {seq_len}: sliding-window attention "
                f"is not modelled (the cost model and the runtime compute full causal attention, which equals it "
                f"only up to {self.sliding_window} tokens); plan at most {self.sliding_window} tokens, or set "
                f"sliding_window to null in the config to plan full attention")

    @classmethod
    def from_dict(cls, d: dict) -> "Model":
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a model description must be a mapping, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            hint = ("; this looks like a Hugging Face config: use Model.from_hf_config(it), or the path of its "
                    "config.json" if unknown & {"num_hidden_layers", "hidden_size", "n_layer", "n_embd"} else "")
            raise InvalidArgumentError(f"unknown model field(s) {sorted(unknown)}; expected {sorted(known)}{hint}")
        required = {"layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"}
        missing = required - set(d)
        if missing:
            raise InvalidArgumentError(f"model is missing field(s) {sorted(missing)}")
        return cls(**d)

    @classmethod
    def from_name_or_path(cls, text) -> "Model":
        """A preset name ("llama3-70b", "7b", ...) or the path of a Hugging Face config.json (or its folder)."""
        if isinstance(text, os.PathLike) or os.path.exists(str(text)) or str(text).endswith(".json"):
            return cls.from_hf_config(text)
        return cls.preset(text)

    @classmethod
    def preset(cls, name: str) -> "Model":
        """A built-in model: gpt-3b, gpt-7b, gpt-13b, gpt-30b, llama3-8b, llama3-70b (short forms 3b, 7b, 13b,
        30b, 8b, 70b)."""
        key = str(name).strip().lower()
        key = _ALIASES.get(key, key)
        if key not in MODEL_PRESETS:
            raise InvalidArgumentError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
        return MODEL_PRESETS[key]

    @classmethod
    def from_hf_config(cls, config) -> "Model":
        """From a Hugging Face config: an object, a dict, or the path of its config.json (or of the folder holding
        it). Llama/Mistral/Qwen-style or GPT-2/NeoX-style keys."""
        if isinstance(config, (str, os.PathLike)):
            config = _read_hf_config(config)
        get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
            lambda k, default=None: getattr(config, k, default))

        def first(*keys):
            for k in keys:
                v = get(k)
                if v is not None:
                    return v
            return None

        layers = first("num_hidden_layers", "n_layer", "num_layers")
        hidden = first("hidden_size", "n_embd", "d_model")
        heads = first("num_attention_heads", "n_head")
        missing = [k for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden),
                                   ("num_attention_heads", heads)) if v is None]
        if missing:
            raise InvalidArgumentError(f"config lacks {', '.join(missing)}")
        kv = first("num_key_value_heads", "n_head_kv") or heads
        head_dim = first("head_dim") or integer(hidden, "hidden_size") // integer(heads, "num_attention_heads")
        act = str(first("hidden_act", "activation_function") or "").lower()
        gated = act in ("silu", "swiglu", "swish") or first("model_type") in ("llama", "mistral", "qwen2", "qwen3",
                                                                               "gemma", "mixtral")
        ffn = first("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
        dtype = str(first("torch_dtype") or "bfloat16")
        dtype_bytes = 4 if "float32" in dtype else 2
        return cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim, ffn=ffn,
                   vocab=first("vocab_size") or 32000, dtype_bytes=dtype_bytes, gated_mlp=gated,
                   name=str(first("_name_or_path", "model_type") or "hf-config"),
                   sliding_window=hf_sliding_window(config))


# GPT-style models follow the GPT-3 paper's shapes (Brown et al. 2020, Table 2.1, 2.7B/6.7B/13B) with
# a 50304-entry vocabulary; 30B follows the MPT-30B/OPT-30B width. Llama 3 shapes are from Meta's
# published configs.
MODEL_PRESETS = {
    "gpt-3b": Model(32, 2560, 32, 32, 80, 10240, 50304, name="gpt-3b"),
    "gpt-7b": Model(32, 4096, 32, 32, 128, 16384, 50304, name="gpt-7b"),
    "gpt-13b": Model(40, 5120, 40, 40, 128, 20480, 50304, name="gpt-13b"),
    "gpt-30b": Model(48, 7168, 56, 56, 128, 28672, 50304, name="gpt-30b"),
    "llama3-8b": Model(32, 4096, 32, 8, 128, 14336, 128256, gated_mlp=True, name="llama3-8b"),
    "llama3-70b": Model(80, 8192, 64, 8, 128, 28672, 128256, gated_mlp=True, name="llama3-70b"),
}

_ALIASES = {"3b": "gpt-3b", "7b": "gpt-7b", "13b": "gpt-13b", "30b": "gpt-30b", "8b": "llama3-8b",
            "70b": "llama3-70b"}


class Sharding(enum.Enum):
    """How parameters, gradients and optimizer states are spread over the devices."""

    FULL = "full"          # ZeRO-3 / FSDP full sharding (default)
    GRAD_OPT = "grad_opt"  # ZeRO-2: gradients and optimizer states sharded
    OPT = "opt"            # ZeRO-1: optimizer states sharded
    NONE = "none"          # replicated (plain data parallel)


_SHARDING_CODE = {Sharding.FULL: 0, Sharding.GRAD_OPT: 1, Sharding.OPT: 2, Sharding.NONE: 3}


@dataclass(frozen=True)
class Training:
    """The training setting the memory and time model needs.

    sequences: sequences of seq_len tokens per step, processed one after another (gradient accumulation).
    checkpointing: full activation checkpointing (each layer's forward recomputed in backward).
    sharding: model-state sharding over all devices.
    reserved_gib: per-device memory kept back for the CUDA context, the framework and fragmentation."""

    sequences: int = 1
    checkpointing: bool = False
    sharding: Sharding = Sharding.FULL
    reserved_gib: float = 2.0

    def __post_init__(self):
        object.__setattr__(self, "sequences", integer(self.sequences, "training.sequences", minimum=1))
        if not isinstance(self.checkpointing, (bool, int)):
            raise InvalidArgumentError(f"training.checkpointing must be a bool, got {self.checkpointing!r}")
        object.__setattr__(self, "checkpointing", bool(self.checkpointing))
        try:
            object.__setattr__(self, "sharding", Sharding(self.sharding))
        except ValueError:
            raise InvalidArgumentError(f"training.sharding must be one of {[s.value for s in Sharding]}, "
                                       f"got {self.sharding!r}") from None
        r = number(self.reserved_gib, "training.reserved_gib")
        if r < 0:
            raise InvalidArgumentError(f"training.reserved_gib must be >= 0, got {r}")
        object.__setattr__(self, "reserved_gib", r)

    def _as_core(self):
        return (self.sequences, int(self.checkpointing), _SHARDING_CODE[self.sharding], self.reserved_gib)

    def to_dict(self) -> dict:
        return {"sequences": self.sequences, "checkpointing": self.checkpointing, "sharding": self.sharding.value,
                "reserved_gib": self.reserved_gib}

    @classmethod
    def from_dict(cls, d: dict) -> "Training":
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a training description must be a mapping, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidArgumentError(f"unknown training field(s) {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)


def _read_hf_config(path) -> dict:
    """The dict of a Hugging Face config.json, given the file or the folder holding it."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise InvalidArgumentError(f"model config {path!r}: no such file" +
                                   (" (the folder has no config.json)" if os.path.isdir(path) else ""))
    with open(file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"model config {file!r} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"model config {file!r} holds a {type(cfg).__name__}, not a JSON object")
    return cfg
