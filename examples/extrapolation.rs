//! Train short, test long: one tiny language model per positional encoding, trained at length
//! L = 64 and evaluated at L, 2L, 4L and 8L.
//!
//! ```text
//! cargo run --release --example extrapolation            # every encoding, at most 15 minutes on 2 cores
//! cargo run --release --example extrapolation -- --quick # a smoke run of the pipeline, well under 2 minutes
//! ```
//!
//! The task (see `examples/lm/data.rs`): sequences over 32 tokens where, after the first 12
//! random tokens, each token is with probability 0.7 a copy of the token 12 places back, with
//! probability 0.2 the fixed successor of the previous token, and otherwise uniform noise. Both
//! rules look a fixed distance back, so the next token depends on relative position only; an
//! encoding that sees distances can in principle keep applying them past the training length.
//! Training and held-out sequences come from different seeds; everything is seeded, so the same
//! command prints the same table.
//!
//! The model (`examples/lm/model.rs`): token embedding, 2 pre-norm layers of the crate's causal
//! `MultiHeadAttention` (d 64, 4 heads) and a 2× GELU MLP, and a linear head. Absolute encodings
//! are added to the embeddings once; rotary and bias encodings are plugged into every layer's
//! attention. Each model is trained with candle-nn's AdamW on CPU (batch 16, 400 steps).
//!
//! Rows: none, sinusoidal, learned (its table ends at L, so longer inputs are a typed error and
//! the table says `n/a`), learned+interp (the same weights, the table linearly stretched to the
//! input length at evaluation), rope, rope+yarn (the same weights, YaRN ×8 applied at
//! evaluation), rope+dynamic (the same weights, dynamic NTK with factor 2 at evaluation), alibi,
//! t5 (causal buckets), clipped_bias (k = 32) and shaw (relative keys and values, k = 32); plus the oracle,
//! the generator's own probabilities (the best possible score).
//!
//! Outputs: the markdown table on stdout and between the table markers of
//! `docs/extrapolation.md` (the page's prose is kept), a PNG plot of loss against evaluation
//! length in `docs/img/extrapolation_loss.png`, and one self-describing f16
//! safetensors checkpoint per row in `weights/extrapolation_<row>.safetensors` (what
//! `attention_demo` evaluates). `--quick` writes everything under the system temp folder
//! instead, so it never replaces the committed results; `--out DIR` puts every output in DIR.
//! `--replot` redraws the table and the plot from the scores recorded in the checkpoints,
//! without training; `--only a,b` and `--steps N` run a subset or another length of training.

#[allow(dead_code)]
#[path = "common/plot.rs"]
mod plot;

#[allow(dead_code)]
mod lm;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use candle_nn::VarMap;
use candle_posenc::{Checkpoint, EncodingConfig};
use lm::train::{
    checkpoint_name, evaluate_lengths, markdown_table, train, variants, Score, Settings, Trained,
    EVAL_STREAM,
};

/// Trains and evaluates every variant (or those in `only`), writing their checkpoints.
fn run(s: &Settings, weights: &Path, only: Option<&[String]>) -> Result<Vec<Row>> {
    let lengths = s.eval_lengths();
    let mut rows = Vec::new();
    let mut trained: Vec<(EncodingConfig, VarMap)> = Vec::new();
    for variant in variants(s) {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|l| l == variant.label))
        {
            continue;
        }
        let known = trained.iter().position(|(c, _)| *c == variant.train);
        let index = match known {
            Some(i) => i,
            None => {
                let t0 = Instant::now();
                let (varmap, losses) = train(s, &variant.train)?;
                let n = losses.len().min(20);
                let last = losses[losses.len() - n..].iter().sum::<f32>() / n.max(1) as f32;
                println!(
                    "{:<16} trained in {:.0} s; mean loss of the last {n} steps {last:.3}",
                    variant.label,
                    t0.elapsed().as_secs_f64()
                );
                trained.push((variant.train.clone(), varmap));
                trained.len() - 1
            }
        };
        let mut ckpt = Trained::new(s, &variant, &trained[index].1)?;
        let scores = evaluate_lengths(s, &ckpt.model()?, EVAL_STREAM, s.eval_seqs, variant.label)?;
        ckpt.record(&lengths, &scores);
        let path = weights.join(checkpoint_name(variant.label));
        ckpt.save(&path)?;
        rows.push((variant.label.to_string(), scores));
    }

    Ok(rows)
}

/// The scores recorded in the checkpoints of an earlier run (`--replot`).
fn recorded(s: &Settings, weights: &Path) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for variant in variants(s) {
        let path = weights.join(checkpoint_name(variant.label));
        let ckpt = Checkpoint::load(&path, &Device::Cpu)
            .with_context(|| format!("loading {}", path.display()))?;
        let meta = ckpt.metadata();
        let mut scores = Vec::new();
        for len in s.eval_lengths() {
            let get = |k: &str| {
                meta.get(&format!("lm.eval.{len}.{k}"))
                    .with_context(|| format!("{}: no lm.eval.{len}.{k}", path.display()))
            };
            scores.push(match (get("loss")?.parse(), get("accuracy")?.parse()) {
                (Ok(loss), Ok(accuracy)) => Some(Score { loss, accuracy }),
                _ => None,
            });
        }
        rows.push((variant.label.to_string(), scores));
    }
    Ok(rows)
}

type Row = (String, Vec<Option<Score>>);

/// Marks where the table starts in `docs/extrapolation.md` (the page's prose is kept).
const TABLE_START: &str =
    "<!-- table: written by `cargo run --release --example extrapolation` -->\n";
/// Marks where the table ends.
const TABLE_END: &str = "<!-- end of table -->";

/// Writes `table` into the page at `md`: between the table markers where the page has them, or
/// as the whole file where there is no page yet or it holds only an earlier run's table.
fn write_table(md: &Path, table: &str) -> Result<()> {
    let text = match std::fs::read_to_string(md) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => table.to_string(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", md.display())),
        Ok(page) if page.starts_with('|') => table.to_string(),
        Ok(page) => match (page.find(TABLE_START), page.find(TABLE_END)) {
            (Some(start), Some(end)) if start < end => {
                format!("{}{TABLE_START}{table}{}", &page[..start], &page[end..])
            }
            _ => anyhow::bail!(
                "{} has prose but no `{}` ... `{TABLE_END}` markers around its table",
                md.display(),
                TABLE_START.trim_end()
            ),
        },
    };
    std::fs::write(md, text).with_context(|| format!("writing {}", md.display()))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = match args.iter().position(|a| a == "--out") {
        Some(i) => Some(PathBuf::from(
            args.get(i + 1).context("--out needs a folder")?,
        )),
        None if quick => Some(std::env::temp_dir().join("candle-posenc-extrapolation-quick")),
        None => None,
    };
    let (weights, docs, img) = match &out {
        Some(dir) => (dir.clone(), dir.clone(), dir.clone()),
        None => (
            root.join("weights"),
            root.join("docs"),
            root.join("docs/img"),
        ),
    };
    for dir in [&weights, &docs, &img] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut s = if quick {
        Settings::quick()
    } else {
        Settings::standard()
    };
    if let Some(i) = args.iter().position(|a| a == "--steps") {
        s.steps = args.get(i + 1).context("--steps needs a number")?.parse()?;
    }
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|list| list.split(',').map(str::to_string).collect::<Vec<_>>());
    let lengths = s.eval_lengths();
    let started = Instant::now();

    let held_out = |len: usize| s.task.sequences(EVAL_STREAM, 0, s.eval_seqs, len + 1);
    let oracle: Vec<Option<Score>> = lengths
        .iter()
        .map(|&len| {
            let (loss, accuracy) = s.task.oracle(&held_out(len));
            Some(Score { loss, accuracy })
        })
        .collect();
    let mut rows = vec![("oracle".to_string(), oracle)];

    let replot = args.iter().any(|a| a == "--replot");
    if replot {
        rows.extend(recorded(&s, &weights)?);
    } else {
        rows.extend(run(&s, &weights, only.as_deref())?);
    }

    let table = markdown_table(&lengths, s.train_len, &rows);
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    println!(
        "\nHeld-out loss (nats per scored token) / next-token accuracy, trained at L = {}:\n",
        s.train_len
    );
    println!("{table}");
    match (replot, quick) {
        (true, _) => println!("(recorded in the checkpoints in {})", weights.display()),
        (false, true) => println!("(quick run, {minutes:.1} minutes)"),
        (false, false) => println!("(default run, {minutes:.1} minutes)"),
    }
    let md = docs.join("extrapolation.md");
    write_table(&md, &table)?;

    let series: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .map(|(label, scores)| {
            let pts = lengths
                .iter()
                .zip(scores)
                .filter_map(|(&len, s)| s.map(|s| (len as f64, s.loss)))
                .collect();
            (label.clone(), pts)
        })
        .collect();
    let png = img.join("extrapolation_loss.png");
    plot::line_chart(
        &png,
        (760, 440),
        &plot::Labels {
            title: &format!(
                "held-out loss vs evaluation length (trained at L = {})",
                s.train_len
            ),
            x: "evaluation length (tokens, log scale)",
            y: "loss (nats)",
        },
        &series,
        &lengths.iter().map(|&l| l as f64).collect::<Vec<_>>(),
        true,
    )?;
    println!("wrote {} and {}", md.display(), png.display());
    Ok(())
}
