//! The synthetic language: deterministic sequences whose next token depends on relative position.
//!
//! Every sequence starts with `copy_distance` uniformly random tokens. After that, token `t` is
//! drawn from a three-way mixture:
//!
//! ```text
//! with probability p_copy:      x[t] = x[t − copy_distance]          (copy from a fixed distance back)
//! with probability p_successor: x[t] = successor[x[t − 1]]           (a fixed bigram rule)
//! otherwise:                    x[t] = uniform over the vocabulary   (noise)
//! ```
//!
//! `successor` is a permutation of the vocabulary drawn once from the task seed, so it is the
//! same for training and evaluation. Both rules look a fixed number of tokens back (1 and
//! `copy_distance`), never at an absolute position, so an encoding that sees relative distances
//! can in principle apply them at any length, while an absolute encoding has to learn them anew
//! at every position it was trained on. Only targets at positions `>= copy_distance` are scored:
//! the first tokens are pure noise.

/// A tiny deterministic PRNG (splitmix64): the same seed gives the same stream on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n
    }

    /// A standard normal draw (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The task's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// Vocabulary size.
    pub vocab: usize,
    /// How far back the copy rule looks.
    pub copy_distance: usize,
    /// Probability of the copy rule.
    pub p_copy: f64,
    /// Probability of the successor (bigram) rule.
    pub p_successor: f64,
    /// Seed of the successor permutation (the "language").
    pub seed: u64,
}

impl Default for Task {
    fn default() -> Self {
        Self {
            vocab: 32,
            copy_distance: 12,
            p_copy: 0.7,
            p_successor: 0.2,
            seed: 0x7a5c,
        }
    }
}

impl Task {
    /// The successor permutation (Fisher-Yates from the task seed).
    pub fn successor(&self) -> Vec<u32> {
        let mut perm: Vec<u32> = (0..self.vocab as u32).collect();
        let mut rng = Rng::new(self.seed);
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        perm
    }

    /// Sequences `first..first + count` of the stream `seed`, each `len` tokens; sequence `i`
    /// is drawn from its own generator, so any slice of the stream can be made on its own.
    pub fn sequences(&self, seed: u64, first: usize, count: usize, len: usize) -> Vec<Vec<u32>> {
        let succ = self.successor();
        (first..first + count)
            .map(|i| {
                let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
                let mut s: Vec<u32> = Vec::with_capacity(len);
                for t in 0..len {
                    let tok = if t < self.copy_distance {
                        rng.below(self.vocab) as u32
                    } else {
                        let u = rng.uniform();
                        if u < self.p_copy {
                            s[t - self.copy_distance]
                        } else if u < self.p_copy + self.p_successor {
                            succ[s[t - 1] as usize]
                        } else {
                            rng.below(self.vocab) as u32
                        }
                    };
                    s.push(tok);
                }
                s
            })
            .collect()
    }

    /// The generator's own probability of `s[t]` given `s[..t]` (for `t >= copy_distance`).
    pub fn oracle_prob(&self, succ: &[u32], s: &[u32], t: usize) -> f64 {
        let mut p = (1.0 - self.p_copy - self.p_successor) / self.vocab as f64;
        if s[t] == s[t - self.copy_distance] {
            p += self.p_copy;
        }
        if s[t] == succ[s[t - 1] as usize] {
            p += self.p_successor;
        }
        p
    }

    /// Mean loss (nats) and accuracy of the generator's own distribution on the scored targets:
    /// the best any model can do on these sequences.
    pub fn oracle(&self, seqs: &[Vec<u32>]) -> (f64, f64) {
        let succ = self.successor();
        let (mut loss, mut hits, mut n) = (0.0, 0usize, 0usize);
        for s in seqs {
            for t in self.copy_distance..s.len() {
                loss -= self.oracle_prob(&succ, s, t).ln();
                // The oracle's argmax is the copy token (p_copy > p_successor + noise).
                hits += usize::from(s[t] == s[t - self.copy_distance]);
                n += 1;
            }
        }
        (loss / n as f64, hits as f64 / n as f64)
    }
}
