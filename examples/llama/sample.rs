//! The next token from a row of logits: greedy (the largest), or drawn at a temperature from
//! the smallest set of tokens whose probabilities reach `top_p` (nucleus sampling, Holtzman et
//! al. 2020), with a seeded generator so a run repeats.
//!
//! ```text
//! p_i = softmax(logits / temperature)_i;  keep the most probable until Σ p ≥ top_p;  draw
//! ```

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The largest logit (the first of equals).
    Greedy,
    /// Drawn from the nucleus at a temperature.
    TopP {
        /// Divides the logits (> 0).
        temperature: f64,
        /// The probability mass kept, in (0, 1].
        top_p: f64,
    },
}

/// Picks tokens; holds the generator's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler with its generator seeded by `seed`.
    pub fn new(sampling: Sampling, seed: u64) -> Self {
        Self {
            sampling,
            state: seed,
        }
    }

    /// The next token from one row of logits.
    pub fn next(&mut self, logits: &[f32]) -> u32 {
        match self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::TopP { temperature, top_p } => {
                let u = self.uniform();
                nucleus(logits, temperature, top_p, u)
            }
        }
    }

    /// A uniform draw in [0, 1) (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The index of the largest value (the first of equals; NaNs never win).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The token at cumulative probability `u` of the nucleus of `logits / temperature`.
fn nucleus(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> u32 {
    if logits.is_empty() {
        return 0;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(f64, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (((l as f64 - max) / temperature).exp(), i as u32))
        .collect();
    let total: f64 = probs.iter().map(|(p, _)| p).sum();
    probs.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut kept = 0.0;
    let mut len = 0;
    for (p, _) in &probs {
        kept += p / total;
        len += 1;
        if kept >= top_p {
            break;
        }
    }
    let mut target = u * kept * total;
    for &(p, id) in &probs[..len] {
        if target < p {
            return id;
        }
        target -= p;
    }
    probs[len.saturating_sub(1)].1
}
