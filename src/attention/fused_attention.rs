//! The attention core of one query block in one pass per head (CPU, f32, inference), with an
//! online softmax over key tiles (Milakov & Gimelshein 2018; FlashAttention's schedule).
//!
//! ```text
//! for each (b, h) and each tile of n query rows i (16 ≤ n ≤ 256):
//!     m_i = sink_h or −∞,  l_i = 1 or 0,  acc_i = 0            (running max, sum, output)
//!     for each tile of ≤ 1024 keys J the rows can see:
//!         S = q[b, h, i] · k[b, h / r, J]ᵀ                     (n × |J|, a per-thread buffer)
//!         S ← S + biases, masked                               (the row pass's terms and masks)
//!         m_i' = max(m_i, max_j S_ij);  α_i = e^(m_i − m_i')
//!         P = e^(S − m')                                        (in place)
//!         l_i ← α_i l_i + Σ_j P_ij;  acc_i ← α_i acc_i + P v[b, h / r, J]
//!         sums_i ← α_i sums_i + Σ_{j: c(i,j) = c} P_ij          (relative values, if any)
//!     out[b, i, h, :] = (acc_i + sums_i · a) / l_i              (written straight into (B, T, H, D))
//! ```
//!
//! `r = H / Hkv` (grouped KV heads read their shared head; nothing is repeated). Without
//! padding or a user's mask no row is masked whole (an encoding's bias is finite), and a tile
//! visits only the keys its rows can see through the causal limit, window and chunk
//! ([`RowRule::keys_seen`]); otherwise every key, so that a row masked whole is uniform over all
//! of them, as on the other paths. When key tiles are read by several query tiles, the keys
//! are transposed once per call, so that gemm reads each tile in place instead of gathering it. The
//! logits of a tile (1 MiB) stay in the core's cache from the product that writes them, through
//! the softmax, to the product that reads them, at any length; no `(B, H, Tq, Tk)` tensor is
//! allocated, and the heads come out already merged for the output projection.
//!
//! Keys and values may also be bf16 or f16 (a half-precision block's decoding step, which
//! leaves its cache in the block's dtype): each key tile is then widened into the thread's
//! buffers as it is read, in tiles of 256 keys, so a step reads the cache once, in half the
//! bytes, and allocates nothing that grows with it.
//!
//! Both products run `gemm` (the crate candle's CPU matmul uses, with its AVX-512 kernels when
//! the `avx512` feature is on) on raw strided views, one thread per tile. The terms and masks
//! are the row pass's of [`super::fused_softmax`]; its weights differ from the row pass's by
//! rounding only (normalised at the end instead of before the product).

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use super::fused_softmax::{
    read_storage, strided_terms, RowPass, RowRule, Running, SeparableTerm, TermGuards,
};
use super::widen::Widen;
use crate::cpu::gemm::product;
use crate::error::{Error, Result};
use crate::plug::relative::add_indexed_sums;
use crate::plug::{Columns, RelativeBias, RelativeValues};

/// The logits of one tile (`rows × keys` floats), which must stay in the core's cache from the
/// product that writes them to the one that reads them: half of a 2 MiB L2.
const TILE_BYTES: usize = 1 << 20;

/// Keys per tile: a query tile meets its keys in tiles of this many (the online softmax
/// carries each row's maximum and sum from one to the next), so its logits stay in cache at
/// any length.
pub(crate) const KEY_TILE: usize = 1024;

/// Keys per tile when keys and values are half precision: both tiles, widened to f32
/// (`2 × 256 × D` floats, 128 KiB at D = 64), stay in L2 with the logits.
const HALF_KEY_TILE: usize = 256;

/// Query rows per tile for `tk` keys: [`TILE_BYTES`] of logits of at most [`KEY_TILE`] keys,
/// 16 to 256 rows (fewer rows would repack the keys too often; more would leave too few tiles
/// to share out).
pub(crate) fn tile_rows(tk: usize) -> usize {
    (TILE_BYTES / (4 * tk.clamp(1, KEY_TILE))).clamp(16, 256)
}

/// One query block of the core, written into rows `first_row..first_row + Tq` of `out`.
pub(crate) struct Core<'a> {
    /// `(B, H, Tq, D)`, already scaled.
    pub q: &'a Tensor,
    /// `(B, Hkv, Tk, D)`.
    pub k: &'a Tensor,
    /// `(B, Hkv, Tk, D)`.
    pub v: &'a Tensor,
    /// Additive terms broadcastable to `(B, H, Tq, Tk)` (f32, CPU).
    pub dense: Vec<&'a Tensor>,
    /// Whether a dense term may hide keys (a user's mask): then a row may be masked whole.
    /// An encoding's bias is taken to be finite, as the other paths' trimming takes it.
    pub dense_masks: bool,
    /// Relative terms with shifted columns, f32 (checked against the block by the caller).
    pub relative: Vec<&'a RelativeBias>,
    /// Separable pairs, packed (checked against the block by the caller).
    pub separable: Vec<&'a SeparableTerm>,
    /// `(B, Tk)` u8, non-zero = keep.
    pub padding: Option<&'a Tensor>,
    /// Which keys each row sees, soft cap and sinks.
    pub rule: &'a RowRule,
    /// A relative value term (`(W, D)` table), checked against the block by the caller.
    pub values: Option<&'a RelativeValues>,
    /// Query rows per tile ([`tile_rows`] of the key count).
    pub tile: usize,
    /// Keys per tile ([`KEY_TILE`]).
    pub key_tile: usize,
}

impl Core<'_> {
    /// Everything the core's pass reads besides q, k and v, for output rows from `first_row`.
    pub(crate) fn spec(&self, first_row: usize) -> Result<CoreSpec> {
        let (b, h, tq, d) = self.q.dims4()?;
        let (_, _, tk, _) = self.k.dims4()?;
        let mut spec = CoreSpec::plain((b, h, tq, tk, d), self.rule, self.padding)?;
        spec.terms = strided_terms((b, h, tq, tk), &self.dense, &self.relative, &self.separable)?;
        // Keys no row of a tile sees may be left out only when no row can be masked whole
        // (such a row is uniform over every key).
        spec.skip &= !self.dense_masks;
        spec.first_row = first_row;
        (spec.tile, spec.key_tile) = (self.tile.max(1), self.key_tile.max(1));
        spec.values = match self.values {
            Some(v) => Some(ValueOperands::new(v, (b, tq, tk, d))?),
            None => None,
        };
        Ok(spec)
    }

    /// Writes `softmax(q kᵀ + terms, masked) v` into `out` `(B, T, H, D)` (contiguous f32, not
    /// part of a graph) at rows `first_row..first_row + Tq`.
    pub(crate) fn write_into(&self, out: &Tensor, first_row: usize) -> Result<()> {
        let op = CoreOp {
            q: self.q.clone(),
            k: self.k.clone(),
            v: self.v.clone(),
            spec: self.spec(first_row)?,
        };
        out.inplace_op1(&op)?;
        Ok(())
    }
}

/// The core as an in-place op on the merged output (inference).
struct CoreOp {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: CoreSpec,
}

/// What the core reads besides q, k and v, checked against them when built.
pub(crate) struct CoreSpec {
    pub(crate) terms: Vec<super::fused_softmax::Strided>,
    pub(crate) padding: Option<Tensor>,
    /// Whether a tile visits only the keys its rows can see ([`RowRule::keys_seen`]).
    pub(crate) skip: bool,
    pub(crate) rule: RowRule,
    pub(crate) first_row: usize,
    /// `(B, H, Tq, Tk, D)`.
    pub(crate) dims: (usize, usize, usize, usize, usize),
    /// The relative value term, ready for the tiles.
    pub(crate) values: Option<ValueOperands>,
    pub(crate) tile: usize,
    pub(crate) key_tile: usize,
    /// Attention dropout (training only).
    pub(crate) dropout: Option<super::dropout::Dropout>,
}

/// A relative value term as the tiles read it: a contiguous f32 `(W, D)` table and its
/// columns, an index map made contiguous `(1|B, Tq, Tk)` u32.
pub(crate) struct ValueOperands {
    pub(crate) table: Tensor,
    pub(crate) columns: Columns,
}

impl ValueOperands {
    /// Checks `values` against a block of `(B, Tq, Tk, D)` and prepares its tensors.
    fn new(values: &RelativeValues, (b, tq, tk, d): (usize, usize, usize, usize)) -> Result<Self> {
        values.check_block(b, tq, tk, d)?;
        let table = values.table();
        if !table.device().is_cpu() {
            return Err(Error::shape(
                "relative value table",
                "a tensor on the CPU, where the attention runs",
                table.shape(),
            ));
        }
        let columns = match values.columns() {
            Columns::Index(index) => Columns::Index(index.to_device(table.device())?.contiguous()?),
            shift => shift.clone(),
        };
        Ok(Self {
            table: table.to_dtype(candle_core::DType::F32)?.contiguous()?,
            columns,
        })
    }
}

/// Read locks on a value term's table and column map, held while the tiles read them.
pub(crate) struct ValueGuards<'a> {
    table: (super::fused_softmax::StorageGuard<'a>, &'a Layout),
    index: Option<(super::fused_softmax::StorageGuard<'a>, &'a Layout)>,
    columns: &'a Columns,
}

impl ValueOperands {
    /// Read-locks the table and the column map.
    pub(crate) fn lock(&self) -> ValueGuards<'_> {
        ValueGuards {
            table: read_storage(&self.table),
            index: match &self.columns {
                Columns::Index(index) => Some(read_storage(index)),
                Columns::Shift(_) => None,
            },
            columns: &self.columns,
        }
    }
}

impl ValueGuards<'_> {
    /// The table's `W × D` values, `W`, and the columns, checked against a block of
    /// `(B, Tq, Tk, D)`: a contiguous f32 table of whole rows of `D`, a contiguous
    /// `(1|B, Tq, Tk)` u32 map.
    pub(crate) fn view(
        &self,
        (b, tq, tk, d): (usize, usize, usize, usize),
    ) -> candle_core::Result<(&[f32], usize, TileColumns<'_>)> {
        let (g, l) = &self.table;
        let table = match (&***g, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(data)), Some((a, z)))
                if z > a && d > 0 && (z - a) % d == 0 =>
            {
                &data[a..z]
            }
            _ => candle_core::bail!("fused attention: the value table must be (W, D) f32"),
        };
        let columns = match (self.columns, &self.index) {
            (Columns::Shift(shift), _) => TileColumns::Shift(*shift),
            (Columns::Index(_), Some((g, l))) => match (&***g, l.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::U32(ix)), Some((a, z)))
                    if l.dims().len() == 3
                        && l.dims()[1..] == [tq, tk]
                        && (l.dims()[0] == 1 || l.dims()[0] == b) =>
                {
                    TileColumns::Index(&ix[a..z], l.dims()[0])
                }
                _ => candle_core::bail!(
                    "fused attention: the value columns must be a contiguous (1|B, Tq, Tk) u32 map"
                ),
            },
            (Columns::Index(_), None) => {
                candle_core::bail!("fused attention: value column map missing")
            }
        };
        Ok((table, table.len() / d, columns))
    }
}

/// A strided f32 view `(B, H, T, D)` with unit stride on `D`.
#[derive(Clone, Copy)]
pub(crate) struct View<T = f32> {
    ptr: *const T,
    pub(crate) strides: [usize; 3],
}

impl View {
    /// A view of `layout` over `storage`, which must be f32 of exactly the `dims` the core
    /// reads (`(B, H, T, D)`), with unit stride on `D` and every element in storage.
    pub(crate) fn new(
        storage: &CpuStorage,
        layout: &Layout,
        dims: [usize; 4],
    ) -> candle_core::Result<Self> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("fused attention: q, k and v must be f32 CPU tensors");
        };
        Self::over(data, layout, dims)
    }
}

impl<T> View<T> {
    /// A view of `layout` over `data`, of exactly `dims`, with unit stride on the last axis
    /// and every element in `data`.
    fn over(data: &[T], layout: &Layout, dims: [usize; 4]) -> candle_core::Result<Self> {
        if layout.dims() != dims || layout.stride()[3] != 1 {
            candle_core::bail!(
                "fused attention: a view of {:?} with strides {:?} where {dims:?} with unit stride on the last axis was expected",
                layout.dims(),
                layout.stride()
            );
        }
        let s = layout.stride();
        // The furthest element read, for the bounds check below.
        let last: usize = layout
            .dims()
            .iter()
            .zip(s)
            .map(|(n, s)| n.saturating_sub(1).saturating_mul(*s))
            .fold(0usize, usize::saturating_add);
        if dims.contains(&0) || layout.start_offset().saturating_add(last) >= data.len() {
            candle_core::bail!("fused attention: a view reaches past its storage");
        }
        Ok(Self {
            // SAFETY: in bounds (checked above).
            ptr: unsafe { data.as_ptr().add(layout.start_offset()) },
            strides: [s[0], s[1], s[2]],
        })
    }

    /// The address of `[b, h, i, 0]`.
    ///
    /// # Safety
    /// `b`, `h` and `i` must lie inside the view's dimensions (checked against its storage in
    /// [`View::new`]).
    pub(crate) unsafe fn at(&self, b: usize, h: usize, i: usize) -> *const T {
        let [s0, s1, s2] = self.strides;
        // SAFETY: the caller stays inside the view's dimensions, which lie in the storage.
        unsafe { self.ptr.add(b * s0 + h * s1 + i * s2) }
    }
}

/// Keys or values as stored: f32, read in place, or half precision (a decoding step's cache,
/// kept in the block's dtype), widened a key tile at a time into a thread's buffer.
#[derive(Clone, Copy)]
enum Operand {
    F32(View),
    Bf16(View<bf16>),
    F16(View<f16>),
}

impl Operand {
    /// A view of `layout` over `storage` (f32, bf16 or f16) of exactly `dims`.
    fn new(storage: &CpuStorage, layout: &Layout, dims: [usize; 4]) -> candle_core::Result<Self> {
        Ok(match storage {
            CpuStorage::F32(data) => Operand::F32(View::over(data, layout, dims)?),
            CpuStorage::BF16(data) => Operand::Bf16(View::over(data, layout, dims)?),
            CpuStorage::F16(data) => Operand::F16(View::over(data, layout, dims)?),
            _ => candle_core::bail!("fused attention: k and v must be f32, bf16 or f16"),
        })
    }

    fn is_f32(&self) -> bool {
        matches!(self, Operand::F32(_))
    }

    /// Rows `j0..j0 + n` of head `(b, h)` as f32: a pointer and a row stride, in place for
    /// f32, else widened into `buf` (`n × d`).
    ///
    /// # Safety
    /// `b`, `h` and `j0 + n` must lie inside the view's dimensions, and `d` must be its last
    /// one; the pointer is valid until `buf` changes.
    unsafe fn rows(
        &self,
        (b, h, j0, n, d): (usize, usize, usize, usize, usize),
        buf: &mut Vec<f32>,
    ) -> (*const f32, usize) {
        #[inline(always)]
        fn widen<T: Widen>(view: &View<T>, (b, h, j0, n, d): Dims5, buf: &mut Vec<f32>) {
            buf.resize(n * d, 0.0);
            if view.strides[2] == d {
                // The tile's rows lie end to end (a cache's head): one run of n·d values.
                // SAFETY: the caller's contract: rows j0..j0 + n of head (b, h) hold d values
                // each, d apart.
                let src = unsafe { std::slice::from_raw_parts(view.at(b, h, j0), n * d) };
                T::widen_fast(src, buf);
                return;
            }
            for (jj, dst) in buf.chunks_exact_mut(d).enumerate() {
                // SAFETY: the caller's contract: row j0 + jj of head (b, h) holds d values.
                let src = unsafe { std::slice::from_raw_parts(view.at(b, h, j0 + jj), d) };
                T::widen_fast(src, dst);
            }
        }
        match self {
            // SAFETY: the caller's contract.
            Operand::F32(view) => (unsafe { view.at(b, h, j0) }, view.strides[2]),
            Operand::Bf16(view) => {
                widen(view, (b, h, j0, n, d), buf);
                (buf.as_ptr(), d)
            }
            Operand::F16(view) => {
                widen(view, (b, h, j0, n, d), buf);
                (buf.as_ptr(), d)
            }
        }
    }
}

type Dims5 = (usize, usize, usize, usize, usize);

/// The output rows, written by disjoint tiles from several threads.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);

impl OutPtr {
    /// The element `offset` past the start (a method, so closures capture the whole `OutPtr`).
    ///
    /// # Safety
    /// `offset` must lie inside the output.
    pub(crate) unsafe fn add(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller keeps `offset` in bounds.
        unsafe { self.0.add(offset) }
    }
}
// SAFETY: every tile writes its own rows of one head; no two tiles write the same element and
// nothing reads the output during the pass.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}
// SAFETY: the views only read storage that the op holds read locks on for the whole pass.
unsafe impl<T: Sync> Send for View<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for View<T> {}

// The per-thread buffers below are borrowed mutably for the whole of one tile's work
// (`with_borrow_mut`); that is sound only because nothing inside that closure re-enters rayon
// (gemm runs with `Parallelism::None`, the row pass is serial): a nested parallel call could run
// another tile on this thread while the buffers are borrowed, and `RefCell` would panic.
thread_local! {
    /// Each thread's buffers, reused across tiles and calls (no page faults).
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
}

/// One thread's working memory for a query tile.
struct Scratch {
    /// The logits of a key tile, `rows × n`.
    logits: Vec<f32>,
    /// Unnormalised output rows, `rows × D`.
    acc: Vec<f32>,
    /// Weights summed per relative distance, `rows × W`.
    sums: Vec<f32>,
    /// The online softmax state per row.
    running: Vec<Running>,
    /// A key tile and a value tile widened from half precision, `n × D` each.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Mixed rows over the columns of a tile.
    slab: Vec<f32>,
}

impl Scratch {
    const fn new() -> Self {
        Self {
            logits: Vec::new(),
            acc: Vec::new(),
            sums: Vec::new(),
            running: Vec::new(),
            keys: Vec::new(),
            values: Vec::new(),
            slab: Vec::new(),
        }
    }
}

impl InplaceOp1 for CoreOp {
    fn name(&self) -> &'static str {
        "posenc-fused-attention"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (b, h, tq, _, d) = self.spec.dims;
        let (ob, t, oh, od) = layout.shape().dims4()?;
        let (CpuStorage::F32(out), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("fused attention: the output must be contiguous f32");
        };
        if (ob, oh, od) != (b, h, d) || self.spec.first_row + tq > t || end - start != b * t * h * d
        {
            candle_core::bail!("fused attention: output shape does not match q");
        }
        let guards = [&self.q, &self.k, &self.v].map(read_storage);
        let [q, k, v] = guards.each_ref().map(|(g, l)| match &***g {
            Storage::Cpu(s) => Ok((s, *l)),
            _ => candle_core::bail!("fused attention: q, k and v must be f32 CPU tensors"),
        });
        self.spec
            .run([q?, k?, v?], OutPtr(out[start..].as_mut_ptr()), t, None)
    }
}

impl CoreSpec {
    /// The core with no terms of an encoding: keys seen by `rule`, `padding` `(B, Tk)` u8
    /// (non-zero = keep), for q `(B, H, Tq, D)` and k and v `(B, Hkv, Tk, D)` of `dims`
    /// `(B, H, Tq, Tk, D)`, written from row 0, tiles of [`tile_rows`] and [`KEY_TILE`]
    /// ([`Core::spec`] adds an encoding's terms to it).
    ///
    /// # Errors
    /// The padding cannot be made contiguous.
    pub(crate) fn plain(
        dims: (usize, usize, usize, usize, usize),
        rule: &RowRule,
        padding: Option<&Tensor>,
    ) -> Result<Self> {
        Ok(CoreSpec {
            terms: Vec::new(),
            padding: padding.map(Tensor::contiguous).transpose()?,
            skip: padding.is_none(),
            rule: rule.clone(),
            first_row: 0,
            dims,
            tile: tile_rows(dims.3),
            key_tile: KEY_TILE,
            values: None,
            dropout: None,
        })
    }

    /// The core over `q` `(B, H, Tq, D)`, `k` and `v` `(B, Hkv, Tk, D)` as stored, writing
    /// rows `first_row..first_row + Tq` of `out` (contiguous `(B, T, H, D)`, checked by the
    /// caller) and, when asked, each row's softmax maximum and inverse sum into `stats`
    /// (`(B, H, Tq, 2)`, contiguous).
    pub(crate) fn run(
        &self,
        [(qs, ql), (ks, kl), (vs, vl)]: [(&CpuStorage, &Layout); 3],
        out: OutPtr,
        t: usize,
        stats: Option<OutPtr>,
    ) -> candle_core::Result<()> {
        let (b, h, tq, tk, d) = self.dims;
        let hkv = kl.dims().get(1).copied().unwrap_or(0);
        if hkv == 0 || !h.is_multiple_of(hkv) || vl.dims() != [b, hkv, tk, d] {
            candle_core::bail!("fused attention: k and v must be (B, Hkv, Tk, D) with Hkv | H");
        }
        let group = h / hkv;
        if b * h * tq == 0 {
            return Ok(());
        }
        let q = View::new(qs, ql, [b, h, tq, d])?;
        let k = Operand::new(ks, kl, [b, hkv, tk, d])?;
        let v = Operand::new(vs, vl, [b, hkv, tk, d])?;
        let terms = TermGuards::new(&self.terms, self.padding.as_ref());
        let pass = terms
            .pass((b, h, tq, tk), &self.rule)?
            .with_mixed_in_tiles();
        let values_guard = self.values.as_ref().map(ValueOperands::lock);
        let values = values_guard
            .as_ref()
            .map(|g| g.view((b, tq, tk, d)))
            .transpose()?;
        let (mut tile, mut key_tile) = (self.tile, self.key_tile);
        if !k.is_f32() || !v.is_f32() {
            // Half-precision keys and values are widened a tile at a time: tiles small enough
            // that both widened tiles stay in L2 next to the logits.
            key_tile = key_tile.min(HALF_KEY_TILE);
        }
        if let Some((_, width, _)) = &values {
            tile = value_tile_rows(tile, *width, d);
            if tile.saturating_mul(*width) > crate::limits::max_elements() {
                candle_core::bail!(
                    "fused attention: a relative value table {width} wide passes the element budget"
                );
            }
        }
        let tiles = tq.div_ceil(tile);
        // gemm reads a key tile as stored, (n, D), by gathering it column by column, a third of
        // the core's time when every query tile does it again: when key tiles are read by more
        // than one query tile, the keys are transposed once, (B, Hkv, D, Tk). Not for a few
        // queries (decoding), where that would read and write the whole cache again per step.
        let keys_t = match (&k, tiles * group > 1 && tq >= 16) {
            (Operand::F32(k), true) => Some(transposed_keys(k, (b, hkv, tk, d))?),
            _ => None,
        };
        let run = Run {
            core: self,
            q,
            k,
            v,
            keys_t,
            pass: &pass,
            values: values.as_ref(),
            group,
            tile,
            key_tile,
            out,
            t,
            stats,
        };
        (0..b * h * tiles).into_par_iter().for_each(|task| {
            let (bh, i0) = (task / tiles, (task % tiles) * tile);
            SCRATCH.with_borrow_mut(|scratch| run.query_tile(bh / h, bh % h, i0, scratch));
        });
        if let Some(keys) = run.keys_t {
            crate::cpu::workspace::keep(keys);
        }
        Ok(())
    }
}

/// One call of the core, shared by its tasks: the operands read in place, the row pass, the
/// value term and the tile sizes.
struct Run<'a> {
    core: &'a CoreSpec,
    q: View,
    k: Operand,
    v: Operand,
    /// The keys transposed, `(B, Hkv, D, Tk)`, when many query tiles read them.
    keys_t: Option<Vec<f32>>,
    pass: &'a RowPass<'a>,
    values: Option<&'a (&'a [f32], usize, TileColumns<'a>)>,
    group: usize,
    tile: usize,
    key_tile: usize,
    out: OutPtr,
    t: usize,
    stats: Option<OutPtr>,
}

impl Run<'_> {
    /// The query tile `i0..` of head `hi` in sequence `bi`: an online softmax over its key
    /// tiles, the value term, then its rows normalised into the output.
    fn query_tile(&self, bi: usize, hi: usize, i0: usize, scratch: &mut Scratch) {
        let (_, h, tq, tk, d) = self.core.dims;
        let rows = self.tile.min(tq - i0);
        let r0 = (bi * h + hi) * tq + i0;
        let (lo, hi_key) = match self.core.skip {
            true => self.core.rule.keys_seen(i0, i0 + rows, tk),
            false => (0, tk),
        };
        let width = self.values.map_or(0, |(_, w, _)| *w);
        scratch.acc.resize(rows * d, 0.0);
        scratch.sums.clear();
        scratch.sums.resize(rows * width, 0.0);
        scratch.running.clear();
        let pass = self.pass;
        scratch
            .running
            .extend((0..rows).map(|li| pass.running(r0 + li)));
        for j0 in (lo..hi_key).step_by(self.key_tile) {
            let n = self.key_tile.min(hi_key - j0);
            self.key_tile_step((bi, hi, i0, rows), (j0, n, lo), scratch);
        }
        self.finish((bi, hi, i0, rows), scratch);
    }

    /// Keys `j0..j0 + n` for the tile's `rows` queries: the logits, each row's online
    /// softmax (rescaling what the row holds), and the weighted values added to it.
    fn key_tile_step(
        &self,
        (bi, hi, i0, rows): (usize, usize, usize, usize),
        (j0, n, lo): (usize, usize, usize),
        scratch: &mut Scratch,
    ) {
        let (_, h, tq, tk, d) = self.core.dims;
        let (q, hkv, group) = (&self.q, self.k_heads(), self.group);
        let r0 = (bi * h + hi) * tq + i0;
        let width = self.values.map_or(0, |(_, w, _)| *w);
        let Scratch {
            logits: s,
            acc,
            sums,
            running,
            keys: key_buf,
            values: value_buf,
            slab,
        } = scratch;
        s.resize(rows * n, 0.0);
        // SAFETY: bi < B, hi / group < Hkv, j0 < Tk; S is rows × n (resized above), acc
        // rows × D; the q rows, the k and v rows and the transposed keys read lie in their
        // views (i0 + rows ≤ Tq, j0 + n ≤ Tk), checked against storage in `View::over` and by
        // `transposed_keys`; the widened tiles are not touched again until the next key tile.
        let at = (bi, hi / group, j0, n, d);
        let ((kp, k_rs), (vp, v_rs)) =
            unsafe { (self.k.rows(at, key_buf), self.v.rows(at, value_buf)) };
        let keys = match &self.keys_t {
            // The key tile (D, n) as a view of (D, Tk): read in place.
            Some(kt) => (
                kt[((bi * hkv + hi / group) * d) * tk + j0..].as_ptr(),
                1,
                tk,
            ),
            // (n, D) as stored: gemm gathers it column by column.
            None => (kp, k_rs, 1),
        };
        unsafe {
            product(
                (rows, n, d),
                (s.as_mut_ptr(), n, false),
                (q.at(bi, hi, i0), 1, q.strides[2]),
                keys,
            )
        };
        if self.pass.mixed_in_tiles() {
            self.pass
                .add_mixed_tile((bi, hi, i0, rows), (j0, n), s, slab);
        }
        for (li, row) in s.chunks_exact_mut(n).enumerate() {
            let alpha = self.pass.online_best(r0 + li, row, j0, &mut running[li]);
            if let Some(dropout) = &self.core.dropout {
                // After the row's sum took every weight: only the products see the dropped
                // ones.
                dropout.apply((bi, hi, self.core.rule.first + i0 + li), j0, row);
            }
            let sums = &mut sums[li * width..(li + 1) * width];
            if alpha != 1.0 && j0 > lo {
                acc[li * d..(li + 1) * d]
                    .iter_mut()
                    .for_each(|x| *x *= alpha);
                sums.iter_mut().for_each(|x| *x *= alpha);
            }
            // A value term's sums per column, while the row is still in L1 (read again after
            // the tile's product, it comes from L2 or beyond).
            match self.values.map(|(_, _, rule)| rule) {
                Some(TileColumns::Shift(shift)) => {
                    self.pass
                        .add_shifted_sums_best(row, (i0 + li, *shift, j0), sums)
                }
                Some(TileColumns::Index(index, ib)) => {
                    let columns = index_row(index, *ib, (bi, i0 + li, j0, n), tq, tk);
                    add_indexed_sums(row, columns, sums);
                }
                None => {}
            }
        }
        // SAFETY: as above.
        unsafe {
            product(
                (rows, d, n),
                (acc.as_mut_ptr(), d, j0 > lo),
                (s.as_ptr(), 1, n),
                (vp, 1, v_rs),
            )
        };
    }

    /// The tile's rows done: the value term joined to them, each row normalised into the
    /// output, and its statistics kept when asked for.
    fn finish(&self, (bi, hi, i0, rows): (usize, usize, usize, usize), scratch: &mut Scratch) {
        let (_, h, tq, _, d) = self.core.dims;
        let (acc, sums, running) = (&mut scratch.acc, &scratch.sums, &scratch.running);
        if let Some((table, width, _)) = self.values {
            // The value term joins the accumulator before both are normalised: acc +=
            // sums · table, in the thread's own rows rather than the output's.
            // SAFETY: sums is rows × W, the table W × D, acc rows × D.
            unsafe {
                product(
                    (rows, d, *width),
                    (acc.as_mut_ptr(), d, true),
                    (sums.as_ptr(), 1, *width),
                    (table.as_ptr(), 1, d),
                )
            };
        }
        let r0 = (bi * h + hi) * tq + i0;
        let row0 = (bi * self.t + self.core.first_row + i0) * h + hi;
        for (li, state) in running.iter().enumerate() {
            let inv = 1.0 / state.sum;
            if let Some(stats) = self.stats {
                // SAFETY: stats is (B, H, Tq, 2) contiguous (the caller's contract); row
                // r0 + li is this tile's own.
                unsafe {
                    *stats.add(2 * (r0 + li)) = state.max;
                    *stats.add(2 * (r0 + li) + 1) = inv;
                }
            }
            // SAFETY: out is (B, T, H, D) contiguous with b·t·h·d elements (checked by the
            // caller); this tile writes rows first_row + i0 .. + rows of head hi only.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(self.out.add((row0 + li * h) * d), d) };
            for (o, a) in dst.iter_mut().zip(&acc[li * d..(li + 1) * d]) {
                *o = a * inv;
            }
        }
    }

    /// The KV heads.
    fn k_heads(&self) -> usize {
        self.core.dims.1 / self.group
    }
}

/// Query rows per tile with a relative value table `width` wide and `d` features: each thread
/// sums a tile's weights per column into `rows × width` floats, so the rows shrink until those
/// sums take no more than the table itself (`width × d`) or 2^20 floats, whichever is more
/// (at least one row).
fn value_tile_rows(tile: usize, width: usize, d: usize) -> usize {
    let cap = (width.saturating_mul(d)).max(1 << 20) / width.max(1);
    tile.min(cap).max(1)
}

/// The keys of `k` `(B, Hkv, Tk, D)` transposed into a new `(B, Hkv, D, Tk)` buffer, in
/// parallel over heads and blocks of 16 keys.
///
/// # Errors
/// Past the crate's element budget, or when the allocation fails (an error, not an abort).
fn transposed_keys(
    k: &View,
    (b, hkv, tk, d): (usize, usize, usize, usize),
) -> candle_core::Result<Vec<f32>> {
    let len = [b, hkv, d, tk]
        .iter()
        .try_fold(1usize, |n, &x| n.checked_mul(x))
        .filter(|&n| n <= crate::limits::max_elements())
        .ok_or_else(|| {
            candle_core::Error::Msg(
                "fused attention: transposed keys past the element budget".into(),
            )
        })?;
    // Every value is written below: a kept buffer (`cpu::workspace`) is reused as it is.
    let mut out = crate::cpu::workspace::take(len, "fused attention: transposed keys")?;
    out.par_chunks_mut(d * tk)
        .enumerate()
        .for_each(|(bh, dst)| {
            let (bi, hk) = (bh / hkv, bh % hkv);
            for j0 in (0..tk).step_by(16) {
                let n = 16.min(tk - j0);
                // SAFETY: bi < B, hk < Hkv, j0 + jj < Tk; each row holds D features with unit
                // stride inside k's view (`View::new`).
                let rows: [&[f32]; 16] = std::array::from_fn(|jj| unsafe {
                    std::slice::from_raw_parts(k.at(bi, hk, j0 + jj.min(n - 1)), d)
                });
                // Each feature's 16 values written in a row, read from 16 rows in L1.
                for (p, line) in dst.chunks_exact_mut(tk).enumerate() {
                    for (x, row) in line[j0..j0 + n].iter_mut().zip(&rows) {
                        *x = row[p];
                    }
                }
            }
        });
    Ok(out)
}

/// The columns an index map `(1|B, Tq, Tk)` (`batches` items) gives row `i` of batch item `b`
/// at keys `j0..j0 + n`.
pub(crate) fn index_row(
    index: &[u32],
    batches: usize,
    (b, i, j0, n): (usize, usize, usize, usize),
    tq: usize,
    tk: usize,
) -> &[u32] {
    let batch = if batches == 1 { 0 } else { b };
    let at = (batch * tq + i) * tk + j0;
    &index[at..at + n]
}

/// How a tile's rows pick the value table's rows: a shift, or a `(1|B, Tq, Tk)` index map
/// (with its batch size).
pub(crate) enum TileColumns<'a> {
    Shift(i64),
    Index(&'a [u32], usize),
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, D};

    use super::*;
    use crate::attention::mask::{apply_keep_mask, keep_mask};
    use crate::matmul::matmul;

    /// The core against candle ops, for tiles of 1 to all rows: grouped heads, strided keys and
    /// values, a dense and a relative bias, relative values, padding (batch item 0 has its first
    /// two keys padded, so its first causal rows are fully masked) and causality.
    #[test]
    fn tiles_equal_candle_ops() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (b, h, hkv, tq, tk, d, w) = (2, 4, 2, 13, 17, 8, 5);
        let q = crate::seeded::randn(0f32, 1.0, (b, h, tq, d), &dev)?;
        // Keys and values as views into a longer buffer, like a KV cache's.
        let k = crate::seeded::randn(0f32, 1.0, (b, hkv, tk + 6, d), &dev)?.narrow(2, 0, tk)?;
        let v = crate::seeded::randn(0f32, 1.0, (b, hkv, tk + 6, d), &dev)?.narrow(2, 0, tk)?;
        let dense = crate::seeded::randn(0f32, 1.0, (1, h, 1, tk), &dev)?;
        let relative = RelativeBias::new(
            crate::seeded::randn(0f32, 1.0, (1, h, 1, 2 * w + 1), &dev)?,
            Columns::Shift(w as i64 + 2),
        )?;
        let table = crate::seeded::randn(0f32, 1.0, (w, d), &dev)?;
        // Both column rules; the map holds entries past the table, which clamp to its last row.
        let map: Vec<u32> = (0..b * tq * tk).map(|n| (n * 7 % (w + 3)) as u32).collect();
        let map = Tensor::from_vec(map, (b, tq, tk), &dev)?;
        let value_terms = [
            RelativeValues::new(table.clone(), Columns::Shift(1))?,
            RelativeValues::new(table.clone(), Columns::Shift(i64::MIN))?,
            RelativeValues::new(table, Columns::Index(map))?,
        ];
        let mut keep = vec![1u8; b * tk];
        keep[..2].fill(0);
        keep[tk + 9] = 0;
        let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
        for (causal, pad, values) in [None, Some(tk - tq)]
            .into_iter()
            .flat_map(|c| [None, Some(&padding)].map(|p| (c, p)))
            .flat_map(|(c, p)| value_terms.iter().map(move |v| (c, p, v)))
        {
            {
                // Reference: repeated heads, dense scores, masks, softmax, products.
                let rep = |t: &Tensor| -> anyhow::Result<Tensor> {
                    Ok(t.unsqueeze(2)?
                        .broadcast_as((b, hkv, h / hkv, tk, d))?
                        .reshape((b, h, tk, d))?)
                };
                let mut s = matmul(&q, &rep(&k)?.t()?)?.broadcast_add(&dense)?;
                s = s.broadcast_add(&relative.to_dense(tq, tk)?)?;
                let rule = match causal {
                    Some(first) => RowRule::causal(first),
                    None => RowRule::default(),
                };
                if let Some(keep) = keep_mask(&rule, pad, b, tq, tk, &dev)? {
                    s = apply_keep_mask(&s, &keep)?;
                }
                let p = candle_nn::ops::softmax(&s, D::Minus1)?;
                let want = (matmul(&p, &rep(&v)?)? + values.weighted_sum(&p)?)?.transpose(1, 2)?;
                for (tile, key_tile) in [(1, 17), (3, 1), (5, 4), (13, 5), (13, 17)] {
                    let out = Tensor::zeros((b, tq, h, d), DType::F32, &dev)?;
                    Core {
                        q: &q,
                        k: &k,
                        v: &v,
                        dense: vec![&dense],
                        dense_masks: true,
                        relative: vec![&relative],
                        separable: vec![],
                        padding: pad,
                        rule: &rule,
                        values: Some(values),
                        tile,
                        key_tile,
                    }
                    .write_into(&out, 0)?;
                    let diff = (out - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        diff < 1e-5,
                        "tile {tile}×{key_tile} causal {causal:?} padded {}: {diff:e}",
                        pad.is_some()
                    );
                }
            }
        }
        Ok(())
    }

    /// Without padding or a mask, causal tiles leave out the keys none of their rows
    /// sees; the result is the same as with every key.
    #[test]
    fn causal_tiles_trim_hidden_keys() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (b, h, tq, tk, d) = (1, 2, 9, 12, 4);
        let q = crate::seeded::randn(0f32, 1.0, (b, h, tq, d), &dev)?;
        let k = crate::seeded::randn(0f32, 1.0, (b, h, tk, d), &dev)?;
        let v = crate::seeded::randn(0f32, 1.0, (b, h, tk, d), &dev)?;
        let rule = RowRule::causal(tk - tq);
        let keep = keep_mask(&rule, None, b, tq, tk, &dev)?.ok_or(anyhow::anyhow!("mask"))?;
        let s = apply_keep_mask(&matmul(&q, &k.t()?)?, &keep)?;
        let want = matmul(&candle_nn::ops::softmax(&s, D::Minus1)?, &v)?.transpose(1, 2)?;
        for (tile, key_tile) in [(1, 12), (2, 1), (4, 5), (9, 3)] {
            let out = Tensor::zeros((b, tq, h, d), DType::F32, &dev)?;
            let core = Core {
                q: &q,
                k: &k,
                v: &v,
                dense: vec![],
                dense_masks: false,
                relative: vec![],
                separable: vec![],
                padding: None,
                rule: &rule,
                values: None,
                tile,
                key_tile,
            };
            core.write_into(&out, 0)?;
            let diff = (out - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "tile {tile}×{key_tile}: {diff:e}");
        }
        Ok(())
    }

    /// The online softmax over key tiles equals the row pass over whole rows (the one-pass
    /// core it replaced) within 3e-6 of the largest output, for every row rule (causal and
    /// bidirectional windows, chunks, sinks, a soft cap), with and without padding (rows
    /// masked whole included), with a relative bias and relative values, for key tiles of one
    /// key to all of them.
    /// Keys and values in bf16 and f16 (a half-precision block's cache, read a key tile at a
    /// time and widened, whole tiles at once or row by row) give what the same values widened
    /// to f32 beforehand give, over several half-precision key tiles, with grouped heads,
    /// padding, a relative bias and relative values, causal and not.
    #[test]
    fn half_keys_and_values_equal_widened_ones() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (b, h, hkv, tk, d, w) = (2, 4, 2, 600, 8, 4);
        for tq in [1, 3, 19] {
            let first = tk - tq;
            let q = crate::seeded::randn(0f32, 1.0, (b, h, tq, d), &dev)?;
            let relative = RelativeBias::new(
                crate::seeded::randn(0f32, 1.0, (1, h, 1, 2 * w + 1), &dev)?,
                Columns::Shift(w as i64 - first as i64),
            )?;
            let values = RelativeValues::new(
                crate::seeded::randn(0f32, 1.0, (2 * w + 1, d), &dev)?,
                Columns::Shift(w as i64 - first as i64),
            )?;
            let mut keep = vec![1u8; b * tk];
            keep[300..320].fill(0);
            let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
            for dtype in [DType::BF16, DType::F16] {
                // Keys as a cache holds them (a head's rows end to end), values strided.
                let k = crate::seeded::randn(0f32, 1.0, (b, hkv, tk, d), &dev)?.to_dtype(dtype)?;
                let v = crate::seeded::randn(0f32, 1.0, (b, tk, hkv, d), &dev)?
                    .to_dtype(dtype)?
                    .transpose(1, 2)?;
                let (k32, v32) = (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
                for causal in [false, true] {
                    let rule = RowRule {
                        first,
                        causal,
                        ..RowRule::default()
                    };
                    let run = |k: &Tensor, v: &Tensor| -> anyhow::Result<Tensor> {
                        let out = Tensor::zeros((b, tq, h, d), DType::F32, &dev)?;
                        Core {
                            q: &q,
                            k,
                            v,
                            dense: vec![],
                            dense_masks: false,
                            relative: vec![&relative],
                            separable: vec![],
                            padding: Some(&padding),
                            rule: &rule,
                            values: Some(&values),
                            tile: tile_rows(tk),
                            // The half tiles' size, so that both sum in the same order.
                            key_tile: HALF_KEY_TILE,
                        }
                        .write_into(&out, 0)?;
                        Ok(out)
                    };
                    let (got, want) = (run(&k, &v)?, run(&k32, &v32)?);
                    let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
                    let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        diff <= 1e-6 * top,
                        "{dtype:?} tq {tq} causal {causal}: {diff:e} of {top}"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn key_tiles_equal_whole_rows() -> anyhow::Result<()> {
        use crate::attention::fused_softmax::bias_mask_softmax_in_place;
        let dev = Device::Cpu;
        // 19 queries: tiles of fewer read the keys transposed once, one tile of all reads them
        // as stored.
        let (b, h, tq, tk, d, w) = (2, 2, 19, 31, 8, 4);
        let first = tk - tq;
        let q = (crate::seeded::randn(0f32, 1.0, (b, h, tq, d), &dev)? * 2.0)?;
        let k = crate::seeded::randn(0f32, 1.0, (b, h, tk, d), &dev)?;
        let v = crate::seeded::randn(0f32, 1.0, (b, h, tk, d), &dev)?;
        let relative = RelativeBias::new(
            crate::seeded::randn(0f32, 1.0, (1, h, 1, 2 * w + 1), &dev)?,
            Columns::Shift(w as i64 - first as i64),
        )?;
        let values = RelativeValues::new(
            crate::seeded::randn(0f32, 1.0, (2 * w + 1, d), &dev)?,
            Columns::Shift(w as i64 - first as i64),
        )?;
        // Batch item 0: its first 14 keys padded, so its early causal rows are masked whole.
        let mut keep = vec![1u8; b * tk];
        keep[..14].fill(0);
        keep[tk + 5] = 0;
        let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
        let causal = RowRule {
            first,
            causal: true,
            ..RowRule::default()
        };
        let rules = [
            RowRule::default(),
            causal.clone(),
            RowRule {
                window: Some(5),
                ..causal.clone()
            },
            RowRule {
                first,
                window: Some(3),
                ..RowRule::default()
            },
            RowRule {
                chunk: Some(4),
                ..causal.clone()
            },
            RowRule {
                softcap: Some(2.0),
                sinks: Some(vec![0.5, -1.0]),
                window: Some(6),
                ..causal.clone()
            },
            RowRule {
                sinks: Some(vec![3.0, f32::MIN]),
                ..RowRule::default()
            },
        ];
        for rule in &rules {
            for pad in [None, Some(&padding)] {
                let s = matmul(&q, &k.t()?)?.contiguous()?;
                bias_mask_softmax_in_place(&s, (&[], &[&relative], &[]), pad, rule)?;
                let want = (matmul(&s, &v)? + values.weighted_sum(&s)?)?.transpose(1, 2)?;
                let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
                for (tile, key_tile) in [(19, 1), (3, 4), (4, 7), (19, 31), (1, 1024)] {
                    let out = Tensor::zeros((b, tq, h, d), DType::F32, &dev)?;
                    Core {
                        q: &q,
                        k: &k,
                        v: &v,
                        dense: vec![],
                        dense_masks: false,
                        relative: vec![&relative],
                        separable: vec![],
                        padding: pad,
                        rule,
                        values: Some(&values),
                        tile,
                        key_tile,
                    }
                    .write_into(&out, 0)?;
                    let diff = (out - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(
                        diff <= 3e-6 * top,
                        "{rule:?} padded {} tile {tile}×{key_tile}: {diff:e} of {top}",
                        pad.is_some()
                    );
                }
            }
        }
        Ok(())
    }

    /// The per-column sums of a tile never take more than the value table or 2^20 floats.
    #[test]
    fn value_sums_stay_within_the_table() {
        assert_eq!(value_tile_rows(256, 129, 64), 256);
        assert_eq!(value_tile_rows(256, 1 << 16, 64), 64);
        assert_eq!(value_tile_rows(256, 1 << 22, 1), 1);
        assert_eq!(value_tile_rows(256, (1 << 32) - 1, 1), 1);
        assert_eq!(value_tile_rows(256, 0, 1), 256);
        for (w, d) in [(1usize << 30, 4usize), (5000, 3), (1 << 20, 1)] {
            let rows = value_tile_rows(256, w, d);
            assert!(rows * w <= (w * d).max(1 << 20), "{w} × {d}: {rows} rows");
        }
    }

    #[test]
    fn tiles_hold_about_a_mebibyte_of_logits() {
        assert_eq!(tile_rows(1024), 256);
        assert_eq!(tile_rows(4096), 256);
        assert_eq!(tile_rows(1 << 20), 256);
        assert_eq!(tile_rows(1), 256);
        assert_eq!(KEY_TILE * tile_rows(KEY_TILE) * 4, TILE_BYTES);
    }
}
