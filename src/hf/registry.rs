//! The registry of `model_type`s: one row per type HF names in `config.json`, saying how the
//! loader reads it (weights, class defaults, biases, scale, q/k norms, layer pattern, RoPE,
//! keys whose null is refused).
//!
//! ```text
//! MODELS: [ModelSpec]                    find("qwen3") ──► &ModelSpec
//!   ModelSpec
//!   ├─ family: Option<HfFamily>          weight layout (hf::weights); None: a wrapper
//!   ├─ text_config                       a vision-language wrapper of `{type}_text`
//!   ├─ defaults: ClassDefaults           the config class's values for absent keys
//!   ├─ bias, scale, logit_softcap, sinks, causal, qk_norm, head_dim, widths
//!   ├─ window, layers, rope_layers       which layers slide, chunk or skip RoPE
//!   ├─ rope: RopeSpec                    θ source, partial rotary, pair layout, axial, per-type
//!   ├─ typed_nulls, null_kv_heads, null_head_dim, even_split   what the class refuses
//!   └─ quirks: Quirks                    Gemma 4's and Llama 4's steps (gemma4.rs, llama4.rs)
//! ```
//!
//! DeepSeek's family reads its latent attention in `deepseek.rs`; the layer patterns the
//! rows choose are in `pattern.rs`.
//!
//! A family that reads as Llama does (separate projections, `attention_bias`, RoPE over the
//! whole head) is one row: `ModelSpec { model_type: "…", defaults: …, ..LLAMA_LIKE }`.
//! Every row loads a layer (its family's, or a wrapper's language model's); a type without a
//! row is refused by `HfAttentionConfig`, and `RopeConfig::from_hf_json` reads it as
//! [`GENERIC`].

use super::defaults::{ClassDefaults, GENERIC as GENERIC_DEFAULTS};
use super::gemma4;
use super::layer::HfFamily;
use crate::rotary::mrope::{AxialRope, MropeSection};

/// How one `model_type` is read (see the [module docs](self)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModelSpec {
    /// HF's `model_type`.
    pub(crate) model_type: &'static str,
    /// The family whose weights and block it loads as; `None`: a vision-language wrapper
    /// ([`Self::text_config`]), or [`GENERIC`].
    pub(crate) family: Option<HfFamily>,
    /// A vision-language model whose language model is `{model_type}_text` under
    /// `text_config`.
    pub(crate) text_config: Option<TextConfig>,
    /// The config class's values for absent keys.
    pub(crate) defaults: ClassDefaults,
    /// Which projections carry biases.
    pub(crate) bias: Bias,
    /// The softmax scale when it is not `1/√head_dim`.
    pub(crate) scale: Scale,
    /// Gemma 2's `attn_logit_softcapping` (50 by default).
    pub(crate) logit_softcap: bool,
    /// gpt-oss's per-head sink logits.
    pub(crate) sinks: bool,
    /// Whether the block is causal.
    pub(crate) causal: bool,
    /// The query/key norms.
    pub(crate) qk_norm: QkNorm,
    /// How the attention's head width follows from `head_dim`.
    pub(crate) head_dim: HeadDim,
    /// The keys the model's width is read from, first found first (both readers read these).
    pub(crate) widths: &'static [&'static str],
    /// Where a sliding layer's window comes from.
    pub(crate) window: Window,
    /// Which layers slide (or chunk).
    pub(crate) layers: Layers,
    /// Which layers rotate q and k.
    pub(crate) rope_layers: RopeLayers,
    /// How the rotary settings are read.
    pub(crate) rope: RopeSpec,
    /// Keys whose explicit `null` the class refuses (or fails computing with).
    pub(crate) typed_nulls: &'static [&'static str],
    /// Whether the class replaces a null `num_key_value_heads` with the heads.
    pub(crate) null_kv_heads: bool,
    /// Whether the class replaces a null `head_dim` with the width over the heads.
    pub(crate) null_head_dim: bool,
    /// Whether the class refuses a width the heads do not divide (`validate_architecture`).
    pub(crate) even_split: bool,
    /// A family's own file of special cases.
    pub(crate) quirks: Quirks,
}

/// A vision-language wrapper's language model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextConfig {
    /// Under `text_config` only.
    Nested,
    /// Under `text_config`, or the file's own keys when it has none (Qwen2-VL, Qwen2.5-VL).
    NestedOrFlat,
}

/// Which projections carry biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bias {
    /// None.
    None,
    /// q, k and v, not the output (Qwen2).
    Qkv,
    /// All four (BLOOM, GPT-2).
    All,
    /// All four or none, as the key says (with its class default).
    Flag(&'static str, bool),
    /// q, k and v or none, as the key says (with its class default); never the output (GLM,
    /// GLM-4, Helium).
    QkvFlag(&'static str, bool),
}

/// The softmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scale {
    /// `1/√head_dim`.
    Default,
    /// 1 (T5).
    One,
    /// `query_pre_attn_scalar^-1/2`, 256 by default (Gemma 2, 3).
    QueryPreAttnScalar,
    /// GPT-2's `scale_attn_weights` and `scale_attn_by_inverse_layer_idx`.
    Gpt2,
    /// MPT's `attn_config.softmax_scale`.
    AttnConfig,
}

/// The query/key RMS norms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum QkNorm {
    /// None.
    None,
    /// Per head, ε from `rms_norm_eps` (1e-6 by default).
    PerHead,
    /// Per head with scale `1 + w` (Gemma 3).
    UnitOffset,
    /// Over all heads, ε default 1e-5 (OLMo 2).
    AllHeads,
    /// Llama 4's: no scale, RoPE layers only, under `use_qk_norm`.
    Llama4,
    /// Cohere's, under `use_qk_norm` (default false): a layer norm without bias per head, each
    /// head with its own scale, ε from `layer_norm_eps` (1e-5 by default).
    LayerNormEachHead,
}

/// How the attention's head width follows from `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadDim {
    /// `head_dim`, else the class default, else the width over the heads.
    Read,
    /// Always the width over the heads; `head_dim` is the rotation's only (Pixtral).
    FromWidth,
    /// `head_dim` must equal the width over the heads (Qwen2-VL, Qwen2.5-VL).
    MustSplit,
    /// `head_dim` must be given: the class leaves an absent one null, and the attention
    /// fails on that (Ministral).
    Required,
    /// `head_dim` (or the class's) times the heads must be the width: the output projection
    /// takes `hidden_size` features (Helium).
    FillsWidth,
}

/// Where a sliding layer's window comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Window {
    /// The model has none.
    None,
    /// `sliding_window`, with the class default.
    Sliding,
    /// As `Sliding`, but under `use_bidirectional_attention` the model attends both ways:
    /// every key on full layers, the keys within `sliding_window / 2` on either side on
    /// sliding ones (Gemma 3, EmbeddingGemma: the class makes the window `w / 2 + 1`,
    /// exclusive, and the mask `|i − j| < w / 2 + 1`).
    SlidingOrBidirectional,
    /// `sliding_window`, only under `use_sliding_window` (Qwen2, Qwen3).
    QwenSwitch,
    /// ModernBERT's `local_attention / 2` on either side (128 by default).
    LocalAttention,
}

/// Which layers slide (from `layer_types` where a pattern is given, else the pattern).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layers {
    /// All alike, no `layer_types`: every layer slides when the model has a window.
    Uniform,
    /// Full attention on the layers `key` lists (`default` when absent), attention within
    /// windows of reordered patches on the others, which the block does not build: those are
    /// refused (Qwen2.5-VL's vision encoder, `fullatt_block_indexes`).
    FullListed {
        key: &'static str,
        default: &'static [usize],
    },
    /// `layer_types`, else all alike as `Uniform` (Ministral).
    Listed,
    /// Layers from `max_window_layers` on slide (Qwen).
    SlidingFrom,
    /// The NoPE layers slide under `use_sliding_window` (SmolLM3).
    NoRopeSlides,
    /// All but every `key`-th (default `every`) layer from layer 0 slide (ModernBERT).
    FromZero { key: &'static str, every: usize },
    /// All but every n-th layer counting from 1 slide; n from `key` (or `every`), and the
    /// last layer full where `last_full` (Gemma 4).
    EveryNth {
        key: Option<&'static str>,
        every: usize,
        last_full: bool,
    },
    /// Llama 4's chunked RoPE layers.
    Chunked,
    /// Inkling's `hybrid` and `hybrid_sliding` layers (`hf::inkling`).
    Hybrid,
}

/// Which layers rotate q and k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RopeLayers {
    /// Every layer.
    All,
    /// `no_rope_layers` (1 = RoPE) or every `no_rope_layer_interval`-th layer NoPE; an empty
    /// list is the default pattern where `empty_is_default` (Llama 4).
    NoRopeList { empty_is_default: bool },
    /// The sliding layers only (Cohere2).
    SlidingOnly,
}

/// How a model's rotary settings are read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RopeSpec {
    /// Where θ and the parameters come from.
    pub(crate) source: RopeSource,
    /// Which keys make the rotation partial.
    pub(crate) partial: PartialRotary,
    /// Whether HF's code rotates adjacent pairs.
    pub(crate) interleaved: bool,
    /// Phi-3's class: `yarn` is LongRoPE, `original_max_position_embeddings` 4096 at the top.
    pub(crate) phi3: bool,
    /// Phi-3's configuration refuses every type but `longrope` and `default`.
    pub(crate) longrope_only: bool,
    /// The axial 2-D layout of a vision encoder's `rope_type: "axial"`.
    pub(crate) axial: Option<Axial>,
    /// Multi-head latent attention: its rotary part alone is not a whole head (refused).
    pub(crate) latent: bool,
    /// How a layer type's parameters are found.
    pub(crate) per_layer: LayerRope,
    /// Whether the attention has another encoding instead of RoPE (the RoPE reader refuses
    /// such a file, pointing at `HfAttentionConfig`).
    pub(crate) instead: Instead,
}

/// Whether a model's attention encodes positions otherwise than by RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Instead {
    /// It rotates q and k.
    Nothing,
    /// Always this encoding.
    Always(&'static str),
    /// This encoding when the key is true (Falcon's `alibi`).
    WhenSet(&'static str, &'static str),
}

/// Where θ and the rotary parameters come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RopeSource {
    /// The parameters' θ, else `rope_theta`, else `rotary_emb_base`, else the class's.
    Standard,
    /// GPT-NeoX: the parameters' θ, else `rotary_emb_base`; a top-level `rope_theta` unread.
    NeoX,
    /// GPT-J: θ 10000 and no parameters, whatever the file says.
    Fixed,
}

/// An axial 2-D RoPE's layout, and whether it is the model's default type (the config class's
/// `default_rope_type = "axial"`: Pixtral, the Qwen-VL and Gemma 4 vision encoders).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Axial {
    pub(crate) layout: AxialRope,
    pub(crate) by_default: bool,
}

/// How a layer type's rotary parameters are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LayerRope {
    /// A nested entry under the type's name, else the flat keys.
    Shared,
    /// One entry per type filled as the class's `convert_rope_params_to_dict` does.
    PerType(PerTypeRope),
    /// Gemma 4's own (`hf::gemma4::rope_entry`).
    Gemma4,
}

/// A per-type class's entries: which take an old `rope_scaling`, and the θ keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PerTypeRope {
    pub(crate) merged: &'static [&'static str],
    pub(crate) full_theta: &'static str,
    pub(crate) sliding_theta: &'static str,
}

/// How a model's HF code (transformers 5.24) reads the keys that make its rotation partial.
///
/// | variant | rows | reads | partial rotation |
/// |---|---|---|---|
/// | `Factor` | `phi3`, `phi4_multimodal`, `glm`, `glm4` | `partial_rotary_factor` (parameters, then top level; GLM's class gives 0.5 without it) | yes, any RoPE type (`apply_rotary_pos_emb` splits at the table's width) |
/// | `NeoX` | `gpt_neox` | `rope_parameters.partial_rotary_factor`, else `rotary_pct`, else 0.25 (a top-level `partial_rotary_factor` is not read) | yes, any RoPE type |
/// | `RotaryDim` | `gptj`, `codegen` | `rotary_dim` (64 without it) | yes |
/// | `WholeHead` | the Llama-style rows, `falcon`, `modernbert`, `pixtral` (and DeepSeek V2/V3's rotary part) | nothing for the default RoPE: `compute_default_rope_parameters` takes the whole head | no: the whole head rotates; with a scaled type (`linear`, `dynamic`, `yarn`, `llama3`, `longrope`) the shared functions of `modeling_rope_utils` honour the factor and the model's rotation fails on the shorter table, so a factor that shortens it is refused; `proportional` reads it as a fraction of frequencies |
/// | `AnyKey` | any other, or none | `partial_rotary_factor`, `rotary_pct`, `rotary_dim`, in that order | yes |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartialRotary {
    AnyKey,
    Factor,
    NeoX,
    RotaryDim,
    WholeHead,
}

/// The families with a file of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quirks {
    None,
    Gemma4,
    Llama4,
    /// Gemma 4's vision encoder: values normalised, no softmax scale (`hf::gemma4::vision`).
    Gemma4Vision,
    /// Inkling's sliding layers' own heads, scale, short convolutions and relative logits
    /// (`hf::inkling`).
    Inkling,
}

/// The width keys of most models, first found first.
const WIDTHS: &[&str] = &["hidden_size", "n_embd", "d_model", "n_embed"];

/// The head-count keys, first found first (one list for both readers).
pub(crate) const HEADS: &[&str] = &["num_attention_heads", "n_head", "num_heads", "n_heads"];

const PLAIN_ROPE: RopeSpec = RopeSpec {
    source: RopeSource::Standard,
    partial: PartialRotary::AnyKey,
    interleaved: false,
    phi3: false,
    longrope_only: false,
    axial: None,
    latent: false,
    per_layer: LayerRope::Shared,
    instead: Instead::Nothing,
};

/// The rotary settings of a model whose attention has `encoding` instead.
const fn no_rope(encoding: &'static str) -> RopeSpec {
    RopeSpec {
        instead: Instead::Always(encoding),
        ..PLAIN_ROPE
    }
}

const WHOLE_HEAD: RopeSpec = RopeSpec {
    partial: PartialRotary::WholeHead,
    ..PLAIN_ROPE
};

const INTERLEAVED: RopeSpec = RopeSpec {
    interleaved: true,
    ..PLAIN_ROPE
};

/// A type without a row: its RoPE read with the generic defaults (by `RopeConfig::from_hf_json`
/// only; `HfAttentionConfig` refuses it).
pub(crate) const GENERIC: ModelSpec = ModelSpec {
    model_type: "",
    family: None,
    text_config: None,
    defaults: GENERIC_DEFAULTS,
    bias: Bias::None,
    scale: Scale::Default,
    logit_softcap: false,
    sinks: false,
    causal: true,
    qk_norm: QkNorm::None,
    head_dim: HeadDim::Read,
    widths: WIDTHS,
    window: Window::None,
    layers: Layers::Uniform,
    rope_layers: RopeLayers::All,
    rope: PLAIN_ROPE,
    typed_nulls: &[],
    null_kv_heads: false,
    null_head_dim: false,
    even_split: false,
    quirks: Quirks::None,
};

/// A family read as Llama is: `q_proj`, `k_proj`, `v_proj`, `o_proj`; `attention_bias`
/// (default false); RoPE over the whole head.
pub(crate) const LLAMA_LIKE: ModelSpec = ModelSpec {
    family: Some(HfFamily::Llama),
    bias: Bias::Flag("attention_bias", false),
    rope: WHOLE_HEAD,
    ..GENERIC
};

/// `ClassDefaults` with these values over the generic ones.
const fn defaults(
    rope_theta: f64,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    sliding_window: Option<usize>,
) -> ClassDefaults {
    ClassDefaults {
        rope_theta,
        num_key_value_heads,
        head_dim,
        max_position_embeddings: Some(max_position_embeddings),
        sliding_window,
        ..GENERIC_DEFAULTS
    }
}

const QWEN2: ModelSpec = ModelSpec {
    model_type: "qwen2",
    defaults: defaults(10_000.0, Some(32), None, 32_768, Some(4096)),
    bias: Bias::Qkv,
    window: Window::QwenSwitch,
    layers: Layers::SlidingFrom,
    typed_nulls: &["use_sliding_window", "max_window_layers"],
    null_kv_heads: true,
    ..LLAMA_LIKE
};

const QWEN3: ModelSpec = ModelSpec {
    model_type: "qwen3",
    defaults: defaults(10_000.0, Some(32), Some(128), 32_768, Some(4096)),
    window: Window::QwenSwitch,
    layers: Layers::SlidingFrom,
    qk_norm: QkNorm::PerHead,
    typed_nulls: &["attention_bias", "use_sliding_window", "max_window_layers"],
    null_kv_heads: true,
    ..LLAMA_LIKE
};

/// The Qwen2-VL and Qwen2.5-VL text models' defaults.
const QWEN2_VL_DEFAULTS: ClassDefaults = ClassDefaults {
    max_window_layers: 80,
    mrope: Some(MropeSection {
        sections: [16, 24, 24],
        interleaved: false,
    }),
    ..defaults(1_000_000.0, Some(8), None, 32_768, Some(4096))
};

/// The Qwen3-VL text models' multimodal sections, always interleaved.
const QWEN3_VL_MROPE: Option<MropeSection> = Some(MropeSection {
    sections: [24, 20, 20],
    interleaved: true,
});

const fn wrapper(model_type: &'static str, text_config: TextConfig) -> ModelSpec {
    ModelSpec {
        model_type,
        text_config: Some(text_config),
        ..GENERIC
    }
}

/// A family read as Llama is, rotating adjacent pairs of the whole head (Cohere, Helium,
/// ERNIE 4.5: their `rotate_half` takes even and odd features).
const LLAMA_INTERLEAVED: ModelSpec = ModelSpec {
    rope: RopeSpec {
        interleaved: true,
        ..WHOLE_HEAD
    },
    ..LLAMA_LIKE
};

/// GPT-J's and CodeGen's rotation: θ 10000 whatever the file says, adjacent pairs of the first
/// `rotary_dim` features (64 by default).
const GPTJ_ROPE: RopeSpec = RopeSpec {
    source: RopeSource::Fixed,
    partial: PartialRotary::RotaryDim,
    ..INTERLEAVED
};

/// GLM's and GLM-4's class: heads of 128, half of which rotate (`partial_rotary_factor`).
const GLM_DEFAULTS: ClassDefaults = ClassDefaults {
    partial_rotary_factor: Some(0.5),
    ..defaults(10_000.0, Some(2), Some(128), 131_072, None)
};

/// GLM's and GLM-4's rotation: adjacent pairs of the `partial_rotary_factor` part.
const GLM_ROPE: RopeSpec = RopeSpec {
    partial: PartialRotary::Factor,
    ..INTERLEAVED
};

/// A vision encoder's rotation: axial 2-D RoPE over the whole head, the type its config class
/// gives a file without one (`default_rope_type = "axial"`), the only one its rotary
/// embedding takes.
const fn axial(layout: AxialRope) -> RopeSpec {
    RopeSpec {
        axial: Some(Axial {
            layout,
            by_default: true,
        }),
        ..WHOLE_HEAD
    }
}

/// The Qwen-VL vision encoders' attention (transformers' `VisionAttention`,
/// `Qwen2_5_VLVisionAttention`, `Qwen3VLVisionAttention`, `Qwen3VLMoeVisionAttention`): one
/// fused `qkv` and `proj`, both with biases, bidirectional, the head width the width over
/// the heads (a `head_dim` that differs is refused: the rotation reads it, the attention
/// does not), axial RoPE repeating a half-width head's frequencies, the width under `widths`.
const fn qwen_vision(model_type: &'static str, widths: &'static [&'static str]) -> ModelSpec {
    ModelSpec {
        model_type,
        family: Some(HfFamily::QwenVision),
        bias: Bias::All,
        causal: false,
        head_dim: HeadDim::MustSplit,
        widths,
        rope: axial(AxialRope::Repeated),
        ..GENERIC
    }
}

/// Phi-3's attention: one `qkv_proj` (rows `[q; k; v]`), `o_proj`, no biases; LongRoPE's
/// class (`yarn` and `su` are LongRoPE, no other scaling), the partial factor read.
const PHI3: ModelSpec = ModelSpec {
    model_type: "phi3",
    family: Some(HfFamily::Phi3),
    defaults: defaults(10_000.0, None, None, 4096, None),
    window: Window::Sliding,
    rope: RopeSpec {
        partial: PartialRotary::Factor,
        phi3: true,
        longrope_only: true,
        ..PLAIN_ROPE
    },
    null_kv_heads: true,
    ..GENERIC
};

const DEEPSEEK_V3: ModelSpec = ModelSpec {
    model_type: "deepseek_v3",
    family: Some(HfFamily::DeepSeek),
    defaults: defaults(10_000.0, Some(128), None, 4096, None),
    rope: RopeSpec {
        latent: true,
        ..PLAIN_ROPE
    },
    null_kv_heads: true,
    ..GENERIC
};

/// GLM (and GLM-4, the same attention): biases on q, k and v (`attention_bias`, default
/// true), none on the output; adjacent pairs of the rotating half.
const GLM: ModelSpec = ModelSpec {
    model_type: "glm",
    defaults: GLM_DEFAULTS,
    bias: Bias::QkvFlag("attention_bias", true),
    rope: GLM_ROPE,
    typed_nulls: &["attention_bias"],
    ..LLAMA_LIKE
};

/// Every `model_type` the crate reads.
pub(crate) const MODELS: &[ModelSpec] = &[
    ModelSpec {
        model_type: "llama",
        defaults: defaults(10_000.0, None, None, 2048, None),
        typed_nulls: &["attention_bias"],
        null_kv_heads: true,
        null_head_dim: true,
        even_split: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "mistral",
        defaults: defaults(10_000.0, Some(8), None, 131_072, Some(4096)),
        bias: Bias::None,
        window: Window::Sliding,
        null_head_dim: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "ministral",
        defaults: defaults(10_000.0, Some(8), None, 131_072, Some(4096)),
        bias: Bias::None,
        head_dim: HeadDim::Required,
        window: Window::Sliding,
        layers: Layers::Listed,
        typed_nulls: &["sliding_window"],
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "starcoder2",
        defaults: defaults(10_000.0, Some(2), None, 4096, None),
        bias: Bias::Flag("use_bias", true),
        window: Window::Sliding,
        typed_nulls: &["use_bias"],
        null_head_dim: true,
        ..LLAMA_LIKE
    },
    QWEN2,
    QWEN3,
    ModelSpec {
        model_type: "gemma",
        defaults: defaults(10_000.0, Some(16), Some(256), 8192, None),
        typed_nulls: &["attention_bias"],
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "gemma2",
        defaults: defaults(10_000.0, Some(4), Some(256), 8192, Some(4096)),
        scale: Scale::QueryPreAttnScalar,
        logit_softcap: true,
        window: Window::Sliding,
        layers: Layers::EveryNth {
            key: None,
            every: 2,
            last_full: false,
        },
        typed_nulls: &["attention_bias", "query_pre_attn_scalar", "sliding_window"],
        even_split: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "gemma3_text",
        defaults: defaults(1_000_000.0, Some(4), Some(256), 131_072, Some(4096)),
        scale: Scale::QueryPreAttnScalar,
        qk_norm: QkNorm::UnitOffset,
        window: Window::SlidingOrBidirectional,
        layers: Layers::EveryNth {
            key: Some("sliding_window_pattern"),
            every: 6,
            last_full: false,
        },
        rope: RopeSpec {
            per_layer: LayerRope::PerType(PerTypeRope {
                merged: &["full_attention"],
                full_theta: "rope_theta",
                sliding_theta: "rope_local_base_freq",
            }),
            ..WHOLE_HEAD
        },
        typed_nulls: &[
            "attention_bias",
            "query_pre_attn_scalar",
            "sliding_window_pattern",
            "sliding_window",
        ],
        even_split: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "olmo2",
        defaults: defaults(10_000.0, None, None, 2048, None),
        qk_norm: QkNorm::AllHeads,
        typed_nulls: &["attention_bias"],
        null_kv_heads: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "gpt_oss",
        defaults: ClassDefaults {
            yarn: true,
            ..defaults(150_000.0, Some(8), Some(64), 131_072, Some(128))
        },
        bias: Bias::Flag("attention_bias", true),
        sinks: true,
        window: Window::Sliding,
        layers: Layers::EveryNth {
            key: None,
            every: 2,
            last_full: false,
        },
        typed_nulls: &["attention_bias", "sliding_window"],
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "smollm3",
        defaults: defaults(2_000_000.0, Some(4), None, 32_768, None),
        window: Window::Sliding,
        layers: Layers::NoRopeSlides,
        rope_layers: RopeLayers::NoRopeList {
            empty_is_default: false,
        },
        typed_nulls: &["attention_bias", "use_sliding_window"],
        null_kv_heads: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "cohere2",
        defaults: defaults(10_000.0, None, None, 8192, Some(4096)),
        window: Window::Sliding,
        layers: Layers::EveryNth {
            key: Some("sliding_window_pattern"),
            every: 4,
            last_full: false,
        },
        rope_layers: RopeLayers::SlidingOnly,
        rope: RopeSpec {
            interleaved: true,
            ..WHOLE_HEAD
        },
        typed_nulls: &["attention_bias", "sliding_window_pattern", "sliding_window"],
        null_kv_heads: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "llama4_text",
        defaults: defaults(500_000.0, Some(8), Some(128), 131_072, None),
        qk_norm: QkNorm::Llama4,
        window: Window::Sliding,
        layers: Layers::Chunked,
        rope_layers: RopeLayers::NoRopeList {
            empty_is_default: true,
        },
        rope: RopeSpec {
            interleaved: true,
            ..WHOLE_HEAD
        },
        typed_nulls: &["attention_bias"],
        quirks: Quirks::Llama4,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "gemma4_text",
        defaults: defaults(10_000.0, Some(4), Some(256), 131_072, Some(512)),
        qk_norm: QkNorm::PerHead,
        window: Window::Sliding,
        layers: Layers::EveryNth {
            key: None,
            every: 6,
            last_full: true,
        },
        rope: RopeSpec {
            per_layer: LayerRope::Gemma4,
            ..WHOLE_HEAD
        },
        typed_nulls: &gemma4::TYPED_FIELDS,
        quirks: Quirks::Gemma4,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "pixtral",
        causal: false,
        head_dim: HeadDim::FromWidth,
        rope: axial(AxialRope::EvenOdd),
        null_kv_heads: true,
        null_head_dim: true,
        ..LLAMA_LIKE
    },
    ModelSpec {
        model_type: "qwen2_vl_text",
        defaults: QWEN2_VL_DEFAULTS,
        head_dim: HeadDim::MustSplit,
        ..QWEN2
    },
    ModelSpec {
        model_type: "qwen2_5_vl_text",
        defaults: QWEN2_VL_DEFAULTS,
        head_dim: HeadDim::MustSplit,
        ..QWEN2
    },
    ModelSpec {
        model_type: "qwen3_vl_text",
        defaults: ClassDefaults {
            mrope: QWEN3_VL_MROPE,
            ..defaults(500_000.0, Some(32), Some(128), 128_000, None)
        },
        ..QWEN3
    },
    ModelSpec {
        model_type: "qwen3_vl_moe_text",
        defaults: ClassDefaults {
            mrope: QWEN3_VL_MROPE,
            ..defaults(500_000.0, Some(16), None, 128_000, None)
        },
        null_kv_heads: false,
        null_head_dim: true,
        ..QWEN3
    },
    PHI3,
    ModelSpec {
        model_type: "gpt_neox",
        family: Some(HfFamily::GptNeoX),
        defaults: defaults(10_000.0, None, None, 2048, None),
        bias: Bias::Flag("attention_bias", true),
        rope: RopeSpec {
            source: RopeSource::NeoX,
            partial: PartialRotary::NeoX,
            ..PLAIN_ROPE
        },
        even_split: true,
        ..GENERIC
    },
    ModelSpec {
        model_type: "bloom",
        family: Some(HfFamily::Bloom),
        bias: Bias::All,
        rope: no_rope("ALiBi"),
        ..GENERIC
    },
    ModelSpec {
        model_type: "gpt2",
        family: Some(HfFamily::Gpt2),
        bias: Bias::All,
        scale: Scale::Gpt2,
        rope: no_rope("learned absolute positions, added at the embeddings (`wpe`)"),
        ..GENERIC
    },
    ModelSpec {
        model_type: "gptj",
        family: Some(HfFamily::GptJ),
        defaults: defaults(10_000.0, None, None, 2048, None),
        rope: GPTJ_ROPE,
        ..GENERIC
    },
    ModelSpec {
        model_type: "falcon",
        family: Some(HfFamily::Falcon),
        defaults: defaults(10_000.0, None, None, 2048, None),
        bias: Bias::Flag("bias", false),
        rope: RopeSpec {
            instead: Instead::WhenSet("alibi", "ALiBi"),
            ..WHOLE_HEAD
        },
        ..GENERIC
    },
    ModelSpec {
        model_type: "t5",
        family: Some(HfFamily::T5),
        defaults: ClassDefaults {
            head_dim: Some(64),
            ..GENERIC_DEFAULTS
        },
        scale: Scale::One,
        causal: false,
        rope: no_rope("T5's relative position buckets"),
        ..GENERIC
    },
    ModelSpec {
        model_type: "mpt",
        family: Some(HfFamily::Mpt),
        scale: Scale::AttnConfig,
        rope: no_rope("ALiBi"),
        ..GENERIC
    },
    ModelSpec {
        model_type: "modernbert",
        family: Some(HfFamily::ModernBert),
        defaults: defaults(160_000.0, None, None, 8192, None),
        bias: Bias::Flag("attention_bias", false),
        causal: false,
        window: Window::LocalAttention,
        layers: Layers::FromZero {
            key: "global_attn_every_n_layers",
            every: 3,
        },
        rope: RopeSpec {
            per_layer: LayerRope::PerType(PerTypeRope {
                merged: &["full_attention", "sliding_attention"],
                full_theta: "global_rope_theta",
                sliding_theta: "local_rope_theta",
            }),
            ..WHOLE_HEAD
        },
        ..GENERIC
    },
    ModelSpec {
        model_type: "deepseek_v2",
        family: Some(HfFamily::DeepSeek),
        defaults: defaults(10_000.0, None, None, 2048, None),
        rope: RopeSpec {
            latent: true,
            interleaved: true,
            ..PLAIN_ROPE
        },
        null_kv_heads: true,
        even_split: true,
        ..GENERIC
    },
    DEEPSEEK_V3,
    // Kimi K2's files name DeepSeek V3's configuration `kimi_k2`; HF reads them as
    // `deepseek_v3` (Kimi K2.5's configuration maps the type), and so does the loader.
    ModelSpec {
        model_type: "kimi_k2",
        ..DEEPSEEK_V3
    },
    // Vision encoders' attention (one image, or one `cu_seqlens` span, per sequence).
    qwen_vision("qwen2_vl_vision", &["embed_dim"]),
    ModelSpec {
        layers: Layers::FullListed {
            key: "fullatt_block_indexes",
            default: &[7, 15, 23, 31],
        },
        ..qwen_vision("qwen2_5_vl_vision", WIDTHS)
    },
    qwen_vision("qwen3_vl_vision", WIDTHS),
    qwen_vision("qwen3_vl_moe_vision", WIDTHS),
    // Gemma 4's vision encoder (`Gemma4VisionAttention`): q, k, v and o under `.linear` (its
    // clippable linears), per-head q/k norms, values normalised, no scale, bidirectional,
    // axial RoPE over each half of the head; θ 100 and 64-wide heads by default.
    ModelSpec {
        model_type: "gemma4_vision",
        family: Some(HfFamily::Gemma4Vision),
        defaults: defaults(100.0, Some(12), Some(64), 131_072, None),
        causal: false,
        qk_norm: QkNorm::PerHead,
        rope: axial(AxialRope::SplitHalves),
        quirks: Quirks::Gemma4Vision,
        ..GENERIC
    },
    // Vision-language models: their language model's attention.
    wrapper("qwen2_vl", TextConfig::NestedOrFlat),
    wrapper("qwen2_5_vl", TextConfig::NestedOrFlat),
    wrapper("qwen3_vl", TextConfig::Nested),
    wrapper("qwen3_vl_moe", TextConfig::Nested),
    wrapper("llama4", TextConfig::Nested),
    wrapper("gemma4", TextConfig::Nested),
    // CodeGen: one `qkv_proj` in 4 model-parallel shards of [q; v; k], `out_proj`, no
    // biases; GPT-J's rotation (θ 10000, adjacent pairs of the first `rotary_dim`, 64).
    ModelSpec {
        model_type: "codegen",
        family: Some(HfFamily::CodeGen),
        defaults: defaults(10_000.0, None, None, 2048, None),
        rope: GPTJ_ROPE,
        typed_nulls: &["rotary_dim"],
        even_split: true,
        ..GENERIC
    },
    // Cohere: `attention_bias` on all four; `use_qk_norm`'s per-head layer norms.
    ModelSpec {
        model_type: "cohere",
        defaults: defaults(500_000.0, None, None, 8192, None),
        qk_norm: QkNorm::LayerNormEachHead,
        typed_nulls: &["attention_bias", "layer_norm_eps"],
        null_kv_heads: true,
        ..LLAMA_INTERLEAVED
    },
    GLM,
    ModelSpec {
        model_type: "glm4",
        ..GLM
    },
    // Helium: biases on q, k and v (`attention_bias`), none on the output, whose input is
    // `hidden_size` wide (HF fails unless the heads fill it).
    ModelSpec {
        model_type: "helium",
        defaults: defaults(100_000.0, Some(20), Some(128), 4096, None),
        bias: Bias::QkvFlag("attention_bias", false),
        head_dim: HeadDim::FillsWidth,
        typed_nulls: &["attention_bias"],
        ..LLAMA_INTERLEAVED
    },
    // ERNIE 4.5: `use_bias` on all four.
    ModelSpec {
        model_type: "ernie4_5",
        defaults: defaults(500_000.0, Some(2), Some(128), 131_072, None),
        bias: Bias::Flag("use_bias", false),
        null_kv_heads: true,
        null_head_dim: true,
        ..LLAMA_INTERLEAVED
    },
    // Inkling's language model: no RoPE but relative logits read from the input, q/k norms,
    // short convolutions on k and v, full and sliding layers with their own heads.
    ModelSpec {
        model_type: "inkling_text",
        defaults: defaults(10_000.0, Some(8), Some(128), 131_072, Some(512)),
        bias: Bias::None,
        qk_norm: QkNorm::PerHead,
        layers: Layers::Hybrid,
        rope: no_rope("Inkling's relative logits"),
        quirks: Quirks::Inkling,
        ..LLAMA_LIKE
    },
    // Phi-4-multimodal's language model: Phi-3's attention and rotation.
    ModelSpec {
        model_type: "phi4_multimodal",
        defaults: defaults(10_000.0, Some(8), None, 131_072, None),
        ..PHI3
    },
];

/// The row of `model_type`, if it has one.
pub(crate) fn find(model_type: &str) -> Option<&'static ModelSpec> {
    MODELS.iter().find(|m| m.model_type == model_type)
}

/// The row of `model_type`, or [`GENERIC`] for a type without one (or none).
pub(crate) fn spec(model_type: Option<&str>) -> &'static ModelSpec {
    model_type.and_then(find).unwrap_or(&GENERIC)
}

/// The `model_type`s [`HfAttentionConfig`](super::HfAttentionConfig) reads, in the
/// registry's order: a family's, or a vision-language wrapper's.
pub fn model_types() -> impl Iterator<Item = &'static str> {
    MODELS
        .iter()
        .filter(|m| m.family.is_some() || m.text_config.is_some())
        .map(|m| m.model_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row loads a layer: a family's, or a wrapper's language model's.
    #[test]
    fn every_row_loads_a_layer() {
        for m in MODELS {
            assert!(
                m.family.is_some() != m.text_config.is_some(),
                "{}: a family or a wrapper",
                m.model_type
            );
        }
    }
}
