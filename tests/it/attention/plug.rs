//! The plug's data forms: checked constructors, every shift and every index value valid on
//! every execution path (the fused core, the row pass, plain ops), answers that do not fit the
//! block refused with typed errors, and rotations that change shapes refused before any kernel
//! reads them.
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::plug::{
    AttentionContext, Columns, Footprint, LogitsBias, PositionalEncoding, RelativeBias,
    RelativeValues,
};
use candle_posenc::{
    AttentionConfig, AttentionOptions, Error, KvCache, MultiHeadAttention, Positions, Result,
    ShawConfig, ShawRelativePosition,
};
use common::assert_close;

const D_MODEL: usize = 16;
const HEADS: usize = 4;
const HEAD_DIM: usize = 4;
const WIDTH: usize = 7;

/// Rows and a value table read at a fixed shift, or (`by_index`) at the column map that shift
/// stands for, computed from the definition `clamp(j − i + shift, 0, W − 1)` in i128.
#[derive(Debug)]
struct Shifted {
    rows: Tensor,
    table: Tensor,
    shift: i64,
    by_index: bool,
}

impl Shifted {
    /// The columns of `ctx`'s block: `shift` counts from the chunk's first query and key, so
    /// that every split of the queries into blocks reads the same columns, as a real
    /// encoding's positions make it.
    fn columns(&self, ctx: &AttentionContext) -> Result<Columns> {
        let (Positions::Offset(qs), Positions::Offset(ks)) = (ctx.queries, ctx.keys) else {
            panic!("the test runs on offsets");
        };
        let shift = self.shift as i128 - *qs as i128 + *ks as i128;
        if !self.by_index {
            let shift = shift.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
            return Ok(Columns::Shift(shift));
        }
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        let map: Vec<u32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| {
                    (j as i128 - i as i128 + shift).clamp(0, WIDTH as i128 - 1) as u32
                })
            })
            .collect();
        Ok(Columns::Index(Tensor::from_vec(
            map,
            (1, tq, tk),
            self.rows.device(),
        )?))
    }
}

impl PositionalEncoding for Shifted {
    fn logits_bias(&self, _q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let rows = RelativeBias::new(self.rows.clone(), self.columns(ctx)?)?;
        Ok(Some(LogitsBias::Relative(rows)))
    }

    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        Ok(Some(RelativeValues::new(
            self.table.clone(),
            self.columns(ctx)?,
        )?))
    }
}

fn block(
    enc: Arc<dyn PositionalEncoding>,
    causal: bool,
    dev: &Device,
) -> Result<MultiHeadAttention> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let cfg = AttentionConfig::new(D_MODEL, HEADS)
        .with_kv_heads(2)
        .with_causal(causal)
        .with_query_block(Some(3));
    MultiHeadAttention::new(&cfg, Some(enc), vb)
}

/// Every shift, however far outside the window, reads the columns its clamp gives, on the
/// fused core (no weights returned), the row pass (weights returned) and the training ops.
fn every_shift_on_every_path(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 8, D_MODEL), dev)?;
    let rows = common::randn(0f32, 1.0, (1, HEADS, 1, WIDTH), dev)?;
    let table = common::randn(0f32, 1.0, (WIDTH, HEAD_DIM), dev)?;
    for shift in [
        i64::MIN,
        i64::MIN + 1,
        -1_000_000,
        -3,
        0,
        4,
        9,
        1_000_000,
        i64::MAX,
    ] {
        for causal in [false, true] {
            let enc = |by_index| Shifted {
                rows: rows.clone(),
                table: table.clone(),
                shift,
                by_index,
            };
            let shifted = block(Arc::new(enc(false)), causal, dev)?;
            let indexed = shifted.clone().with_encoding(Some(Arc::new(enc(true))));
            let want = indexed
                .forward_with(&x, &AttentionOptions::default(), None)?
                .output;
            let what = format!("shift {shift} causal {causal}");
            for (train, return_weights) in [(false, false), (false, true), (true, false)] {
                let opts = AttentionOptions {
                    train,
                    return_weights,
                    ..Default::default()
                };
                let got = shifted.forward_with(&x, &opts, None)?.output;
                let path = format!("{what} train {train} weights {return_weights}");
                assert_close(&got, &want, 1e-5, &path)?;
            }
        }
    }
    Ok(())
}

/// Shaw with queries and keys far apart (cross attention, or a cache of another sequence):
/// queries at 0, keys at 1000, and the reverse; the shifted forms equal explicit ids.
fn shaw_far_apart(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let shaw = ShawRelativePosition::new(&ShawConfig::new(HEAD_DIM, 3), vb)?;
    let q = common::randn(0f32, 1.0, (2, HEADS, 5, HEAD_DIM), dev)?;
    let ids = |start: u32, len: usize| -> anyhow::Result<Positions> {
        Ok(Positions::ids(
            &Tensor::arange(start, start + len as u32, dev)?.unsqueeze(0)?,
        )?)
    };
    for (qs, ks) in [(0usize, 1000usize), (1000, 0), (0, 0)] {
        let (qp, kp) = (Positions::Offset(qs), Positions::Offset(ks));
        let (qi, ki) = (ids(qs as u32, 5)?, ids(ks as u32, 6)?);
        let offsets = AttentionContext::new(&qp, 5, &kp, 6);
        let explicit = AttentionContext::new(&qi, 5, &ki, 6);
        let dense = |ctx| -> anyhow::Result<Tensor> {
            Ok(shaw.logits_bias(&q, ctx)?.expect("a bias").to_dense(5, 6)?)
        };
        let what = format!("queries at {qs}, keys at {ks}");
        let shape = (2, HEADS, 5, 6);
        let (a, b) = (dense(&offsets)?, dense(&explicit)?);
        // Offsets read exactly the reachable rows, ids a bound on them: the products' widths
        // (and so their summation order) differ.
        assert_close(
            &a.broadcast_as(shape)?,
            &b.broadcast_as(shape)?,
            1e-6,
            &what,
        )?;
        let probs = common::rand(0f32, 1.0, shape, dev)?;
        let sum = |ctx| -> anyhow::Result<Tensor> {
            Ok(shaw
                .value_term(ctx)?
                .expect("values")
                .weighted_sum(&probs)?)
        };
        assert_close(&sum(&offsets)?, &sum(&explicit)?, 1e-6, &what)?;
    }
    Ok(())
}

/// Shaw reads only the table rows its pairs reach: with a clip distance of 65536 (131073 rows),
/// 29 queries against 29 keys take 57 rows (the api fuzz target found the whole product
/// refused by a lowered budget), keys 10^5 ahead take one; the bias still equals the formula
/// `q_i · a^K[clamp(j − i, −k, k) + k]` read from the whole table.
fn shaw_reads_reachable_rows(dev: &Device) -> anyhow::Result<()> {
    let k = 65_536;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let shaw = ShawRelativePosition::new(&ShawConfig::new(HEAD_DIM, k), vb)?;
    let table = common::randn(0f32, 1.0, (2 * k + 1, HEAD_DIM), dev)?;
    varmap.data().lock().unwrap()["relative_keys.weight"].set(&table)?;
    let q = common::randn(0f32, 1.0, (1, HEADS, 29, HEAD_DIM), dev)?;
    for (qs, ks, width) in [(0usize, 0usize, 57usize), (500, 490, 57), (0, 100_000, 1)] {
        let (qp, kp) = (Positions::Offset(qs), Positions::Offset(ks));
        let ctx = AttentionContext::new(&qp, 29, &kp, 29);
        let Some(LogitsBias::Relative(rows)) = shaw.logits_bias(&q, &ctx)? else {
            panic!("Shaw answers rows");
        };
        assert_eq!(rows.width(), width, "queries at {qs}, keys at {ks}");
        let dense = rows.to_dense(29, 29)?;
        // The formula, from the whole table.
        let all = q.broadcast_matmul(&table.t()?)?; // (1, H, 29, 2k + 1)
        let index: Vec<u32> = (0..29)
            .flat_map(|i| {
                (0..29).map(move |j| {
                    let d = (ks + j) as i64 - (qs + i) as i64;
                    (d.clamp(-(k as i64), k as i64) + k as i64) as u32
                })
            })
            .collect();
        let index =
            Tensor::from_vec(index, (1, 1, 29, 29), dev)?.broadcast_as((1, HEADS, 29, 29))?;
        let want = all.contiguous()?.gather(&index.contiguous()?, 3)?;
        assert_close(
            &dense,
            &want,
            1e-5,
            &format!("queries at {qs}, keys at {ks}"),
        )?;
    }
    Ok(())
}

/// The forms cannot be built invalid: wrong ranks, empty widths, integer values and index
/// maps of another dtype are typed errors.
fn constructors_check(dev: &Device) -> anyhow::Result<()> {
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev);
    let map = |dtype| Tensor::zeros((1, 2, 2), dtype, dev);
    let cases: Vec<(&str, Result<()>)> = vec![
        (
            "rows of rank 3",
            RelativeBias::new(t(&[1, 2, 3])?, Columns::Shift(0)).map(drop),
        ),
        (
            "rows of width 0",
            RelativeBias::new(t(&[1, 2, 1, 0])?, Columns::Shift(0)).map(drop),
        ),
        (
            // Empty, but 2^32 columns: past the u32 column indices (found by the api fuzz
            // target, where the last column's index overflowed).
            "rows of width 2^32",
            RelativeBias::new(t(&[0, 1, 1, 1 << 32])?, Columns::Shift(0)).map(drop),
        ),
        (
            "integer rows",
            RelativeBias::new(
                Tensor::zeros((1, 1, 1, 3), DType::U32, dev)?,
                Columns::Shift(0),
            )
            .map(drop),
        ),
        (
            "an i64 map",
            RelativeBias::new(t(&[1, 1, 1, 3])?, Columns::Index(map(DType::I64)?)).map(drop),
        ),
        (
            "a map of rank 2",
            RelativeValues::new(
                t(&[3, 4])?,
                Columns::Index(Tensor::zeros((2, 2), DType::U32, dev)?),
            )
            .map(drop),
        ),
        (
            "a table of rank 3",
            RelativeValues::new(t(&[1, 3, 4])?, Columns::Shift(0)).map(drop),
        ),
        (
            "an empty table",
            RelativeValues::new(t(&[0, 4])?, Columns::Shift(0)).map(drop),
        ),
        (
            "an integer table",
            RelativeValues::new(Tensor::zeros((3, 4), DType::U8, dev)?, Columns::Shift(0))
                .map(drop),
        ),
    ];
    for (what, result) in cases {
        match result {
            Err(Error::Rank { .. } | Error::Shape { .. } | Error::DType { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    // Entries past the table are valid: they clamp to its last row.
    let table = Tensor::arange(0f32, 8.0, dev)?.reshape((2, 4))?;
    let far = Tensor::new(&[[[0u32, 7, u32::MAX]]], dev)?;
    let values = RelativeValues::new(table, Columns::Index(far))?;
    let probs = Tensor::new(&[[[[1f32, 0.0, 0.0]]]], dev)?;
    assert_eq!(
        values
            .weighted_sum(&probs)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        [0., 1., 2., 3.]
    );
    let probs = Tensor::new(&[[[[0f32, 0.5, 0.5]]]], dev)?;
    assert_eq!(
        values
            .weighted_sum(&probs)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        [4., 5., 6., 7.]
    );
    Ok(())
}

/// An encoding whose answers do not fit the block: each is a typed error on every path.
#[derive(Debug)]
enum Misfit {
    RowsWithHeads(usize),
    RowsWithRows(usize),
    MapOfShape(usize, usize),
    DenseOfShape(usize),
    IntegerDense,
    /// A value table of the wrong width, on the block's device (so that the width is what
    /// is wrong).
    TableOfWidth(usize, Device),
    NarrowKeys,
    WideQueries,
    /// An input hook that answers in another dtype (found by the api fuzz target: f64 into an
    /// f16 block reached matmul as candle's error), or shape.
    InputOfDtype(DType),
    InputLonger,
}

impl PositionalEncoding for Misfit {
    fn add_to_input(&self, x: &Tensor, _ctx: &AttentionContext) -> Result<Tensor> {
        Ok(match self {
            Misfit::InputOfDtype(dtype) => x.to_dtype(*dtype)?,
            Misfit::InputLonger => Tensor::cat(&[x, x], 1)?,
            _ => x.clone(),
        })
    }

    fn rotate(&self, q: Tensor, k: Tensor, _ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            Misfit::NarrowKeys => (q, k.narrow(3, 0, HEAD_DIM - 1)?),
            Misfit::WideQueries => (Tensor::cat(&[&q, &q], 3)?, k),
            _ => (q, k),
        })
    }

    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let dev = q.device();
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, dev);
        Ok(Some(match self {
            Misfit::RowsWithHeads(h) => LogitsBias::Relative(RelativeBias::new(
                zeros(&[1, *h, 1, 5])?,
                Columns::Shift(0),
            )?),
            Misfit::RowsWithRows(r) => LogitsBias::Relative(RelativeBias::new(
                zeros(&[1, HEADS, *r, 5])?,
                Columns::Shift(0),
            )?),
            Misfit::MapOfShape(a, b) => {
                let map = Tensor::zeros((1, tq + a, tk + b), DType::U32, dev)?;
                LogitsBias::Relative(RelativeBias::new(
                    zeros(&[1, HEADS, 1, 5])?,
                    Columns::Index(map),
                )?)
            }
            Misfit::DenseOfShape(h) => LogitsBias::Dense(zeros(&[1, *h, tq, tk])?),
            Misfit::IntegerDense => {
                LogitsBias::Dense(Tensor::zeros((1, 1, tq, tk), DType::U8, dev)?)
            }
            _ => return Ok(None),
        }))
    }

    fn value_term(&self, _ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        match self {
            Misfit::TableOfWidth(d, dev) => Ok(Some(RelativeValues::new(
                Tensor::zeros((5, *d), DType::F32, dev)?,
                Columns::Shift(0),
            )?)),
            _ => Ok(None),
        }
    }
}

fn misfits_are_typed_errors(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 6, D_MODEL), dev)?;
    let misfits = [
        Misfit::RowsWithHeads(3),
        Misfit::RowsWithRows(2),
        Misfit::MapOfShape(1, 0),
        Misfit::MapOfShape(0, 1),
        Misfit::DenseOfShape(3),
        Misfit::IntegerDense,
        Misfit::TableOfWidth(HEAD_DIM + 1, dev.clone()),
        Misfit::NarrowKeys,
        Misfit::WideQueries,
        Misfit::InputOfDtype(DType::F64),
        Misfit::InputOfDtype(DType::F16),
        Misfit::InputLonger,
    ];
    for misfit in misfits {
        let what = format!("{misfit:?}");
        let mha = block(Arc::new(misfit), false, dev)?;
        for (train, return_weights) in [(false, false), (false, true), (true, false)] {
            let opts = AttentionOptions {
                train,
                return_weights,
                ..Default::default()
            };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                mha.forward_with(&x, &opts, None)
            }));
            match result {
                Ok(Err(Error::Shape { .. } | Error::DType { .. })) => {}
                Ok(other) => panic!("{what} train {train}: {other:?}"),
                Err(_) => panic!("{what} train {train}: panicked"),
            }
        }
    }
    Ok(())
}

/// Values read from the key projection (k = v) are never rotated with the keys: RoPE turns
/// what the block hands it in place where it can, and for one KV head, or a chunk of one token,
/// the keys' and values' heads were views of one storage (a review found the values rotated).
/// The same block with a value projection equal to the key projection is the reference, on a
/// whole chunk and token by token through a cache.
fn keys_as_values_keep_their_own_storage(dev: &Device) -> anyhow::Result<()> {
    use candle_core::Module;
    use candle_posenc::{KvCache, RopeConfig, RotaryEmbedding};
    for kv_heads in [1usize, 2] {
        let cfg = AttentionConfig::new(D_MODEL, HEADS)
            .with_kv_heads(kv_heads)
            .with_causal(true);
        let w = |rows: usize| common::randn(0f32, 0.5, (rows, D_MODEL), dev);
        let k_proj = w(kv_heads * HEAD_DIM)?;
        let mut weights = std::collections::HashMap::new();
        weights.insert("q_proj.weight".to_string(), w(D_MODEL)?);
        weights.insert("k_proj.weight".to_string(), k_proj.clone());
        weights.insert("o_proj.weight".to_string(), w(D_MODEL)?.t()?.contiguous()?);
        let mut separate = weights.clone();
        separate.insert("v_proj.weight".to_string(), k_proj);
        let rope: Arc<dyn PositionalEncoding> =
            Arc::new(RotaryEmbedding::new(&RopeConfig::new(HEAD_DIM), dev)?);
        let block = |cfg: &AttentionConfig, w: &std::collections::HashMap<String, Tensor>| {
            let vb = VarBuilder::from_tensors(w.clone(), DType::F32, dev);
            MultiHeadAttention::new(cfg, Some(rope.clone()), vb)
        };
        let shared = block(&cfg.clone().with_k_eq_v(true), &weights)?;
        let reference = block(&cfg, &separate)?;
        let x = common::randn(0f32, 1.0, (2, 5, D_MODEL), dev)?;
        let want = reference.forward(&x)?;
        assert_close(&shared.forward(&x)?, &want, 1e-6, &format!("kv {kv_heads}"))?;
        let mut cache = KvCache::new();
        let steps = (0..5)
            .map(|i| {
                let step = shared.forward_with(
                    &x.narrow(1, i, 1)?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?;
                anyhow::Ok(step.output)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let what = format!("kv {kv_heads} decoded");
        common::assert_close_scaled(&Tensor::cat(&steps, 1)?, &want, 1e-5, 2e-6, &what)?;
    }
    Ok(())
}

/// Another encoding's answers, with the number of queries of every `logits_bias` call.
#[derive(Debug)]
struct Recorded {
    inner: Arc<dyn PositionalEncoding>,
    calls: Mutex<Vec<usize>>,
}

impl Recorded {
    fn new(inner: Arc<dyn PositionalEncoding>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: Mutex::new(Vec::new()),
        })
    }

    /// The calls since the last take.
    fn take(&self) -> Vec<usize> {
        std::mem::take(&mut *self.calls.lock().expect("calls"))
    }
}

impl PositionalEncoding for Recorded {
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        self.calls.lock().expect("calls").push(ctx.q_len);
        self.inner.logits_bias(q, ctx)
    }

    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        self.inner.value_term(ctx)
    }

    fn footprint(&self, ctx: &AttentionContext) -> Footprint {
        self.inner.footprint(ctx)
    }
}

/// Zero rows `2·Tq` wide per query, read through a shift: a bias that changes nothing, in rows
/// that widen faster than any span of relative distances.
#[derive(Debug)]
struct Widening;

impl PositionalEncoding for Widening {
    fn logits_bias(&self, q: &Tensor, _ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let (b, h, tq, _) = q.dims4()?;
        let rows = Tensor::zeros((b, h, tq, 2 * tq), q.dtype(), q.device())?;
        Ok(Some(LogitsBias::Relative(RelativeBias::new(
            rows,
            Columns::Shift(0),
        )?)))
    }
}

/// On the fused cores, answers with a row per query (Shaw's) size the query blocks by the
/// logits budget instead of the logits, and are asked for once per block, never probed: the
/// size comes from the rows the encoding declares ([`Footprint`]) and is left at the logits'
/// block when even that holds too many rows; rows nothing declared stay at the logits' block.
/// In inference (frozen weights) and in training (a `VarMap`'s), every split gives the output
/// of one block (for the zero bias, of the block without an encoding).
fn rows_size_fused_blocks_once(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let trained = common::seeded_vb(&varmap, DType::F32, dev);
    let shaw = |vb: &VarBuilder, k: usize| -> anyhow::Result<Arc<dyn PositionalEncoding>> {
        Ok(Arc::new(ShawRelativePosition::new(
            &ShawConfig::new(HEAD_DIM, k),
            vb.pp(format!("shaw{k}")),
        )?))
    };
    for k in [3, 30, 100] {
        shaw(&trained, k)?;
    }
    let cfg = AttentionConfig::new(D_MODEL, HEADS).with_kv_heads(2);
    MultiHeadAttention::new(&cfg, None, trained.pp("attn"))?;
    let frozen = VarBuilder::from_tensors(
        varmap
            .data()
            .lock()
            .expect("weights")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect(),
        DType::F32,
        dev,
    );
    let x = common::randn(0f32, 1.0, (2, 40, D_MODEL), dev)?;
    let cached = common::randn(0f32, 1.0, (2, 25, D_MODEL), dev)?;
    // One query's logits: 2 items × 4 heads × 4 bytes a key (1280 bytes for 40 keys, 2080 for
    // 65); each budget holds 4 queries' logits. A query's rows of W columns take 32·W bytes.
    let blocks = |sizes: &[usize]| sizes.to_vec();
    for vb in [&frozen, &trained] {
        let widening: Arc<dyn PositionalEncoding> = Arc::new(Widening);
        let cases = [
            // Rows 7 wide: 5120 / (32 · 7) = 22 queries a block.
            ("shaw k=3", shaw(vb, 3)?, false, 0, blocks(&[22, 18])),
            // Causal rows as wide as the keys seen, up to the 40 distances 0..=39 at the
            // chunk's end: 4 queries' 40-column rows fill the budget, so the blocks stay at
            // the logits' 4 (the first block's rows are 4 wide, and would have let 40 in).
            (
                "shaw k=100 causal",
                shaw(vb, 100)?,
                true,
                0,
                blocks(&[4; 10]),
            ),
            // Rows 2·n wide for n queries, declared by nothing: the logits' 4 queries a block
            // (8 columns), never grown.
            ("widening", widening, false, 0, blocks(&[4; 10])),
            // 40 queries after 25 cached keys: query 7 (position 32) has 32 keys on either
            // side, so the call reaches the full 61 columns; 8320 / (32 · 61) = 4 queries.
            // (The chunk's middle, query 18, has rows 52 wide, and blocks of 5 would have
            // passed the budget at query 5.)
            (
                "shaw k=30 cached",
                shaw(vb, 30)?,
                false,
                25,
                blocks(&[4; 10]),
            ),
        ];
        for (name, enc, causal, prefill, calls) in cases {
            let cfg = cfg.clone().with_causal(causal);
            let budget = 4 * 2 * HEADS * 4 * (prefill + 40);
            let recorded = Recorded::new(enc.clone());
            let blocked = MultiHeadAttention::new(
                &cfg.clone().with_logits_budget(budget),
                Some(recorded.clone()),
                vb.pp("attn"),
            )?;
            let reference = match name {
                "widening" => None,
                _ => Some(enc),
            };
            let one = MultiHeadAttention::new(&cfg, reference, vb.pp("attn"))?;
            let run = |mha: &MultiHeadAttention| -> anyhow::Result<Tensor> {
                let mut cache = KvCache::new();
                if prefill > 0 {
                    mha.forward_with(&cached, &Default::default(), Some(&mut cache))?;
                    recorded.take();
                }
                Ok(mha
                    .forward_with(&x, &Default::default(), Some(&mut cache))?
                    .output)
            };
            let got = run(&blocked)?;
            if dev.is_cpu() {
                assert_eq!(recorded.take(), calls, "{name}: queries per call");
            }
            assert_close(&got, &run(&one)?, 1e-5, name)?;
        }
    }
    Ok(())
}

device_tests!(
    keys_as_values_keep_their_own_storage,
    every_shift_on_every_path,
    shaw_far_apart,
    shaw_reads_reachable_rows,
    constructors_check,
    misfits_are_typed_errors,
    rows_size_fused_blocks_once
);
