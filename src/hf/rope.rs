//! [`RopeConfig::from_hf_json`]: the rotary configuration of an HF model's `config.json`.
//!
//! Reads, as HF transformers does:
//! - `rope_parameters` (transformers ≥ 5) or `rope_scaling` (older files), with the type under
//!   `rope_type` or `type` (`su` is LongRoPE's old name); absent or `null` means plain RoPE;
//! - `rope_theta` inside the parameters or at the top level, default 10000 (GPT-NeoX: the
//!   parameters' θ, else `rotary_emb_base`, else 10000; a top-level `rope_theta` is not read;
//!   GPT-J and CodeGen: always 10000, and neither `rope_parameters` nor `rope_scaling` is
//!   read);
//! - `head_dim`, else `hidden_size / num_attention_heads` (GPT-2-style `n_embd` / `n_head`);
//! - partial rotary as the model's HF code reads it (the table at `hf::registry::PartialRotary`): Phi-3 from
//!   `partial_rotary_factor`, GPT-NeoX from `rope_parameters.partial_rotary_factor` or
//!   `rotary_pct` (25% without either, as its config class does), GLM and GLM-4 from
//!   `partial_rotary_factor` (half without it), GPT-J and CodeGen from `rotary_dim`;
//!   the Llama-style models HF's attention layers load (Llama, Mistral, Qwen, Gemma, ...)
//!   rotate the whole head with the default RoPE whatever `partial_rotary_factor` says, and
//!   a factor that shortens a scaled RoPE's table is refused there (HF's layer fails on it);
//!   other or unnamed models read `partial_rotary_factor`, `rotary_pct` or `rotary_dim`; with
//!   `rope_type: "proportional"` the factor is instead the fraction of frequencies that
//!   rotate over the whole head;
//! - multimodal RoPE's `mrope_section` and `mrope_interleaved` in the parameters (Qwen2-VL,
//!   Qwen3-VL; the old `type: "mrope"` is plain RoPE's frequencies), and `rope_type: "axial"`
//!   (axial 2-D RoPE over the patch grid), which the vision encoders' config classes (Pixtral's,
//!   the Qwen-VL and Gemma 4 vision ones) also make of a missing or `default` type, refusing
//!   any other;
//! - the pair layout from `model_type` (GPT-J, CodeGen, Cohere, GLM, Helium, ERNIE 4.5, Llama 4
//!   rotate adjacent pairs) or `rope_interleave`;
//! - `max_position_embeddings` (`n_positions`), and `original_max_position_embeddings` at the top
//!   level (which takes precedence; Phi-3 defaults it to 4096) or in the parameters, defaulting
//!   to the former.
//!
//! Keys the file leaves out take the model's class defaults (the table in `hf::defaults`, held
//! by `hf::registry`'s rows): `rope_theta` (10000 for most, Llama 4's 500000, SmolLM3's 2e6, the
//! Qwen-VL text models' 1e6 and 500000, Gemma 4's vision encoder's 100, Cohere's and ERNIE
//! 4.5's 500000, Helium's 100000, ...), `head_dim` (Gemma 4's vision encoder's 64; GLM's,
//! GLM-4's, Helium's and ERNIE 4.5's 128), `max_position_embeddings`, gpt-oss's YaRN
//! parameters, the Qwen-VL text models' `mrope_section` (Qwen3-VL's always interleaved, as its
//! HF code is), GPT-J's and CodeGen's `rotary_dim` (64), GLM's `partial_rotary_factor` (0.5).
//! Not read: per-layer-type parameters.
//!
//! Every type with a row in `hf::registry` is a layer `HfAttentionConfig` loads, and reads its
//! rotation here, the same (a vision-language wrapper's from its `text_config`, as the layer
//! reader does); both run the file-wide checks of `hf::checks` first, so a file one refuses
//! the other refuses with the same error. A layer whose rotation is not read here alone is
//! refused under `model_type` pointing at `HfAttentionConfig`: latent attention (its rotary
//! part is not a whole head), and attention with another encoding (BLOOM's and MPT's ALiBi,
//! Falcon's under `alibi`, T5's buckets, GPT-2's learned positions). Types without a row read
//! as a generic model here and are refused there.
//!
//! Each `rope_type` is one reader function in the table `ROPE_TYPES` (as HF's
//! `ROPE_INIT_FUNCTIONS`); what differs by `model_type` is the row's `RopeSpec` in
//! `hf::registry`.

use serde_json::{Map, Value};

use super::checks::check_file;
use super::defaults::{gpt_oss_rope, GPTJ_ROPE_THETA, GPTJ_ROTARY_DIM};
use super::json::{first, parse_root, problem, Obj};
use super::layer::text_model;
use super::registry::{spec, Instead, ModelSpec, PartialRotary, RopeSource, RopeSpec, HEADS};
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
        if let Some(inner) = text_model(text)? {
            return Self::from_hf_json(&inner);
        }
        let map = parse_root(text)?;
        let top = Obj {
            map: &map,
            prefix: "",
        };
        check_file(&top, spec(top.str("model_type")?))?;
        rope_of_file(text)
    }
}

/// The rotation of a `config.json` whose file-wide checks (`hf::checks`) have passed: the
/// steps of [`RopeConfig::from_hf_json`], which the layer reader runs on the file (or the
/// layer's entry) it has checked.
pub(super) fn rope_of_file(text: &str) -> Result<RopeConfig> {
    let map = parse_root(text)?;
    let file = RopeFile::new(&map)?;
    file.refuse_other_encoding()?;
    let mut keys = Blame::default();
    let head_dim = file.head_dim(&mut keys)?;
    file.refuse_null_theta()?;
    let base = file.base(&mut keys)?;
    let mut config = RopeConfig::new(head_dim).with_base(base);
    file.refuse_other_types()?;
    keys.rotary = keys.head.clone();
    config = file.partial(config, &mut keys)?;
    file.check_rotary(&config, &keys)?;
    if file.layout_interleaved()? {
        config = config.with_layout(RopeLayout::Interleaved);
    }
    let max_pos = file.max_position()?;
    if let Some(n) = max_pos {
        config = config.with_max_position(n);
    }
    let (rope_type, axial) = file.rope_type()?;
    let lengths = Lengths {
        file: &file,
        max_pos,
    };
    keys.original = lengths.original_key();
    keys.kind = type_key(&file.params());
    config = config.with_scaling(read_scaling(&lengths, rope_type)?);
    if axial {
        config = config.with_axial(Some(file.axial_layout()?));
    }
    config = file.mrope(config)?;
    config
        .validate()
        .map_err(|e| keys.blame(&file.params(), e))?;
    Ok(config)
}

/// A `config.json` being read: its top level, the rotary parameters and the model's row.
struct RopeFile<'a> {
    top: Obj<'a>,
    model_type: Option<&'a str>,
    spec: &'static ModelSpec,
    /// `rope_parameters` or `rope_scaling` (or the class's own), and its dotted prefix.
    params: Map<String, Value>,
    prefix: String,
}

/// The keys each derived setting came from, so a value the checks refuse names its key.
#[derive(Default)]
struct Blame {
    head: String,
    rotary: String,
    base: String,
    original: String,
    kind: String,
}

impl Blame {
    /// A value [`RopeConfig::validate`] refuses, reported under the key it came from.
    fn blame(&self, params: &Obj, err: Error) -> Error {
        let Error::InvalidConfig {
            name,
            value,
            expected,
        } = err
        else {
            return err;
        };
        let key = match name {
            "head_dim" => self.head.clone(),
            "rotary_dim" => self.rotary.clone(),
            "base" => self.base.clone(),
            "original_max_position_embeddings" => self.original.clone(),
            "rope attention factor" if params.get("attention_factor").is_some() => {
                params.name("attention_factor")
            }
            "rope inverse frequency" | "rope attention factor" => self.kind.clone(),
            "partial_rotary_factor" if params.get("partial_rotary_factor").is_some() => {
                params.name("partial_rotary_factor")
            }
            "partial_rotary_factor" => "partial_rotary_factor".to_string(),
            "mrope_section" => params.name("mrope_section"),
            f if f.ends_with(" factor") => params.name("factor"),
            f => params.name(f),
        };
        problem(key, format!("gives {name} = {value}, expected {expected}"))
    }
}

impl<'a> RopeFile<'a> {
    /// The file's top level, its row and its rotary parameters.
    ///
    /// HF reads `rope_scaling` first when a file has both, unless it is null or empty
    /// (`rope_scaling or rope_parameters`); GPT-J's attention builds its table with θ 10000
    /// and no scaling (`create_sinusoidal_positions` in modeling_gptj.py) whatever the file
    /// says; a class with its own parameters (gpt-oss's YaRN) gives them when the file has none.
    fn new(map: &'a Map<String, Value>) -> Result<Self> {
        let top = Obj { map, prefix: "" };
        let model_type = top.str("model_type")?;
        let spec = spec(model_type);
        let scaling = top
            .get("rope_scaling")
            .filter(|v| !(v.is_null() || v.as_object().is_some_and(|m| m.is_empty())));
        let (key, value) = match (scaling, top.get("rope_parameters")) {
            _ if spec.rope.source == RopeSource::Fixed => ("rope_parameters", None),
            (Some(v), _) => ("rope_scaling", Some(v)),
            (None, Some(v)) => ("rope_parameters", Some(v)),
            (None, None) => ("rope_parameters", None),
        };
        let params = match value {
            None if spec.defaults.yarn => gpt_oss_rope(),
            None => Map::new(),
            Some(v) => v
                .as_object()
                .ok_or_else(|| problem(key, format!("is {v}, expected an object")))?
                .clone(),
        };
        let nested = !params.contains_key("rope_type")
            && !params.contains_key("type")
            && !params.is_empty()
            && params.values().all(|v| v.is_object() || v.is_null());
        if nested {
            return Err(problem(
                key,
                "holds per-layer-type parameters; build one RopeConfig per layer type from its entry",
            ));
        }
        Ok(Self {
            top,
            model_type,
            spec,
            params,
            prefix: format!("{key}."),
        })
    }

    fn params(&self) -> Obj<'_> {
        Obj {
            map: &self.params,
            prefix: &self.prefix,
        }
    }

    fn rope(&self) -> &'static RopeSpec {
        &self.spec.rope
    }

    /// The parameters' type (`rope_type`, else the older `type`), if given.
    fn given_type(&self) -> Result<Option<&str>> {
        let params = self.params();
        Ok(params.str("rope_type")?.or(params.str("type")?))
    }

    /// `head_dim`, else the class's, else the width over the heads.
    fn head_dim(&self, keys: &mut Blame) -> Result<usize> {
        let top = &self.top;
        if let Some(d) = top.usize("head_dim")?.or(self.spec.defaults.head_dim) {
            keys.head = "head_dim".into();
            return Ok(d);
        }
        let (hidden, hidden_key) = first(top, self.spec.widths)?;
        let (heads, heads_key) = first(top, HEADS)?;
        if heads == 0 || !hidden.is_multiple_of(heads) {
            return Err(problem(
                heads_key,
                format!("is {heads}, expected a non-zero divisor of {hidden_key} ({hidden})"),
            ));
        }
        keys.head = format!("{hidden_key} / {heads_key}");
        Ok(hidden / heads)
    }

    /// Refuses an explicit null θ where θ is read: HF's classes pass it on and its rotary code
    /// computes with None and fails (GPT-NeoX reads `rotary_emb_base` instead).
    fn refuse_null_theta(&self) -> Result<()> {
        let params = self.params();
        let null = |o: &Obj, key: &str| o.map.get(key).is_some_and(Value::is_null);
        let key = match (null(&params, "rope_theta"), params.get("rope_theta")) {
            (true, _) => params.name("rope_theta"),
            (false, None)
                if null(&self.top, "rope_theta") && self.rope().source == RopeSource::Standard =>
            {
                "rope_theta".to_string()
            }
            _ => return Ok(()),
        };
        Err(problem(
            key,
            "is null, expected a positive θ (HF's rotary code fails on a null one; leave \
             the key out for the model's default)",
        ))
    }

    /// θ, by the row's source.
    fn base(&self, keys: &mut Blame) -> Result<f64> {
        let (top, params) = (&self.top, self.params());
        let emb_base = top.f64("rotary_emb_base")?;
        let default = self.spec.defaults.rope_theta;
        let (base, key) = match (self.rope().source, params.f64("rope_theta")?) {
            (RopeSource::Fixed, _) => (GPTJ_ROPE_THETA, "model_type".to_string()),
            (_, Some(b)) => (b, params.name("rope_theta")),
            // GPTNeoXConfig.convert_rope_params_to_dict only fills a θ the parameters lack,
            // from `rotary_emb_base` or its default (a null one reaches the rotary code and
            // fails there), and never reads a top-level `rope_theta`.
            (RopeSource::NeoX, None)
                if top.map.get("rotary_emb_base").is_some_and(Value::is_null) =>
            {
                return Err(problem(
                    "rotary_emb_base",
                    "is null, expected a positive θ (HF's rotary code fails on a null one; \
                     leave the key out for the default 10000)",
                ))
            }
            (RopeSource::NeoX, None) => (emb_base.unwrap_or(default), "rotary_emb_base".into()),
            (RopeSource::Standard, None) => match (top.f64("rope_theta")?, emb_base) {
                (Some(b), _) => (b, "rope_theta".to_string()),
                (None, Some(b)) => (b, "rotary_emb_base".to_string()),
                (None, None) => (default, "rope_theta".to_string()),
            },
        };
        keys.base = key;
        Ok(base)
    }

    /// Phi-3's configuration refuses every scaling but LongRoPE.
    fn refuse_other_types(&self) -> Result<()> {
        if !self.rope().longrope_only {
            return Ok(());
        }
        match self.given_type()? {
            Some(kind) if !matches!(kind, "default" | "longrope") => Err(problem(
                type_key(&self.params()),
                format!("is {kind}, but HF's Phi-3 configuration takes only longrope or default"),
            )),
            _ => Ok(()),
        }
    }

    /// `partial_rotary_factor` in the parameters, else at the top level, with its key.
    fn factor(&self) -> Result<Option<(f64, String)>> {
        let params = self.params();
        Ok(match params.f64("partial_rotary_factor")? {
            Some(f) => Some((f, params.name("partial_rotary_factor"))),
            None => self
                .top
                .f64("partial_rotary_factor")?
                .map(|f| (f, "partial_rotary_factor".to_string())),
        })
    }

    /// The rotary width as the model's HF code reads it (see `PartialRotary`). Proportional
    /// RoPE reads `partial_rotary_factor` as the fraction of frequencies that rotate; the
    /// whole head is its rotary dimension.
    fn partial(&self, config: RopeConfig, keys: &mut Blame) -> Result<RopeConfig> {
        let kind = self.given_type()?;
        if kind == Some("proportional") {
            return Ok(config);
        }
        let top = &self.top;
        let (config, key) = match self.rope().partial {
            PartialRotary::AnyKey => match self.factor()? {
                Some((f, key)) => (config.with_partial_rotary_factor(f), key),
                None => match top.f64("rotary_pct")? {
                    Some(f) => (config.with_partial_rotary_factor(f), "rotary_pct".into()),
                    None => match top.usize("rotary_dim")? {
                        Some(d) => (config.with_rotary_dim(d), "rotary_dim".into()),
                        None => return Ok(config),
                    },
                },
            },
            PartialRotary::Factor => {
                match (self.factor()?, self.spec.defaults.partial_rotary_factor) {
                    (Some((f, key)), _) => (config.with_partial_rotary_factor(f), key),
                    // The class's own factor (GLM's 0.5).
                    (None, Some(f)) => (
                        config.with_partial_rotary_factor(f),
                        "partial_rotary_factor".into(),
                    ),
                    (None, None) => return Ok(config),
                }
            }
            PartialRotary::NeoX => self.neox_partial(config)?,
            PartialRotary::RotaryDim => {
                // GPTJConfig's default when absent.
                let d = top.usize("rotary_dim")?.unwrap_or(GPTJ_ROTARY_DIM);
                (config.with_rotary_dim(d), "rotary_dim".into())
            }
            PartialRotary::WholeHead => {
                let scaled = !matches!(kind.unwrap_or("default"), "default" | "mrope" | "axial");
                if scaled {
                    self.refuse_short_table(config.head_dim)?;
                }
                return Ok(config);
            }
        };
        keys.rotary = key;
        Ok(config)
    }

    /// GPT-NeoX's rotary width: `rope_parameters.partial_rotary_factor`, else `rotary_pct`,
    /// else GPTNeoXConfig's default 0.25 (a null `rotary_pct` is taken as the factor there and
    /// fails).
    fn neox_partial(&self, config: RopeConfig) -> Result<(RopeConfig, String)> {
        let (top, params) = (&self.top, self.params());
        if let Some(f) = params.f64("partial_rotary_factor")? {
            return Ok((
                config.with_partial_rotary_factor(f),
                params.name("partial_rotary_factor"),
            ));
        }
        if let Some(f) = top.f64("rotary_pct")? {
            return Ok((config.with_partial_rotary_factor(f), "rotary_pct".into()));
        }
        if top.map.get("rotary_pct").is_some_and(Value::is_null) {
            return Err(problem(
                "rotary_pct",
                "is null, expected a fraction of the head (HF's GPT-NeoX fails on a null one; leave the key out for 0.25)",
            ));
        }
        Ok((config.with_partial_rotary_factor(0.25), "model_type".into()))
    }

    /// Refuses a factor that shortens a scaled RoPE's table on a model that rotates the whole
    /// head: HF's shared scaled-RoPE functions honour the factor, and the model's rotation then
    /// multiplies the whole head by a shorter table: most fail on it, and where a broadcast
    /// lets one run (LongRoPE's factors, Llama 4's complex product) the rotation is not a RoPE
    /// this crate builds.
    fn refuse_short_table(&self, head_dim: usize) -> Result<()> {
        let Some((f, key)) = self.factor()? else {
            return Ok(());
        };
        let rotary = RopeConfig::new(head_dim).with_partial_rotary_factor(f);
        // The table HF builds: one frequency per pair of the truncated width.
        let width = rotary.rotary_dim.div_ceil(2) * 2;
        if width == head_dim {
            return Ok(());
        }
        Err(problem(
            key,
            format!(
                "is {f}: HF's scaled RoPE then gives {width} rotary features for a {head_dim}-wide head that this model's attention rotates whole, which HF's layer fails on or broadcasts into a rotation this crate does not build; expected a factor giving the whole head"
            ),
        ))
    }

    /// Refuses the file of a model whose attention has another encoding than RoPE (ALiBi, T5's
    /// buckets, GPT-2's learned positions), whose rotation read alone would be none the model
    /// applies, or latent attention, whose rotary part alone is not a whole head.
    fn refuse_other_encoding(&self) -> Result<()> {
        let model_type = self.spec.model_type;
        if self.rope().latent {
            return Err(problem(
                "model_type",
                format!(
                    "is `{model_type}`: multi-head latent attention rotates `qk_rope_head_dim` features of each head; read the layer with HfAttentionConfig, which builds its RopeConfig"
                ),
            ));
        }
        let (key, problem_text) = match self.rope().instead {
            Instead::Nothing => return Ok(()),
            Instead::Always(encoding) => (
                "model_type",
                format!(
                    "is `{model_type}`, whose attention has no rotary embedding but {encoding}"
                ),
            ),
            Instead::WhenSet(key, encoding) if self.top.bool(key)?.unwrap_or(false) => (
                key,
                format!(
                    "is true: `{model_type}`'s attention then has {encoding}, no rotary embedding"
                ),
            ),
            Instead::WhenSet(..) => return Ok(()),
        };
        Err(problem(
            key,
            format!(
                "{problem_text}; read the layer with HfAttentionConfig, which builds its encoding"
            ),
        ))
    }

    /// Refuses an odd rotary width.
    fn check_rotary(&self, config: &RopeConfig, keys: &Blame) -> Result<()> {
        if !config.rotary_dim.is_multiple_of(2) {
            return Err(problem(
                keys.rotary.clone(),
                format!(
                    "gives an odd rotary dimension {} for head_dim {}, expected an even one",
                    config.rotary_dim, config.head_dim
                ),
            ));
        }
        Ok(())
    }

    /// Whether pairs are adjacent: the model's HF code, or `rope_interleave` (not read where
    /// the code decides).
    fn layout_interleaved(&self) -> Result<bool> {
        if self.rope().interleaved {
            return Ok(true);
        }
        Ok(self.top.bool("rope_interleave")?.unwrap_or(false))
    }

    /// `max_position_embeddings`, else `n_positions`, else the class's.
    fn max_position(&self) -> Result<Option<usize>> {
        let top = &self.top;
        Ok(match top.usize("max_position_embeddings")? {
            Some(n) => Some(n),
            None => top
                .usize("n_positions")?
                .or(self.spec.defaults.max_position_embeddings),
        })
    }

    /// The scaling type to read, and whether the rotation is axial 2-D.
    ///
    /// The vision encoders' config classes (Pixtral's, the Qwen-VL and Gemma 4 vision ones)
    /// turn a missing or "default" type into their own default, "axial" (`default_rope_type`,
    /// applied by `standardize_rope_params`), and their rotary embeddings fail on any other
    /// type. Qwen2-VL's older files name multimodal RoPE as a type; its frequencies are plain.
    /// Phi-3's config maps `yarn` to LongRoPE.
    fn rope_type(&self) -> Result<(&str, bool)> {
        let given = self.given_type()?.unwrap_or("default");
        let by_default = self.rope().axial.is_some_and(|a| a.by_default);
        let kind = match given {
            "default" | "axial" if by_default => "axial",
            other if by_default => {
                return Err(problem(
                    type_key(&self.params()),
                    format!(
                        "is `{other}`, but the vision encoder of `{}` has only axial 2-D RoPE (HF's rotary embedding for it fails on any other type); leave it out or give `axial`",
                        self.spec.model_type
                    ),
                ))
            }
            t => t,
        };
        Ok(match kind {
            "axial" => ("default", true),
            "mrope" => ("default", false),
            "yarn" if self.rope().phi3 => ("longrope", false),
            t => (t, false),
        })
    }

    /// The axial layout: Pixtral interleaves the rows' and columns' frequencies; the Qwen-VL
    /// and Gemma 4 vision encoders repeat a half-width head's frequencies, and Gemma 4 rotates
    /// each half of the head on its own. A type without a row is refused, its layout unknown
    /// (HF's vision encoders lay their frequencies out in more ways than these three).
    fn axial_layout(&self) -> Result<AxialRope> {
        if let Some(axial) = self.rope().axial {
            return Ok(axial.layout);
        }
        let known: Vec<&str> = super::registry::MODELS
            .iter()
            .filter(|m| m.rope.axial.is_some())
            .map(|m| m.model_type)
            .collect();
        Err(problem(
            type_key(&self.params()),
            format!(
                "is `axial` for model_type {:?}, whose frequency layout is not known ({})",
                self.model_type,
                known.join(", ")
            ),
        ))
    }

    /// Multimodal RoPE's sections: the parameters' `mrope_section` (interleaved by
    /// `mrope_interleaved`, always for Qwen3-VL, as its HF code is), else the class's.
    fn mrope(&self, config: RopeConfig) -> Result<RopeConfig> {
        let params = self.params();
        let class = self.spec.defaults.mrope;
        let Some(list) = params.list("mrope_section")? else {
            return Ok(match (params.get("mrope_section"), class) {
                (None, Some(section)) => config.with_mrope(Some(section)),
                _ => config,
            });
        };
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
        let interleaved = match class {
            Some(m) if m.interleaved => true,
            _ => params.bool("mrope_interleaved")?.unwrap_or(false),
        };
        Ok(config.with_mrope(Some(
            MropeSection::new(sections).with_interleaved(interleaved),
        )))
    }
}

/// The lengths a scaling reads: `max_position_embeddings` and the original length.
struct Lengths<'f, 'a> {
    file: &'f RopeFile<'a>,
    max_pos: Option<usize>,
}

impl Lengths<'_, '_> {
    fn max_pos(&self) -> Result<usize> {
        self.file
            .top
            .required("max_position_embeddings", self.max_pos)
    }

    /// `original_max_position_embeddings` at the top level (Phi3Config always has one,
    /// default 4096, which wins), else in the parameters, else `max_position_embeddings`.
    fn original(&self) -> Result<usize> {
        match self.file.top.usize("original_max_position_embeddings")? {
            Some(n) => Ok(n),
            None if self.file.rope().phi3 => Ok(4096),
            None => match self.params().usize("original_max_position_embeddings")? {
                Some(n) => Ok(n),
                None => self.max_pos(),
            },
        }
    }

    /// The key [`Self::original`] reads.
    fn original_key(&self) -> String {
        let key = "original_max_position_embeddings";
        if self.file.top.get(key).is_some() || self.file.rope().phi3 {
            key.to_string()
        } else if self.params().get(key).is_some() {
            self.params().name(key)
        } else {
            "max_position_embeddings".to_string()
        }
    }

    fn params(&self) -> Obj<'_> {
        self.file.params()
    }

    /// The parameters' `factor`, required.
    fn factor(&self) -> Result<f64> {
        let params = self.params();
        params.required("factor", params.f64("factor")?)
    }

    /// The parameters' `factor`, else the lengths' ratio (YaRN, LongRoPE).
    fn factor_or_ratio(&self, original: usize) -> Result<f64> {
        match self.params().f64("factor")? {
            Some(f) => Ok(f),
            None => Ok(self.max_pos()? as f64 / original as f64),
        }
    }
}

/// One `rope_type`'s reader: its scaling from the parameters (as HF's `ROPE_INIT_FUNCTIONS`
/// maps a type to its function).
type RopeReader = fn(&Lengths) -> Result<RopeScaling>;

/// Every `rope_type` the crate reads, and its reader.
const ROPE_TYPES: &[(&str, RopeReader)] = &[
    ("default", |_| Ok(RopeScaling::None)),
    ("linear", read_linear),
    ("dynamic", read_dynamic),
    ("yarn", read_yarn),
    ("llama3", read_llama3),
    ("longrope", read_longrope),
    ("su", read_longrope),
    ("proportional", read_proportional),
];

/// The scaling of `rope_type` by its reader in [`ROPE_TYPES`].
fn read_scaling(lengths: &Lengths, rope_type: &str) -> Result<RopeScaling> {
    if let Some((_, read)) = ROPE_TYPES.iter().find(|(name, _)| *name == rope_type) {
        return read(lengths);
    }
    let names: Vec<&str> = ROPE_TYPES.iter().map(|(name, _)| *name).collect();
    let (last, rest) = names.split_last().unwrap_or((&"", &[]));
    Err(problem(
        type_key(&lengths.params()),
        format!("is `{rope_type}`, expected {} or {last}", rest.join(", ")),
    ))
}

fn read_linear(lengths: &Lengths) -> Result<RopeScaling> {
    Ok(RopeScaling::Linear {
        factor: lengths.factor()?,
    })
}

fn read_dynamic(lengths: &Lengths) -> Result<RopeScaling> {
    Ok(RopeScaling::Dynamic {
        factor: lengths.factor()?,
        original_max_position_embeddings: lengths.max_pos()?,
    })
}

/// YaRN: HF treats a zero or missing beta as the default, and a zero mscale as unset.
fn read_yarn(lengths: &Lengths) -> Result<RopeScaling> {
    let params = lengths.params();
    let original = lengths.original()?;
    let mut y = YarnScaling::new(lengths.factor_or_ratio(original)?, original);
    if let Some(b) = params.f64("beta_fast")?.filter(|b| *b != 0.0) {
        y.beta_fast = b;
    }
    if let Some(b) = params.f64("beta_slow")?.filter(|b| *b != 0.0) {
        y.beta_slow = b;
    }
    y.mscale = params.f64("mscale")?.filter(|m| *m != 0.0);
    y.mscale_all_dim = params.f64("mscale_all_dim")?.filter(|m| *m != 0.0);
    y.attention_factor = params.f64("attention_factor")?;
    if let Some(t) = params.bool("truncate")? {
        y.truncate = t;
    }
    Ok(RopeScaling::Yarn(y))
}

fn read_llama3(lengths: &Lengths) -> Result<RopeScaling> {
    let params = lengths.params();
    let required = |key: &str| -> Result<f64> { params.required(key, params.f64(key)?) };
    Ok(RopeScaling::Llama3 {
        factor: lengths.factor()?,
        low_freq_factor: required("low_freq_factor")?,
        high_freq_factor: required("high_freq_factor")?,
        original_max_position_embeddings: lengths.original()?,
    })
}

fn read_longrope(lengths: &Lengths) -> Result<RopeScaling> {
    let params = lengths.params();
    let original = lengths.original()?;
    let factor = lengths.factor_or_ratio(original)?;
    let list = |key: &str| -> Result<Vec<f64>> { params.required(key, params.list(key)?) };
    Ok(RopeScaling::LongRope(LongRopeScaling {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        factor,
        attention_factor: params.f64("attention_factor")?,
    }))
}

fn read_proportional(lengths: &Lengths) -> Result<RopeScaling> {
    let params = lengths.params();
    Ok(RopeScaling::Proportional {
        factor: params.f64("factor")?.unwrap_or(1.0),
        partial_rotary_factor: match params.f64("partial_rotary_factor")? {
            Some(p) => p,
            None => lengths
                .file
                .top
                .f64("partial_rotary_factor")?
                .unwrap_or(1.0),
        },
    })
}

/// The key a parameters object names its RoPE type under (`rope_type`, or the older `type`).
fn type_key(params: &Obj) -> String {
    params.name(if params.get("rope_type").is_some() {
        "rope_type"
    } else {
        "type"
    })
}
