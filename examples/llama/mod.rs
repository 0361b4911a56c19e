//! A whole Llama-architecture model from a GGUF file, run through the crate's attention:
//! the model ([`model`]), its tokenizer from the file's own vocabulary and merges
//! ([`tokenizer`]), SmolLM2's chat template ([`chat`]), and the choice of each next token
//! ([`sample`]). Shared by `examples/generate.rs`, `benches/generate.rs` and
//! `tests/it/examples/gguf_llama.rs`.
//!
//! The library's part is the file itself (`candle_posenc::hf::gguf`: the `config.json` from
//! the metadata, HF's tensor names, the rows of q and k) and each layer's attention
//! (`HfAttentionConfig::load_shared`); what is here is what every Llama has around its
//! attention, and is the user's to write.

pub mod chat;
pub mod model;
pub mod sample;
pub mod tokenizer;
