//! Bad input, non-finite values, integer paths, the size budget, and random use of the public API.

mod api_fuzz;
mod api_properties;
mod bad_input;
mod budget;
mod fallbacks;
mod finite;
mod gguf;
mod integer_ops;
mod memory;
mod non_finite;
mod properties;
mod reliability;
