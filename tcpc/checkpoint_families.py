"""Where each example family's weights live in a HuggingFace checkpoint: one declarative table
per family, read by tcpc/checkpoints.py (and documented in docs/checkpoints.md). A family a
user declares in a TOML file (tcpc/family_file.py) becomes the same table.

A table maps the graph arguments of a family's programs (examples/*.moe: a bf16 one and the
low-precision ones, whose weight arguments have the same names) to tensor names under the
chosen layer's prefix, with the layout transform that turns the stored tensor into the shape
the program declares; the program's dims come from config.json. Names and layouts follow the
HuggingFace checkpoints of each model (the per-expert `nn.Linear` weights are [out, in], the
programs take [in, out]) and transformers' fused expert tensors, which some checkpoints store
instead. The activations (the first argument) are not weights: they come from `--inputs` or
the seed. A low-precision argument `w`'s block scales are the argument `w_scale`; they come
from the same source (`Source.scale`, or an MXFP4 tensor's `_scales`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Config = Mapping[str, Any]


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor (or one per expert) and the transform to the program's layout."""

    tensor: str
    """Name under the layer prefix; `{e}` marks one tensor per expert, stacked on a new first axis."""
    transpose: bool = False
    """Swap the last two axes: nn.Linear's [out, in] to the program's [in, out]."""
    part: int | None = None
    """Of a fused gate/up tensor, which part this argument is: 0 the gate, 1 the up projection."""
    parts_axis: int = -1
    """The stored axis that holds the two parts."""
    interleaved: bool = False
    """The parts alternate along `parts_axis` (gpt-oss: gate, up, gate, up, ...) instead of
    being two halves (the gate half first)."""
    mxfp4: bool = False
    """Stored as MXFP4 (gpt-oss's released checkpoints): `{tensor}_blocks`, uint8 [..., N / 32, 16]
    holding two e2m1 values a byte (value 2j in the low nibble, 2j + 1 in the high one), and
    `{tensor}_scales`, uint8 e8m0 [..., N / 32] (2^(s - 127)), one per 32 values along the last
    stored axis (N)."""
    scale: str | None = None
    """The block scales stored beside an fp8 weight when the checkpoint holds it in fp8
    (`weight_scale_inv`: one f32 per block of quantization_config's `weight_block_size`
    [out, in], 128 x 128 by default; ceil-divided at ragged edges). `{e}` as in `tensor`."""

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.tensor

    def stored_shape(self, declared: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the checkpoint must hold (of each expert's tensor, when per expert) for
        the program's `declared` shape: the inverse of the transform."""
        shape = list(declared[1:] if self.per_expert else declared)
        if self.transpose:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        if self.part is not None:
            shape[self.parts_axis] *= 2
        return tuple(shape)


def linear(tensor: str, scale: bool = False) -> Source:
    """An nn.Linear weight (or one per expert): stored [out, in], transposed; `scale`: an fp8
    checkpoint stores it with `weight_scale_inv` beside it."""
    return Source(tensor, transpose=True, scale=tensor.removesuffix("weight") + "weight_scale_inv" if scale else None)


def fused(tensor: str, part: int, axis: int, *, transpose: bool = False, interleaved: bool = False) -> Source:
    """One part of a fused gate_up tensor."""
    return Source(tensor, transpose=transpose, part=part, parts_axis=axis, interleaved=interleaved)


@dataclass(frozen=True)
class Layout:
    """One way a family's checkpoints store a layer: graph argument -> its source."""

    name: str
    arguments: dict[str, Source]


REQUIRED: Any = object()
"""A ConfigKey's default when tcpc takes none: a size (transformers' defaults for sizes are one
released model's, which a checkpoint of other sizes would only contradict tensor by tensor);
config.json must hold it as a positive integer."""


@dataclass(frozen=True)
class ConfigKey:
    """One config.json value, as transformers' config class for the family reads it."""

    name: str
    """The attribute the modeling code reads (`config.<name>`)."""
    default: Any = REQUIRED
    """What transformers assumes when config.json omits the key (REQUIRED: tcpc stops)."""
    aliases: tuple[str, ...] = ()
    """Other names config.json may hold it under (attribute_map, another version's name)."""

    def describe(self) -> str:
        """The key and its aliases, for messages: `'a' or its alias 'b'`."""
        if not self.aliases:
            return repr(self.name)
        return (f"{self.name!r} or its alias{'es' if len(self.aliases) > 1 else ''} "
                + ", ".join(repr(a) for a in self.aliases))


@dataclass(frozen=True)
class Requirement:
    """A config value the program bakes in (a constant in the .moe text, not a dim); its
    default is its ConfigKey's."""

    key: str
    expected: Any
    why: str


@dataclass(frozen=True)
class Product:
    """A dim that is the product of config values (DeepSeek's shared experts' width)."""

    keys: tuple[str, ...]

    def __call__(self, config: Config) -> int:
        value = 1
        for key in self.keys:
            value *= config[key]
        return value


ConfigValue = str | Product
"""A dim from config.json: a ConfigKey's name, or a product of them."""


@dataclass(frozen=True)
class MoeLayers:
    """Which layers hold an MoE block: those in the list under `listed` when config.json has
    one; else every layer L >= `first` with (L + `offset`) % `step` == 0 that is not in the
    list under `dense`. `first` and `step` are integers or ConfigKey names."""

    first: int | str = 0
    step: int | str = 1
    offset: int = 0
    dense: str | None = None
    listed: str | None = None

    def keys(self) -> list[str]:
        return [k for k in (self.first, self.step, self.dense, self.listed) if isinstance(k, str)]

    def __call__(self, config: Config, layer: int) -> bool:
        def value(v: int | str) -> Any:
            return config[v] if isinstance(v, str) else v

        if self.listed is not None and config[self.listed] is not None:
            return layer in config[self.listed]
        dense = (config[self.dense] or []) if self.dense is not None else []
        return layer >= value(self.first) and (layer + self.offset) % value(self.step) == 0 and layer not in dense


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values of this family."""
    programs: dict[str, str]
    """Graph name -> the program declaring it, whose graph arguments the layouts name (the
    examples, bf16 first, then the low-precision ones)."""
    prefixes: tuple[str, ...]
    """Where layer `{layer}`'s MoE block lives; the first that the checkpoint holds is used."""
    layouts: tuple[Layout, ...]
    """Alternative layouts, the first the checkpoint holds completely wins."""
    keys: tuple[ConfigKey, ...]
    """Every config.json value tcpc reads for this family; dims, moe_layer and requirements see
    only these (moe_layer only those with defaults)."""
    dims: dict[str, ConfigValue]
    moe_layer: MoeLayers = field(default_factory=MoeLayers)
    requirements: tuple[Requirement, ...] = ()
    config_section: str | None = None
    """A nested config holding the text model's values (Llama-4's `text_config`)."""
    layers_key: str = "num_hidden_layers"

    def __post_init__(self) -> None:
        """A table that names a key it does not declare is refused (a ValueError naming it)."""
        keys = {k.name: k for k in self.keys}
        named = [("dims." + dim, k) for dim, v in self.dims.items() for k in ([v] if isinstance(v, str) else v.keys)]
        named += [("requirements", r.key) for r in self.requirements] + [("layers_key", self.layers_key)]
        named += [("moe_layer", k) for k in self.moe_layer.keys()]
        for where, key in named:
            if key not in keys:
                raise ValueError(f"{where}: config key '{key}' is not declared under keys")
        for where, key in named:
            if where in ("requirements", "moe_layer") and keys[key].default is REQUIRED:
                raise ValueError(f"{where}: config key '{key}' needs a default (the one transformers assumes)")

    def key(self, name: str) -> ConfigKey:
        return next(k for k in self.keys if k.name == name)

    @property
    def graphs(self) -> str:
        """The programs and graphs, for messages."""
        return ", ".join(f"{program} (graph '{graph}')" for graph, program in self.programs.items())


def _swiglu_experts(gate: str, up: str, down: str, scale: bool = False) -> dict[str, Source]:
    return {"w_gate": linear(f"experts.{{e}}.{gate}.weight", scale), "w_up": linear(f"experts.{{e}}.{up}.weight", scale),
            "w_down": linear(f"experts.{{e}}.{down}.weight", scale)}


_FUSED_EXPERTS = {  # transformers' fused experts: gate_up_proj [E, 2F, D] (gate half first), down_proj [E, D, F]
    "w_gate": fused("experts.gate_up_proj", 0, 1, transpose=True),
    "w_up": fused("experts.gate_up_proj", 1, 1, transpose=True),
    "w_down": Source("experts.down_proj", transpose=True),
}


_QWEN3_MOE_LAYERS = MoeLayers(step="decoder_sparse_step", offset=1, dense="mlp_only_layers")
"""Qwen3MoeDecoderLayer's test (mlp_only_layers null is [], as its config class makes it); its
`num_experts > 0` holds, as every dim is positive."""

_DEEPSEEK_MOE_LAYERS = MoeLayers(first="first_k_dense_replace", step="moe_layer_freq")
"""DeepseekV3DecoderLayer's test, and the model's own code's `moe_layer_freq`."""

_LLAMA4_MOE_LAYERS = MoeLayers(listed="moe_layers", step="interleave_moe_layer_step", offset=1)
"""Llama4TextConfig's `moe_layers`, by default every `interleave_moe_layer_step`-th layer."""


MIXTRAL = Family(
    name="mixtral", model_types=("mixtral",), programs={"mixtral": "examples/mixtral.moe"},
    prefixes=("model.layers.{layer}.block_sparse_moe",),
    layouts=(Layout("per expert (w1 gate, w3 up, w2 down)",
                    {"router": linear("gate.weight"), **_swiglu_experts("w1", "w3", "w2")}),),
    keys=(ConfigKey("hidden_size"), ConfigKey("intermediate_size"),
          ConfigKey("num_local_experts", aliases=("num_experts",)), ConfigKey("num_experts_per_tok"),
          ConfigKey("num_hidden_layers", 32)),
    dims={"D": "hidden_size", "F": "intermediate_size", "E": "num_local_experts", "K": "num_experts_per_tok"},
)

QWEN3_MOE = Family(
    name="qwen3_moe", model_types=("qwen3_moe",),
    programs={"qwen3_moe": "examples/qwen3_moe.moe", "qwen3_moe_fp8": "examples/qwen3_moe_fp8.moe"},
    prefixes=("model.layers.{layer}.mlp",),
    layouts=(Layout("per expert", {"router": linear("gate.weight"),
                                   **_swiglu_experts("gate_proj", "up_proj", "down_proj", True)}),
             Layout("fused gate_up_proj", {"router": linear("gate.weight"), **_FUSED_EXPERTS})),
    keys=(ConfigKey("hidden_size"), ConfigKey("moe_intermediate_size"),
          ConfigKey("num_experts", aliases=("num_local_experts",)), ConfigKey("num_experts_per_tok"),
          ConfigKey("norm_topk_prob", False), ConfigKey("decoder_sparse_step", 1), ConfigKey("mlp_only_layers", None),
          ConfigKey("num_hidden_layers", 24)),
    dims={"D": "hidden_size", "F": "moe_intermediate_size", "E": "num_experts", "K": "num_experts_per_tok"},
    moe_layer=_QWEN3_MOE_LAYERS,
    requirements=(Requirement("norm_topk_prob", True, "the program renormalises the top-K probabilities"),),
)

_DEEPSEEK_SHARED = {"ws_gate": linear("shared_experts.gate_proj.weight", True),
                    "ws_up": linear("shared_experts.up_proj.weight", True),
                    "ws_down": linear("shared_experts.down_proj.weight", True)}
_DEEPSEEK_ROUTER = {"router": linear("gate.weight"), "bias": Source("gate.e_score_correction_bias")}

DEEPSEEK_V3 = Family(
    name="deepseek_v3", model_types=("deepseek_v3",),
    programs={"deepseek_v3": "examples/deepseek_v3.moe", "deepseek_v3_fp8": "examples/deepseek_v3_fp8.moe"},
    prefixes=("model.layers.{layer}.mlp",),
    layouts=(Layout("per expert", {**_DEEPSEEK_ROUTER, **_swiglu_experts("gate_proj", "up_proj", "down_proj", True),
                                   **_DEEPSEEK_SHARED}),
             Layout("fused gate_up_proj", {**_DEEPSEEK_ROUTER, **_FUSED_EXPERTS, **_DEEPSEEK_SHARED})),
    keys=(ConfigKey("hidden_size"), ConfigKey("moe_intermediate_size"),
          ConfigKey("n_routed_experts", aliases=("num_local_experts",)), ConfigKey("num_experts_per_tok"),
          ConfigKey("n_group"), ConfigKey("topk_group"), ConfigKey("n_shared_experts", 1),
          ConfigKey("first_k_dense_replace", 3), ConfigKey("routed_scaling_factor", 2.5),
          ConfigKey("norm_topk_prob", True), ConfigKey("num_hidden_layers", 61),
          # read by the model's own code (transformers always routes so, every layer from first_k_dense_replace)
          ConfigKey("scoring_func", "sigmoid"), ConfigKey("topk_method", "noaux_tc"), ConfigKey("moe_layer_freq", 1)),
    dims={"D": "hidden_size", "F": "moe_intermediate_size", "E": "n_routed_experts", "K": "num_experts_per_tok",
          "NG": "n_group", "TG": "topk_group",
          "FS": Product(("moe_intermediate_size", "n_shared_experts"))},
    moe_layer=_DEEPSEEK_MOE_LAYERS,
    requirements=(Requirement("routed_scaling_factor", 2.5, "the program scales the weights by 2.5"),
                  Requirement("norm_topk_prob", True, "the program renormalises the chosen scores"),
                  Requirement("scoring_func", "sigmoid", "the program scores experts with a sigmoid"),
                  Requirement("topk_method", "noaux_tc", "the program routes by groups with the correction bias"),
                  Requirement("n_shared_experts", 1, "the program adds one shared expert")),
)

_GPT_OSS_ROUTER_AND_BIASES = {
    "router": linear("router.weight"), "router_bias": Source("router.bias"),
    "b_gate": fused("experts.gate_up_proj_bias", 0, -1, interleaved=True),
    "b_up": fused("experts.gate_up_proj_bias", 1, -1, interleaved=True),
    "b_down": Source("experts.down_proj_bias"),
}

GPT_OSS = Family(
    name="gpt_oss", model_types=("gpt_oss",),
    programs={"gpt_oss": "examples/gpt_oss.moe", "gpt_oss_mxfp4": "examples/gpt_oss_mxfp4.moe"},
    prefixes=("model.layers.{layer}.mlp",),
    layouts=(Layout("bf16, interleaved gate_up_proj [E, D, 2F]", {
                 **_GPT_OSS_ROUTER_AND_BIASES,
                 "w_gate": fused("experts.gate_up_proj", 0, -1, interleaved=True),
                 "w_up": fused("experts.gate_up_proj", 1, -1, interleaved=True),
                 "w_down": Source("experts.down_proj")}),
             Layout("MXFP4, transposed: gate_up_proj [E, 2F, D] interleaved, down_proj [E, D, F]", {
                 **_GPT_OSS_ROUTER_AND_BIASES,
                 "w_gate": Source("experts.gate_up_proj", transpose=True, part=0, parts_axis=1, interleaved=True,
                                  mxfp4=True),
                 "w_up": Source("experts.gate_up_proj", transpose=True, part=1, parts_axis=1, interleaved=True,
                                mxfp4=True),
                 "w_down": Source("experts.down_proj", transpose=True, mxfp4=True)})),
    # experts_per_token: the name in OpenAI's release (its config.json holds both)
    keys=(ConfigKey("hidden_size"), ConfigKey("intermediate_size"),
          ConfigKey("num_local_experts", aliases=("num_experts",)),
          ConfigKey("num_experts_per_tok", aliases=("experts_per_token",)), ConfigKey("swiglu_limit", 7.0),
          ConfigKey("swiglu_alpha", 1.702), ConfigKey("num_hidden_layers", 36)),
    dims={"D": "hidden_size", "F": "intermediate_size", "E": "num_local_experts", "K": "num_experts_per_tok"},
    requirements=(Requirement("swiglu_limit", 7.0, "the program clamps the SwiGLU at 7"),
                  Requirement("swiglu_alpha", 1.702, "the program's SwiGLU is gate * sigmoid(1.702 * gate)")),
)

_LLAMA4_LAYOUT = {
    "router": linear("router.weight"),
    "w_gate": fused("experts.gate_up_proj", 0, -1), "w_up": fused("experts.gate_up_proj", 1, -1),
    "w_down": Source("experts.down_proj"),
    "ws_gate": linear("shared_expert.gate_proj.weight"), "ws_up": linear("shared_expert.up_proj.weight"),
    "ws_down": linear("shared_expert.down_proj.weight"),
}

LLAMA4 = Family(
    name="llama4", model_types=("llama4", "llama4_text"), programs={"llama4": "examples/llama4.moe"},
    prefixes=("language_model.model.layers.{layer}.feed_forward", "model.layers.{layer}.feed_forward"),
    layouts=(Layout("fused gate_up_proj [E, D, 2F]", _LLAMA4_LAYOUT),),
    keys=(ConfigKey("hidden_size"), ConfigKey("intermediate_size"), ConfigKey("num_local_experts"),
          ConfigKey("num_experts_per_tok", 1), ConfigKey("moe_layers", None), ConfigKey("interleave_moe_layer_step", 1),
          ConfigKey("num_hidden_layers", 48)),
    dims={"D": "hidden_size", "F": "intermediate_size", "FS": "intermediate_size", "E": "num_local_experts",
          "K": "num_experts_per_tok"},
    moe_layer=_LLAMA4_MOE_LAYERS,
    requirements=(Requirement("num_experts_per_tok", 1, "the program routes top-1 (it scales the expert input)"),),
    config_section="text_config",
)

FAMILIES: tuple[Family, ...] = (MIXTRAL, QWEN3_MOE, DEEPSEEK_V3, GPT_OSS, LLAMA4)
