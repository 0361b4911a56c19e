//! The sections on length and memory: peak memory of Shaw attention against the direct formula
//! (`memory`), time against length with PyTorch's beside it (`lengths`), and one forward at
//! T = 16384 per encoding with its peak memory (`long`).

use anyhow::{Context, Result};
use candle_core::{Module, Tensor};

use crate::cases::block;
use crate::children::run_child;
use crate::{common, json_line, plot, Bench};

/// `--only memory`: peak memory of a causal forward at T = 2048, B1 H8 D64, k = 64, one child
/// process per case.
pub(crate) fn memory(bench: &Bench) -> Result<()> {
    let t_mem = if bench.quick { 512 } else { 2048 };
    println!(
        "\npeak resident memory, one causal forward, B1 H8 T{t_mem} D64 (child process each):"
    );
    println!(
        "{:<18} {:>14} {:>14} {:>10}",
        "encoding", "before MiB", "peak MiB", "vs none"
    );
    let mut base = None;
    for name in ["none", "shaw_k64", "shaw_direct_k64"] {
        let (before, peak, _) = run_child(name, t_mem, true)?;
        let b0 = *base.get_or_insert(peak);
        println!("{name:<18} {before:>14.0} {peak:>14.0} {:>9.2}x", peak / b0);
        json_line(bench.json, &format!("\"bench\":\"peak_memory\",\"encoding\":\"{name}\",\"t\":{t_mem},\"peak_mib\":{peak:.1},\"ratio\":{:.4}", peak / b0));
    }
    Ok(())
}

/// A line of points (T, seconds) with its legend.
type Series = (String, Vec<(f64, f64)>);

/// `--only lengths`: one block forward without an encoding, B1, T = 1k .. 32k (medians of 3 in
/// this process up to 8k, then one run in a child process each), drawn beside PyTorch's
/// figures with `--pytorch FILE --plot PATH`.
pub(crate) fn lengths(bench: &Bench) -> Result<()> {
    let lengths: &[usize] = if bench.quick {
        &[1024, 2048]
    } else {
        &[1024, 2048, 4096, 8192, 16384, 32768]
    };
    println!("\nblock forward without an encoding, B1 H8 D64, by length:");
    println!("{:<10} {:>8} {:>12}", "T", "causal", "seconds");
    let mut series = Vec::new();
    for causal in [true, false] {
        let points = lengths
            .iter()
            .map(|&t| length_point(bench, t, causal))
            .collect::<Result<_>>()?;
        let mode = if causal { "causal" } else { "bidirectional" };
        series.push((format!("ours, {mode}"), points));
    }
    match (bench.arg_after("--pytorch"), bench.arg_after("--plot")) {
        (Some(file), Some(path)) => plot_lengths(series, lengths, file, path),
        _ => Ok(()),
    }
}

/// One forward without an encoding at length `t`: (T, seconds).
fn length_point(bench: &Bench, t: usize, causal: bool) -> Result<(f64, f64)> {
    let (heads, d_model) = (bench.heads, bench.d_model);
    let dev = &bench.dev;
    let secs = if t <= 8192 {
        let mha = block(&bench.all[0], causal, d_model, heads, &bench.vb)?;
        let x = Tensor::randn(0f32, 1.0, (1, t, d_model), dev)?;
        common::median_ms(3, || {
            let y = mha.forward(&x)?;
            dev.synchronize()?;
            drop(y);
            Ok(())
        })? / 1e3
    } else {
        run_child("none", t, causal)?.2 / 1e3
    };
    println!("{t:<10} {causal:>8} {secs:>12.3}");
    json_line(
        bench.json,
        &format!("\"bench\":\"length\",\"t\":{t},\"causal\":{causal},\"seconds\":{secs:.4}"),
    );
    Ok((t as f64, secs))
}

/// Draws `ours` beside PyTorch's lines read from `file` (`pytorch_baseline.py --lengths
/// --json`) into `path`.
fn plot_lengths(mut series: Vec<Series>, lengths: &[usize], file: &str, path: &str) -> Result<()> {
    let text = std::fs::read_to_string(file)?;
    for causal in [true, false] {
        let mut points = Vec::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let case = v["case"].as_str().unwrap_or_default();
            let flag = if causal { "True" } else { "False" };
            for &t in lengths {
                if case == format!("length T{t} causal={flag}") {
                    let ms = v["median_ms"].as_f64().context("median_ms")?;
                    points.push((t as f64, ms / 1e3));
                }
            }
        }
        let mode = if causal { "causal" } else { "bidirectional" };
        series.push((format!("PyTorch SDPA, {mode}"), points));
    }
    let ticks: Vec<f64> = lengths.iter().map(|&t| t as f64).collect();
    plot::line_chart(
        std::path::Path::new(path),
        (760, 420),
        &plot::Labels {
            title: "one block forward, no bias, B1 H8 D64 (2-core EPYC, f32)",
            x: "sequence length T",
            y: "seconds",
        },
        &series,
        &ticks,
        true,
    )?;
    println!("wrote {path}");
    Ok(())
}

/// `--only long`: one forward at T = 16384 per encoding, in a child process each.
pub(crate) fn long(bench: &Bench) -> Result<()> {
    let t_long = if bench.quick { 2048 } else { 16384 };
    println!(
        "\nlong context, one forward, B1 H8 T{t_long} D64 (child process each; limit 4096 MiB):"
    );
    println!(
        "{:<18} {:>8} {:>14} {:>12}",
        "encoding", "causal", "peak MiB", "seconds"
    );
    for causal in [true, false] {
        for case in bench.all.iter().filter(|c| c.name != "shaw_direct_k64") {
            let (_, peak, ms) = run_child(case.name, t_long, causal)?;
            println!(
                "{:<18} {causal:>8} {peak:>14.0} {:>12.2}",
                case.name,
                ms / 1e3
            );
            json_line(bench.json, &format!("\"bench\":\"long_context\",\"encoding\":\"{}\",\"causal\":{causal},\"t\":{t_long},\"peak_mib\":{peak:.1},\"seconds\":{:.3}", case.name, ms / 1e3));
        }
    }
    Ok(())
}
