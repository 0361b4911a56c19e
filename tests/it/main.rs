//! The integration tests: one crate, so one build, one link and one process whose tests run
//! side by side, with a module per component of the library. `cargo test --test it <module>`
//! runs one component (e.g. `rotary`, `hf::layers`, `robustness::budget`); see
//! `docs/testing.md` for the layout and what each CI step costs.
//!
//! Tests that change something process-wide do it for their own thread only
//! (`limits::BudgetScope`, `cuda::FusedKernelScope`); the one test that must be alone in its
//! process (`attention::decode_step`, which counts every thread's allocations) runs itself in a
//! child process of this binary.

#[macro_use]
mod common;

mod absolute;
mod attention;
mod checkpoint;
mod cuda;
mod examples;
mod hf;
mod relative;
mod robustness;
mod rotary;
mod structure;
mod vision;
