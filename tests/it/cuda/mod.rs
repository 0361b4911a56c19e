//! The crate's own CUDA kernels (only with the `cuda` feature, on a GPU).

mod kernel;
