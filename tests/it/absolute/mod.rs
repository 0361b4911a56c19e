//! Encodings added to the input: sinusoidal, learned (with interpolation), and the embedding layer that adds them.

mod embeddings;
mod learned;
mod sinusoidal;
