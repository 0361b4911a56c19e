//! Training with candle-nn's AdamW, evaluation at several lengths, and self-describing
//! checkpoints.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use candle_posenc::checkpoint::save;
use candle_posenc::rotary::{RopeScaling, YarnScaling};
use candle_posenc::{
    AlibiConfig, AlibiMode, Checkpoint, ClippedBiasConfig, EncodingConfig, Error, FoxConfig,
    InklingConfig, Interpolation, LearnedConfig, RopeConfig, ShawConfig, SinusoidalConfig,
    T5Config,
};
use indicatif::{ProgressBar, ProgressStyle};

use super::data::Task;
use super::model::{seeded_init, Lm, ModelConfig};

/// Seed of the training stream.
pub const TRAIN_STREAM: u64 = 1;
/// Seed of the held-out stream the experiment's table is measured on.
pub const EVAL_STREAM: u64 = 2;
/// Seed of the fresh stream the demo evaluates on.
pub const DEMO_STREAM: u64 = 3;

/// Everything that decides a run. The same settings give the same numbers.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The synthetic task.
    pub task: Task,
    /// The model's size.
    pub model: ModelConfig,
    /// Training length L.
    pub train_len: usize,
    /// Optimiser steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Peak learning rate (linear warm-up, then cosine decay to a tenth).
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Initialisation seed.
    pub seed: u64,
    /// Held-out sequences per evaluation length.
    pub eval_seqs: usize,
    /// Sequences per evaluation forward pass.
    pub eval_batch: usize,
    /// Evaluation lengths as multiples of L.
    pub eval_multiples: Vec<usize>,
    /// Whether to draw progress bars.
    pub progress: bool,
}

impl Settings {
    /// The default experiment: d 64, 4 heads, 2 layers, L = 64.
    pub fn standard() -> Self {
        Self {
            task: Task::default(),
            model: ModelConfig {
                vocab: 32,
                d_model: 64,
                num_heads: 4,
                num_layers: 2,
                mlp: 128,
                sinks: false,
            },
            train_len: 64,
            steps: 400,
            batch: 16,
            lr: 3e-3,
            warmup: 50,
            seed: 42,
            eval_seqs: 16,
            eval_batch: 8,
            eval_multiples: vec![1, 2, 4, 8],
            progress: true,
        }
    }

    /// A smoke run of the whole pipeline: same model, few steps, few evaluation sequences.
    pub fn quick() -> Self {
        Self {
            steps: 25,
            batch: 8,
            warmup: 5,
            eval_seqs: 2,
            eval_batch: 2,
            ..Self::standard()
        }
    }

    /// A tiny configuration for tests in a debug build.
    pub fn tiny() -> Self {
        Self {
            task: Task {
                vocab: 8,
                copy_distance: 3,
                ..Task::default()
            },
            model: ModelConfig {
                vocab: 8,
                d_model: 16,
                num_heads: 2,
                num_layers: 1,
                mlp: 32,
                sinks: false,
            },
            train_len: 12,
            steps: 12,
            batch: 4,
            lr: 1e-2,
            warmup: 2,
            seed: 7,
            eval_seqs: 4,
            eval_batch: 2,
            eval_multiples: vec![1, 2],
            progress: false,
        }
    }

    /// The evaluation lengths.
    pub fn eval_lengths(&self) -> Vec<usize> {
        self.eval_multiples
            .iter()
            .map(|m| m * self.train_len)
            .collect()
    }

    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.steps - self.warmup).max(1) as f64;
        let progress = (step - self.warmup) as f64 / span;
        self.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }

    /// A progress bar of `len` steps (hidden unless `progress`).
    pub fn bar(&self, len: usize, message: String) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(len as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:<28} [{bar:30}] {pos:>4}/{len} {elapsed_precise} {per_sec}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message);
        bar
    }
}

/// One row of the experiment: an encoding trained with `train` and evaluated with `eval`.
#[derive(Debug, Clone)]
pub struct Variant {
    /// Row label and checkpoint name.
    pub label: &'static str,
    /// Encoding during training.
    pub train: EncodingConfig,
    /// Encoding at evaluation (differs only for the variants applied at evaluation).
    pub eval: EncodingConfig,
    /// Whether the model's attention has learned sink logits.
    pub sinks: bool,
}

impl Variant {
    /// The settings this variant's model is trained with: `s` with its sinks.
    pub fn settings(&self, s: &Settings) -> Settings {
        let mut s = s.clone();
        s.model.sinks = self.sinks;
        s
    }
}

/// Every encoding of the experiment. `learned+interp`, `rope+yarn` and `rope+dynamic` change
/// only how the trained model is evaluated (at L linear interpolation is the identity), so they
/// reuse the weights trained for `learned` and `rope`.
pub fn variants(s: &Settings) -> Vec<Variant> {
    let m = &s.model;
    let (d, h, l) = (m.d_model, m.num_heads, s.train_len);
    let head_dim = d / h;
    let learned = LearnedConfig::new(d).with_max_len(l).with_dropout(0.0);
    let rope = RopeConfig::new(head_dim);
    let max_eval = s.eval_lengths().into_iter().max().unwrap_or(l);
    let yarn = YarnScaling::new((max_eval / l).max(2) as f64, l);
    let same = |label, c: EncodingConfig| Variant {
        label,
        train: c.clone(),
        eval: c,
        sinks: false,
    };
    vec![
        same("none", EncodingConfig::None),
        same(
            "sinusoidal",
            EncodingConfig::Sinusoidal(SinusoidalConfig::new(d).with_dropout(0.0)),
        ),
        same("learned", EncodingConfig::Learned(learned.clone())),
        Variant {
            label: "learned+interp",
            train: EncodingConfig::Learned(learned.clone()),
            eval: EncodingConfig::Learned(
                learned.with_interpolation(Interpolation::ToSequenceLength),
            ),
            sinks: false,
        },
        same("rope", EncodingConfig::Rotary(rope.clone())),
        Variant {
            label: "rope+yarn",
            train: EncodingConfig::Rotary(rope.clone()),
            eval: EncodingConfig::Rotary(rope.clone().with_scaling(RopeScaling::Yarn(yarn))),
            sinks: false,
        },
        Variant {
            label: "rope+dynamic",
            train: EncodingConfig::Rotary(rope.clone()),
            eval: EncodingConfig::Rotary(rope.with_scaling(RopeScaling::Dynamic {
                factor: 2.0,
                original_max_position_embeddings: l,
            })),
            sinks: false,
        },
        same(
            "alibi",
            EncodingConfig::Alibi(AlibiConfig::new(h).with_mode(AlibiMode::Causal)),
        ),
        same(
            "t5",
            EncodingConfig::T5(T5Config::new(h).with_bidirectional(false)),
        ),
        same(
            "clipped_bias",
            EncodingConfig::ClippedBias(ClippedBiasConfig::new(h, 32)),
        ),
        // Relative keys and values (Shaw et al.'s full form).
        same("shaw", EncodingConfig::Shaw(ShawConfig::new(head_dim, 32))),
        // FoX's causal forget gates: a bias of summed log gates read from each token.
        same("fox", EncodingConfig::Fox(FoxConfig::new(d, h))),
        // Inkling's relative logits, the bank as long as L: no bias at distances never trained.
        same(
            "inkling",
            EncodingConfig::Inkling(InklingConfig::new(d, h).with_rel_extent(l)),
        ),
    ]
}

/// The text experiment's rows: [`variants`] and `rope+sinks`, RoPE with learned per-head sink
/// logits in every attention layer (gpt-oss's form), after `rope+dynamic`.
pub fn text_variants(s: &Settings) -> Vec<Variant> {
    let mut rows = variants(s);
    let at = rows
        .iter()
        .position(|v| v.label == "rope+dynamic")
        .map_or(rows.len(), |i| i + 1);
    let rope = EncodingConfig::Rotary(RopeConfig::new(s.model.d_model / s.model.num_heads));
    rows.insert(
        at,
        Variant {
            label: "rope+sinks",
            train: rope.clone(),
            eval: rope,
            sinks: true,
        },
    );
    rows
}

/// The file name of row `label`'s checkpoint in `weights/`.
pub fn checkpoint_name(label: &str) -> String {
    format!("extrapolation_{}.safetensors", label.replace('+', "_"))
}

/// `(B, len + 1)` token ids on the CPU.
pub fn batch_tensor(seqs: &[Vec<u32>]) -> candle_core::Result<Tensor> {
    let len = seqs.first().map_or(0, Vec::len);
    let flat: Vec<u32> = seqs.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (seqs.len(), len), &Device::Cpu)
}

/// Mean next-token loss on the scored targets of `(B, T + 1)` tokens: the model reads tokens
/// `0..T` and predicts `1..=T`; targets before `copy_distance` are not scored.
pub fn batch_loss(lm: &Lm, task: &Task, tokens: &Tensor) -> candle_posenc::Result<Tensor> {
    scored_loss(lm, task.copy_distance.saturating_sub(1), tokens)
}

/// Mean next-token loss of `(B, T + 1)` tokens over the predictions `first..T` (the model reads
/// tokens `0..T` and predicts `1..=T`).
pub fn scored_loss(lm: &Lm, first: usize, tokens: &Tensor) -> candle_posenc::Result<Tensor> {
    let (b, n) = tokens.dims2()?;
    let t = n.saturating_sub(1);
    let Some(scored) = t.checked_sub(first).filter(|&s| s > 0) else {
        return Err(candle_core::Error::Msg(format!(
            "{n} tokens leave no target past the first {first} predictions"
        ))
        .into());
    };
    let logits = lm.forward(&tokens.narrow(1, 0, t)?, true)?;
    let logits = logits
        .narrow(1, first, scored)?
        .reshape((b * scored, lm.config().vocab))?;
    let targets = tokens.narrow(1, first + 1, scored)?.flatten_all()?;
    Ok(candle_nn::loss::cross_entropy(&logits, &targets)?)
}

/// Trains a model with `encoding` on the copy task and returns its variables and the loss of
/// every step.
pub fn train(s: &Settings, encoding: &EncodingConfig) -> anyhow::Result<(VarMap, Vec<f32>)> {
    let batches = |step: usize| {
        s.task
            .sequences(TRAIN_STREAM, step * s.batch, s.batch, s.train_len + 1)
    };
    train_on(s, encoding, batches, s.task.copy_distance.saturating_sub(1))
}

/// Trains a model with `encoding` on the sequences `batches(step)` gives (each `L + 1` tokens),
/// scoring the predictions from `first` on, and returns its variables and every step's loss.
pub fn train_on(
    s: &Settings,
    encoding: &EncodingConfig,
    batches: impl Fn(usize) -> Vec<Vec<u32>>,
    first: usize,
) -> anyhow::Result<(VarMap, Vec<f32>)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let lm = Lm::new(&s.model, encoding, vb)?;
    seeded_init(&varmap, s.seed)?;
    let params = ParamsAdamW {
        lr: s.lr,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = AdamW::new(varmap.all_vars(), params)?;
    let bar = s.bar(s.steps, format!("train {}", encoding.kind()));
    let mut losses = Vec::with_capacity(s.steps);
    for step in 0..s.steps {
        opt.set_learning_rate(s.lr_at(step));
        let loss = scored_loss(&lm, first, &batch_tensor(&batches(step))?)?;
        opt.backward_step(&loss)?;
        let value = loss.to_scalar::<f32>()?;
        losses.push(value);
        bar.set_message(format!("train {} loss {value:.3}", encoding.kind()));
        bar.inc(1);
    }
    bar.finish();
    Ok((varmap, losses))
}

/// Loss (nats per scored token) and next-token accuracy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    /// Mean cross-entropy.
    pub loss: f64,
    /// Fraction of scored targets that are the model's argmax.
    pub accuracy: f64,
}

/// Scores `lm` on `seqs` (each `T + 1` tokens) in inference mode, `batch` sequences at a time.
/// `Ok(None)` when the encoding cannot reach position `T − 1` (a learned table without
/// interpolation).
pub fn evaluate(
    lm: &Lm,
    task: &Task,
    seqs: &[Vec<u32>],
    batch: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Option<Score>> {
    let first = task.copy_distance.saturating_sub(1);
    let (mut loss, mut hits, mut count) = (0f64, 0f64, 0usize);
    for chunk in seqs.chunks(batch.max(1)) {
        let tokens = batch_tensor(chunk)?;
        let t = tokens.dim(1)?.saturating_sub(1);
        if t <= first {
            anyhow::bail!("sequences of {} tokens leave no scored target", t + 1);
        }
        let logits = match lm.forward(&tokens.narrow(1, 0, t)?, false) {
            Ok(l) => l,
            Err(Error::PositionOutOfRange { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let scored = t - first;
        let logits = logits.narrow(1, first, scored)?;
        let targets = tokens.narrow(1, first + 1, scored)?.contiguous()?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let picked = logp.gather(&targets.unsqueeze(2)?, 2)?;
        loss -= picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        let guess = logits.argmax(D::Minus1)?;
        hits += guess
            .eq(&targets)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
        count += chunk.len() * scored;
        bar.inc(chunk.len() as u64);
    }
    Ok(Some(Score {
        loss: loss / count as f64,
        accuracy: hits / count as f64,
    }))
}

/// Scores `lm` at every evaluation length on `count` sequences of `stream`.
pub fn evaluate_lengths(
    s: &Settings,
    lm: &Lm,
    stream: u64,
    count: usize,
    label: &str,
) -> anyhow::Result<Vec<Option<Score>>> {
    let lengths = s.eval_lengths();
    let bar = s.bar(count * lengths.len(), format!("eval {label}"));
    let mut out = Vec::with_capacity(lengths.len());
    for len in lengths {
        let seqs = s.task.sequences(stream, 0, count, len + 1);
        let score = evaluate(lm, &s.task, &seqs, s.eval_batch, &bar)?;
        if score.is_none() {
            bar.inc(count as u64);
        }
        out.push(score);
    }
    bar.finish();
    Ok(out)
}

/// The checkpoint of a variant: every variable stored in f16 (to keep `weights/` small) and
/// metadata naming the encoding (`posenc.encoding`), the attention block (`posenc.attention`), the model
/// (`lm.*`), the task, the training settings and the held-out scores measured on these very
/// f16 weights (`lm.eval.*`).
pub struct Trained {
    /// The weights as stored.
    pub tensors: HashMap<String, Tensor>,
    /// The metadata.
    pub metadata: HashMap<String, String>,
}

impl Trained {
    /// Rounds `varmap` to f16 and describes it, with the copy task's parameters.
    pub fn new(s: &Settings, variant: &Variant, varmap: &VarMap) -> anyhow::Result<Self> {
        let task = &s.task;
        let data = [
            ("lm.task.vocab", task.vocab.to_string()),
            ("lm.task.copy_distance", task.copy_distance.to_string()),
            ("lm.task.p_copy", task.p_copy.to_string()),
            ("lm.task.p_successor", task.p_successor.to_string()),
            ("lm.task.seed", task.seed.to_string()),
            ("lm.eval.sequences", s.eval_seqs.to_string()),
        ];
        Self::describe(s, variant, varmap, data.map(|(k, v)| (k.to_string(), v)))
    }

    /// Rounds `varmap` to f16 and describes it, with `data` describing what it was trained on.
    pub fn describe(
        s: &Settings,
        variant: &Variant,
        varmap: &VarMap,
        data: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<Self> {
        let vars = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
        let mut tensors = HashMap::new();
        for (name, var) in vars.iter() {
            tensors.insert(name.clone(), var.as_tensor().detach().to_dtype(DType::F16)?);
        }
        let mut metadata = s.model.to_metadata();
        metadata.extend(s.model.attention().to_metadata());
        metadata.extend(variant.eval.to_metadata());
        metadata.extend(data);
        for (k, v) in [
            ("lm.label", variant.label.to_string()),
            ("lm.train_len", s.train_len.to_string()),
            ("lm.train_steps", s.steps.to_string()),
            ("lm.train_batch", s.batch.to_string()),
            ("lm.train_lr", s.lr.to_string()),
            ("lm.train_encoding", variant.train.kind().to_string()),
            ("lm.seed", s.seed.to_string()),
        ] {
            metadata.insert(k.to_string(), v);
        }
        Ok(Self { tensors, metadata })
    }

    /// The model these weights make (computed in f32).
    pub fn model(&self) -> anyhow::Result<Lm> {
        let vb = VarBuilder::from_tensors(self.tensors.clone(), DType::F32, &Device::Cpu);
        let enc = EncodingConfig::from_metadata(&self.metadata, "<memory>")?;
        Ok(Lm::new(
            &ModelConfig::from_metadata(&self.metadata)?,
            &enc,
            vb,
        )?)
    }

    /// Records held-out scores under `lm.eval.<len>.loss` / `.accuracy` (`n/a` if none).
    pub fn record(&mut self, lengths: &[usize], scores: &[Option<Score>]) {
        for (len, score) in lengths.iter().zip(scores) {
            let (l, a) = match score {
                Some(s) => (format!("{:.6}", s.loss), format!("{:.6}", s.accuracy)),
                None => ("n/a".into(), "n/a".into()),
            };
            self.metadata.insert(format!("lm.eval.{len}.loss"), l);
            self.metadata.insert(format!("lm.eval.{len}.accuracy"), a);
        }
    }

    /// Writes the safetensors file.
    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        save(path, &self.tensors, &self.metadata)?;
        Ok(())
    }
}

/// A checkpoint written by [`Trained::save`]: the model, its label and the task it was trained on.
pub struct Loaded {
    /// The model (f32).
    pub lm: Lm,
    /// The variant's label.
    pub label: String,
    /// The task, read back from the metadata.
    pub task: Task,
    /// Training length.
    pub train_len: usize,
    /// Everything the file holds.
    pub checkpoint: Checkpoint,
}

/// Loads a checkpoint written by [`Trained::save`].
pub fn load(path: &Path) -> anyhow::Result<Loaded> {
    let checkpoint = Checkpoint::load(path, &Device::Cpu)?;
    let m = checkpoint.metadata();
    let get = |k: &str| {
        m.get(k)
            .ok_or_else(|| anyhow::anyhow!("{}: metadata `{k}` missing", path.display()))
    };
    let task = Task {
        vocab: get("lm.task.vocab")?.parse()?,
        copy_distance: get("lm.task.copy_distance")?.parse()?,
        p_copy: get("lm.task.p_copy")?.parse()?,
        p_successor: get("lm.task.p_successor")?.parse()?,
        seed: get("lm.task.seed")?.parse()?,
    };
    let enc = EncodingConfig::from_metadata(m, checkpoint.source())?;
    let vb = checkpoint.var_builder(DType::F32, &Device::Cpu);
    let lm = Lm::new(&ModelConfig::from_metadata(m)?, &enc, vb)?;
    Ok(Loaded {
        lm,
        label: get("lm.label")?.clone(),
        train_len: get("lm.train_len")?.parse()?,
        task,
        checkpoint,
    })
}

/// A markdown table: one row per variant, one column per length, `loss / accuracy` per cell.
pub fn markdown_table(
    lengths: &[usize],
    train_len: usize,
    rows: &[(String, Vec<Option<Score>>)],
) -> String {
    let mut out = String::from("| encoding |");
    for len in lengths {
        out.push_str(&format!(" {len} ({}L) |", len / train_len));
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(lengths.len()));
    out.push('\n');
    for (label, scores) in rows {
        out.push_str(&format!("| {label} |"));
        for score in scores {
            match score {
                Some(s) => out.push_str(&format!(" {:.3} / {:.1}% |", s.loss, 100.0 * s.accuracy)),
                None => out.push_str(&format!(" n/a (table ends at {train_len}) |")),
            }
        }
        out.push('\n');
    }
    out
}
