//! The attention block and its plug: parity with PyTorch, every path, the KV cache, gradients, half precision, threads.

mod block;
mod decode_step;
mod fused_core;
mod gradients;
mod half_precision;
mod linear;
mod one_node;
mod one_pass;
mod plug;
mod separable;
mod threads;
mod traits;
