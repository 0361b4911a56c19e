//! Pictures of the encodings, written as small PNGs to a folder (default `docs/img`).
//!
//! ```text
//! cargo run --release --example visualize            # writes docs/img/*.png
//! cargo run --release --example visualize -- OUT_DIR
//! ```
//!
//! - `sinusoidal_table.png`: the sinusoidal table, 128 positions (rows) × 64 dimensions.
//! - `sinusoidal_similarity.png`: dot products `p_i · p_j` of those 128 rows.
//! - `rope_distance.png`: RoPE's `q · k` for `q = k = (1, …, 1)` as a function of the distance
//!   between their positions (head_dim 64, base 10 000, and with base 500).
//! - `alibi_bias.png`: ALiBi's bias `−m_h · distance` for each of 8 heads.
//! - `t5_buckets.png`: the bucket T5 gives each (query, key) pair of 96 positions,
//!   bidirectional, 32 buckets, max distance 128.
//! - `learned_table.png`: the learned table (64 positions × 64 dimensions) of the extrapolation
//!   experiment's trained `learned` model, read from `weights/extrapolation_learned.safetensors`.
//!
//! Every tensor comes from the crate's own modules (the sinusoidal and learned encodings added to
//! zeros, the rotary embedding applied to ones, ALiBi's and T5's bias builders).
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

#[allow(dead_code)]
#[path = "common/plot.rs"]
mod plot;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_posenc::{
    Alibi, AlibiConfig, AlibiMode, AttentionContext, Checkpoint, Positions, QkLayout, RopeConfig,
    RotaryEmbedding, SinusoidalConfig, SinusoidalPositionalEncoding, T5Config,
};
use plot::{heatmap, line_chart, Labels};

fn rows(t: &Tensor) -> Result<Vec<Vec<f64>>> {
    Ok(t.to_dtype(DType::F64)?.to_vec2::<f64>()?)
}

fn sinusoidal(out: &Path, dev: &Device) -> Result<()> {
    let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(64), dev)?;
    let zeros = Tensor::zeros((1, 128, 64), DType::F32, dev)?;
    let table = pe
        .forward_with_positions(&zeros, &Positions::Offset(0), false)?
        .i(0)?;
    let labels = Labels {
        title: "sinusoidal table, d = 64",
        x: "dimension 0..63 ->",
        y: "position 0..127",
    };
    heatmap(
        &out.join("sinusoidal_table.png"),
        &labels,
        &rows(&table)?,
        3,
    )?;
    let sim = table.matmul(&table.t()?)?;
    let labels = Labels {
        title: "p_i . p_j (sinusoidal)",
        x: "position j 0..127 ->",
        y: "position i",
    };
    heatmap(
        &out.join("sinusoidal_similarity.png"),
        &labels,
        &rows(&sim)?,
        3,
    )
}

fn rope(out: &Path, dev: &Device) -> Result<()> {
    let n = 512;
    let mut series = Vec::new();
    for base in [10_000.0, 500.0] {
        let rope = RotaryEmbedding::new(&RopeConfig::new(64).with_base(base), dev)?;
        let q = Tensor::ones((1, 1, n, 64), DType::F32, dev)?;
        let k = Tensor::ones((1, 1, 1, 64), DType::F32, dev)?;
        let at0 = Positions::Offset(0);
        let (q, k) = rope.rotate_queries_keys(&q, &k, &at0, &at0, QkLayout::Bhtd)?;
        // q at position m against k at position 0: the score at distance m.
        let dots = q.matmul(&k.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let pts = dots
            .iter()
            .enumerate()
            .map(|(m, &v)| (m as f64, f64::from(v)))
            .collect();
        series.push((format!("base {base}"), pts));
    }
    let labels = Labels {
        title: "RoPE: q . k for q = k = ones, head_dim 64",
        x: "distance between query and key positions",
        y: "q . k",
    };
    let ticks: Vec<f64> = (0..=8).map(|i| f64::from(i) * 64.0).collect();
    line_chart(
        &out.join("rope_distance.png"),
        (720, 360),
        &labels,
        &series,
        &ticks,
        false,
    )
}

fn alibi(out: &Path, dev: &Device) -> Result<()> {
    let heads = 8;
    let cfg = AlibiConfig::new(heads).with_mode(AlibiMode::CausalPairwise);
    let n = 64;
    let at0 = Positions::Offset(0);
    let bias = Alibi::new(&cfg, dev)?.bias(&AttentionContext::new(&at0, n, &at0, n))?;
    let mut series = Vec::new();
    for h in 0..heads {
        // The last query's row, read from the key n-1 (distance 0) back to key 0.
        let row = bias.i((0, h, n - 1))?.to_vec1::<f32>()?;
        let pts = (0..n)
            .map(|d| (d as f64, f64::from(row[n - 1 - d])))
            .collect();
        series.push((format!("head {}", h + 1), pts));
    }
    let labels = Labels {
        title: "ALiBi bias per head (8 heads)",
        x: "distance from query to key",
        y: "bias",
    };
    let ticks: Vec<f64> = (0..=8).map(|i| f64::from(i) * 8.0).collect();
    line_chart(
        &out.join("alibi_bias.png"),
        (720, 360),
        &labels,
        &series,
        &ticks,
        false,
    )
}

fn t5(out: &Path) -> Result<()> {
    let cfg = T5Config::new(1);
    let n = 96i64;
    let map = (0..n)
        .map(|i| (0..n).map(|j| f64::from(cfg.bucket(j - i))).collect())
        .collect::<Vec<Vec<f64>>>();
    let labels = Labels {
        title: "T5 bucket of (query i, key j)",
        x: "key j 0..95 ->",
        y: "query i",
    };
    heatmap(&out.join("t5_buckets.png"), &labels, &map, 3)
}

fn learned(out: &Path, dev: &Device) -> Result<()> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("weights/extrapolation_learned.safetensors");
    let ckpt =
        Checkpoint::load(&path, dev).with_context(|| format!("loading {}", path.display()))?;
    let table = ckpt
        .tensors()
        .get("pos.weight")
        .context("the checkpoint has no learned table `pos.weight`")?;
    let labels = Labels {
        title: "learned table after training",
        x: "dimension 0..63 ->",
        y: "position 0..63",
    };
    heatmap(&out.join("learned_table.png"), &labels, &rows(table)?, 4)
}

fn main() -> Result<()> {
    let out = match std::env::args().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/img"),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let dev = Device::Cpu;
    sinusoidal(&out, &dev)?;
    rope(&out, &dev)?;
    alibi(&out, &dev)?;
    t5(&out)?;
    learned(&out, &dev)?;
    println!("wrote six pictures to {}", out.display());
    Ok(())
}
