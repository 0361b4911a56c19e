//! The extrapolation experiment's pieces, shared by `examples/extrapolation.rs`,
//! `examples/attention_demo.rs`, `examples/visualize.rs` and `tests/it/examples/extrapolation.rs`: the
//! synthetic copy task ([`data`]), character-level text ([`text`]), the small language model
//! ([`model`]), training, copy-task evaluation and checkpoints ([`train`]), the text views
//! ([`text_eval`]), and the text experiment's runs, tables and record ([`text_report`]).

pub mod data;
pub mod gelu;
pub mod model;
pub mod rms_norm;
pub mod text;
pub mod text_eval;
pub mod text_report;
pub mod train;
