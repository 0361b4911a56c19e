//! The extrapolation experiment's pieces, shared by `examples/extrapolation.rs`,
//! `examples/attention_demo.rs`, `examples/visualize.rs` and `tests/extrapolation.rs`: the
//! synthetic task ([`data`]), the tiny language model ([`model`]), and training, evaluation and
//! checkpoints ([`train`]).

pub mod data;
pub mod model;
pub mod text;
pub mod text_eval;
pub mod text_report;
pub mod train;
