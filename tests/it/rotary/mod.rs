//! Rotary encodings: RoPE and its scaled variants, xPos, M-RoPE, axial and mixed RoPE, in place and as tables.

mod rope;
