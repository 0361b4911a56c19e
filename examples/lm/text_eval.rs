//! Scoring a character-level model on held-out text three ways, after Press et al. (2022),
//! "Train Short, Test Long":
//!
//! - **non-overlapping windows**: the held-out text cut into windows of N characters, every
//!   prediction scored (their main protocol; early predictions in a window see little context);
//! - **loss per position bucket**: the longest windows' losses averaged per position, in buckets
//!   `[0, L)`, `[L, 2L)`, …, which isolates what happens past the training length;
//! - **sliding windows** of N characters advancing by `L/2`, only each window's last `L/2`
//!   predictions scored, so every scored prediction sees between `N − L/2` and `N − 1`
//!   characters (the control: no prediction is made from a short context).
//!
//! Every view scores the same held-out characters at every length, so the lengths compare.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_posenc::Error;
use indicatif::ProgressBar;
use serde::Serialize;

use super::model::Lm;

/// What to score and how much.
#[derive(Debug, Clone, Serialize)]
pub struct TextEval {
    /// Training length L.
    pub train_len: usize,
    /// Evaluation lengths as multiples of L.
    pub multiples: Vec<usize>,
    /// Predictions scored per length with non-overlapping windows (a multiple of the longest
    /// length).
    pub tokens: usize,
    /// Predictions scored per length with sliding windows (a multiple of `L/2`).
    pub slide_tokens: usize,
    /// Characters per forward pass (windows are batched up to it).
    pub batch_tokens: usize,
}

impl TextEval {
    /// The evaluation lengths.
    pub fn lengths(&self) -> Vec<usize> {
        self.multiples.iter().map(|m| m * self.train_len).collect()
    }

    /// The sliding windows' stride, `L/2`.
    pub fn stride(&self) -> usize {
        (self.train_len / 2).max(1)
    }

    fn longest(&self) -> usize {
        self.lengths().into_iter().max().unwrap_or(self.train_len)
    }

    /// Held-out characters the evaluation reads.
    pub fn needed(&self) -> usize {
        self.tokens.max(self.longest() + self.slide_tokens) + 1
    }
}

/// One model's scores: mean loss in nats per character, `None` where the model cannot read
/// that far (a learned table without interpolation).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TextScores {
    /// Non-overlapping windows, per evaluation length.
    pub windows: Vec<Option<f64>>,
    /// Per L-wide position bucket of the longest non-overlapping windows.
    pub buckets: Vec<Option<f64>>,
    /// Sliding windows, per evaluation length.
    pub sliding: Vec<Option<f64>>,
}

/// Per-prediction losses of `windows` (each N + 1 characters, all the same N) in one forward
/// pass: N losses per window. `None` when the model cannot read N characters.
fn window_losses(lm: &Lm, windows: &[&[u32]]) -> Result<Option<Vec<Vec<f32>>>> {
    let n = windows.first().map_or(0, |w| w.len().saturating_sub(1));
    let flat: Vec<u32> = windows.iter().flat_map(|w| w.iter().copied()).collect();
    let tokens = Tensor::from_vec(flat, (windows.len(), n + 1), &Device::Cpu)?;
    let logits = match lm.forward(&tokens.narrow(1, 0, n)?, false) {
        Ok(l) => l,
        Err(Error::PositionOutOfRange { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let targets = tokens.narrow(1, 1, n)?.contiguous()?.unsqueeze(2)?;
    let picked = logp.gather(&targets, 2)?.squeeze(2)?.neg()?;
    Ok(Some(picked.to_vec2::<f32>()?))
}

/// [`window_losses`] over batches of about `batch_tokens` characters.
fn losses(
    lm: &Lm,
    windows: &[&[u32]],
    batch_tokens: usize,
    bar: &ProgressBar,
) -> Result<Option<Vec<Vec<f32>>>> {
    let n = windows.first().map_or(1, |w| w.len().max(1));
    let mut out = Vec::with_capacity(windows.len());
    for batch in windows.chunks((batch_tokens / n).max(1)) {
        match window_losses(lm, batch)? {
            Some(l) => out.extend(l),
            None => return Ok(None),
        }
        bar.inc((batch.len() * n) as u64);
    }
    Ok(Some(out))
}

fn mean(values: impl IntoIterator<Item = f32>) -> f64 {
    let (sum, n) = values
        .into_iter()
        .fold((0f64, 0usize), |(s, n), v| (s + f64::from(v), n + 1));
    sum / n.max(1) as f64
}

/// Characters the whole evaluation reads (for a progress bar).
pub fn work(e: &TextEval) -> u64 {
    let slide: usize = e
        .lengths()
        .iter()
        .map(|n| e.slide_tokens / e.stride() * (n + 1))
        .sum();
    (e.tokens * e.lengths().len() + slide) as u64
}

/// Scores `lm` on `held_out` (at least [`TextEval::needed`] characters) in inference mode.
///
/// # Errors
/// Held-out text shorter than the evaluation needs, or a failing forward pass.
pub fn evaluate_text(
    lm: &Lm,
    held_out: &[u32],
    e: &TextEval,
    bar: &ProgressBar,
) -> Result<TextScores> {
    anyhow::ensure!(
        e.train_len > 0 && !e.multiples.is_empty() && !e.multiples.contains(&0),
        "evaluation lengths must be positive multiples of a positive L: L = {}, multiples {:?}",
        e.train_len,
        e.multiples
    );
    anyhow::ensure!(
        held_out.len() >= e.needed(),
        "the held-out text has {} characters; the evaluation reads {}",
        held_out.len(),
        e.needed()
    );
    let (l, longest, stride) = (e.train_len, e.longest(), e.stride());
    anyhow::ensure!(
        e.tokens.is_multiple_of(longest) && e.slide_tokens.is_multiple_of(stride),
        "scored predictions ({}, {}) must be multiples of the longest length {longest} and of L/2 = {stride}",
        e.tokens,
        e.slide_tokens
    );
    let mut scores = TextScores {
        buckets: vec![None; longest / l],
        ..Default::default()
    };
    for n in e.lengths() {
        // Non-overlapping: the first `tokens` predictions, N at a time.
        let windows: Vec<&[u32]> = (0..e.tokens / n)
            .map(|k| &held_out[k * n..k * n + n + 1])
            .collect();
        let got = losses(lm, &windows, e.batch_tokens, bar)?;
        scores
            .windows
            .push(got.as_ref().map(|w| mean(w.iter().flatten().copied())));
        if let (true, Some(w)) = (n == longest, &got) {
            for (b, bucket) in scores.buckets.iter_mut().enumerate() {
                *bucket = Some(mean(
                    w.iter().flat_map(|r| r[b * l..(b + 1) * l].iter().copied()),
                ));
            }
        }
        // Sliding: predictions of characters longest + 1 ..= longest + slide_tokens, the last
        // `stride` of each window of N (every window starts at or after the text's start).
        let windows: Vec<&[u32]> = (0..e.slide_tokens / stride)
            .map(|c| {
                let end = longest + (c + 1) * stride;
                &held_out[end - n..end + 1]
            })
            .collect();
        let got = losses(lm, &windows, e.batch_tokens, bar)?;
        scores
            .sliding
            .push(got.map(|w| mean(w.iter().flat_map(|r| r[n - stride..].iter().copied()))));
    }
    Ok(scores)
}
