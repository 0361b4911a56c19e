//! The text experiment's settings, one seed's run of every encoding, and the report: scores
//! over seeds as mean and spread, markdown tables and the JSON record.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_nn::VarMap;
use candle_posenc::EncodingConfig;
use serde::Serialize;

use super::model::ModelConfig;
use super::text::Corpus;
use super::text_eval::{evaluate_text, work, TextEval, TextScores};
use super::train::{text_variants, train_on, Settings, Trained, Variant};

/// Everything that decides a run of the text experiment. The same settings give the same
/// numbers.
#[derive(Debug, Clone)]
pub struct TextSettings {
    /// Model, training length, optimiser and schedule (`train.seed` is replaced by each seed).
    pub train: Settings,
    /// Initialisation and data-order seeds, one model per encoding and seed.
    pub seeds: Vec<u64>,
    /// What the evaluation scores.
    pub eval: TextEval,
}

impl TextSettings {
    /// The default experiment for a corpus of `vocab` characters: d 64, 4 heads, 2 layers,
    /// trained at L = 64, evaluated at 1, 2, 4, 8 and 16 L, three seeds.
    pub fn standard(vocab: usize) -> Self {
        let train = Settings {
            model: ModelConfig {
                vocab,
                d_model: 64,
                num_heads: 4,
                num_layers: 2,
                mlp: 256,
                sinks: false,
            },
            train_len: 64,
            steps: 200,
            batch: 32,
            lr: 1e-2,
            warmup: 20,
            seed: 1,
            eval_multiples: vec![1, 2, 4, 8, 16],
            progress: true,
            ..Settings::standard()
        };
        Self {
            train,
            seeds: vec![1, 2, 3],
            eval: TextEval {
                train_len: 64,
                multiples: vec![1, 2, 4, 8, 16],
                tokens: 16384,
                slide_tokens: 2048,
                batch_tokens: 8192,
            },
        }
    }

    /// A smoke run of the whole pipeline: the same model, few steps, little evaluation.
    pub fn quick(vocab: usize) -> Self {
        let mut s = Self::standard(vocab);
        s.train.steps = 30;
        s.train.warmup = 5;
        s.eval.tokens = 2048;
        s.eval.slide_tokens = 256;
        s.seeds.truncate(2);
        s
    }

    /// A tiny configuration for tests in a debug build.
    pub fn tiny(vocab: usize) -> Self {
        let mut train = Settings::tiny();
        train.model.vocab = vocab;
        train.train_len = 8;
        train.eval_multiples = vec![1, 2, 4];
        Self {
            train,
            seeds: vec![1, 2],
            eval: TextEval {
                train_len: 8,
                multiples: vec![1, 2, 4],
                tokens: 64,
                slide_tokens: 16,
                batch_tokens: 64,
            },
        }
    }

    /// The settings of one seed's models.
    pub fn for_seed(&self, seed: u64) -> Settings {
        Settings {
            seed,
            ..self.train.clone()
        }
    }
}

/// The training stream's seed for model seed `seed` (data order differs per seed too).
fn data_seed(seed: u64) -> u64 {
    seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x7e87
}

/// One encoding's scores under one seed.
#[derive(Debug, Clone, Serialize)]
pub struct SeedRun {
    /// The seed.
    pub seed: u64,
    /// Mean training loss of the last 20 steps.
    pub final_train_loss: f64,
    /// Held-out scores.
    pub scores: TextScores,
}

/// Every seed's scores of one row of the experiment.
#[derive(Debug, Clone, Serialize)]
pub struct RowRuns {
    /// The row's label.
    pub label: String,
    /// The encoding the model was trained with (`kind`).
    pub trained_with: String,
    /// The runs, in seed order.
    pub runs: Vec<SeedRun>,
}

/// Trains every variant's model for `seed` (once per training encoding and sinks) and scores every
/// variant on the held-out text. `save` receives each trained variant's checkpoint.
pub fn run_seed(
    s: &TextSettings,
    corpus: &Corpus,
    seed: u64,
    only: Option<&[String]>,
    mut save: impl FnMut(&Variant, Trained) -> Result<()>,
) -> Result<Vec<(String, SeedRun)>> {
    let base = s.for_seed(seed);
    let mut trained: Vec<((EncodingConfig, bool), VarMap, f64)> = Vec::new();
    let mut out = Vec::new();
    for variant in text_variants(&base) {
        if only.is_some_and(|o| !o.iter().any(|l| l == variant.label)) {
            continue;
        }
        let settings = variant.settings(&base);
        let key = (variant.train.clone(), variant.sinks);
        let index = match trained.iter().position(|(k, _, _)| *k == key) {
            Some(i) => i,
            None => {
                let l = settings.train_len;
                let batches = |step: usize| {
                    corpus.train_windows(
                        data_seed(seed),
                        step * settings.batch,
                        settings.batch,
                        l + 1,
                    )
                };
                let (varmap, losses) = train_on(&settings, &variant.train, batches, 0)?;
                let n = losses.len().min(20);
                let last = losses[losses.len() - n..]
                    .iter()
                    .map(|&x| f64::from(x))
                    .sum::<f64>()
                    / n.max(1) as f64;
                trained.push((key, varmap, last));
                trained.len() - 1
            }
        };
        let (_, varmap, final_train_loss) = &trained[index];
        let ckpt = Trained::describe(&settings, &variant, varmap, corpus_metadata(corpus))?;
        let bar = settings.bar(
            work(&s.eval) as usize,
            format!("eval {} seed {seed}", variant.label),
        );
        let scores = evaluate_text(&ckpt.model()?, &corpus.held_out, &s.eval, &bar)?;
        bar.finish_and_clear();
        if variant.train == variant.eval {
            let mut ckpt = ckpt;
            record(&mut ckpt.metadata, &s.eval, &scores);
            save(&variant, ckpt)?;
        }
        out.push((
            variant.label.to_string(),
            SeedRun {
                seed,
                final_train_loss: *final_train_loss,
                scores,
            },
        ));
    }
    Ok(out)
}

/// What a text checkpoint says about its data: the alphabet (ids 1..), the corpus and the
/// held-out documents.
pub fn corpus_metadata(corpus: &Corpus) -> Vec<(String, String)> {
    vec![
        ("lm.data".into(), "text".into()),
        ("lm.text.alphabet".into(), corpus.alphabet_string()),
        ("lm.text.source".into(), corpus.source.clone()),
        ("lm.text.held_out".into(), corpus.held_out_names.join(",")),
    ]
}

/// Records `scores` in checkpoint metadata: `lm.eval.<N>.windows` and `.sliding` per length.
fn record(metadata: &mut HashMap<String, String>, e: &TextEval, scores: &TextScores) {
    let text = |v: &Option<f64>| v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.6}"));
    for (i, n) in e.lengths().into_iter().enumerate() {
        metadata.insert(format!("lm.eval.{n}.windows"), text(&scores.windows[i]));
        metadata.insert(format!("lm.eval.{n}.sliding"), text(&scores.sliding[i]));
    }
    metadata.insert("lm.eval.tokens".into(), e.tokens.to_string());
}

/// Mean and spread of one number over seeds (`None` if any seed has none).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Mean over seeds.
    pub mean: f64,
    /// Sample standard deviation (0 for one seed).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

/// The spread of `values`, `None` if any is `None` or there are none.
pub fn spread(values: &[Option<f64>]) -> Option<Spread> {
    let v: Vec<f64> = values.iter().copied().collect::<Option<Vec<_>>>()?;
    if v.is_empty() {
        return None;
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    Some(Spread {
        mean,
        std: var.sqrt(),
        min: v.iter().copied().fold(f64::INFINITY, f64::min),
        max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    })
}

/// Which view of [`TextScores`] a table shows.
#[derive(Debug, Clone, Copy)]
pub enum View {
    /// Non-overlapping windows per length.
    Windows,
    /// Sliding windows per length.
    Sliding,
    /// Position buckets, grouped as `[0, L)`, `[L, 2L)`, `[2L, 4L)`, …
    Buckets,
}

/// The values of `view` for one run, one per column of its table.
pub fn columns(view: View, scores: &TextScores) -> Vec<Option<f64>> {
    match view {
        View::Windows => scores.windows.clone(),
        View::Sliding => scores.sliding.clone(),
        View::Buckets => {
            // Buckets [0,1), [1,2), [2,4), [4,8), … in units of L, each the mean of its L-wide
            // buckets.
            let b = &scores.buckets;
            let mut out = Vec::new();
            let (mut lo, mut hi) = (0, 1);
            while hi <= b.len() {
                let part: Option<Vec<f64>> = b[lo..hi].iter().copied().collect();
                out.push(part.map(|p| p.iter().sum::<f64>() / p.len() as f64));
                lo = hi;
                hi *= 2;
            }
            out
        }
    }
}

/// A markdown table of `view`: one row per encoding, `mean ± std` over seeds per column.
pub fn table(view: View, e: &TextEval, rows: &[RowRuns]) -> String {
    let l = e.train_len;
    let heads: Vec<String> = match view {
        View::Windows | View::Sliding => e
            .lengths()
            .iter()
            .map(|n| format!("{n} ({}L)", n / l))
            .collect(),
        View::Buckets => {
            let longest = e.lengths().into_iter().max().unwrap_or(l) / l;
            let mut out = vec!["[0, L)".to_string()];
            let mut lo = 1;
            while lo < longest {
                out.push(match lo {
                    1 => "[L, 2L)".to_string(),
                    _ => format!("[{lo}L, {}L)", 2 * lo),
                });
                lo *= 2;
            }
            out
        }
    };
    let mut t = format!("| encoding | {} |\n|---|", heads.join(" | "));
    t.push_str(&"---|".repeat(heads.len()));
    t.push('\n');
    for row in rows {
        t.push_str(&format!("| {} |", row.label));
        let per_run: Vec<Vec<Option<f64>>> =
            row.runs.iter().map(|r| columns(view, &r.scores)).collect();
        for c in 0..heads.len() {
            let values: Vec<Option<f64>> = per_run
                .iter()
                .map(|r| r.get(c).copied().flatten())
                .collect();
            match spread(&values) {
                Some(s) => t.push_str(&format!(" {:.3} ± {:.3} |", s.mean, s.std)),
                None => t.push_str(&format!(" n/a (table ends at {l}) |")),
            }
        }
        t.push('\n');
    }
    t
}

/// The JSON record of a run: its settings and every seed's numbers.
#[derive(Debug, Serialize)]
pub struct Record<'a> {
    /// What the numbers are.
    pub description: &'static str,
    /// Where the text came from.
    pub corpus: &'a str,
    /// Held-out documents.
    pub held_out: &'a [String],
    /// Characters of training and held-out text.
    pub characters: (usize, usize),
    /// The model.
    pub model: HashMap<String, String>,
    /// Training: length, steps, batch, learning rate, warm-up.
    pub training: HashMap<&'static str, f64>,
    /// The evaluation's settings.
    pub evaluation: &'a TextEval,
    /// Every row's runs.
    pub rows: &'a [RowRuns],
    /// Minutes the run took on the machine that made it.
    pub minutes: f64,
}

impl<'a> Record<'a> {
    /// The record of `rows`, run with `s` on `corpus`.
    pub fn new(s: &'a TextSettings, corpus: &'a Corpus, rows: &'a [RowRuns], minutes: f64) -> Self {
        let t = &s.train;
        Self {
            description: "held-out loss in nats per character: `windows` non-overlapping windows \
                per evaluation length, `buckets` per L-wide position bucket of the longest windows, \
                `sliding` windows advancing by L/2 with their last L/2 predictions scored",
            corpus: &corpus.source,
            held_out: &corpus.held_out_names,
            characters: (corpus.train.len(), corpus.held_out.len()),
            model: t.model.to_metadata(),
            training: HashMap::from([
                ("train_len", t.train_len as f64),
                ("steps", t.steps as f64),
                ("batch", t.batch as f64),
                ("lr", t.lr),
                ("warmup", t.warmup as f64),
            ]),
            evaluation: &s.eval,
            rows,
            minutes,
        }
    }

    /// Writes the record as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self)? + "\n")?;
        Ok(())
    }
}

/// A text checkpoint written by [`run_seed`]: the model, its label, training length and
/// alphabet, and every score it recorded.
pub struct LoadedText {
    /// The model (f32).
    pub lm: super::model::Lm,
    /// The row's label.
    pub label: String,
    /// Training length L.
    pub train_len: usize,
    /// The alphabet of ids 1.. (id 0 is any other character).
    pub alphabet: Vec<char>,
    /// Everything the file holds.
    pub checkpoint: candle_posenc::Checkpoint,
}

impl LoadedText {
    /// The score recorded for `view` (`windows` or `sliding`) at length `n`, `None` for `n/a`.
    ///
    /// # Errors
    /// No such entry, or one that is neither a number nor `n/a`.
    pub fn recorded(&self, view: &str, n: usize) -> Result<Option<f64>> {
        let key = format!("lm.eval.{n}.{view}");
        let raw = self
            .checkpoint
            .metadata()
            .get(&key)
            .with_context(|| format!("{}: no `{key}`", self.checkpoint.source()))?;
        Ok(match raw.as_str() {
            "n/a" => None,
            v => Some(v.parse()?),
        })
    }

    /// The corpus encoding of `text` with this model's alphabet.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        super::text::encode(&self.alphabet, text)
    }
}

/// Loads a checkpoint written by the text experiment.
///
/// # Errors
/// An unreadable file, or one that is not a text model's.
pub fn load_text(path: &Path) -> Result<LoadedText> {
    use candle_core::{DType, Device};
    let checkpoint = candle_posenc::Checkpoint::load(path, &Device::Cpu)?;
    let m = checkpoint.metadata();
    let get = |k: &str| {
        m.get(k)
            .with_context(|| format!("{}: metadata `{k}` missing", path.display()))
    };
    anyhow::ensure!(
        get("lm.data")? == "text",
        "{}: not a text model",
        path.display()
    );
    let alphabet: Vec<char> = get("lm.text.alphabet")?.chars().collect();
    let enc = EncodingConfig::from_metadata(m, checkpoint.source())?;
    let vb = checkpoint.var_builder(DType::F32, &Device::Cpu);
    let lm = super::model::Lm::new(&ModelConfig::from_metadata(m)?, &enc, vb)?;
    Ok(LoadedText {
        lm,
        label: get("lm.label")?.clone(),
        train_len: get("lm.train_len")?.parse()?,
        alphabet,
        checkpoint,
    })
}
