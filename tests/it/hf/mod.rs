//! Attention layers read from HF `config.json` files and HF tensor names, against HF transformers' own modules.

mod bidirectional;
mod docs;
mod inkling;
mod layers;
mod registry;
mod shared;
