//! Train short, test long: one small language model per positional encoding, trained at length
//! L = 64 and evaluated on longer inputs, after Press et al. (2022).
//!
//! ```text
//! bash scripts/fetch_shakespeare.sh                       # once: the corpus, into data/shakespeare/
//! cargo run --release --example extrapolation             # every encoding, three seeds, ≤ 15 minutes on 2 cores
//! cargo run --release --example extrapolation -- --quick  # a smoke run of the pipeline, ≤ 2 minutes
//! cargo run --release --example extrapolation -- --task copy   # the synthetic copy task instead
//! ```
//!
//! **Text** (the default): character-level language models of Shakespeare's plays
//! (`examples/lm/text.rs`; whole plays held out), d 64, 4 heads, 2 layers
//! (`examples/lm/model.rs`), trained with candle-nn's AdamW at L = 64 with the same number of
//! characters for every encoding, one model per encoding and seed. Each is scored on the
//! held-out plays at 1, 2, 4, 8 and 16 L three ways (`examples/lm/text_eval.rs`):
//! non-overlapping windows, loss per position bucket, and sliding windows with stride L/2.
//! `--corpus PATH` reads any UTF-8 text instead (a folder of documents or one file).
//!
//! **Copy** (`--task copy`): the synthetic task of `examples/lm/data.rs`, where the next token
//! is a copy of the one 12 back or a fixed successor of the previous one: it rewards exact
//! offsets, the kind of task where Kazemnejad et al. (2023) found their ordering.
//!
//! Rows: none, sinusoidal, learned (its table ends at L, so longer inputs are a typed error and
//! the table says `n/a`), learned+interp (the same weights, the table linearly stretched to the
//! input length at evaluation), rope, rope+yarn (the same weights, YaRN applied at evaluation
//! with the factor of the longest length), rope+dynamic (the same weights, dynamic NTK with
//! factor 2 at evaluation), alibi, t5 (causal buckets), clipped_bias (k = 32), shaw (relative
//! keys and values, k = 32), fox (FoX's causal forget gates) and inkling (Inkling's relative
//! logits, a bank of L distances); the text task adds rope+sinks (RoPE with learned per-head
//! sink logits in every attention layer, as gpt-oss has).
//!
//! Outputs of the text run: the tables between the text markers of `docs/extrapolation.md`
//! (the page's prose is kept), every number with the run's settings in
//! `docs/extrapolation.json`, PNG plots in `docs/img/` (loss against evaluation length with the
//! seeds' spread; loss per position bucket), and one self-describing f16 checkpoint per trained
//! encoding (the first seed's) in `weights/extrapolation_<row>.safetensors`, which
//! `attention_demo` scores. The copy run writes its table between the copy markers and its
//! checkpoints to `target/extrapolation-copy/`. `--quick` writes everything under the system
//! temp folder instead, so it never replaces the committed results; `--out DIR` puts every
//! output in DIR. `--only a,b`, `--steps N` and `--seeds 1,2` run a subset, another length of
//! training or other seeds; `--replot` (copy task) redraws from the checkpoints.
//!
//! The text run's models train side by side, one per core (`--jobs N` to choose), each on one
//! thread (`RAYON_NUM_THREADS=1` unless set): the model is small enough that one run cannot use
//! a second core, and candle's thread pools would spin on it.
//!
//! Every weight is initialised from a seeded generator and every batch drawn from a seeded
//! stream: the same command gives the same numbers, bit for bit, on the same machine, whatever
//! `--jobs` (the runs share nothing).

#[allow(dead_code)]
#[path = "common/plot.rs"]
mod plot;

#[allow(dead_code)]
mod lm;

#[path = "common/malloc.rs"]
mod malloc;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use candle_nn::VarMap;
use candle_posenc::{Checkpoint, EncodingConfig};
use lm::text::Corpus;
use lm::text_report::{run_seed, spread, table, Record, RowRuns, TextSettings, View};
use lm::train::{
    checkpoint_name, evaluate_lengths, markdown_table, text_variants, train, variants, Score,
    Settings, Trained, Variant, EVAL_STREAM,
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

/// Marks where the copy task's table starts in `docs/extrapolation.md`.
const COPY_START: &str =
    "<!-- copy table: written by `cargo run --release --example extrapolation -- --task copy` -->\n";
/// Marks where the copy task's table ends.
const COPY_END: &str = "<!-- end of copy table -->";
/// Marks where the text tables start.
const TEXT_START: &str =
    "<!-- text tables: written by `cargo run --release --example extrapolation` -->\n";
/// Marks where the text tables end.
const TEXT_END: &str = "<!-- end of text tables -->";

/// Writes `block` into the page at `md` between `start` and `end`, or as the whole file where
/// there is no page yet.
fn write_between(md: &Path, start: &str, end: &str, block: &str) -> Result<()> {
    let text = match std::fs::read_to_string(md) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!("{start}{block}{end}\n"),
        Err(e) => return Err(e).with_context(|| format!("reading {}", md.display())),
        Ok(page) => match (page.find(start), page.find(end)) {
            (Some(a), Some(z)) if a < z => format!("{}{start}{block}{}", &page[..a], &page[z..]),
            _ => format!("{page}\n{start}{block}{end}\n"),
        },
    };
    std::fs::write(md, text).with_context(|| format!("writing {}", md.display()))
}

/// Command-line options shared by both tasks.
struct Options {
    args: Vec<String>,
    quick: bool,
    root: PathBuf,
}

impl Options {
    fn flag(&self, name: &str) -> bool {
        self.args.iter().any(|a| a == name)
    }

    fn value(&self, name: &str) -> Result<Option<&String>> {
        match self.args.iter().position(|a| a == name) {
            Some(i) => Ok(Some(
                self.args
                    .get(i + 1)
                    .with_context(|| format!("{name} needs a value"))?,
            )),
            None => Ok(None),
        }
    }

    fn list(&self, name: &str) -> Result<Option<Vec<String>>> {
        Ok(self
            .value(name)?
            .map(|v| v.split(',').map(str::to_string).collect()))
    }

    /// Folders for checkpoints, pages and pictures.
    fn folders(&self, default_weights: PathBuf, temp: &str) -> Result<(PathBuf, PathBuf, PathBuf)> {
        let out = match self.value("--out")? {
            Some(dir) => Some(PathBuf::from(dir)),
            None if self.quick => Some(std::env::temp_dir().join(temp)),
            None => None,
        };
        let dirs = match out {
            Some(dir) => (dir.clone(), dir.clone(), dir),
            None => (
                default_weights,
                self.root.join("docs"),
                self.root.join("docs/img"),
            ),
        };
        for dir in [&dirs.0, &dirs.1, &dirs.2] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(dirs)
    }
}

fn main() -> Result<()> {
    malloc::keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = Options {
        quick: args.iter().any(|a| a == "--quick"),
        args,
        root: PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    };
    match o.value("--task")?.map(String::as_str) {
        None | Some("text") => {
            // One thread per run (the runs themselves run side by side, see `text_main`):
            // candle's and rayon's pools would otherwise spin on the cores the other runs
            // need. Set before any thread exists; a value the user set is kept.
            if std::env::var_os("RAYON_NUM_THREADS").is_none() {
                std::env::set_var("RAYON_NUM_THREADS", "1");
            }
            text_main(&o)
        }
        Some("copy") => copy_main(&o),
        Some(other) => anyhow::bail!("--task {other}: expected `text` or `copy`"),
    }
}

/// The text experiment: the corpus, the settings, the runs, then the tables, JSON and plots.
fn text_main(o: &Options) -> Result<()> {
    let corpus = text_corpus(o)?;
    let (weights, docs, img) =
        o.folders(o.root.join("weights"), "candle-posenc-extrapolation-quick")?;
    let s = text_settings(o, &corpus)?;
    let only = o.list("--only")?;
    println!(
        "corpus: {} ({} training and {} held-out characters, {} symbols; held out: {})",
        corpus.source,
        corpus.train.len(),
        corpus.held_out.len(),
        corpus.vocab(),
        corpus.held_out_names.join(", ")
    );
    let started = Instant::now();
    let rows = text_runs(o, &s, &corpus, only.as_deref(), &weights)?;
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    text_outputs(o, &s, &corpus, &rows, minutes, (&docs, &img))
}

/// The corpus `--corpus` names, else the fetched Shakespeare (or, for `--quick` without it, a
/// generated text).
fn text_corpus(o: &Options) -> Result<Corpus> {
    let default_corpus = o.root.join("data/shakespeare");
    Ok(match o.value("--corpus")? {
        Some(path) => Corpus::load(Path::new(path))?,
        None if default_corpus.is_dir() => Corpus::load(&default_corpus)?,
        None if o.quick => {
            println!(
                "(no corpus in {}: a generated text instead)",
                default_corpus.display()
            );
            Corpus::generated(7, 12, 40_000)?
        }
        None => anyhow::bail!(
            "no corpus in {}: run `bash scripts/fetch_shakespeare.sh` once, or pass --corpus PATH",
            default_corpus.display()
        ),
    })
}

/// The text settings: the standard or quick ones, with the command line's changes.
fn text_settings(o: &Options, corpus: &Corpus) -> Result<TextSettings> {
    let mut s = if o.quick {
        TextSettings::quick(corpus.vocab())
    } else {
        TextSettings::standard(corpus.vocab())
    };
    if let Some(steps) = o.value("--steps")? {
        s.train.steps = steps.parse()?;
    }
    for (flag, field) in [
        ("--d-model", &mut s.train.model.d_model),
        ("--layers", &mut s.train.model.num_layers),
        ("--mlp", &mut s.train.model.mlp),
        ("--batch", &mut s.train.batch),
        ("--warmup", &mut s.train.warmup),
    ] {
        if let Some(v) = o.value(flag)? {
            *field = v.parse()?;
        }
    }
    if let Some(lr) = o.value("--lr")? {
        s.train.lr = lr.parse()?;
    }
    if let Some(seeds) = o.list("--seeds")? {
        s.seeds = seeds.iter().map(|x| x.parse()).collect::<Result<_, _>>()?;
    }
    Ok(s)
}

/// Every run of the experiment (seed × trained model), side by side over `--jobs` threads,
/// as rows of the variants in their order with their runs in seed order; seed 1's models saved
/// in `weights`.
fn text_runs(
    o: &Options,
    s: &TextSettings,
    corpus: &Corpus,
    only: Option<&[String]>,
    weights: &Path,
) -> Result<Vec<RowRuns>> {
    let started = Instant::now();
    let first_seed = s.seeds.first().copied();
    // The runs are independent: one job per seed and trained model (the variants that share a
    // trained model stay together), shared out over `--jobs` threads (default: one per core),
    // each run single-threaded (see `main`). The model is small enough that one run leaves a
    // second core idle; two runs side by side use both.
    let variants = text_variants(&s.train);
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut keys = Vec::new();
    for v in &variants {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|l| l == v.label))
        {
            continue;
        }
        let key = (v.train.clone(), v.sinks);
        match keys.iter().position(|k| *k == key) {
            Some(i) => groups[i].push(v.label.to_string()),
            None => {
                keys.push(key);
                groups.push(vec![v.label.to_string()]);
            }
        }
    }
    let jobs: Vec<(u64, &[String])> = s
        .seeds
        .iter()
        .flat_map(|&seed| groups.iter().map(move |g| (seed, g.as_slice())))
        .collect();
    let workers = match o.value("--jobs")? {
        Some(n) => n.parse::<usize>()?.max(1),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|scope| -> Result<()> {
        let handles: Vec<_> = (0..workers.min(jobs.len()))
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(seed, group)) = jobs.get(i) else {
                            return Ok(());
                        };
                        let save = |variant: &Variant, ckpt: Trained| -> Result<()> {
                            if Some(seed) == first_seed {
                                ckpt.save(&weights.join(checkpoint_name(variant.label)))?;
                            }
                            Ok(())
                        };
                        let runs = run_seed(s, corpus, seed, Some(group), save)?;
                        println!(
                            "{} seed {seed} done after {:.1} minutes",
                            group.join(", "),
                            started.elapsed().as_secs_f64() / 60.0
                        );
                        results
                            .lock()
                            .map_err(|_| anyhow::anyhow!("a run panicked"))?[i] = Some(runs);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a run panicked"))??;
        }
        Ok(())
    })?;
    // Rows in the variants' order, runs in seed order, as one run after another gives them.
    let mut rows: Vec<RowRuns> = Vec::new();
    let results = results
        .into_inner()
        .map_err(|_| anyhow::anyhow!("a run panicked"))?;
    for runs in results.into_iter().flatten() {
        for (label, run) in runs {
            match rows.iter_mut().find(|r| r.label == label) {
                Some(row) => row.runs.push(run),
                None => {
                    let trained_with = variants
                        .iter()
                        .find(|v| v.label == label)
                        .map_or_else(String::new, |v| v.train.kind().to_string());
                    rows.push(RowRuns {
                        label,
                        trained_with,
                        runs: vec![run],
                    });
                }
            }
        }
    }
    rows.sort_by_key(|r| variants.iter().position(|v| v.label == r.label));
    Ok(rows)
}

/// The tables (printed, and written between the markers of docs/extrapolation.md), the JSON
/// record and the two plots.
fn text_outputs(
    o: &Options,
    s: &TextSettings,
    corpus: &Corpus,
    rows: &[RowRuns],
    minutes: f64,
    (docs, img): (&Path, &Path),
) -> Result<()> {
    let e = &s.eval;
    let block = format!(
        "Non-overlapping windows: held-out loss (nats per character), mean ± standard deviation over \
         {} seeds, at each evaluation length:\n\n{}\nLoss per position bucket of the {}-character \
         windows (positions past L were never trained on):\n\n{}\nSliding windows advancing by \
         L/2 = {}, each scoring its last L/2 predictions (the control):\n\n{}\n",
        s.seeds.len(),
        table(View::Windows, e, rows),
        e.lengths().into_iter().max().unwrap_or(0),
        table(View::Buckets, e, rows),
        e.stride(),
        table(View::Sliding, e, rows),
    );
    println!("\n{block}");
    println!(
        "({} run, {minutes:.1} minutes)",
        if o.quick { "quick" } else { "default" }
    );
    let md = docs.join("extrapolation.md");
    write_between(&md, TEXT_START, TEXT_END, &block)?;
    let json = docs.join("extrapolation.json");
    Record::new(s, corpus, rows, minutes).write(&json)?;

    // Loss against evaluation length: the seeds' mean with their range.
    let lengths = e.lengths();
    let mut series = Vec::new();
    let mut bars = Vec::new();
    for row in rows {
        let (mut pts, mut bar) = (Vec::new(), Vec::new());
        for (i, &n) in lengths.iter().enumerate() {
            let values: Vec<Option<f64>> = row.runs.iter().map(|r| r.scores.windows[i]).collect();
            if let Some(sp) = spread(&values) {
                pts.push((n as f64, sp.mean));
                bar.push((sp.min, sp.max));
            }
        }
        series.push((row.label.clone(), pts));
        bars.push(bar);
    }
    let loss_png = img.join("extrapolation_loss.png");
    plot::line_chart_with_bars(
        &loss_png,
        (760, 440),
        &plot::Labels {
            title: &format!(
                "held-out loss vs evaluation length (trained at L = {}; bars: range over {} seeds)",
                e.train_len,
                s.seeds.len()
            ),
            x: "evaluation length (characters, log scale)",
            y: "loss (nats per character)",
        },
        &series,
        &bars,
        &lengths.iter().map(|&l| l as f64).collect::<Vec<_>>(),
        true,
    )?;
    // Loss per L-wide position bucket of the longest windows, mean over seeds.
    let buckets: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .map(|row| {
            let n = row.runs.first().map_or(0, |r| r.scores.buckets.len());
            let pts = (0..n)
                .filter_map(|b| {
                    let values: Vec<Option<f64>> =
                        row.runs.iter().map(|r| r.scores.buckets[b]).collect();
                    spread(&values).map(|sp| ((b + 1) as f64, sp.mean))
                })
                .collect();
            (row.label.clone(), pts)
        })
        .collect();
    let bucket_png = img.join("extrapolation_buckets.png");
    let longest = lengths.iter().max().copied().unwrap_or(e.train_len) / e.train_len;
    plot::line_chart(
        &bucket_png,
        (760, 440),
        &plot::Labels {
            title: &format!(
                "loss per position in {}-character windows (bucket k covers positions [(k-1)L, kL))",
                longest * e.train_len
            ),
            x: "position bucket k (units of L)",
            y: "loss (nats per character)",
        },
        &buckets,
        &(1..=longest).map(|k| k as f64).collect::<Vec<_>>(),
        false,
    )?;
    println!(
        "wrote {}, {}, {} and {}",
        md.display(),
        json.display(),
        loss_png.display(),
        bucket_png.display()
    );
    Ok(())
}

/// The synthetic copy task.
fn copy_main(o: &Options) -> Result<()> {
    let (weights, docs, img) = o.folders(
        o.root.join("target/extrapolation-copy"),
        "candle-posenc-extrapolation-copy-quick",
    )?;
    let mut s = if o.quick {
        Settings::quick()
    } else {
        Settings::standard()
    };
    if let Some(steps) = o.value("--steps")? {
        s.steps = steps.parse()?;
    }
    let only = o.list("--only")?;
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

    let replot = o.flag("--replot");
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
    match (replot, o.quick) {
        (true, _) => println!("(recorded in the checkpoints in {})", weights.display()),
        (false, true) => println!("(quick run, {minutes:.1} minutes)"),
        (false, false) => println!("(default run, {minutes:.1} minutes)"),
    }
    let md = docs.join("extrapolation.md");
    write_between(&md, COPY_START, COPY_END, &table)?;

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
    let png = img.join("extrapolation_copy_loss.png");
    plot::line_chart(
        &png,
        (760, 440),
        &plot::Labels {
            title: &format!(
                "copy task: held-out loss vs evaluation length (trained at L = {})",
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
