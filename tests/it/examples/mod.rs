//! The examples' code under test: the extrapolation experiment and a third-party scheme through the plug.

mod extrapolation;
mod third_party;
