//! Rotary position embeddings (Su et al. 2021, "RoFormer"), with partial rotary, both pair
//! layouts, the HF scaling family and xPos (Sun et al. 2022).
//!
//! ```text
//! θ_i = inv_freq[i] = base^(-2i/d)           (before scaling; d = rotary_dim)
//! R(m): rotate pair i of a head at position m by the angle m·θ_i
//! q_m' = R(m) q_m,  k_n' = R(n) k_n    ⇒    q_m'·k_n' = q_mᵀ R(n − m) k_n   (depends on n − m)
//! xPos: q_m' ·= ζ_i^(m/γ),  k_n' ·= ζ_i^(−n/γ),  ζ_i = (2i/d + 0.4)/1.4
//! ```
//!
//! # Shapes
//! Queries and keys `(B, H, T, D)` or `(B, T, H, D)` ([`QkLayout`]); cos/sin tables
//! `(N, rotary_dim / 2)`.
//!
//! - [`rope`]: [`RotaryEmbedding`] and [`RopeConfig`].
//! - [`scaling`]: [`RopeScaling`], one function per HF `rope_type`.
//! - [`RopeConfig::from_hf_json`] (in [`crate::hf::rope`]) reads a model's `config.json`.
//! - [`mixed`]: RoPE-Mixed, learned per-head 2-D frequencies ([`RopeMixed`]).
//! - [`mrope`]: multimodal RoPE's frequency bands ([`MropeSection`]) and positions
//!   ([`mrope::mrope_positions`]).

mod inplace;
mod kernels;
pub mod mixed;
pub mod mrope;
pub mod rope;
pub mod scaling;

pub use mixed::{RopeMixed, RopeMixedConfig};
pub use mrope::{AxialRope, MropeSection, MropeSegment};
pub use rope::{QkLayout, RopeConfig, RopeKernel, RopeLayout, RotaryEmbedding};
pub use scaling::{LongRopeScaling, RopeFrequencies, RopeScaling, YarnScaling};
