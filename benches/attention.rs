//! Attention block cost of each positional encoding, against the same block with no encoding
//! measured in the same run (ratio of the medians, and median of the per-pair ratios), and
//! alone in a fresh process as a user's process runs it (on the CPU; the figure to publish),
//! and the
//! block with no encoding against the same attention written as plain candle ops (matmul,
//! softmax_last_dim, matmul); the block in bf16 and f16 against f32; query block sizes; one decoding step
//! against caches of growing length; peak memory of Shaw attention against the direct formula;
//! long-context (T = 16384) forwards per encoding, with their peak memory; and training steps
//! (forward + backward) on the fused training core against candle's ops, with the peak memory
//! of a step at T = 8192.
//!
//! ```text
//! cargo bench --bench attention              # table of medians and ratios
//! cargo bench --bench attention -- --json    # one JSON object per line as well
//! cargo bench --bench attention -- --quick   # fewer, smaller runs (a smoke test)
//! cargo bench --bench attention -- --only decode   # one section: encodings, half, blocks,
//!                                                  # decode, memory, training, long, lengths,
//!                                                  # small (a small model's layer) or streaming
//! cargo bench --bench attention -- --only lengths --pytorch pytorch.jsonl --plot docs/img/lengths.png
//!     # forwards from T = 1k to 32k, drawn beside `pytorch_baseline.py --lengths --json`'s
//! cargo bench --features cuda --bench attention -- --only cuda [--max-t 4096]
//!     # on GPU 0: the fused CUDA kernels against candle's ops (bf16), inference and
//!     # training steps, beside `pytorch_baseline.py --device cuda`; then a training step
//!     # at T = 16384 and 65536 (B1) with the device memory it took
//! ```
//!
//! Run it on a quiet machine: a build or test beside it skews the figures by 2x or more.
//! Peak memory is read from `VmHWM` in `/proc/self/status` of a child process per case (Linux).
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

#[path = "sections/cases.rs"]
mod cases;
#[path = "sections/children.rs"]
mod children;
mod common;
#[cfg(feature = "cuda")]
#[path = "sections/cuda.rs"]
mod cuda;
#[path = "sections/decode.rs"]
mod decode;
#[path = "sections/inference.rs"]
mod inference;
#[path = "sections/length.rs"]
mod length;
#[path = "../examples/common/plot.rs"]
#[allow(dead_code)] // the benchmark draws one kind of chart
mod plot;
#[path = "sections/small_layer.rs"]
mod small_layer;
#[path = "sections/training.rs"]
mod training;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;

use cases::{cases, Case};

/// What every section reads: the command line's choices, and the block's shape, weights, input
/// and encodings (B2 H8 D64, T 1024, or 256 with `--quick`).
pub(crate) struct Bench {
    pub(crate) args: Vec<String>,
    pub(crate) json: bool,
    pub(crate) quick: bool,
    /// `--only`'s section.
    pub(crate) only: Option<String>,
    pub(crate) dev: Device,
    pub(crate) b: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) d_model: usize,
    pub(crate) t: usize,
    /// Runs per median.
    pub(crate) runs: usize,
    /// The blocks' weights, as a loaded checkpoint gives them.
    pub(crate) vb: VarBuilder<'static>,
    /// `(B, T, d_model)`.
    pub(crate) x: Tensor,
    /// Every encoding, with tables long enough for the decoding section.
    pub(crate) all: Vec<Case>,
}

impl Bench {
    fn new(args: Vec<String>) -> Result<Self> {
        let json = args.iter().any(|a| a == "--json");
        let quick = args.iter().any(|a| a == "--quick");
        let only = args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .cloned();
        let dev = common::device()?;
        let (b, heads, head_dim) = (2, 8, 64);
        let d_model = heads * head_dim;
        let t = if quick { 256 } else { 1024 };
        let vb = common::inference_vb(&dev);
        let x = Tensor::randn(0f32, 1.0, (b, t, d_model), &dev)?;
        let all = cases(d_model, heads, head_dim, 16385, &dev, &vb)?;
        Ok(Self {
            args,
            json,
            quick,
            only,
            dev,
            b,
            heads,
            head_dim,
            d_model,
            t,
            runs: if quick { 3 } else { 25 },
            vb,
            x,
            all,
        })
    }

    /// The block's shape and the run settings most sections read: `(B, H, d_model, T, runs per
    /// median, --json)`.
    pub(crate) fn settings(&self) -> (usize, usize, usize, usize, usize, bool) {
        (
            self.b,
            self.heads,
            self.d_model,
            self.t,
            self.runs,
            self.json,
        )
    }

    /// The value after `flag` on the command line.
    pub(crate) fn arg_after(&self, flag: &str) -> Option<&String> {
        let i = self.args.iter().position(|a| a == flag)?;
        self.args.get(i + 1)
    }

    /// Whether `section` runs: every section without `--only`, else the one it names. Sections
    /// marked `named` run only when `--only` names them.
    fn runs_section(&self, section: &Section) -> bool {
        match &self.only {
            Some(only) => only == section.name,
            None => !section.named,
        }
    }
}

/// A section of the bench: its `--only` name, whether it runs only when named, and its body.
struct Section {
    name: &'static str,
    named: bool,
    run: fn(&Bench) -> Result<()>,
}

/// The sections in the order they run.
const SECTIONS: &[Section] = &[
    Section {
        name: "encodings",
        named: false,
        run: inference::encodings,
    },
    Section {
        name: "half",
        named: false,
        run: inference::half,
    },
    Section {
        name: "blocks",
        named: false,
        run: inference::query_blocks,
    },
    Section {
        name: "decode",
        named: false,
        run: decode::steps,
    },
    Section {
        name: "decode",
        named: false,
        run: decode::half_steps,
    },
    Section {
        name: "memory",
        named: false,
        run: length::memory,
    },
    Section {
        name: "training",
        named: false,
        run: training::steps,
    },
    Section {
        name: "training",
        named: false,
        run: training::memory,
    },
    #[cfg(feature = "cuda")]
    Section {
        name: "cuda",
        named: true,
        run: cuda::section,
    },
    Section {
        name: "small",
        named: false,
        run: |b| small_layer::run(b.json, b.runs),
    },
    Section {
        name: "streaming",
        named: true,
        run: decode::streaming_steps,
    },
    Section {
        name: "lengths",
        named: true,
        run: length::lengths,
    },
    Section {
        name: "long",
        named: false,
        run: length::long,
    },
];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(child) = children::run_mode(&args) {
        return child;
    }
    let bench = Bench::new(args)?;
    for section in SECTIONS.iter().filter(|s| bench.runs_section(s)) {
        (section.run)(&bench)?;
    }
    Ok(())
}

/// `fields` as one JSON object on its own line, with `--json`.
pub(crate) fn json_line(json: bool, fields: &str) {
    if json {
        println!("{{{fields}}}");
    }
}
