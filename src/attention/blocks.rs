//! Query blocks: the chunk's queries in blocks of bounded logits, each against the keys it can
//! see, on the execution path chosen once per call.
//!
//! ```text
//! for each block [s, s + n) of queries:
//!     keys 0..kv  (kv = Tk, or under a plain causal mask the last key the block sees)
//!     bias  = enc.logits_bias(q[s..s+n], ctx)       dense, or rows per clamped column
//!     terms = bias + attn_mask                      consumed as the path reads them
//!     out[s..s+n] = softmax(q kᵀ + terms, masked) v + enc.value_term(ctx)
//! ```
//!
//! The encoding's answers are data; this file decides how each path consumes them: the fused
//! core and the row pass read shifted rows in place and every other form through its broadcast
//! strides; plain ops expand everything to `(B, H, n, kv)`.

use candle_core::{DType, Tensor};

use super::cuda::{CudaCore, Mode};
use super::dropout::Dropout;
use super::fused_attention;
use super::fused_softmax::{RowRule, SeparableTerm};
use super::fused_training;
use super::mask::{cast_mask, widened_mask};
use super::unfused;
use crate::error::{check_device, check_float, largest_finite, overflowed, shown, Error, Result};
use crate::limits::check_elements;
use crate::plug::{
    AttentionContext, Columns, Footprint, LogitsBias, PositionalEncoding, RelativeBias,
    RelativeValues, TokenStates,
};
use crate::positions::Positions;

/// The execution path of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// The fused CPU core: f32 inference without returned weights.
    Fused,
    /// Products as candle ops, bias, masks and softmax in one in-place pass: f32 CPU
    /// inference returning the weights.
    RowPass,
    /// The fused CPU core with its fused backward: f32 training without returned weights.
    FusedTrain,
    /// Candle ops throughout (training, other dtypes and devices): differentiable.
    Ops,
    /// The fused CUDA kernels (`cuda/`), inference or training, without returned weights,
    /// where the switch lets them ([`crate::cuda`]; by default, what has passed on a GPU);
    /// never chosen without the `cuda` feature.
    Cuda(Mode),
}

impl Path {
    /// Whether the path reads relative rows with shifted columns as they are (the fused
    /// paths), rather than expanded to a dense bias.
    fn reads_rows(self) -> bool {
        match self {
            Path::Fused | Path::FusedTrain | Path::RowPass | Path::Cuda(_) => true,
            Path::Ops => false,
        }
    }

    /// Whether the path reads a separable bias as its pairs and mixed rows as their mix and
    /// bank (the CPU's fused paths), rather than summed to a dense bias or built rows.
    fn reads_pairs(self) -> bool {
        matches!(self, Path::Fused | Path::FusedTrain | Path::RowPass)
    }

    /// Whether the path is a fused core (CPU or CUDA), which allocates no logits and reads
    /// grouped KV heads in place.
    fn is_fused(self) -> bool {
        match self {
            Path::Fused | Path::FusedTrain | Path::Cuda(_) => true,
            Path::RowPass | Path::Ops => false,
        }
    }

    /// Columns per query the path keeps beside a value term of `width` rows (the CUDA
    /// backward's two `(B, H, Tq, W)` tensors); none on the other paths.
    fn kept_columns(self, width: usize) -> usize {
        match self {
            Path::Cuda(mode) => mode.kept_columns(width),
            _ => 0,
        }
    }

    /// Whether the path returns each block token-major, `(B, n, H, D)` (the training cores),
    /// rather than `(B, H, n, D)` (candle's ops) or into a merged output.
    fn token_major(self) -> bool {
        match self {
            Path::FusedTrain => true,
            Path::Cuda(mode) => mode.trains(),
            _ => false,
        }
    }

    /// The path for rotated `q` (not yet scaled), `k` and `v`, and the dtype it computes in:
    /// the CUDA kernels where they are on and take the call; on the CPU a fused core or the
    /// row pass for f32, and the fused core in f32 for a half-precision block without
    /// gradients or returned weights; plain ops otherwise.
    fn choose(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        differentiable: bool,
        weights: bool,
        dropout: bool,
    ) -> (Path, Compute) {
        let tracked = [q, k, v].iter().any(|t| t.track_op());
        let grads = differentiable || tracked;
        if let Some(mode) = Mode::choose((q, k, v), grads, weights, dropout) {
            return (Path::Cuda(mode), Compute::AsGiven);
        }
        // (The scaled queries are a fresh, packed tensor.)
        let cpu = [q, k, v]
            .iter()
            .all(|t| t.device().is_cpu() && t.rank() == 4)
            && [k, v].iter().all(|t| t.layout().stride()[3] == 1);
        let half = matches!(v.dtype(), DType::BF16 | DType::F16);
        let compute = match !differentiable && !weights && cpu && half {
            true => Compute::F32 {
                tiles: q.dim(2).is_ok_and(|t| t <= DECODE_QUERIES),
            },
            false => Compute::AsGiven,
        };
        let [qd, kd, vd] = compute.dtypes([q, k, v]);
        let f32s = [qd, kd, vd].iter().all(|&d| d == DType::F32);
        // A decoding step of a half-precision block: f32 queries, and keys and values as
        // cached, which the core widens a tile at a time.
        let half_cache = qd == DType::F32 && matches!(kd, DType::BF16 | DType::F16) && vd == kd;
        let path = match (grads, cpu, weights) {
            (false, true, false) if f32s || half_cache => Path::Fused,
            (false, true, true) if f32s => Path::RowPass,
            (true, true, false) if f32s => Path::FusedTrain,
            _ => Path::Ops,
        };
        (path, compute)
    }
}

/// Queries per call up to which a half-precision block's fused core reads the cached keys and
/// values in their dtype, widening a tile at a time (each query tile widens every key tile
/// again, so past a few queries widening the whole cache once is cheaper).
const DECODE_QUERIES: usize = 16;

/// The dtype a path computes in, and how the chunk's operands reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compute {
    /// q, k and v as given.
    AsGiven,
    /// f32 (a half-precision block on the CPU's fused core, whose heads return to the block's
    /// dtype before the output projection): the queries widened, and the keys and values
    /// widened once, or, with `tiles` (a decoding step), left as cached for the core to widen a
    /// key tile at a time, so that a step reads the cache once and allocates nothing that
    /// grows with it.
    F32 { tiles: bool },
}

impl Compute {
    /// The dtypes of q, k and v as the path reads them.
    fn dtypes(self, [q, k, v]: [&Tensor; 3]) -> [DType; 3] {
        match self {
            Compute::AsGiven => [q.dtype(), k.dtype(), v.dtype()],
            Compute::F32 { tiles: true } => [DType::F32, k.dtype(), v.dtype()],
            Compute::F32 { tiles: false } => [DType::F32; 3],
        }
    }
}

/// Everything the query blocks of one call share.
pub(crate) struct Chunk<'a> {
    /// `(B, H, T, D)`, rotated; scaled (and widened, where the path computes in f32) by
    /// [`Chunk::attend`] before any block runs.
    pub(crate) q: Tensor,
    /// The softmax scale, `1/√D` unless configured.
    pub(crate) scale: f64,
    /// Whether `q` comes scaled already (by its projection).
    pub(crate) q_scaled: bool,
    /// `(B, Hkv, Tk, D)`, cached keys included.
    pub(crate) k: Tensor,
    /// `(B, Hkv, Tk, D)`.
    pub(crate) v: Tensor,
    /// The features of each value head that are values (latent attention pads its
    /// `v_head_dim` to `D` with zeros, cut before the output projection); `D` otherwise.
    pub(crate) value_dim: usize,
    pub(crate) q_positions: &'a Positions,
    pub(crate) k_positions: &'a Positions,
    /// Additive mask broadcast to `(B, H, T, Tk)`.
    pub(crate) attn_mask: Option<Tensor>,
    /// `(B, Tk)` u8, non-zero = keep.
    pub(crate) padding: Option<Tensor>,
    pub(crate) causal: bool,
    /// Sliding window: each query sees its last `w` keys (causal) or those within `w` of it.
    pub(crate) window: Option<usize>,
    /// Chunked attention: each (causal) query sees only keys of its own chunk.
    pub(crate) chunk: Option<usize>,
    /// Soft cap of the `q·k` logits.
    pub(crate) softcap: Option<f64>,
    /// `(H)` learned sink logits.
    pub(crate) sinks: Option<&'a Tensor>,
    /// Training mode: dropout on.
    pub(crate) train: bool,
    /// Gradients wanted: the differentiable softmax.
    pub(crate) differentiable: bool,
    /// Dropout on the weights in training.
    pub(crate) dropout: f32,
    /// The seed of the fused training core's dropout.
    pub(crate) dropout_seed: u64,
    /// Queries per block.
    pub(crate) block: usize,
    /// Bytes per query block of logits ([`super::AttentionConfig::logits_budget`]); on the
    /// fused paths, of answers per query.
    pub(crate) logits_budget: usize,
    pub(crate) return_weights: bool,
    pub(crate) encoding: Option<&'a dyn PositionalEncoding>,
    /// `(B, C, Tk)`: every key's per-token states, for an encoding that reads the block's
    /// input (the chunk's tokens are the last `T`).
    pub(crate) states: Option<Tensor>,
}

/// One query block's inputs, narrowed from the chunk.
pub(crate) struct Block<'a> {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) padding: Option<&'a Tensor>,
    /// Which keys each row sees, the soft cap, and (on the fused paths) the sinks' values.
    pub(crate) rule: RowRule,
    /// `(H)` sink logits, for plain ops.
    pub(crate) sinks: Option<&'a Tensor>,
}

/// The attention of a chunk: `(B, T, H, D)` outputs (heads not yet merged) and, when asked
/// for, the `(B, H, T, Tk)` weights.
pub(crate) struct Attended {
    pub(crate) out: Tensor,
    pub(crate) weights: Option<Tensor>,
}

/// An encoding's answers for one query block.
type Answers = (Option<LogitsBias>, Option<RelativeValues>);

/// What [`Chunk::attend`] settles before its first query block runs.
struct Plan {
    path: Path,
    /// The query blocks, `(start, queries, keys seen)`.
    spans: Vec<(usize, usize, usize)>,
    /// The first block's answers, computed while the plan was made.
    first: Option<Answers>,
    /// Gradients flow: asked for, or the encoding's answers track them.
    differentiable: bool,
}

/// Keys and values as a plan's path reads them, and what the blocks share.
struct Operands {
    k: Tensor,
    v: Tensor,
    /// The fused inference cores' output `(B, T, H, D)`, written block by block.
    merged: Option<Tensor>,
    /// The sinks' values, for the CPU paths.
    host_sinks: Option<Vec<f32>>,
}

/// Whether an encoding's answers track gradients (learned biases or tables in a graph).
fn tracks((bias, values): &Answers) -> bool {
    let bias = match bias {
        Some(LogitsBias::Dense(t)) => t.track_op(),
        Some(LogitsBias::Relative(r)) => r.track_op(),
        Some(LogitsBias::Separable(s)) => s.track_op(),
        None => false,
    };
    bias || values.as_ref().is_some_and(|v| v.table().track_op())
}

/// The path once the first block's answers are known: answers that track gradients leave
/// the inference paths for the fused training core where it gives them their gradients, and
/// for candle's ops elsewhere.
fn rechoose(path: Path, tracked: bool, first: Option<&Answers>) -> Path {
    match (path, tracked) {
        (Path::Fused | Path::FusedTrain, true) => match first.is_some_and(fused_grads) {
            true => Path::FusedTrain,
            false => Path::Ops,
        },
        (Path::Cuda(mode), _) => {
            let answers = first.map_or((None, None), |(b, v)| (b.as_ref(), v.as_ref()));
            mode.rechoose(tracked, answers)
                .map_or(Path::Ops, Path::Cuda)
        }
        (path, false) => path,
        (_, true) => Path::Ops,
    }
}

impl Chunk<'_> {
    /// Runs every query block on `path`, or on plain ops when the encoding's answers track
    /// gradients (learned biases or tables in a graph): the path is still chosen once, from
    /// the first block's answers.
    pub(crate) fn attend(mut self) -> Result<Attended> {
        let dropout = self.train && self.dropout > 0.0;
        let (path, compute) = Path::choose(
            &self.q,
            &self.k,
            &self.v,
            self.differentiable,
            self.return_weights,
            dropout,
        );
        self.prepare(compute)?;
        let mut plan = self.plan(path)?;
        let operands = self.operands(&plan)?;
        let (mut outs, mut weights) = (Vec::new(), Vec::new());
        for &span in &plan.spans {
            let answers = match plan.first.take() {
                Some(answers) => answers,
                None => self.answers(span)?,
            };
            let out = self.run_block(&plan, &operands, span, answers, &mut weights)?;
            outs.extend(out);
        }
        let out = match (operands.merged, plan.path.token_major()) {
            (Some(merged), _) => merged,
            (None, true) => cat(outs, 1)?,
            (None, false) => cat(outs, 2)?.transpose(1, 2)?,
        };
        let weights = match weights.is_empty() {
            true => None,
            false => Some(cat(weights, 2)?),
        };
        Ok(Attended { out, weights })
    }

    /// The queries scaled, in the dtype the path computes in, with the keys and values it
    /// reads widened (`compute`).
    fn prepare(&mut self, compute: Compute) -> Result<()> {
        let q = match compute {
            Compute::F32 { .. } => self.q.to_dtype(DType::F32)?,
            Compute::AsGiven => self.q.clone(),
        };
        // (The fused cores read packed queries: a fresh tensor, or the projection's own.)
        self.q = match self.q_scaled {
            true => q.contiguous()?,
            false => (q * self.scale)?,
        };
        if compute == (Compute::F32 { tiles: false }) {
            self.k = self.k.to_dtype(DType::F32)?;
            self.v = self.v.to_dtype(DType::F32)?;
        }
        Ok(())
    }

    /// The call's plan: the path (as chosen, or candle's ops where the first block's answers
    /// need them), the query blocks sized from what the encoding declares
    /// ([`Footprint`]) and refitted to the first block's answers, and whether gradients flow.
    fn plan(&self, path: Path) -> Result<Plan> {
        let (t, tk) = (self.q.dim(2)?, self.k.dim(2)?);
        // With a plain causal mask, block [s, s + n) sees keys 0..s + n + tk − t only (no row is
        // fully masked, so dropping the hidden keys changes nothing); otherwise every key.
        let trim_keys = self.causal && self.padding.is_none() && self.attn_mask.is_none();
        let spans = blocks_of(t, tk, self.declared_block(path)?, trim_keys);
        let first = match spans.first() {
            Some(&span) => Some(self.answers(span)?),
            None => None,
        };
        let tracked = first.as_ref().is_some_and(tracks);
        let path = rechoose(path, tracked, first.as_ref());
        let mut plan = Plan {
            path,
            spans,
            first,
            differentiable: self.differentiable || tracked,
        };
        self.refit(&mut plan, trim_keys)?;
        self.check_kept_logits(&plan)?;
        Ok(plan)
    }

    /// Queries per block on `path` before any answer is known. Off the fused cores, and for an
    /// encoding that declares nothing, the logits' block. The fused cores allocate no logits:
    /// without an encoding every query is one block, and for declared rows per query as many
    /// queries as the logits budget holds of them.
    fn declared_block(&self, path: Path) -> Result<usize> {
        let (b, h, t, _) = self.q.dims4()?;
        if !path.is_fused() {
            return Ok(self.block);
        }
        let Some(encoding) = self.encoding else {
            return Ok(t);
        };
        let tk = self.k.dim(2)?;
        let ctx = self.context(self.q_positions, t, self.k_positions, tk);
        Ok(match encoding.footprint(&ctx) {
            Footprint::Rows { bias, values } => {
                match bias.saturating_add(path.kept_columns(values)) {
                    0 => t,
                    width => self.rows_block(b * h, width),
                }
            }
            _ => self.block,
        })
    }

    /// The query blocks refitted to the first block's answers: the logits' blocks off the fused
    /// cores; on them every query in one block when the answers do not grow with the queries,
    /// and blocks shrunk to what the budget holds when their rows are wider than declared (or
    /// than the logits' block, for rows nothing declared: those blocks never grow).
    fn refit(&self, plan: &mut Plan, trim_keys: bool) -> Result<()> {
        let Some(first) = plan.first.as_ref() else {
            return Ok(());
        };
        let (b, h, t, _) = self.q.dims4()?;
        let tk = self.k.dim(2)?;
        let current = plan.spans[0].1;
        let kept = value_rows(plan.path, first)?;
        let want = match (plan.path.is_fused(), per_query_width(plan.path, first)) {
            (false, _) => self.block,
            (true, _) if kept == 0 && shared_answers(first) => t,
            (true, Some(width)) => current.min(self.rows_block(b * h, width.saturating_add(kept))),
            (true, None) if shared_answers(first) => current.min(self.rows_block(b * h, kept)),
            (true, None) => current.min(self.block),
        };
        if want != current {
            plan.spans = blocks_of(t, tk, want, trim_keys);
            plan.first = Some(self.answers(plan.spans[0])?);
        }
        Ok(())
    }

    /// candle's ops keep every query block's logits (and their softmax's intermediates) for
    /// the backward, so a differentiable call on them holds its whole `(B, H, T, Tk)`: the
    /// query blocks bound its memory only in inference.
    fn check_kept_logits(&self, plan: &Plan) -> Result<()> {
        if !(plan.differentiable && plan.path == Path::Ops) {
            return Ok(());
        }
        let (b, h, t, _) = self.q.dims4()?;
        let tk = self.k.dim(2)?;
        check_elements(
            "sequence length",
            t,
            format_args!(
                "batch ({b}) × heads ({h}) × queries ({t}) × keys ({tk}) of the logits \
                 that candle's ops keep for the backward (a differentiable call off the \
                 fused paths)"
            ),
            &[b.max(1), h, t, tk],
        )?;
        Ok(())
    }

    /// Keys and values as the plan's path reads them, the fused cores' output buffer, and the
    /// sinks' values for the CPU paths.
    fn operands(&self, plan: &Plan) -> Result<Operands> {
        let (b, h, t, d) = self.q.dims4()?;
        let hkv = self.k.dim(1)?;
        let path = plan.path;
        // Half-precision keys and values next to f32 queries are read by the inference core
        // only; any other path gets them widened.
        let (k, v) = match (path, self.k.dtype() == self.q.dtype()) {
            (Path::Fused, _) | (_, true) => (self.k.clone(), self.v.clone()),
            _ => (
                self.k.to_dtype(self.q.dtype())?,
                self.v.to_dtype(self.q.dtype())?,
            ),
        };
        let (k, v) = match path.is_fused() {
            true => (k, v), // grouped heads read in place
            _ => (repeat_kv(&k, h / hkv)?, repeat_kv(&v, h / hkv)?),
        };
        let merged = match path {
            Path::Fused => Some(Tensor::zeros((b, t, h, d), DType::F32, self.q.device())?),
            Path::Cuda(mode) => mode.output(&self.q)?,
            _ => None,
        };
        let host_sinks = match (path, self.sinks) {
            (Path::Fused | Path::FusedTrain | Path::RowPass, Some(s)) => {
                Some(s.to_dtype(DType::F32)?.to_vec1::<f32>()?)
            }
            _ => None,
        };
        Ok(Operands {
            k,
            v,
            merged,
            host_sinks,
        })
    }

    /// Runs the query block `(start, n, kv)` with its `answers` on the plan's path: written
    /// into the merged output, or returned (and its weights pushed to `weights`).
    fn run_block(
        &self,
        plan: &Plan,
        operands: &Operands,
        (start, n, kv): (usize, usize, usize),
        (bias, values): Answers,
        weights: &mut Vec<Tensor>,
    ) -> Result<Option<Tensor>> {
        let (b, h, t, _) = self.q.dims4()?;
        let tk = self.k.dim(2)?;
        let path = plan.path;
        let part = Block {
            q: narrowed(&self.q, 2, start, n, t)?,
            k: narrowed(&operands.k, 2, 0, kv, tk)?,
            v: narrowed(&operands.v, 2, 0, kv, tk)?,
            padding: self.padding.as_ref(),
            rule: RowRule {
                first: start + tk - t,
                causal: self.causal,
                window: self.window,
                chunk: self.chunk,
                softcap: self.softcap.map(|c| c as f32),
                sinks: operands.host_sinks.clone(),
            },
            sinks: self.sinks,
        };
        let mask = self
            .attn_mask
            .as_ref()
            .map(|m| narrowed(m, 2, start, n, t))
            .transpose()?;
        let terms = LogitTerms::new(bias, mask, (b, h, n, kv), path, &self.q)?;
        if let Path::Cuda(mode) = path {
            let core = self.cuda_core(&part, &terms, values.as_ref());
            return mode.run(&core, operands.merged.as_ref(), start);
        }
        let core = || fused_attention::Core {
            q: &part.q,
            k: &part.k,
            v: &part.v,
            dense: terms.dense.iter().collect(),
            dense_masks: self.attn_mask.is_some(),
            relative: terms.rows.iter().collect(),
            separable: terms.separable.iter().collect(),
            padding: part.padding,
            rule: &part.rule,
            values: values.as_ref(),
            tile: fused_attention::tile_rows(kv),
            key_tile: fused_attention::KEY_TILE,
        };
        if let Some(merged) = &operands.merged {
            core().write_into(merged, start)?;
            return Ok(None);
        }
        if path == Path::FusedTrain {
            let train = fused_training::TrainCore {
                core: core(),
                sinks: self.sinks,
                tiles: fused_training::Tiles::default(),
                dropout: (self.train && self.dropout > 0.0).then_some(Dropout {
                    p: self.dropout,
                    seed: self.dropout_seed,
                }),
            };
            return Ok(Some(train.attend()?));
        }
        let row_pass = path == Path::RowPass;
        let dropout = if self.train { self.dropout } else { 0.0 };
        let (probs, out) = unfused::attend(
            &part,
            &terms,
            values.as_ref(),
            row_pass,
            plan.differentiable,
            dropout,
        )?;
        if self.return_weights {
            weights.push(pad_keys(probs, tk)?);
        }
        Ok(Some(out))
    }

    /// A query block as the CUDA path reads it.
    fn cuda_core<'b>(
        &'b self,
        part: &'b Block,
        terms: &'b LogitTerms,
        values: Option<&'b RelativeValues>,
    ) -> CudaCore<'b> {
        CudaCore {
            q: &part.q,
            k: &part.k,
            v: &part.v,
            dense: &terms.dense,
            dense_masks: self.attn_mask.is_some(),
            relative: &terms.rows,
            padding: part.padding,
            rule: &part.rule,
            sinks: self.sinks,
            values,
        }
    }

    /// Query rows per block for answers holding `width` values per query of each of `heads`
    /// batch items × heads: as many as the logits budget holds (in f32), at least the logits'
    /// own block, at most every query.
    fn rows_block(&self, heads: usize, width: usize) -> usize {
        let row = heads.saturating_mul(width).saturating_mul(4).max(1);
        (self.logits_budget / row)
            .max(self.block)
            .min(self.q.dim(2).unwrap_or(0))
    }

    /// The context of `n` queries at `queries` against `kv` keys at `keys` in this chunk.
    fn context<'p>(
        &self,
        queries: &'p Positions,
        n: usize,
        keys: &'p Positions,
        kv: usize,
    ) -> AttentionContext<'p> {
        AttentionContext::new(queries, n, keys, kv)
            .with_causal(self.causal)
            // A row masked whole (padding, a user's mask) is uniform over every key, the unseen
            // ones included: only without those are unseen keys' answers never read.
            .with_masks_unseen(self.padding.is_none() && self.attn_mask.is_none())
            .with_train(self.train)
            .with_sinks(self.sinks.is_some())
    }

    /// The encoding's answers for the query block `(start, n, kv)`, checked where the block's
    /// paths do not check them again.
    fn answers(&self, (start, n, kv): (usize, usize, usize)) -> Result<Answers> {
        let Some(e) = self.encoding else {
            return Ok((None, None));
        };
        let (b, _, t, d) = self.q.dims4()?;
        let tk = self.k.dim(2)?;
        let q_positions = narrowed_positions(self.q_positions, start, n, t)?;
        let k_positions = narrowed_positions(self.k_positions, 0, kv, tk)?;
        // Query row i's own token is key start + tk − t + i.
        let first = start + tk - t;
        let states = self
            .states
            .as_ref()
            .map(|s| -> Result<TokenStates> {
                Ok(TokenStates {
                    queries: narrowed(s, 2, first, n, tk)?,
                    keys: narrowed(s, 2, 0, kv, tk)?,
                    first,
                })
            })
            .transpose()?;
        let ctx = self
            .context(&q_positions, n, &k_positions, kv)
            .with_states(states.as_ref());
        let q = narrowed(&self.q, 2, start, n, t)?;
        let (bias, values) = (e.logits_bias(&q, &ctx)?, e.value_term(&ctx)?);
        if let Some(values) = &values {
            check_device("relative value table", values.table(), self.q.device())?;
            // A table's rows past the values' own features would be added to their zero
            // padding and cut with it.
            if self.value_dim != d {
                return Err(Error::shape(
                    "relative value table",
                    format!(
                        "no value term on a block whose values are {} features wide, narrower \
                         than its {d}-wide heads (latent attention's v_head_dim)",
                        self.value_dim
                    ),
                    values.table().shape(),
                ));
            }
            values.check_block(b, n, kv, d)?;
        }
        Ok((bias, values))
    }
}

/// The dtype every path adds dense terms (a mask, an encoding's dense bias) to the logits in,
/// for a block computing in `dtype`: f32 at least (f64 for an f64 block). A term rounded to a
/// half format first loses what the logits keep: ALiBi's causal row of a long prefill holds
/// `m·(j − i_last)` down to `−m·T`, which bf16 rounds by whole units (a bf16 block on candle's
/// ops was 21% of the largest output off f64 at T = 600, and the CUDA kernel failed a decoding
/// test by it).
fn terms_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The additive terms of one query block's logits, in the forms its path reads.
pub(crate) struct LogitTerms {
    /// Broadcastable to `(B, H, n, kv)`, in the dtype every path adds them in
    /// ([`terms_dtype`]).
    pub(crate) dense: Vec<Tensor>,
    /// f32 rows with shifted columns (fused core and row pass only).
    pub(crate) rows: Vec<RelativeBias>,
    /// f32 separable pairs, packed (the CPU's fused core and row pass only).
    pub(crate) separable: Vec<SeparableTerm>,
}

impl LogitTerms {
    /// Checks the encoding's bias and the mask against the block's `dims` and converts them to
    /// what `path` reads: shifted rows stay rows on the fused paths; everything else is dense,
    /// in f32 (f64 for an f64 block; a mask of a half format widened, a wider one saturated).
    pub(super) fn new(
        bias: Option<LogitsBias>,
        mask: Option<Tensor>,
        dims: (usize, usize, usize, usize),
        path: Path,
        q: &Tensor,
    ) -> Result<Self> {
        let (dtype, device) = (terms_dtype(q.dtype()), q.device());
        let mut terms = Self {
            dense: Vec::new(),
            rows: Vec::new(),
            separable: Vec::new(),
        };
        if let Some(mask) = mask {
            // A half-format mask widened (its lowest value becomes the wider format's lowest);
            // a wider one kept, saturated to the terms' range (f64::MIN for f32 logits).
            terms.dense.push(match mask.dtype() {
                DType::F16 | DType::BF16 => widened_mask(&mask, dtype)?,
                _ => cast_mask(&mask, dtype)?,
            });
        }
        match bias {
            None => {}
            Some(LogitsBias::Dense(t)) => {
                check_device("dense logits bias", &t, device)?;
                check_float("dense logits bias from the encoding", t.dtype())?;
                t.broadcast_as(dims).map_err(|_| {
                    Error::shape(
                        "dense logits bias from the encoding",
                        format!(
                            "a shape broadcastable to {dims:?} = (batch, heads, queries, keys)"
                        ),
                        t.shape(),
                    )
                })?;
                terms
                    .dense
                    .push(bias_in("dense logits bias from the encoding", &t, dtype)?);
            }
            Some(LogitsBias::Relative(r)) => {
                let rows = match r.mixed_rows() {
                    Some(m) => m.mix().clone(),
                    None => r.values()?,
                };
                check_device("relative logits bias", &rows, device)?;
                r.check_block(dims)?;
                let what = "relative logits bias from the encoding";
                match (path.reads_rows(), r.columns()) {
                    // Mixed rows stay mixed (each factor cast) where the CPU's passes read
                    // them; the CUDA kernels read rows built from f32 factors (Inkling's
                    // rows built in bf16 and cast after missed the f64 block by 1.4% there).
                    (true, Columns::Shift(_)) => {
                        let f32_rows = r.map(|t| bias_in(what, t, DType::F32))?;
                        terms.rows.push(match (path.reads_pairs(), r.mixed_rows()) {
                            (false, Some(_)) => {
                                RelativeBias::new(f32_rows.values()?, r.columns().clone())?
                            }
                            _ => f32_rows,
                        })
                    }
                    // Each factor cast before the rows are built and expanded: the rows are
                    // what the bias holds, built in the dtype the path adds them in.
                    _ => terms.dense.push(
                        RelativeBias::new(
                            r.map(|t| bias_in(what, t, dtype))?.values()?,
                            r.columns().clone(),
                        )?
                        .to_dense(dims.2, dims.3)?,
                    ),
                }
            }
            Some(LogitsBias::Separable(s)) => {
                for (q, _, _) in s.parts() {
                    check_device("separable logits bias", q, device)?;
                }
                s.check_block(dims)?;
                let what = "separable logits bias from the encoding";
                match path.reads_pairs() {
                    true => terms.separable.extend(SeparableTerm::of(
                        &s.map(|t| bias_in(what, t, DType::F32))?,
                    )?),
                    // Each pair cast, then summed, as the fused paths add it.
                    false => terms.dense.push(
                        s.map(|t| bias_in(what, t, dtype))?
                            .to_dense(dims.2, dims.3)?,
                    ),
                }
            }
        }
        Ok(terms)
    }
}

/// `bias` (`what`: an encoding's answer) cast to `dtype`, the dtype its path adds it to the
/// logits in ([`terms_dtype`]). A finite value the cast would turn into ±∞ (an f64 bias past
/// f32's range) is refused: as a logit it would make its row NaN, or, saturated, weigh its
/// keys wrongly. NaN and ±∞ the encoding answered pass as they are.
///
/// # Errors
/// [`Error::InvalidConfig`] naming `what`, the largest such magnitude and `dtype`'s range.
fn bias_in(what: &'static str, bias: &Tensor, dtype: DType) -> Result<Tensor> {
    let cast = bias.to_dtype(dtype)?;
    match overflowed(bias, &cast)? {
        None => Ok(cast),
        Some(largest) => Err(Error::config(
            what,
            format!("a value of magnitude {largest:e}"),
            format!(
                "values within ±{} ({d}'s largest finite value), as the logits on this path are {d}: past it a finite bias becomes ±∞",
                shown(largest_finite(dtype).unwrap_or(f64::MAX)),
                d = dtype.as_str(),
            ),
        )),
    }
}

/// The query blocks `(start, queries, keys)` of `t` queries against `tk` keys, `block` queries
/// each; with `trim_keys` (a plain causal mask) each block sees only keys up to its last
/// query's.
fn blocks_of(t: usize, tk: usize, block: usize, trim_keys: bool) -> Vec<(usize, usize, usize)> {
    let mut spans = Vec::new();
    let mut start = 0;
    while start < t {
        let n = block.max(1).min(t - start);
        let kv = if trim_keys {
            (start + n + tk - t).min(tk)
        } else {
            tk
        };
        spans.push((start, n, kv));
        start += n;
    }
    spans
}

/// The width per query of an encoding's answers on `path` when it does not grow with the
/// keys: a relative bias with a row of `W` columns per query read through a shift (Shaw's
/// keys), or with its mix of `R` per query where the path reads mixed rows as they are (the
/// bank is shared), and no values or values through a shift.
fn per_query_width(path: Path, (bias, values): &Answers) -> Option<usize> {
    let width = match bias {
        Some(LogitsBias::Relative(r)) if matches!(r.columns(), Columns::Shift(_)) => {
            match (path.reads_pairs(), r.mixed_rows()) {
                (true, Some(m)) => m.bank().dims()[0],
                _ => r.width(),
            }
        }
        _ => return None,
    };
    values
        .as_ref()
        .is_none_or(|v| matches!(v.columns(), Columns::Shift(_)))
        .then_some(width)
}

/// Columns per query that `path` keeps beside an encoding's answers: the CUDA backward keeps
/// two `(B, H, Tq, W)` f32 tensors for a value term of `W` columns (dO · a, and the weights
/// its columns gather), whatever the bias; every other path, none.
///
/// # Errors
/// A value table without a first dimension.
fn value_rows(path: Path, (_, values): &Answers) -> Result<usize> {
    Ok(match values {
        Some(v) => path.kept_columns(v.table().dim(0)?),
        None => 0,
    })
}

/// Whether the fused backward gives every gradient an encoding's answers want: a tracked
/// dense bias must not vary per query (its gradient is summed per task, and a `(B, H, Tq, Tk)`
/// one would cost the logits the fused path avoids), nor a tracked relative bias read through
/// an index map (expanded to such a dense bias).
fn fused_grads((bias, _): &Answers) -> bool {
    match bias {
        Some(LogitsBias::Dense(t)) if t.track_op() => {
            let d = t.dims();
            d.len() < 2 || d[d.len() - 2] == 1
        }
        Some(LogitsBias::Relative(r)) if r.track_op() => {
            matches!(r.columns(), Columns::Shift(_))
        }
        // (A separable bias gets the row and column sums of dS.)
        _ => true,
    }
}

/// Whether an encoding's answers for a query block take the same memory for any number of
/// queries: no bias, or a bias with one row for every query (dense or shifted), and no values
/// or values read through a shift (not an index map per query).
fn shared_answers((bias, values): &Answers) -> bool {
    let one_row = |t: &Tensor| t.rank() == 4 && t.dims()[2] == 1;
    let bias = match bias {
        None => true,
        Some(LogitsBias::Dense(t)) => one_row(t),
        Some(LogitsBias::Relative(r)) => {
            r.dims().2 == 1 && matches!(r.columns(), Columns::Shift(_))
        }
        // One value per query and head: as small as a row of the output.
        Some(LogitsBias::Separable(_)) => true,
    };
    bias && values
        .as_ref()
        .is_none_or(|v| matches!(v.columns(), Columns::Shift(_)))
}

/// Repeats each KV head `n_rep` times: `(B, Hkv, T, D)` → `(B, Hkv·n_rep, T, D)`.
fn repeat_kv(t: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(t.clone());
    }
    let (b, hkv, len, d) = t.dims4()?;
    Ok(t.unsqueeze(2)?
        .broadcast_as((b, hkv, n_rep, len, d))?
        .reshape((b, hkv * n_rep, len, d))?)
}

/// `t.narrow(dim, start, len)`, or `t` itself when that is all of `total`.
fn narrowed(t: &Tensor, dim: usize, start: usize, len: usize, total: usize) -> Result<Tensor> {
    Ok(if start == 0 && len == total {
        t.clone()
    } else {
        t.narrow(dim, start, len)?
    })
}

/// The positions of tokens `start..start + len` of `total`.
fn narrowed_positions(p: &Positions, start: usize, len: usize, total: usize) -> Result<Positions> {
    if start == 0 && len == total {
        return Ok(p.clone());
    }
    p.narrow(start, len)
}

/// A block's `(B, H, n, kv)` weights with zeros for the `tk − kv` keys it did not see.
fn pad_keys(probs: Tensor, tk: usize) -> Result<Tensor> {
    let (b, h, n, kv) = probs.dims4()?;
    if kv == tk {
        return Ok(probs);
    }
    let hidden = Tensor::zeros((b, h, n, tk - kv), probs.dtype(), probs.device())?;
    Ok(Tensor::cat(&[&probs, &hidden], 3)?)
}

/// The tensors concatenated along `dim` (one tensor is returned as is).
fn cat(mut parts: Vec<Tensor>, dim: usize) -> Result<Tensor> {
    Ok(match parts.len() {
        1 => parts.swap_remove(0),
        _ => Tensor::cat(&parts, dim)?,
    })
}

#[cfg(test)]
pub(crate) mod terms {
    use candle_core::{DType, Device, Tensor};

    use super::{LogitTerms, Path};
    use crate::plug::LogitsBias;

    /// ALiBi's causal row of a 600-token prefill, `0.25·(j − 599)` down to −149.75, and the
    /// terms `path` builds from it for a bf16 block, given as both a dense bias and a mask
    /// (in that order in `dense`: the mask, then the bias).
    pub(crate) fn long_row_terms(path: Path) -> anyhow::Result<(Vec<f32>, LogitTerms)> {
        let dev = Device::Cpu;
        let row: Vec<f32> = (0..600).map(|j| 0.25 * (j as f32 - 599.0)).collect();
        let bias = Tensor::from_vec(row.clone(), (1, 1, 1, 600), &dev)?;
        let q = Tensor::zeros((1, 1, 600, 64), DType::BF16, &dev)?;
        let terms = LogitTerms::new(
            Some(LogitsBias::Dense(bias.clone())),
            Some(bias),
            (1, 1, 600, 600),
            path,
            &q,
        )?;
        Ok((row, terms))
    }

    /// Every path (the CUDA kernels' too: `attention::cuda`'s tests) takes a bf16 block's dense
    /// terms and masks in f32, unrounded: where bf16 steps by whole units, candle's ops were 21%
    /// of the largest output off f64 by that rounding, and decoding with ALiBi after 600 cached
    /// keys failed on an H100 by it; an f32 mask keeps its low bits too. Builds the terms only.
    #[test]
    fn dense_terms_and_masks_reach_every_path_unrounded() -> anyhow::Result<()> {
        for path in [Path::Ops, Path::Fused, Path::RowPass, Path::FusedTrain] {
            let (row, terms) = long_row_terms(path)?;
            for (t, what) in terms.dense.iter().zip(["mask", "bias"]) {
                assert_eq!(t.dtype(), DType::F32, "{path:?} {what}");
                let got = t.flatten_all()?.to_vec1::<f32>()?;
                assert_eq!(got, row, "{path:?} {what}");
            }
        }
        Ok(())
    }
}
