//! The examples' code under test: the extrapolation experiment, a third-party scheme through the
//! plug, and the whole model from a GGUF file.

mod extrapolation;
mod gguf_llama;
mod third_party;
