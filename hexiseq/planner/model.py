"""Model shapes and the training setting the cost model needs."""

import enum
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import List, Optional

from .. import _core
from .._validate import boolean, core_integer, integer, load_json, number, read_text
from ..errors import InvalidArgumentError

__all__ = ["Model", "Training", "Sharding", "MODEL_PRESETS"]


def hf_sliding_layers(config, layers):
    """How many of a Hugging Face config's `layers` use its sliding window: the "sliding_attention" entries of
    `layer_types` when it lists them (Gemma 2 and 3, gpt-oss), else every layer (Mistral)."""
    get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
        lambda k, default=None: getattr(config, k, default))
    layer_types = get("layer_types") or []
    if layer_types:
        return sum(1 for t in layer_types if t == "sliding_attention")
    return layers


def hf_sliding_window(config):
    """The attention window a Hugging Face config applies, or None for full causal attention: `sliding_window`
    counts unless `use_sliding_window` is false (Qwen2 keeps a window size it does not use), or when some
    `layer_types` entry is "sliding_attention" (Gemma-style alternating layers). config: a dict or an object."""
    get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
        lambda k, default=None: getattr(config, k, default))
    window = get("sliding_window")
    if window is None:
        return None
    layer_types = get("layer_types") or []
    if not isinstance(layer_types, (list, tuple)):
        raise InvalidArgumentError(f"layer_types must be a list of layer kinds, got {layer_types!r}")
    if boolean(get("use_sliding_window", True), "use_sliding_window") or "sliding_attention" in layer_types:
        return window
    return None


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's shape. `gated_mlp` selects SwiGLU (3 matrices) over a GELU MLP (2).

    `sliding_window`: the attention window of a model that uses one, in tokens as Hugging Face counts it (a query
    sees its `sliding_window` latest keys, itself included; Mistral 7B v0.1: 4096), None for full causal attention.
    `sliding_layers`: how many of the layers use it (Gemma 3: 5 of every 6; Mistral: all, the default when a window
    is given). The cost model prices a windowed layer with the pairs and ring steps it needs, and the runtime runs
    it so (hexiseq_attn_func's window: (sliding_window - 1, 0)); the plan balances the mix of both kinds.

    `embedding`, `head`: whether the model holds its token embedding, and its output head with the final norm and
    the loss; both True for a whole model. A pipeline stage is a Model without one or both (Model.stage), its
    `layers` the stage's; the cost model then leaves out their parameters, compute and activations."""

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
    sliding_layers: Optional[int] = None
    embedding: bool = True
    head: bool = True

    def __post_init__(self):
        for f in fields(self):
            if f.name in ("name", "gated_mlp", "sliding_window", "sliding_layers", "embedding", "head"):
                continue
            object.__setattr__(self, f.name, core_integer(getattr(self, f.name), f"model.{f.name}", f"model.{f.name}"))
        if self.sliding_window is not None:
            window = integer(self.sliding_window, "model.sliding_window")
            if window < 1:
                raise InvalidArgumentError(f"model.sliding_window must be a positive token count or None, got {window}")
            object.__setattr__(self, "sliding_window", window)
            used = self.layers if self.sliding_layers is None else integer(self.sliding_layers, "model.sliding_layers")
            if not 0 <= used <= self.layers:
                raise InvalidArgumentError(f"model.sliding_layers must be in [0, model.layers = {self.layers}], got "
                                           f"{used}")
            object.__setattr__(self, "sliding_layers", used)
        elif self.sliding_layers is not None:
            raise InvalidArgumentError(f"model.sliding_layers = {self.sliding_layers!r} needs model.sliding_window")
        object.__setattr__(self, "gated_mlp", boolean(self.gated_mlp, "model.gated_mlp"))
        object.__setattr__(self, "embedding", boolean(self.embedding, "model.embedding"))
        object.__setattr__(self, "head", boolean(self.head, "model.head"))
        if not isinstance(self.name, str):
            raise InvalidArgumentError(f"model.name must be a string, got {self.name!r}")
        _core.model_params(self._as_core())  # heads % kv_heads

    @property
    def params(self) -> float:
        """Parameter count, embeddings and an untied output head included."""
        return _core.model_params(self._as_core())

    @property
    def window(self):
        """The runtime's window of the sliding layers, (sliding_window - 1, 0), or None."""
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    def stage(self, layers: int, first: bool, last: bool) -> "Model":
        """The part of this model a pipeline stage holds: `layers` of its layers (consecutive), the embedding when it
        is the first stage, the output head (final norm, loss) when it is the last. The sliding layers are shared
        out in proportion (rounded down): which layers use the window is not part of a shape."""
        layers = integer(layers, "layers", 1, self.layers)
        sliding = None if self.sliding_window is None else self.sliding_layers * layers // self.layers
        return replace(self, layers=layers, embedding=bool(first), head=bool(last),
                       sliding_window=self.sliding_window if sliding else None, sliding_layers=sliding or None,
                       name=f"{self.name}[{layers} layers{', embedding' if first else ''}{', head' if last else ''}]")

    def _as_core(self):
        core = (self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.ffn, self.vocab,
                self.dtype_bytes, int(self.gated_mlp))
        windowed = self.sliding_window is not None and self.sliding_layers
        if self.embedding and self.head:
            return core + (self.sliding_window, self.sliding_layers) if windowed else core
        return core + ((self.sliding_window, self.sliding_layers) if windowed else (0, 0)) + (
            int(not self.embedding), int(not self.head))

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["sliding_window"] is None:  # absent, as before the fields existed: older plan files keep their hash
            del d["sliding_window"], d["sliding_layers"]
        for part in ("embedding", "head"):  # a whole model's, absent: its plan files keep their hash
            if d[part]:
                del d[part]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Model":
        if not isinstance(d, dict):
            hint = (": for a Hugging Face config.json use Model.from_hf_config(path), for a preset Model.preset(name)"
                    if isinstance(d, (str, os.PathLike)) else "")
            raise InvalidArgumentError(f"a model description must be a mapping, got {d!r}{hint}")
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
        it). Llama/Mistral/Qwen-style or GPT-2/NeoX-style keys. The element size comes from `dtype` (transformers
        5), else `torch_dtype` (older configs), bfloat16 when neither is set; the name is the config's
        `_name_or_path` when set, else its model_type and size ("llama-1.2b")."""
        if isinstance(config, (str, os.PathLike)):
            config = _read_hf_config(config)
        elif isinstance(config, (bytes, list, tuple, int, float)) or config is None:
            raise InvalidArgumentError(f"a Hugging Face config must be a dict, an object or the path of its "
                                       f"config.json, got {config!r}")
        get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (
            lambda k, default=None: getattr(config, k, default))

        def first(*keys):
            """(key, value) of the first key present and not null, or (keys[0], None)."""
            for k in keys:
                v = get(k)
                if v is not None:
                    return k, v
            return keys[0], None

        def count(field, *keys, default=None):
            """An integer under one of `keys` in the core's range for model.<field> (the message names the key the
            config used), or `default` when none is present: a 0 or a wrong type is refused, never read as
            missing."""
            key, value = first(*keys)
            if value is None:
                return default
            return core_integer(value, key, f"model.{field}")

        layers = count("layers", "num_hidden_layers", "n_layer", "num_layers")
        hidden = count("hidden", "hidden_size", "n_embd", "d_model")
        heads = count("heads", "num_attention_heads", "n_head")
        missing = [k for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden),
                                   ("num_attention_heads", heads)) if v is None]
        if missing:
            raise InvalidArgumentError(f"config lacks {', '.join(missing)}")
        kv = count("kv_heads", "num_key_value_heads", "n_head_kv", default=heads)
        head_dim = count("head_dim", "head_dim", default=hidden // heads)
        if head_dim < 1:
            raise InvalidArgumentError(f"hidden_size ({hidden}) over num_attention_heads ({heads}) leaves no head_dim; "
                                       f"give head_dim")
        act = str(first("hidden_act", "activation_function")[1] or "").lower()
        gated = act in ("silu", "swiglu", "swish") or first("model_type")[1] in ("llama", "mistral", "qwen2", "qwen3",
                                                                                  "gemma", "mixtral")
        ffn = count("ffn", "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
        if isinstance(config, dict) or not hasattr(config, "dtype"):
            dtype_key, dtype = first("dtype", "torch_dtype")
        else:
            # transformers 5 holds `dtype` (None when unset) and keeps `torch_dtype` as an alias of it that logs a
            # deprecation when read: an object with `dtype` is never asked for `torch_dtype`
            dtype_key, dtype = "dtype", config.dtype
        window = hf_sliding_window(config)
        sliding = None if window is None else hf_sliding_layers(config, layers)
        model = cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim, ffn=ffn,
                    vocab=count("vocab", "vocab_size", default=32000), dtype_bytes=_hf_dtype_bytes(dtype_key, dtype),
                    gated_mlp=gated, name="hf-config",
                    sliding_window=None if window is None else integer(window, "sliding_window", minimum=1),
                    sliding_layers=sliding)
        return replace(model, name=_hf_name(get, model))


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
    # not a published model: Llama 3's shape scaled down (45M parameters, states of 0.7 GiB under Adam) so that the
    # whole loop (calibrate, plan, measure, train) runs on CPU ranks of a laptop or a CI machine
    "llama-tiny": Model(4, 512, 8, 2, 64, 1408, 32000, gated_mlp=True, name="llama-tiny"),
    # sliding-window models, from their published configs: Mistral 7B v0.1 (a 4096-token window on every layer) and
    # Gemma 3 12B (a 1024-token window on 40 of its 48 layers, five local layers to each global one)
    "mistral-7b": Model(32, 4096, 32, 8, 128, 14336, 32000, gated_mlp=True, name="mistral-7b", sliding_window=4096),
    "gemma3-12b": Model(48, 3840, 16, 8, 256, 15360, 262208, gated_mlp=True, name="gemma3-12b", sliding_window=1024,
                        sliding_layers=40),
}

_ALIASES = {"3b": "gpt-3b", "7b": "gpt-7b", "13b": "gpt-13b", "30b": "gpt-30b", "8b": "llama3-8b",
            "70b": "llama3-70b"}


class Sharding(enum.Enum):
    """How parameters, gradients and optimizer states are spread over the devices."""

    FULL = "full"          # ZeRO-3 / FSDP full sharding (default)
    GRAD_OPT = "grad_opt"  # ZeRO-2: gradients and optimizer states sharded
    OPT = "opt"            # ZeRO-1: optimizer states sharded
    NONE = "none"          # replicated (plain data parallel)


_SHARDING_CODE = {s: _core.SHARDINGS[s.value] for s in Sharding}  # the core's enum values, by name
STATE_SHARES = ("auto", "even", "memory")
_STATE_SHARES_CODE = dict(_core.STATE_SHARES)  # the core's values; "auto" is chosen in Python (plan.py)
MEMORY_FEATURES = tuple(_core.MEMORY_FEATURES)  # "offload", "tile_mlp", "tile_loss": the core's mask bits by name


def memory_features_mask(value: str) -> int:
    """The core's mask of a training's memory_features ("auto": all, "none": none, else names joined by ',')."""
    if value == "auto":
        return sum(_core.MEMORY_FEATURES.values())
    if value == "none":
        return 0
    return sum(_core.MEMORY_FEATURES[f] for f in value.split(","))


def memory_features_names(mask: int) -> List[str]:
    """The names of the features in a core mask, in the core's order."""
    return [f for f in MEMORY_FEATURES if mask & _core.MEMORY_FEATURES[f]]


def _memory_features(value) -> str:
    """A training's memory_features in its canonical form: "auto", "none", or known names joined by ','."""
    if isinstance(value, (list, tuple, set, frozenset)):
        value = ",".join(str(v) for v in value) if value else "none"
    if not isinstance(value, str):
        raise InvalidArgumentError(f"training.memory_features must be 'auto', 'none' or names from "
                                   f"{list(MEMORY_FEATURES)}, got {value!r}")
    if value in ("auto", "none"):
        return value
    names = [v.strip() for v in value.replace("+", ",").split(",") if v.strip()]
    bad = [v for v in names if v not in MEMORY_FEATURES]
    if bad or not names:
        raise InvalidArgumentError(f"training.memory_features must be 'auto', 'none' or names from "
                                   f"{list(MEMORY_FEATURES)} joined by ',', got {value!r}")
    return ",".join(f for f in MEMORY_FEATURES if f in names)


@dataclass(frozen=True)
class Training:
    """The training setting the memory and time model needs.

    sequences: sequences of seq_len tokens per step, processed one after another (gradient accumulation).
    checkpointing: full activation checkpointing (each layer's forward recomputed in backward).
    sharding: model-state sharding over all devices.
    reserved_gib: per-device memory kept back for the CUDA context, the framework and fragmentation.
    state_shares: how the sharded states are divided: "even" (1/N per device, what FSDP and ZeRO do), "memory"
        (in proportion to the memory each device has beside the unsharded part, so a small device holds less;
        run such a plan with hexiseq.shard_states), or "auto" (even when a plan fits so, else by memory; a plan
        records which it chose).
    memory_features: what a device short of memory may use, chosen per device by the cost model (the combination
        that fits with the least added time; none where nothing is short): "offload" (activation checkpoints to
        host memory, overlapped with the neighbouring layer; needs checkpointing), "tile_mlp" (the MLP a tile of
        tokens at a time, recomputed per tile), "tile_loss" (the logits and loss a tile at a time). "auto" allows
        all three, "none" none; or names joined by ','. The plan says per device what it chose
        (`plan.memory_features(device)`); hexiseq.hf applies it, hexiseq.nn has the pieces for a model of one's
        own."""

    sequences: int = 1
    checkpointing: bool = False
    sharding: Sharding = Sharding.FULL
    reserved_gib: float = 2.0
    state_shares: str = "auto"
    memory_features: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "sequences", core_integer(self.sequences, "training.sequences", "training.sequences"))
        object.__setattr__(self, "checkpointing", boolean(self.checkpointing, "training.checkpointing"))
        try:
            object.__setattr__(self, "sharding", Sharding(self.sharding))
        except ValueError:
            raise InvalidArgumentError(f"training.sharding must be one of {[s.value for s in Sharding]}, "
                                       f"got {self.sharding!r}") from None
        r = number(self.reserved_gib, "training.reserved_gib")
        if r < 0:
            raise InvalidArgumentError(f"training.reserved_gib must be >= 0, got {r}")
        object.__setattr__(self, "reserved_gib", r)
        if self.state_shares not in STATE_SHARES:
            raise InvalidArgumentError(f"training.state_shares must be one of {list(STATE_SHARES)}, "
                                       f"got {self.state_shares!r}")
        object.__setattr__(self, "memory_features", _memory_features(self.memory_features))

    def _as_core(self):
        """The core's training tuple; "auto" is evaluated as even (plan() tries even first, then by memory)."""
        return (self.sequences, int(self.checkpointing), _SHARDING_CODE[self.sharding], self.reserved_gib,
                _STATE_SHARES_CODE.get(self.state_shares, 0), memory_features_mask(self.memory_features))

    def to_dict(self) -> dict:
        d = {"sequences": self.sequences, "checkpointing": self.checkpointing, "sharding": self.sharding.value,
             "reserved_gib": self.reserved_gib, "state_shares": self.state_shares}
        if self.state_shares == "even":  # absent, as before the field existed: older plan files keep their hash
            del d["state_shares"]
        if self.memory_features != "none":  # likewise: absent means none (what older files planned without)
            d["memory_features"] = self.memory_features
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Training":
        """The inverse of to_dict: a field to_dict leaves out is its written-out default (state_shares "even",
        memory_features "none", what files older than those fields planned with), so that
        Training.from_dict(t.to_dict()) == t for every t. A dict a user writes as a setting goes to plan() as it
        is, where absent fields take the constructor's defaults ("auto")."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a training description must be a mapping, got {d!r}")
        return cls._of_fields({"state_shares": "even", "memory_features": "none", **d})

    @classmethod
    def _of_fields(cls, d: dict) -> "Training":
        """A Training of a mapping of its fields (unknown ones refused by name); absent ones take the defaults."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a training description must be a mapping, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidArgumentError(f"unknown training field(s) {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)

    @classmethod
    def setting(cls, d: dict) -> "Training":
        """A Training of a user's mapping of some of its fields, the others at the constructor's defaults (what
        plan() and the other entry points do with a dict given as training)."""
        return cls._of_fields(d)


# A Hugging Face dtype (a name, "torch.<name>", or a torch.dtype) -> bytes per element. "auto" (take the
# checkpoint's) and an unset dtype count as bfloat16, what the planner assumes of a model.
_HF_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4,
                   "float": 4, "float64": 8, "double": 8, "auto": 2}


def _hf_dtype_bytes(key, value) -> int:
    """Bytes per element of a Hugging Face config's `dtype` (or `torch_dtype`, its name before transformers 5)."""
    if value is None:
        return 2
    # a name, or a torch.dtype (what transformers 5 turns the name into), told by its type without importing torch
    named = isinstance(value, str) or (type(value).__name__ == "dtype" and str(value).startswith("torch."))
    text = str(value).strip().lower().removeprefix("torch.") if named else None
    if text not in _HF_DTYPE_BYTES:
        raise InvalidArgumentError(f"config's {key} must be a floating-point dtype ({', '.join(_HF_DTYPE_BYTES)}), "
                                   f"got {value!r}")
    return _HF_DTYPE_BYTES[text]


def _size_label(params: float) -> str:
    """A parameter count as model names give it, cut (not rounded) to at most one decimal below 10 and to whole
    units from 10 on: 8.03e9 -> "8b", 1.24e9 -> "1.2b", 70.55e9 -> "70b", 124.4e6 -> "124m"."""
    for unit, suffix in ((1e12, "t"), (1e9, "b"), (1e6, "m"), (1e3, "k")):
        if params >= unit:
            x = params / unit
            x += 1e-6  # a count just under a boundary by the division's rounding stays on it
            text = str(int(x)) if x >= 10 else f"{int(x * 10) / 10:.1f}".removesuffix(".0")
            return text + suffix
    return f"{int(params)}"


def _hf_name(get, model) -> str:
    """The name of a model read from a Hugging Face config: the name or path it was loaded under
    (`_name_or_path`, or `name_or_path`) when set, else its `model_type` (or "hf") and its size, e.g. "llama-1.2b":
    short, and what the checkpoint would be called. The size counts the parameters the checkpoint holds (the output
    head once when `tie_word_embeddings` says it is the embedding), not the untied head the planner prices."""
    for key in ("_name_or_path", "name_or_path"):
        value = get(key)
        if value is None:
            continue
        if not isinstance(value, (str, os.PathLike)):
            raise InvalidArgumentError(f"config's {key} must be a string, got {value!r}")
        value = os.fspath(value).strip()
        if value:
            return value
    kind = get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise InvalidArgumentError(f"config's model_type must be a string, got {kind!r}")
    tied = get("tie_word_embeddings")
    params = model.params - (model.vocab * model.hidden if tied is not None and
                             boolean(tied, "config's tie_word_embeddings") else 0)
    return f"{(kind or '').strip() or 'hf'}-{_size_label(params)}"


def _read_hf_config(path) -> dict:
    """The dict of a Hugging Face config.json, given the file or the folder holding it."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise InvalidArgumentError(f"model config {path!r}: no such file" +
                                   (" (the folder has no config.json)" if os.path.isdir(path) else ""))
    cfg = load_json(read_text(file, "model config"), f"model config {file!r}")
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"model config {file!r} holds a {type(cfg).__name__}, not a JSON object")
    return cfg
