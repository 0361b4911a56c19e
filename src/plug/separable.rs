//! A separable logits bias as data: one value per query and one per key, for each head.
//!
//! ```text
//! bias[b, h, i, j] = a[b, h, i] + c[b, h, j]        every key, or the keys up to query i's own
//!                  = a'[b, h, i] + c'[b, h, j]      keys after query i's own token, when given
//! a, a': (1|B, 1|H, Tq)      c, c': (1|B, 1|H, Tk)
//! query i's own token is key first + i
//! ```
//!
//! A bias of this form never needs a `(Tq, Tk)` tensor: a fused core adds `a_i + c_j` to a row
//! of logits as it computes it, and its gradient is the row sums of dS for `a` and the column
//! sums for `c` (over each half's keys). The difference form `c_i − c_j` of a cumulative sum
//! (FoX's forget gates) is `a = c_q`, `c = −c_k`; each pair is summed once, in f32, before it
//! meets the logit, as `c_i − c_j` would be.

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::limits::check_elements;

/// A bias `a_i + c_j` per head, optionally another pair for the keys after each query's own
/// token; see the module docs.
///
/// # Shapes
/// Queries' values `(1|B, 1|H, Tq)`, keys' values `(1|B, 1|H, Tk)`; the bias they stand for is
/// `(1|B, 1|H, Tq, Tk)`.
#[derive(Debug, Clone)]
pub struct SeparableBias {
    queries: Tensor,
    keys: Tensor,
    /// The pair for keys after query i's own token (key `first + i`), and `first`.
    after: Option<(Tensor, Tensor, usize)>,
}

/// Which keys of query row `i` a pair of a [`SeparableBias`] covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeySide {
    /// Every key.
    All,
    /// Keys `j ≤ first + i`.
    UpTo(usize),
    /// Keys `j > first + i`.
    After(usize),
}

impl KeySide {
    /// The keys of row `i` this side covers among `j0..j0 + n`, counted from `j0`.
    #[inline(always)]
    pub(crate) fn range(self, i: usize, j0: usize, n: usize) -> (usize, usize) {
        let split = |first: usize| (first + i + 1).saturating_sub(j0).min(n);
        match self {
            KeySide::All => (0, n),
            KeySide::UpTo(first) => (0, split(first)),
            KeySide::After(first) => (split(first), n),
        }
    }
}

impl SeparableBias {
    /// `queries[b, h, i] + keys[b, h, j]` for every key.
    ///
    /// # Errors
    /// [`Error::Rank`] unless both are 3-D; [`Error::DType`] for integer values;
    /// [`Error::Shape`] if their batch or head axes are neither 1 nor equal.
    pub fn new(queries: Tensor, keys: Tensor) -> Result<Self> {
        check_pair(&queries, &keys)?;
        Ok(Self {
            queries,
            keys,
            after: None,
        })
    }

    /// The same bias with `queries[b, h, i] + keys[b, h, j]` for the keys after query `i`'s
    /// own token, key `first + i` (the pair given to [`Self::new`] keeps the keys up to it).
    ///
    /// # Errors
    /// As [`Self::new`], for this pair.
    pub fn with_after(mut self, queries: Tensor, keys: Tensor, first: usize) -> Result<Self> {
        check_pair(&queries, &keys)?;
        self.after = Some((queries, keys, first));
        Ok(self)
    }

    /// The queries' values of the first pair, `(1|B, 1|H, Tq)`.
    pub fn queries(&self) -> &Tensor {
        &self.queries
    }

    /// The keys' values of the first pair, `(1|B, 1|H, Tk)`.
    pub fn keys(&self) -> &Tensor {
        &self.keys
    }

    /// The pair for the keys after each query's own token and the key index of query 0's own
    /// token, when given.
    pub fn after(&self) -> Option<(&Tensor, &Tensor, usize)> {
        self.after.as_ref().map(|(q, k, f)| (q, k, *f))
    }

    /// Every pair with the keys it covers.
    pub(crate) fn parts(&self) -> Vec<(&Tensor, &Tensor, KeySide)> {
        match &self.after {
            None => vec![(&self.queries, &self.keys, KeySide::All)],
            Some((q, k, first)) => vec![
                (&self.queries, &self.keys, KeySide::UpTo(*first)),
                (q, k, KeySide::After(*first)),
            ],
        }
    }

    /// Whether any of its tensors tracks gradients.
    pub(crate) fn track_op(&self) -> bool {
        self.parts()
            .iter()
            .any(|(q, k, _)| q.track_op() || k.track_op())
    }

    /// Every tensor through `f` (a cast), the pairs kept.
    pub(crate) fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let mut out = Self::new(f(&self.queries)?, f(&self.keys)?)?;
        if let Some((q, k, first)) = &self.after {
            out = out.with_after(f(q)?, f(k)?, *first)?;
        }
        Ok(out)
    }

    /// Checks the values against a query block of `(B, H, Tq, Tk)` logits.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the expected shape.
    pub(crate) fn check_block(&self, (b, h, tq, tk): (usize, usize, usize, usize)) -> Result<()> {
        for (q, k, _) in self.parts() {
            for (what, t, len, axis) in [
                ("separable bias (queries' values)", q, tq, "queries"),
                ("separable bias (keys' values)", k, tk, "keys"),
            ] {
                let (tb, th, n) = t.dims3()?;
                if (tb != 1 && tb != b) || (th != 1 && th != h) || n != len {
                    return Err(Error::shape(
                        what,
                        format!("(1 or {b}, 1 or {h}, {len}) = (batch, heads, {axis})"),
                        t.shape(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The bias for `tq` queries and `tk` keys as a dense `(1|B, 1|H, Tq, Tk)` tensor, each
    /// pair summed once; gradients flow to every pair.
    ///
    /// # Errors
    /// [`Error::Shape`] if the values do not fit `tq` and `tk`; [`Error::InvalidConfig`] if the
    /// result would pass [`crate::limits::max_elements`].
    pub fn to_dense(&self, tq: usize, tk: usize) -> Result<Tensor> {
        let (qb, qh, _) = self.queries.dims3()?;
        let (kb, kh, _) = self.keys.dims3()?;
        let (b, h) = (qb.max(kb), qh.max(kh));
        self.check_block((b, h, tq, tk))?;
        check_elements(
            "queries × keys",
            format_args!("{tq} × {tk}"),
            "batch × heads × queries × keys of a dense separable bias",
            &[b, h, tq, tk],
        )?;
        let sum = |q: &Tensor, k: &Tensor| -> Result<Tensor> {
            Ok(q.unsqueeze(3)?.broadcast_add(&k.unsqueeze(2)?)?)
        };
        let before = sum(&self.queries, &self.keys)?;
        let Some((q, k, first)) = &self.after else {
            return Ok(before);
        };
        let after = sum(q, k)?;
        let shape = (
            before.dim(0)?.max(after.dim(0)?),
            before.dim(1)?.max(after.dim(1)?),
            tq,
            tk,
        );
        let later: Vec<u8> = (0..tq)
            .flat_map(|i| (0..tk).map(move |j| u8::from(j > first + i)))
            .collect();
        let later = Tensor::from_vec(later, (1, 1, tq, tk), before.device())?;
        Ok(later
            .broadcast_as(shape)?
            .where_cond(&after.broadcast_as(shape)?, &before.broadcast_as(shape)?)?)
    }
}

/// A pair's values: 3-D floats whose batch and head axes are 1 or agree.
fn check_pair(queries: &Tensor, keys: &Tensor) -> Result<()> {
    for (what, t) in [
        ("separable bias (queries' values)", queries),
        ("separable bias (keys' values)", keys),
    ] {
        if t.rank() != 3 {
            return Err(Error::Rank {
                what,
                expected: 3,
                got: t.rank(),
                shape: t.dims().to_vec(),
            });
        }
        crate::error::check_float(what, t.dtype())?;
    }
    let (qd, kd) = (queries.dims(), keys.dims());
    let agree = |a: usize, b: usize| a == b || a == 1 || b == 1;
    if !(agree(qd[0], kd[0]) && agree(qd[1], kd[1])) || queries.dtype() != keys.dtype() {
        return Err(Error::shape(
            "separable bias (keys' values)",
            format!(
                "(1 or {}, 1 or {}, keys) in {} like the queries' values",
                qd[0],
                qd[1],
                queries.dtype().as_str()
            ),
            keys.shape(),
        ));
    }
    Ok(())
}
