//! [`RopeConfig::from_hf_json`]: the rotary configuration of an HF model's `config.json`.
//!
//! Reads, as HF transformers does:
//! - `rope_parameters` (transformers ≥ 5) or `rope_scaling` (older files), with the type under
//!   `rope_type` or `type` (`su` is LongRoPE's old name); absent or `null` means plain RoPE;
//! - `rope_theta` inside the parameters or at the top level, default 10000 (GPT-NeoX: the
//!   parameters' θ, else `rotary_emb_base`, else 10000; a top-level `rope_theta` is not read;
//!   GPT-J: always 10000, and neither `rope_parameters` nor `rope_scaling` is read);
//! - `head_dim`, else `hidden_size / num_attention_heads` (GPT-2-style `n_embd` / `n_head`);
//! - partial rotary as the model's HF code reads it (the table at `PartialRotary`): Phi-3 from
//!   `partial_rotary_factor`, GPT-NeoX from `rope_parameters.partial_rotary_factor` or
//!   `rotary_pct` (25% without either, as its config class does), GPT-J from `rotary_dim`;
//!   the Llama-style models HF's attention layers load (Llama, Mistral, Qwen, Gemma, ...)
//!   rotate the whole head with the default RoPE whatever `partial_rotary_factor` says, and
//!   a factor that shortens a scaled RoPE's table is refused there (HF's layer fails on it);
//!   other or unnamed models read `partial_rotary_factor`, `rotary_pct` or `rotary_dim`; with
//!   `rope_type: "proportional"` the factor is instead the fraction of frequencies that
//!   rotate over the whole head;
//! - multimodal RoPE's `mrope_section` and `mrope_interleaved` in the parameters (Qwen2-VL,
//!   Qwen3-VL; the old `type: "mrope"` is plain RoPE's frequencies), and `rope_type: "axial"`
//!   (axial 2-D RoPE over the patch grid), which Pixtral's config class also makes of a
//!   missing or `default` type;
//! - the pair layout from `model_type` (GPT-J, CodeGen, Cohere, GLM, Helium, ERNIE 4.5, Llama 4 rotate
//!   adjacent pairs) or `rope_interleave`; DeepSeek-style latent attention is read by
//!   `HfAttentionConfig` (its rotary part alone is not a whole head);
//! - `max_position_embeddings` (`n_positions`), and `original_max_position_embeddings` at the top
//!   level (which takes precedence; Phi-3 defaults it to 4096) or in the parameters, defaulting
//!   to the former.
//!
//! Keys the file leaves out take the model's class defaults (the table in `hf::defaults`):
//! `rope_theta` (10000 for most, Llama 4's 500000, SmolLM3's 2e6, the Qwen-VL text models'
//! 1e6 and 500000, ...), `max_position_embeddings`, gpt-oss's YaRN parameters, the Qwen-VL
//! text models' `mrope_section` (Qwen3-VL's always interleaved, as its HF code is), GPT-J's
//! `rotary_dim` (64). Not read: per-layer-type parameters.

use serde_json::Map;

use super::defaults::{class_defaults, gpt_oss_rope, GPTJ_ROPE_THETA, GPTJ_ROTARY_DIM};
use super::json::{first, parse_root, problem, Obj};
use crate::error::{Error, Result};
use crate::rotary::mrope::{AxialRope, MropeSection};
use crate::rotary::rope::{RopeConfig, RopeLayout};
use crate::rotary::scaling::{LongRopeScaling, RopeScaling, YarnScaling};

impl RopeConfig {
    /// The rotary configuration of an HF model's `config.json` text (see the [module
    /// docs](self) for the keys read).
    ///
    /// The result is validated. Its `max_position` is the model's `max_position_embeddings`
    /// (tables still grow past it).
    ///
    /// # Example
    /// ```
    /// use candle_posenc::{RopeConfig, RopeScaling};
    ///
    /// let json = r#"{"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 500000.0,
    ///     "max_position_embeddings": 131072,
    ///     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ///         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
    /// let config = RopeConfig::from_hf_json(json)?;
    /// assert_eq!(config.head_dim, 128);
    /// assert!(matches!(config.scaling, RopeScaling::Llama3 { .. }));
    /// # Ok::<(), candle_posenc::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::HfConfig`] naming the key for text that is not a JSON object, a missing
    /// required key (`hidden_size`, `num_attention_heads`, a scaling `factor`, ...), a key of
    /// the wrong type, an unknown `rope_type`, per-layer-type parameters, or an odd rotary
    /// dimension; then the errors of [`RopeConfig::validate`].
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let map = &parse_root(text)?;
        let top = Obj { map, prefix: "" };
        let defaults = class_defaults(top.str("model_type")?);

        // HF reads `rope_scaling` first when a file has both, unless it is null or empty
        // (`rope_scaling or rope_parameters`).
        let scaling = top
            .get("rope_scaling")
            .filter(|v| !(v.is_null() || v.as_object().is_some_and(|m| m.is_empty())));
        // GPT-J's attention builds its table with θ 10000 and no scaling
        // (`create_sinusoidal_positions` in modeling_gptj.py) whatever the file says.
        let gptj = top.str("model_type")? == Some("gptj");
        let (params_key, params_value) = match (scaling, top.get("rope_parameters")) {
            _ if gptj => ("rope_parameters", None),
            (Some(v), _) => ("rope_scaling", Some(v)),
            (None, Some(v)) => ("rope_parameters", Some(v)),
            (None, None) => ("rope_parameters", None),
        };
        // The class's own parameters when the file has none (gpt-oss's YaRN).
        let empty = if defaults.yarn {
            gpt_oss_rope()
        } else {
            Map::new()
        };
        let params_map = match params_value {
            None => &empty,
            Some(v) => v
                .as_object()
                .ok_or_else(|| problem(params_key, format!("is {v}, expected an object")))?,
        };
        let prefix = format!("{params_key}.");
        let params = Obj {
            map: params_map,
            prefix: &prefix,
        };
        let nested = !params_map.contains_key("rope_type")
            && !params_map.contains_key("type")
            && !params_map.is_empty()
            && params_map.values().all(|v| v.is_object() || v.is_null());
        if nested {
            return Err(problem(
                params_key,
                "holds per-layer-type parameters; build one RopeConfig per layer type from its entry",
            ));
        }

        // Head size, and the key each derived setting came from (errors name those keys).
        let (head_dim, head_key) = match top.usize("head_dim")?.or(defaults.head_dim) {
            Some(d) => (d, "head_dim".to_string()),
            None => {
                // Qwen2-VL's vision encoder keeps its width in `embed_dim` (`hidden_size` is
                // the language model's there); Qwen2.5-VL's and Qwen3-VL's in `hidden_size`.
                let widths: &[&str] = match top.str("model_type")? {
                    Some("qwen2_vl_vision") => &["embed_dim"],
                    _ => &["hidden_size", "n_embd", "d_model"],
                };
                let (hidden, hidden_key) = first(&top, widths)?;
                let (heads, heads_key) =
                    first(&top, &["num_attention_heads", "n_head", "num_heads"])?;
                if heads == 0 || !hidden.is_multiple_of(heads) {
                    return Err(problem(
                        heads_key,
                        format!(
                            "is {heads}, expected a non-zero divisor of {hidden_key} ({hidden})"
                        ),
                    ));
                }
                (hidden / heads, format!("{hidden_key} / {heads_key}"))
            }
        };

        let model_type = top.str("model_type")?;
        // An explicit null θ where θ is read: HF's classes pass it on and its rotary code
        // computes with None and fails (GPT-NeoX reads `rotary_emb_base` instead).
        let null = |o: &Obj, key: &str| o.map.get(key).is_some_and(|v| v.is_null());
        let null_theta = match (null(&params, "rope_theta"), params.get("rope_theta")) {
            (true, _) => Some(params.name("rope_theta")),
            (false, Some(_)) => None,
            (false, None)
                if null(&top, "rope_theta") && !matches!(model_type, Some("gpt_neox" | "gptj")) =>
            {
                Some("rope_theta".to_string())
            }
            (false, None) => None,
        };
        if let Some(key) = null_theta {
            return Err(problem(
                key,
                "is null, expected a positive θ (HF's rotary code fails on a null one; leave \
                 the key out for the model's default)",
            ));
        }
        let (base, base_key) =
            match (model_type, top.f64("rotary_emb_base")?) {
                (Some("gptj"), _) => (GPTJ_ROPE_THETA, "model_type".to_string()),
                // GPTNeoXConfig.convert_rope_params_to_dict only fills a θ the parameters lack,
                // from `rotary_emb_base` or its default (a null one reaches the rotary code and
                // fails there), and never reads a top-level `rope_theta`.
                (Some("gpt_neox"), neox_base) => match params.f64("rope_theta")? {
                    Some(b) => (b, params.name("rope_theta")),
                    None if null(&top, "rotary_emb_base") => return Err(problem(
                        "rotary_emb_base",
                        "is null, expected a positive θ (HF's rotary code fails on a null one; \
                         leave the key out for the default 10000)",
                    )),
                    None => (
                        neox_base.unwrap_or(defaults.rope_theta),
                        "rotary_emb_base".to_string(),
                    ),
                },
                (_, neox_base) => match params.f64("rope_theta")? {
                    Some(b) => (b, params.name("rope_theta")),
                    None => match (top.f64("rope_theta")?, neox_base) {
                        (Some(b), _) => (b, "rope_theta".to_string()),
                        (None, Some(b)) => (b, "rotary_emb_base".to_string()),
                        (None, None) => (defaults.rope_theta, "rope_theta".to_string()),
                    },
                },
            };

        let mut config = RopeConfig::new(head_dim).with_base(base);
        let mut rotary_key = head_key.clone();
        // Proportional RoPE reads partial_rotary_factor as the fraction of frequencies that
        // rotate; the whole head is its rotary dimension.
        // Phi-3's configuration refuses every scaling but LongRoPE.
        if model_type == Some("phi3") {
            let kind = params.str("rope_type")?.or(params.str("type")?);
            if let Some(kind) = kind.filter(|k| !matches!(*k, "default" | "longrope")) {
                let key = match params.str("rope_type")? {
                    Some(_) => params.name("rope_type"),
                    None => params.name("type"),
                };
                return Err(problem(
                    key,
                    format!(
                        "is {kind}, but HF's Phi-3 configuration takes only longrope or default"
                    ),
                ));
            }
        }
        let proportional = match params.str("rope_type")? {
            Some(t) => t == "proportional",
            None => params.str("type")? == Some("proportional"),
        };
        // Which keys make the rotation partial depends on the model's HF code (see
        // `PartialRotary`).
        let scaled = !matches!(
            params
                .str("rope_type")?
                .or(params.str("type")?)
                .unwrap_or("default"),
            "default" | "mrope" | "axial"
        );
        let factor = || -> Result<Option<(f64, String)>> {
            Ok(match params.f64("partial_rotary_factor")? {
                Some(f) => Some((f, params.name("partial_rotary_factor"))),
                None => top
                    .f64("partial_rotary_factor")?
                    .map(|f| (f, "partial_rotary_factor".to_string())),
            })
        };
        if !proportional {
            match PartialRotary::of(model_type) {
                PartialRotary::AnyKey => {
                    if let Some((f, key)) = factor()? {
                        config = config.with_partial_rotary_factor(f);
                        rotary_key = key;
                    } else if let Some(f) = top.f64("rotary_pct")? {
                        config = config.with_partial_rotary_factor(f);
                        rotary_key = "rotary_pct".into();
                    } else if let Some(d) = top.usize("rotary_dim")? {
                        config = config.with_rotary_dim(d);
                        rotary_key = "rotary_dim".into();
                    }
                }
                PartialRotary::Factor => {
                    if let Some((f, key)) = factor()? {
                        config = config.with_partial_rotary_factor(f);
                        rotary_key = key;
                    }
                }
                PartialRotary::NeoX => {
                    if let Some(f) = params.f64("partial_rotary_factor")? {
                        config = config.with_partial_rotary_factor(f);
                        rotary_key = params.name("partial_rotary_factor");
                    } else if let Some(f) = top.f64("rotary_pct")? {
                        config = config.with_partial_rotary_factor(f);
                        rotary_key = "rotary_pct".into();
                    } else if top.map.get("rotary_pct").is_some_and(|v| v.is_null()) {
                        // GPTNeoXConfig takes the null as the factor and fails on it.
                        return Err(problem(
                            "rotary_pct",
                            "is null, expected a fraction of the head (HF's GPT-NeoX fails on a null one; leave the key out for 0.25)",
                        ));
                    } else {
                        // GPTNeoXConfig's default rotary_pct.
                        config = config.with_partial_rotary_factor(0.25);
                        rotary_key = "model_type".into();
                    }
                }
                PartialRotary::RotaryDim => {
                    // GPTJConfig's default when absent.
                    let d = top.usize("rotary_dim")?.unwrap_or(GPTJ_ROTARY_DIM);
                    config = config.with_rotary_dim(d);
                    rotary_key = "rotary_dim".into();
                }
                PartialRotary::WholeHead if scaled => {
                    // HF's shared scaled-RoPE functions honour the factor, and the model's
                    // rotation then multiplies the whole head by a shorter table: most fail on
                    // it, and where a broadcast lets one run (LongRoPE's factors, Llama 4's
                    // complex product) the rotation is not a RoPE this crate builds.
                    if let Some((f, key)) = factor()? {
                        let rotary = RopeConfig::new(head_dim).with_partial_rotary_factor(f);
                        // The table HF builds: one frequency per pair of the truncated width.
                        let width = rotary.rotary_dim.div_ceil(2) * 2;
                        if width != head_dim {
                            return Err(problem(
                                key,
                                format!(
                                    "is {f}: HF's scaled RoPE then gives {width} rotary features for a {head_dim}-wide head that this model's attention rotates whole, which HF's layer fails on or broadcasts into a rotation this crate does not build; expected a factor giving the whole head"
                                ),
                            ));
                        }
                    }
                }
                PartialRotary::WholeHead => {}
            }
        }
        if !config.rotary_dim.is_multiple_of(2) {
            return Err(problem(
                rotary_key.clone(),
                format!(
                    "gives an odd rotary dimension {} for head_dim {head_dim}, expected an even one",
                    config.rotary_dim
                ),
            ));
        }
        if let Some(t @ ("deepseek_v2" | "deepseek_v3" | "kimi_k2")) = model_type {
            return Err(problem(
                "model_type",
                format!(
                    "is `{t}`: multi-head latent attention rotates `qk_rope_head_dim` features of each head; read the layer with HfAttentionConfig, which builds its RopeConfig"
                ),
            ));
        }
        // Models whose HF code rotates adjacent pairs.
        let interleaved = matches!(
            model_type,
            Some(
                "gptj"
                    | "codegen"
                    | "cohere"
                    | "cohere2"
                    | "glm"
                    | "glm4"
                    | "helium"
                    | "ernie4_5"
                    | "llama4_text"
            )
        ) || top.bool("rope_interleave")?.unwrap_or(false);
        if interleaved {
            config = config.with_layout(RopeLayout::Interleaved);
        }
        let max_pos = match top.usize("max_position_embeddings")? {
            Some(n) => Some(n),
            None => top
                .usize("n_positions")?
                .or(defaults.max_position_embeddings),
        };
        if let Some(n) = max_pos {
            config = config.with_max_position(n);
        }

        let rope_type = match params.str("rope_type")? {
            Some(t) => t,
            None => params.str("type")?.unwrap_or("default"),
        };
        // Pixtral's config class turns a missing or "default" type into its own default,
        // "axial" (`default_rope_type`, applied by `standardize_rope_params`), and its rotary
        // embedding fails on any other type.
        let rope_type = match (model_type, rope_type) {
            (Some("pixtral"), "default" | "axial") => "axial",
            (Some("pixtral"), other) => {
                return Err(problem(
                    type_key(&params),
                    format!(
                        "is `{other}`, but Pixtral's vision encoder has only axial 2-D RoPE (HF's PixtralVisionRotaryEmbedding fails on any other type); leave it out or give `axial`"
                    ),
                ))
            }
            (_, t) => t,
        };
        // Qwen2-VL's older files name multimodal RoPE as a type; its frequencies are plain.
        // Pixtral's vision encoder names its axial 2-D RoPE "axial".
        let axial = rope_type == "axial";
        let rope_type = if rope_type == "mrope" || axial {
            "default"
        } else {
            rope_type
        };
        let is_phi3 = matches!(model_type, Some("phi3" | "phi4_multimodal"));
        // Phi-3's config maps `yarn` to LongRoPE.
        let rope_type = if is_phi3 && rope_type == "yarn" {
            "longrope"
        } else {
            rope_type
        };
        let type_key = type_key(&params);
        let max_pos_required = || top.required("max_position_embeddings", max_pos);
        let original = || -> Result<usize> {
            match top.usize("original_max_position_embeddings")? {
                Some(n) => Ok(n),
                // Phi3Config always has a top-level value (default 4096), which wins.
                None if is_phi3 => Ok(4096),
                None => match params.usize("original_max_position_embeddings")? {
                    Some(n) => Ok(n),
                    None => max_pos_required(),
                },
            }
        };
        let original_key = if top.get("original_max_position_embeddings").is_some() || is_phi3 {
            "original_max_position_embeddings".to_string()
        } else if params.get("original_max_position_embeddings").is_some() {
            params.name("original_max_position_embeddings")
        } else {
            "max_position_embeddings".to_string()
        };
        let factor = || -> Result<f64> { params.required("factor", params.f64("factor")?) };
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "dynamic" => RopeScaling::Dynamic {
                factor: factor()?,
                original_max_position_embeddings: max_pos_required()?,
            },
            "yarn" => {
                let original = original()?;
                let factor = match params.f64("factor")? {
                    Some(f) => f,
                    None => max_pos_required()? as f64 / original as f64,
                };
                let mut y = YarnScaling::new(factor, original);
                // HF treats a zero or missing beta as the default.
                if let Some(b) = params.f64("beta_fast")?.filter(|b| *b != 0.0) {
                    y.beta_fast = b;
                }
                if let Some(b) = params.f64("beta_slow")?.filter(|b| *b != 0.0) {
                    y.beta_slow = b;
                }
                // HF treats a zero mscale as unset.
                y.mscale = params.f64("mscale")?.filter(|m| *m != 0.0);
                y.mscale_all_dim = params.f64("mscale_all_dim")?.filter(|m| *m != 0.0);
                y.attention_factor = params.f64("attention_factor")?;
                if let Some(t) = params.bool("truncate")? {
                    y.truncate = t;
                }
                RopeScaling::Yarn(y)
            }
            "llama3" => RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: params
                    .required("low_freq_factor", params.f64("low_freq_factor")?)?,
                high_freq_factor: params
                    .required("high_freq_factor", params.f64("high_freq_factor")?)?,
                original_max_position_embeddings: original()?,
            },
            "longrope" | "su" => {
                let original = original()?;
                let factor = match params.f64("factor")? {
                    Some(f) => f,
                    None => max_pos_required()? as f64 / original as f64,
                };
                RopeScaling::LongRope(LongRopeScaling {
                    short_factor: params.required("short_factor", params.list("short_factor")?)?,
                    long_factor: params.required("long_factor", params.list("long_factor")?)?,
                    original_max_position_embeddings: original,
                    factor,
                    attention_factor: params.f64("attention_factor")?,
                })
            }
            "proportional" => RopeScaling::Proportional {
                factor: params.f64("factor")?.unwrap_or(1.0),
                partial_rotary_factor: match params.f64("partial_rotary_factor")? {
                    Some(p) => p,
                    None => top.f64("partial_rotary_factor")?.unwrap_or(1.0),
                },
            },
            other => {
                return Err(problem(
                    type_key,
                    format!(
                    "is `{other}`, expected default, linear, dynamic, yarn, llama3, longrope, su or proportional"
                ),
                ))
            }
        };
        let mut config = config.with_scaling(scaling);
        if axial {
            // Pixtral interleaves the rows' and columns' frequencies; the Qwen-VL and Gemma 4
            // vision encoders repeat a half-width head's frequencies, and Gemma 4 rotates each
            // half of the head on its own.
            let layout = match model_type {
                Some("pixtral") => AxialRope::EvenOdd,
                Some("gemma4_vision") => AxialRope::SplitHalves,
                Some(t) if t.ends_with("_vl_vision") => AxialRope::Repeated,
                other => {
                    return Err(problem(
                        type_key,
                        format!(
                            "is `axial` for model_type {other:?}, whose frequency layout is not known (pixtral, qwen2_vl_vision, qwen2_5_vl_vision, qwen3_vl_vision, gemma4_vision)"
                        ),
                    ))
                }
            };
            config = config.with_axial(Some(layout));
        }
        if let (None, Some(section)) = (params.get("mrope_section"), defaults.mrope) {
            config = config.with_mrope(Some(section));
        }
        if let Some(list) = params.list("mrope_section")? {
            let bad = || {
                problem(
                    params.name("mrope_section"),
                    format!("is {list:?}, expected three non-negative integers"),
                )
            };
            let ints: Vec<usize> = list
                .iter()
                .map(|&x| {
                    (x.fract() == 0.0 && (0.0..=u32::MAX as f64).contains(&x))
                        .then_some(x as usize)
                        .ok_or_else(bad)
                })
                .collect::<Result<_>>()?;
            let sections: [usize; 3] = ints.try_into().map_err(|_| bad())?;
            // Qwen3-VL's HF code interleaves whatever `mrope_interleaved` says.
            let interleaved = match defaults.mrope {
                Some(m) if m.interleaved => true,
                _ => params.bool("mrope_interleaved")?.unwrap_or(false),
            };
            config = config.with_mrope(Some(
                MropeSection::new(sections).with_interleaved(interleaved),
            ));
        }
        // A value the checks refuse is reported under the key of the file it came from.
        let blame = |field: &str| -> String {
            match field {
                "head_dim" => head_key.clone(),
                "rotary_dim" => rotary_key.clone(),
                "base" => base_key.clone(),
                "original_max_position_embeddings" => original_key.clone(),
                "rope attention factor" if params.get("attention_factor").is_some() => {
                    params.name("attention_factor")
                }
                "rope inverse frequency" | "rope attention factor" => type_key.clone(),
                "partial_rotary_factor" if params.get("partial_rotary_factor").is_some() => {
                    params.name("partial_rotary_factor")
                }
                "partial_rotary_factor" => "partial_rotary_factor".to_string(),
                "mrope_section" => params.name("mrope_section"),
                f if f.ends_with(" factor") => params.name("factor"),
                f => params.name(f),
            }
        };
        config.validate().map_err(|e| match e {
            Error::InvalidConfig {
                name,
                value,
                expected,
            } => problem(
                blame(name),
                format!("gives {name} = {value}, expected {expected}"),
            ),
            other => other,
        })?;
        Ok(config)
    }
}

/// The key a parameters object names its RoPE type under (`rope_type`, or the older `type`).
fn type_key(params: &Obj) -> String {
    params.name(if params.get("rope_type").is_some() {
        "rope_type"
    } else {
        "type"
    })
}

/// How a model's HF code (transformers 5.24) reads the keys that make its rotation partial.
///
/// | `model_type` | reads | partial rotation |
/// |---|---|---|
/// | `phi3`, `phi4_multimodal` | `partial_rotary_factor` (parameters, then top level) | yes, any RoPE type (`apply_rotary_pos_emb` splits at the table's width) |
/// | `gpt_neox` | `rope_parameters.partial_rotary_factor`, else `rotary_pct`, else 0.25 (a top-level `partial_rotary_factor` is not read) | yes, any RoPE type |
/// | `gptj` | `rotary_dim` | yes |
/// | `llama`, `mistral`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `olmo2`, `gpt_oss`, `smollm3`, `cohere2`, `llama4_text`, `gemma4_text`, `falcon`, `modernbert`, `pixtral`, the Qwen2/2.5/3-VL text models (and DeepSeek V2/V3's rotary part) | nothing for the default RoPE: `compute_default_rope_parameters` takes the whole head | no: the whole head rotates; with a scaled type (`linear`, `dynamic`, `yarn`, `llama3`, `longrope`) the shared functions of `modeling_rope_utils` honour the factor and the model's rotation fails on the shorter table, so a factor that shortens it is refused; `proportional` reads it as a fraction of frequencies |
/// | any other, or none | `partial_rotary_factor`, `rotary_pct`, `rotary_dim`, in that order | yes |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartialRotary {
    AnyKey,
    Factor,
    NeoX,
    RotaryDim,
    WholeHead,
}

impl PartialRotary {
    fn of(model_type: Option<&str>) -> Self {
        match model_type {
            Some("phi3" | "phi4_multimodal") => Self::Factor,
            Some("gpt_neox") => Self::NeoX,
            Some("gptj") => Self::RotaryDim,
            Some(
                "llama" | "mistral" | "qwen2" | "qwen3" | "gemma" | "gemma2" | "gemma3_text"
                | "olmo2" | "gpt_oss" | "smollm3" | "cohere2" | "llama4_text" | "gemma4_text"
                | "falcon" | "modernbert" | "pixtral" | "qwen2_vl_text" | "qwen2_5_vl_text"
                | "qwen3_vl_text" | "qwen3_vl_moe_text",
            ) => Self::WholeHead,
            _ => Self::AnyKey,
        }
    }
}
