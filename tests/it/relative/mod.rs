//! Encodings that bias the logits or add to the values: ALiBi, T5 buckets, clipped bias, Shaw, KERPLE-style plug-ins.

mod biases;
