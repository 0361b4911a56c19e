//! Encodings that bias the logits or add to the values: ALiBi, T5 buckets, clipped bias, Shaw, FoX, KERPLE-style plug-ins.

mod biases;
mod fox;
mod gradients;
mod inkling;
