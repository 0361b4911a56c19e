//! safetensors checkpoints: round trips, HF names, and files that are wrong or hostile.

mod attack;
mod roundtrip;
