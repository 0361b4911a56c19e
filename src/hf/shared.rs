//! [`SharedEncodings`]: the positional encodings a model's layers share, one per distinct
//! configuration, so that a stack of layers holds one RoPE table and not one per layer.

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::encoding::EncodingConfig;
use crate::error::Result;
use crate::plug::PositionalEncoding;

/// The encodings built so far while loading a model's layers, one `Arc` per distinct
/// [`EncodingConfig`] (with its dtype and device), handed to every later layer that asks for
/// the same configuration.
///
/// A RoPE encoding's cos/sin tables are the same for every layer with the same rotation, and
/// they grow on demand behind the `Arc`: sharing one gives a 30-layer model one table instead
/// of thirty. Layers whose configurations differ (Gemma 3's local and global θ, ModernBERT's,
/// NoPE layers) get one encoding per configuration. Learned tables are shared the same way:
/// the first layer that asks for a T5 configuration reads the table from its own tensors, and
/// later layers with that configuration reuse it, as HF's T5 does with its first layer's
/// bias. Keep one `SharedEncodings` per stack of layers that shares its tables (a T5 encoder
/// and its decoder each their own); it is a cache for loading, and can be dropped afterwards.
/// Encodings whose learned weights are every layer's own (Inkling's relative logits) are never
/// shared: each layer builds its own from its tensors.
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::hf::{HfAttentionConfig, SharedEncodings};
///
/// let json = r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
///     "num_hidden_layers": 2, "rope_theta": 100000.0}"#;
/// let config = HfAttentionConfig::from_json(json)?;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let mut shared = SharedEncodings::new();
/// let layers = (0..2)
///     .map(|i| config.load_shared(&mut shared, vb.pp(format!("model.layers.{i}.self_attn"))))
///     .collect::<Result<Vec<_>, _>>()?;
/// let (a, b) = (layers[0].encoding().unwrap(), layers[1].encoding().unwrap());
/// assert!(Arc::ptr_eq(a, b));
/// assert_eq!(shared.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct SharedEncodings {
    built: Vec<Built>,
}

/// One encoding built, with what it was built for.
#[derive(Debug, Clone)]
struct Built {
    config: EncodingConfig,
    dtype: DType,
    device: Device,
    encoding: Option<Arc<dyn PositionalEncoding>>,
}

impl SharedEncodings {
    /// No encodings yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many distinct configurations have been built.
    pub fn len(&self) -> usize {
        self.built.len()
    }

    /// Whether none has been built.
    pub fn is_empty(&self) -> bool {
        self.built.is_empty()
    }

    /// The encoding already built for `config` in `vb`'s dtype and on its device, if any
    /// (`Some(None)`: the configuration has no encoding, [`EncodingConfig::None`]).
    pub(super) fn find(
        &self,
        config: &EncodingConfig,
        vb: &VarBuilder,
    ) -> Option<Option<Arc<dyn PositionalEncoding>>> {
        if per_layer(config) {
            return None;
        }
        self.built
            .iter()
            .find(|b| {
                b.config == *config && b.dtype == vb.dtype() && b.device.same_device(vb.device())
            })
            .map(|b| b.encoding.clone())
    }

    /// Builds the encoding for `config` from `vb` (learned tables are read there) and keeps
    /// it for the layers that follow.
    ///
    /// # Errors
    /// As [`EncodingConfig::build`].
    pub(super) fn build(
        &mut self,
        config: &EncodingConfig,
        vb: VarBuilder,
    ) -> Result<Option<Arc<dyn PositionalEncoding>>> {
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        let encoding = config.build(vb)?;
        if per_layer(config) {
            return Ok(encoding);
        }
        self.built.push(Built {
            config: config.clone(),
            dtype,
            device,
            encoding: encoding.clone(),
        });
        Ok(encoding)
    }
}

/// Whether each layer's encoding of `config` has weights of its own (Inkling's `r_proj` and
/// bank), so that no two layers share one.
fn per_layer(config: &EncodingConfig) -> bool {
    matches!(config, EncodingConfig::Inkling(_))
}
