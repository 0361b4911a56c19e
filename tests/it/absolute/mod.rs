//! Encodings added to the input: sinusoidal, learned (with interpolation), scaled sinusoidal, and the embedding layer that adds them.

mod embeddings;
mod learned;
mod scaled_sinusoidal;
mod sinusoidal;
