//! Fuzzes the public API with structured input: an encoding configuration of every kind, an
//! attention configuration, chunks of input of every shape and dtype, positions, masks, a KV
//! cache used over several chunks (cloned, truncated, reset), a custom encoding whose hooks
//! answer with arbitrary (possibly misshapen) tensors, and the plug's data forms driven directly.
//!
//! Everything runs on the CPU with the size budget lowered to 2^22 elements
//! (`limits::set_max_elements`), so absurd sizes are refused before they are allocated, and every
//! size the input chooses freely is small (batch ≤ 3, chunks ≤ 40 tokens, ≤ 8 heads, head width
//! ≤ 16); extreme values (2^32, usize::MAX, ...) are drawn from a short list.
//!
//! What is asserted (a failed assertion is a crash, as a panic or an abort is):
//! - **typed errors**: every `Err` is `InvalidConfig`, `PositionOutOfRange`, `Rank`, `Shape` or
//!   `DType`. `Error::Candle` is never allowed: every input here lives on the CPU, so a candle
//!   error can only mean that bad input reached a kernel unchecked. (The custom encoding's own
//!   failures are `InvalidConfig` named "fuzz hook".) Checkpoint, I/O and `config.json` errors
//!   cannot arise from these calls.
//! - **well-formed input succeeds**: a forward pass whose every input is well formed (right
//!   shapes and dtypes, small positions, an encoding that matches the block) returns `Ok`, or
//!   `PositionOutOfRange` (a learned table), or `InvalidConfig` where xPos limits positions.
//! - **finite outputs**: with finite, moderate inputs (values ≤ 4 in magnitude, a softmax scale
//!   ≤ 2, additive masks whose entries are finite or −∞ with one finite entry per row, dropout
//!   ≤ 0.5, half-precision positions below 2048), an `Ok` output is finite, and returned weights
//!   are probabilities whose rows sum to 1. Extreme but valid settings (a scale of 3e38, inputs
//!   of 1e30, a dropout of 0.999999 in f16) may overflow as IEEE arithmetic does: not asserted.
//! - **paths agree**: in f32 inference the fused core (no weights), the row pass (weights
//!   returned), another query-block size and, without dropout, the differentiable ops path
//!   (training) give the same output to 1e-4 of its scale.
//! - **a failed forward leaves the cache as it was** (length and positions).
//! - **the plug's data forms** (`RelativeBias::to_dense`, `LogitsBias::to_dense`,
//!   `RelativeValues::weighted_sum`) equal their documented formulas, computed here on the host.
//!
//! Run: `cargo +nightly fuzz run -O api corpus/api -- -runs=1000000 -rss_limit_mb=2048 -malloc_limit_mb=1024`
//! Print an input: `cargo +nightly fuzz fmt api <file>`
#![no_main]

use std::fmt;
use std::sync::{Arc, Once};

use arbitrary::{Arbitrary, Result as AResult, Unstructured};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::plug::{
    AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias, RelativeValues,
};
use candle_posenc::{
    AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, AttentionTemperature,
    ClippedBiasConfig, EncodingConfig, Error, Interpolation, KvCache, LatentConfig, LearnedConfig,
    LongRopeScaling, MultiHeadAttention, PositionIds, Positions, QkNormConfig, QkNormScope,
    RopeConfig, RopeKernel, RopeLayout, RopeMixedConfig, RopeScaling, ShawConfig, SinusoidalConfig,
    T5Config, YarnScaling,
};
use libfuzzer_sys::fuzz_target;

/// The size budget of the whole target: 2^22 elements (16 MiB of f32) per tensor.
const BUDGET: usize = 1 << 22;

fuzz_target!(|case: Case| {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        candle_posenc::limits::set_max_elements(BUDGET);
    });
    case.run();
});

// ---------------------------------------------------------------------------------------------
// Small values drawn from one byte each.

/// A number in `0..=N`.
#[derive(Clone, Copy)]
struct Up<const N: u8>(usize);

impl<const N: u8> fmt::Debug for Up<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'a, const N: u8> Arbitrary<'a> for Up<N> {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        Ok(Up(u.int_in_range(0..=N)? as usize))
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

/// Sizes far outside what the budget allows, or just at the edges of `u32` and `usize`.
const EXTREME_SIZES: [usize; 8] = [
    1 << 16,
    1 << 20,
    (1 << 31) + 1,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    usize::MAX / 2 + 1,
    usize::MAX,
];

/// A size: usually `0..=N`, sometimes (1 in 32) an extreme one.
#[derive(Clone, Copy)]
struct Dim<const N: u8> {
    value: usize,
    extreme: bool,
}

impl<const N: u8> fmt::Debug for Dim<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.value)
    }
}

impl<'a, const N: u8> Arbitrary<'a> for Dim<N> {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        let b = u8::arbitrary(u)?;
        Ok(if b >= 248 {
            Dim {
                value: EXTREME_SIZES[(b - 248) as usize],
                extreme: true,
            }
        } else {
            Dim {
                value: b as usize % (N as usize + 1),
                extreme: false,
            }
        })
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

const EXTREME_REALS: [f64; 16] = [
    0.0,
    -1.0,
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    f64::MIN_POSITIVE,
    1e-300,
    1e300,
    f32::MAX as f64,
    f32::MIN_POSITIVE as f64,
    -0.0,
    1.0,
    1.0 + f64::EPSILON,
    f64::MAX,
    0.5,
    131008.0,
];

/// A real number: `normal(u)` of a `u` in `[0, 1)`, or (1 in 16) an extreme value.
#[derive(Clone, Copy)]
struct Real {
    unit: f64,
    extreme: Option<f64>,
}

impl fmt::Debug for Real {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.extreme {
            Some(x) => write!(f, "extreme {x:e}"),
            None => write!(f, "u{:.3}", self.unit),
        }
    }
}

impl<'a> Arbitrary<'a> for Real {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        let b = u8::arbitrary(u)?;
        Ok(if b >= 240 {
            Real {
                unit: 0.0,
                extreme: Some(EXTREME_REALS[(b - 240) as usize]),
            }
        } else {
            Real {
                unit: b as f64 / 240.0,
                extreme: None,
            }
        })
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

impl Real {
    /// `lo + unit · span`, or the extreme value.
    fn get(&self, lo: f64, span: f64) -> f64 {
        self.extreme.unwrap_or(lo + self.unit * span)
    }
}

/// A dropout probability, valid or not.
#[derive(Clone, Copy)]
struct Prob(f32);

impl fmt::Debug for Prob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'a> Arbitrary<'a> for Prob {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        const P: [f32; 8] = [0.0, 0.0, 0.0, 0.1, 0.5, 0.999_999, -0.1, 1.0];
        let b = u8::arbitrary(u)?;
        Ok(Prob(if b == 255 {
            f32::NAN
        } else {
            P[b as usize % 8]
        }))
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

/// A dtype: mostly the four float dtypes, sometimes an integer one.
#[derive(Clone, Copy)]
struct Dt(DType);

impl fmt::Debug for Dt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl<'a> Arbitrary<'a> for Dt {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        Ok(Dt(match u8::arbitrary(u)? % 16 {
            0..=6 => DType::F32,
            7..=8 => DType::F64,
            9..=10 => DType::BF16,
            11..=12 => DType::F16,
            13 => DType::U8,
            14 => DType::U32,
            _ => DType::I64,
        }))
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// The dtype of an input: the model's, or another one.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum DtSel {
    Model,
    Model2,
    Other(Dt),
}

impl DtSel {
    fn get(&self, model: DType, f: &mut Flags) -> DType {
        match self {
            DtSel::Model | DtSel::Model2 => model,
            DtSel::Other(d) => {
                if d.0 != model {
                    f.malformed();
                }
                d.0
            }
        }
    }
}

/// An offset: small, or at the edges of `u32` and `usize`.
#[derive(Clone, Copy)]
struct Offset(usize);

impl fmt::Debug for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'a> Arbitrary<'a> for Offset {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        let b = u8::arbitrary(u)?;
        let k = (b % 8) as usize;
        Ok(Offset(match b / 8 {
            0..=19 => b as usize % 64,
            20 => 2048 + k * 300,
            21 => (1 << 20) + k,
            22 => u32::MAX as usize - k,
            23 => u32::MAX as usize + k,
            24 => (1 << 31) + k,
            25 => usize::MAX - k,
            26 => usize::MAX / 2 + k,
            27 => 65504 + k * 9000,
            _ => b as usize % 16,
        }))
    }
    fn size_hint(_: usize) -> (usize, Option<usize>) {
        (1, Some(1))
    }
}

/// Whether an offset keeps positions in the range every test of well-formedness assumes.
fn small_offset(o: usize) -> bool {
    o < 2048
}

/// Values to fill a tensor with.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Fill {
    /// Pseudo-random values in `[-1, 1]`.
    Unit(u8),
    /// Pseudo-random values in `[-m, m]`.
    Scaled(u8, Mag),
    /// One value everywhere.
    Const(Up<7>),
    /// Pseudo-random values with a NaN or ±∞ at some entries.
    NonFinite(u8, Up<2>),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Mag {
    Tiny,
    Four,
    Hundred,
    Big,
    Huge,
}

impl Mag {
    fn get(&self) -> f64 {
        match self {
            Mag::Tiny => 1e-3,
            Mag::Four => 4.0,
            Mag::Hundred => 100.0,
            Mag::Big => 1e4,
            Mag::Huge => 1e30,
        }
    }
}

const CONSTS: [f64; 8] = [0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 1e-30, 7.0];

impl Fill {
    /// Whether the values are finite and at most 4 in magnitude.
    fn moderate(&self) -> bool {
        match self {
            Fill::Unit(_) | Fill::Const(_) => true,
            Fill::Scaled(_, m) => m.get() <= 4.0,
            Fill::NonFinite(..) => false,
        }
    }

    fn values(&self, n: usize) -> Vec<f64> {
        match self {
            Fill::Unit(s) => (0..n).map(|i| unit(*s as u64, i)).collect(),
            Fill::Scaled(s, m) => (0..n).map(|i| unit(*s as u64, i) * m.get()).collect(),
            Fill::Const(c) => vec![CONSTS[c.0]; n],
            Fill::NonFinite(s, kind) => (0..n)
                .map(|i| {
                    let v = unit(*s as u64, i);
                    if hash(*s as u64 ^ 0x55, i) % 5 == 0 {
                        [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][kind.0]
                    } else {
                        v
                    }
                })
                .collect(),
        }
    }
}

fn hash(seed: u64, i: usize) -> u64 {
    // splitmix64
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i as u64)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A pseudo-random value in `[-1, 1]`.
fn unit(seed: u64, i: usize) -> f64 {
    (hash(seed, i) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// At most this many elements in a tensor built by the target itself.
const MAX_BUILT: usize = 1 << 18;

/// A CPU tensor of `dims` in `dtype` holding `values` (cast from f64), or `None` when it would
/// hold more than [`MAX_BUILT`] elements, or when its strides would not fit `usize` (an empty
/// tensor with two huge axes: candle's own stride arithmetic overflows on it, which a build
/// with debug assertions reports as a panic in candle, not in the crate).
fn tensor(values: &[f64], dims: &[usize], dtype: DType) -> Option<Tensor> {
    dims.iter()
        .filter(|&&d| d > 0)
        .try_fold(1usize, |a, &d| a.checked_mul(d))?;
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    if n > MAX_BUILT || n != values.len() {
        return None;
    }
    let t = Tensor::from_vec(values.to_vec(), dims, &Device::Cpu).ok()?;
    t.to_dtype(dtype).ok()
}

fn filled(fill: &Fill, dims: &[usize], dtype: DType) -> Option<Tensor> {
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    if n > MAX_BUILT {
        return None;
    }
    tensor(&fill.values(n), dims, dtype)
}

/// A shape relative to the one that is right where it is used.
#[derive(Arbitrary, Debug, Clone)]
enum ShapeSpec {
    Right,
    Right2,
    Right3,
    /// The right shape with the axes whose bit is set made 1 (broadcast).
    Ones(u8),
    /// The right shape with one axis changed.
    Perturb(Up<7>, Dim<9>),
    /// Another rank.
    Dims(Vec<Up<5>>),
}

impl ShapeSpec {
    /// The dims, and whether they are the right ones (`broadcast_ok`: axes made 1 count as
    /// right).
    fn dims(&self, right: &[usize], broadcast_ok: bool) -> (Vec<usize>, bool) {
        match self {
            ShapeSpec::Right | ShapeSpec::Right2 | ShapeSpec::Right3 => (right.to_vec(), true),
            ShapeSpec::Ones(bits) => {
                let d: Vec<usize> = right
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| if bits >> i & 1 == 1 { 1 } else { n })
                    .collect();
                let ok = broadcast_ok || d == right;
                (d, ok)
            }
            ShapeSpec::Perturb(axis, to) => {
                let mut d = right.to_vec();
                if d.is_empty() {
                    return (d, true);
                }
                let a = axis.0 % d.len();
                d[a] = to.value;
                let ok = d == right;
                (d, ok)
            }
            ShapeSpec::Dims(v) => {
                let d: Vec<usize> = v.iter().take(5).map(|x| x.0).collect();
                let ok = d == right;
                (d, ok)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the run knows about its input.

#[derive(Debug, Clone, Copy)]
struct Flags {
    /// Every input so far is well formed (so a forward pass must succeed).
    wellformed: bool,
    /// Every value so far is finite and moderate (so outputs must be finite).
    moderate: bool,
}

impl Flags {
    fn malformed(&mut self) {
        self.wellformed = false;
    }
    fn immoderate(&mut self) {
        self.moderate = false;
    }
}

/// With `API_FUZZ_TRACE` set, prints what each forward pass did (to see how deep inputs reach).
fn trace(msg: impl FnOnce() -> String) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("API_FUZZ_TRACE").is_some()) {
        eprintln!("api: {}", msg());
    }
}

fn typed(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidConfig { .. }
            | Error::PositionOutOfRange { .. }
            | Error::Rank { .. }
            | Error::Shape { .. }
            | Error::Positions { .. }
            | Error::DType { .. }
    )
}

fn check_err(e: &Error, what: &str) {
    assert!(typed(e), "{what}: untyped error {e:?}");
}

fn all_finite(t: &Tensor) -> bool {
    match t
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
    {
        Ok(v) => v.iter().all(|x| x.is_finite()),
        Err(e) => panic!("reading back a result: {e}"),
    }
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
        .expect("reading back a result")
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

// ---------------------------------------------------------------------------------------------
// Configurations.

#[derive(Arbitrary, Debug)]
enum KvSpec {
    Same,
    Divisor(Up<7>),
    Any(Dim<8>),
}

#[derive(Arbitrary, Debug)]
enum HeadDimSpec {
    Derived,
    Explicit(Dim<16>),
}

#[derive(Arbitrary, Debug)]
enum DModelSpec {
    Product,
    Product2,
    Other(Dim<64>),
}

/// Logits budgets in bytes.
#[derive(Clone, Copy)]
struct Budget(usize);

impl fmt::Debug for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl<'a> Arbitrary<'a> for Budget {
    fn arbitrary(u: &mut Unstructured<'a>) -> AResult<Self> {
        const B: [usize; 8] = [0, 1, 16, 256, 4096, 65536, 1 << 24, usize::MAX];
        Ok(Budget(B[u8::arbitrary(u)? as usize % 8]))
    }
}

#[derive(Arbitrary, Debug)]
struct AttnSpec {
    heads: Dim<8>,
    kv: KvSpec,
    head_dim: HeadDimSpec,
    d_model: DModelSpec,
    causal: bool,
    query_block: Option<Dim<40>>,
    logits_budget: Option<Budget>,
    bias: bool,
    dropout: Prob,
    softmax_scale: Option<Real>,
    dtype: Dt,
    /// The query block of the second model, which shares the weights.
    alt_block: Up<7>,
    window: Option<Dim<8>>,
    /// Chunked attention (valid in causal blocks only).
    chunk: Option<Dim<8>>,
    softcap: Option<Real>,
    sinks: bool,
    /// Query/key norm: (over all heads, Gemma's unit offset, without a learned scale).
    qk_norm: Option<(bool, bool, bool)>,
    /// Attention temperature tuning: (attn_scale in [0, 1], floor_scale).
    temperature: Option<(Real, Dim<8>)>,
    /// Latent attention: (query rank, kv rank, rope features, value features).
    latent: Option<(Option<Dim<8>>, Dim<8>, Dim<8>, Dim<8>)>,
    /// Gemma 4's value norm and values from the key projection.
    value_norm: bool,
    k_eq_v: bool,
}

impl AttnSpec {
    fn config(&self, f: &mut Flags) -> AttentionConfig {
        let heads = self
            .heads
            .value
            .max(usize::from(!self.heads.extreme && self.heads.value == 0));
        let head_dim = match &self.head_dim {
            HeadDimSpec::Derived => 4,
            HeadDimSpec::Explicit(d) => d.value,
        };
        let d_model = match &self.d_model {
            DModelSpec::Product | DModelSpec::Product2 => heads.saturating_mul(head_dim),
            DModelSpec::Other(d) => d.value,
        };
        let mut c = AttentionConfig::new(d_model, heads);
        if let HeadDimSpec::Explicit(d) = &self.head_dim {
            c = c.with_head_dim(d.value);
        }
        c = match &self.kv {
            KvSpec::Same => c,
            KvSpec::Divisor(i) => {
                let divisors: Vec<usize> = (1..=heads.min(64)).filter(|d| heads % d == 0).collect();
                c.with_kv_heads(
                    divisors
                        .get(i.0 % divisors.len().max(1))
                        .copied()
                        .unwrap_or(1),
                )
            }
            KvSpec::Any(d) => c.with_kv_heads(d.value),
        };
        c = c
            .with_causal(self.causal)
            .with_bias(self.bias)
            .with_dropout(self.dropout.0)
            .with_query_block(self.query_block.map(|d| d.value));
        if let Some(b) = self.logits_budget {
            c = c.with_logits_budget(b.0);
        }
        if let Some(s) = self.softmax_scale {
            let scale = s.get(0.01, 2.0);
            if !(scale <= 2.0) {
                f.immoderate();
            }
            c = c.with_softmax_scale(scale);
        }
        if self.dropout.0 > 0.5 {
            f.immoderate();
        }
        let norm = self.qk_norm.map(|(all, unit, plain)| {
            let scope = if all {
                QkNormScope::AllHeads
            } else {
                QkNormScope::PerHead
            };
            QkNormConfig::new()
                .with_scope(scope)
                .with_unit_offset(unit)
                .with_learned_scale(!plain)
        });
        let temperature = match self.temperature {
            Some((s, floor)) => {
                let scale = s.get(0.0, 1.0);
                if !(scale <= 1.0) {
                    f.immoderate();
                }
                Some(AttentionTemperature::new(scale, floor.value))
            }
            None => None,
        };
        c.with_sliding_window(self.window.map(|w| w.value))
            .with_attention_chunk(self.chunk.map(|c| c.value))
            .with_attention_temperature(temperature)
            .with_value_norm(self.value_norm.then_some(1e-6))
            .with_k_eq_v(self.k_eq_v)
            .with_latent(self.latent.map(|(q, kv, rope, v)| {
                LatentConfig::new(q.map(|q| q.value), kv.value, rope.value, v.value)
            }))
            .with_logit_softcap(self.softcap.map(|s| s.get(0.5, 50.0)))
            .with_sinks(self.sinks)
            .with_qk_norm(norm)
    }
}

/// A value that should match the attention's (`Match`), or another one.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum M<T> {
    Match,
    Match2,
    Other(T),
}

impl<const N: u8> M<Dim<N>> {
    fn get(&self, right: usize, f: &mut Flags) -> usize {
        match self {
            M::Match | M::Match2 => right,
            M::Other(d) => {
                if d.value != right {
                    f.malformed();
                }
                d.value
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
enum InterpSpec {
    Off,
    ToSequenceLength,
    ToLength(Dim<128>),
}

#[derive(Arbitrary, Debug)]
enum ModeSpec {
    Auto,
    Causal,
    CausalPairwise,
    Symmetric,
}

#[derive(Arbitrary, Debug)]
enum RotaryDimSpec {
    Full,
    Partial(Up<16>),
    Factor(Real),
}

#[derive(Arbitrary, Debug)]
struct Factors {
    len: M<Dim<12>>,
    base: Real,
    step: Up<8>,
}

impl Factors {
    fn get(&self, right: usize) -> Vec<f64> {
        let mut f = Flags {
            wellformed: true,
            moderate: true,
        };
        let n = self.len.get(right, &mut f).min(64);
        (0..n)
            .map(|i| self.base.get(0.5, 4.0) + i as f64 * self.step.0 as f64 / 8.0)
            .collect()
    }
}

#[derive(Arbitrary, Debug)]
enum ScalingSpec {
    None,
    Linear {
        factor: Real,
    },
    Ntk {
        alpha: Real,
    },
    Dynamic {
        factor: Real,
        original: Dim<64>,
    },
    Yarn {
        factor: Real,
        original: Dim<64>,
        betas: Option<(Real, Real)>,
        mscale: Option<(Real, Real)>,
        attention_factor: Option<Real>,
        truncate: bool,
    },
    Llama3 {
        factor: Real,
        low: Real,
        high: Real,
        original: Dim<64>,
    },
    LongRope {
        short: Factors,
        long: Factors,
        original: Dim<64>,
        factor: Real,
        attention_factor: Option<Real>,
    },
}

impl ScalingSpec {
    fn get(&self, rotary_dim: usize) -> RopeScaling {
        match self {
            ScalingSpec::None => RopeScaling::None,
            ScalingSpec::Linear { factor } => RopeScaling::Linear {
                factor: factor.get(0.25, 16.0),
            },
            ScalingSpec::Ntk { alpha } => RopeScaling::NtkAware {
                alpha: alpha.get(0.25, 16.0),
            },
            ScalingSpec::Dynamic { factor, original } => RopeScaling::Dynamic {
                factor: factor.get(0.25, 16.0),
                original_max_position_embeddings: original.value,
            },
            ScalingSpec::Yarn {
                factor,
                original,
                betas,
                mscale,
                attention_factor,
                truncate,
            } => {
                let mut y = YarnScaling::new(factor.get(1.0, 16.0), original.value)
                    .with_truncate(*truncate);
                if let Some((fast, slow)) = betas {
                    y = y.with_betas(fast.get(0.0, 64.0), slow.get(0.0, 4.0));
                }
                if let Some((m, all)) = mscale {
                    y = y.with_mscale(m.get(0.0, 2.0), all.get(0.0, 2.0));
                }
                if let Some(a) = attention_factor {
                    y = y.with_attention_factor(a.get(0.1, 2.0));
                }
                RopeScaling::Yarn(y)
            }
            ScalingSpec::Llama3 {
                factor,
                low,
                high,
                original,
            } => RopeScaling::Llama3 {
                factor: factor.get(1.0, 16.0),
                low_freq_factor: low.get(0.5, 4.0),
                high_freq_factor: high.get(1.0, 8.0),
                original_max_position_embeddings: original.value,
            },
            ScalingSpec::LongRope {
                short,
                long,
                original,
                factor,
                attention_factor,
            } => RopeScaling::LongRope(LongRopeScaling {
                short_factor: short.get(rotary_dim / 2),
                long_factor: long.get(rotary_dim / 2),
                original_max_position_embeddings: original.value,
                factor: factor.get(1.0, 16.0),
                attention_factor: attention_factor.map(|a| a.get(0.1, 2.0)),
            }),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct RotarySpec {
    head_dim: M<Dim<16>>,
    rotary_dim: RotaryDimSpec,
    base: Real,
    interleaved: bool,
    scaling: ScalingSpec,
    max_position: Dim<64>,
    xpos: Option<Real>,
    ops: bool,
}

#[derive(Arbitrary, Debug)]
enum EncSpec {
    None,
    Sinusoidal {
        d_model: M<Dim<64>>,
        max_len: Dim<64>,
        base: Real,
        dropout: Prob,
    },
    Learned {
        d_model: M<Dim<64>>,
        max_len: Dim<64>,
        dropout: Prob,
        interpolation: InterpSpec,
    },
    Alibi {
        extra_heads: Up<4>,
        first_head: Up<8>,
        head_count: M<Dim<8>>,
        mode: ModeSpec,
        learnable: bool,
    },
    T5 {
        num_heads: M<Dim<8>>,
        num_buckets: Dim<64>,
        max_distance: Dim<200>,
        bidirectional: bool,
    },
    Clipped {
        num_heads: M<Dim<8>>,
        max_distance: Dim<16>,
    },
    Shaw {
        head_dim: M<Dim<16>>,
        max_distance: Dim<16>,
        values: bool,
    },
    Rotary(RotarySpec),
    Custom(CustomSpec),
    /// RoPE-Mixed: learned 2-D frequencies per head, read from multimodal positions.
    Mixed {
        num_heads: M<Dim<8>>,
        head_dim: M<Dim<16>>,
        theta: Real,
        seed: u8,
    },
}

impl EncSpec {
    /// The configuration (`None` for the custom encoding), and the dropout it applies in
    /// training.
    fn config(&self, a: &AttentionConfig, f: &mut Flags) -> Option<(EncodingConfig, f32)> {
        Some(match self {
            EncSpec::None => (EncodingConfig::None, 0.0),
            EncSpec::Sinusoidal {
                d_model,
                max_len,
                base,
                dropout,
            } => (
                EncodingConfig::Sinusoidal(
                    SinusoidalConfig::new(d_model.get(a.d_model, f))
                        .with_max_len(max_len.value)
                        .with_base(base.get(2.0, 20000.0))
                        .with_dropout(dropout.0),
                ),
                dropout.0,
            ),
            EncSpec::Learned {
                d_model,
                max_len,
                dropout,
                interpolation,
            } => (
                EncodingConfig::Learned(
                    LearnedConfig::new(d_model.get(a.d_model, f))
                        .with_max_len(max_len.value)
                        .with_dropout(dropout.0)
                        .with_interpolation(match interpolation {
                            InterpSpec::Off => Interpolation::Off,
                            InterpSpec::ToSequenceLength => Interpolation::ToSequenceLength,
                            InterpSpec::ToLength(n) => Interpolation::ToLength(n.value),
                        }),
                ),
                dropout.0,
            ),
            EncSpec::Alibi {
                extra_heads,
                first_head,
                head_count,
                mode,
                learnable,
            } => {
                let count = head_count.get(a.num_heads, f);
                let total = count.saturating_add(extra_heads.0);
                let first = first_head.0 % (extra_heads.0 + 1);
                (
                    EncodingConfig::Alibi(
                        AlibiConfig::new(total)
                            .with_head_range(first, count)
                            .with_mode(match mode {
                                ModeSpec::Auto => AlibiMode::Auto,
                                ModeSpec::Causal => AlibiMode::Causal,
                                ModeSpec::CausalPairwise => AlibiMode::CausalPairwise,
                                ModeSpec::Symmetric => AlibiMode::Symmetric,
                            })
                            .with_learnable(*learnable),
                    ),
                    0.0,
                )
            }
            EncSpec::T5 {
                num_heads,
                num_buckets,
                max_distance,
                bidirectional,
            } => (
                EncodingConfig::T5(
                    T5Config::new(num_heads.get(a.num_heads, f))
                        .with_num_buckets(num_buckets.value)
                        .with_max_distance(max_distance.value)
                        .with_bidirectional(*bidirectional),
                ),
                0.0,
            ),
            EncSpec::Clipped {
                num_heads,
                max_distance,
            } => (
                EncodingConfig::ClippedBias(ClippedBiasConfig::new(
                    num_heads.get(a.num_heads, f),
                    max_distance.value,
                )),
                0.0,
            ),
            EncSpec::Shaw {
                head_dim,
                max_distance,
                values,
            } => (
                EncodingConfig::Shaw(
                    ShawConfig::new(head_dim.get(a.head_dim, f), max_distance.value)
                        .with_values(*values),
                ),
                0.0,
            ),
            EncSpec::Rotary(r) => {
                let head_dim = r.head_dim.get(a.head_dim, f);
                let mut c = RopeConfig::new(head_dim)
                    .with_base(r.base.get(2.0, 20000.0))
                    .with_layout(if r.interleaved {
                        RopeLayout::Interleaved
                    } else {
                        RopeLayout::Half
                    })
                    .with_max_position(r.max_position.value)
                    .with_kernel(if r.ops {
                        RopeKernel::Ops
                    } else {
                        RopeKernel::Fused
                    });
                c = match &r.rotary_dim {
                    RotaryDimSpec::Full => c,
                    RotaryDimSpec::Partial(n) => c.with_rotary_dim(n.0),
                    RotaryDimSpec::Factor(x) => c.with_partial_rotary_factor(x.get(0.0, 1.0)),
                };
                let rotary_dim = c.rotary_dim;
                c = c.with_scaling(r.scaling.get(rotary_dim));
                if let Some(g) = r.xpos {
                    c = c.with_xpos(g.get(16.0, 1024.0));
                }
                (EncodingConfig::Rotary(c), 0.0)
            }
            EncSpec::Mixed {
                num_heads,
                head_dim,
                theta,
                seed,
            } => {
                // One frequency set per head: grouped KV heads are refused.
                if a.num_kv_heads != a.num_heads {
                    f.malformed();
                }
                (
                    EncodingConfig::RopeMixed(
                        RopeMixedConfig::new(
                            num_heads.get(a.num_heads, f),
                            head_dim.get(a.head_dim, f),
                        )
                        .with_theta(theta.get(2.0, 100.0))
                        .with_seed(*seed as u64),
                    ),
                    0.0,
                )
            }
            EncSpec::Custom(_) => return None,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The custom encoding.

#[derive(Arbitrary, Debug, Clone)]
struct TSpec {
    shape: ShapeSpec,
    dtype: DtSel,
    fill: Fill,
}

#[derive(Arbitrary, Debug, Clone)]
enum ShiftSpec {
    Natural,
    Natural2,
    Small(i8),
    Min,
    MinPlus1,
    Max,
    MaxMinus1,
    Any(i64),
}

#[derive(Arbitrary, Debug, Clone)]
enum IndexValues {
    Below(u8),
    Zero,
    Max,
    Any(u8),
}

#[derive(Arbitrary, Debug, Clone)]
enum ColSpec {
    Shift(ShiftSpec),
    Index {
        shape: ShapeSpec,
        per_batch: bool,
        dtype: IndexDt,
        values: IndexValues,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum IndexDt {
    U32,
    U32b,
    U32c,
    U8,
    I64,
    F32,
}

impl IndexDt {
    fn get(&self) -> DType {
        match self {
            IndexDt::U32 | IndexDt::U32b | IndexDt::U32c => DType::U32,
            IndexDt::U8 => DType::U8,
            IndexDt::I64 => DType::I64,
            IndexDt::F32 => DType::F32,
        }
    }
}

impl ColSpec {
    /// The columns for `batch` sequences of `tq` queries and `tk` keys over `width` columns.
    fn build(&self, batch: usize, tq: usize, tk: usize, width: usize) -> Option<Columns> {
        Some(match self {
            ColSpec::Shift(s) => Columns::Shift(match s {
                ShiftSpec::Natural | ShiftSpec::Natural2 => {
                    i64::try_from(tq).unwrap_or(i64::MAX) - 1
                }
                ShiftSpec::Small(x) => *x as i64,
                ShiftSpec::Min => i64::MIN,
                ShiftSpec::MinPlus1 => i64::MIN + 1,
                ShiftSpec::Max => i64::MAX,
                ShiftSpec::MaxMinus1 => i64::MAX - 1,
                ShiftSpec::Any(x) => *x,
            }),
            ColSpec::Index {
                shape,
                per_batch,
                dtype,
                values,
            } => {
                let b = if *per_batch { batch } else { 1 };
                let (dims, _) = shape.dims(&[b, tq, tk], false);
                let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
                if n > MAX_BUILT {
                    return None;
                }
                let v: Vec<f64> = (0..n)
                    .map(|i| match values {
                        IndexValues::Below(s) => {
                            (hash(*s as u64, i) % (width as u64).saturating_add(1)) as f64
                        }
                        IndexValues::Zero => 0.0,
                        IndexValues::Max => u32::MAX as f64,
                        IndexValues::Any(s) => (hash(*s as u64, i) % (1u64 << 32)) as f64,
                    })
                    .collect();
                Columns::Index(tensor(&v, &dims, dtype.get())?)
            }
        })
    }
}

#[derive(Arbitrary, Debug, Clone)]
enum RotSpec {
    Keep,
    Keep2,
    Swap,
    Replace(Option<TSpec>, Option<TSpec>),
}

#[derive(Arbitrary, Debug, Clone)]
enum BiasSpec {
    None,
    Dense(TSpec),
    Relative {
        values: TSpec,
        per_query: bool,
        width: Dim<48>,
        columns: ColSpec,
    },
}

#[derive(Arbitrary, Debug, Clone)]
enum ValSpec {
    None,
    Table {
        table: TSpec,
        width: Dim<48>,
        columns: ColSpec,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Hook {
    Input,
    Rotate,
    Bias,
    Values,
}

/// A third-party encoding whose hooks answer what the input says.
#[derive(Arbitrary, Debug, Clone)]
struct CustomSpec {
    input: Option<TSpec>,
    rotate: RotSpec,
    bias: BiasSpec,
    values: ValSpec,
    fail: Option<Hook>,
}

impl CustomSpec {
    /// Whether every answer of the hooks has the shape and dtype the block expects.
    fn wellformed(&self) -> bool {
        let right = |t: &TSpec| {
            matches!(
                t.shape,
                ShapeSpec::Right | ShapeSpec::Right2 | ShapeSpec::Right3
            ) && !matches!(t.dtype, DtSel::Other(_))
        };
        let cols = |c: &ColSpec| match c {
            ColSpec::Shift(_) => true,
            ColSpec::Index { shape, dtype, .. } => {
                matches!(
                    shape,
                    ShapeSpec::Right | ShapeSpec::Right2 | ShapeSpec::Right3
                ) && dtype.get() == DType::U32
            }
        };
        self.fail.is_none()
            && self.input.as_ref().is_none_or(right)
            && match &self.rotate {
                RotSpec::Keep | RotSpec::Keep2 => true,
                RotSpec::Swap => false,
                RotSpec::Replace(q, k) => {
                    q.as_ref().is_none_or(right) && k.as_ref().is_none_or(right)
                }
            }
            && match &self.bias {
                BiasSpec::None => true,
                BiasSpec::Dense(t) => right(t),
                BiasSpec::Relative {
                    values,
                    width,
                    columns,
                    ..
                } => right(values) && !width.extreme && width.value > 0 && cols(columns),
            }
            && match &self.values {
                ValSpec::None => true,
                ValSpec::Table {
                    table,
                    width,
                    columns,
                } => right(table) && !width.extreme && width.value > 0 && cols(columns),
            }
    }

    fn moderate(&self) -> bool {
        let m = |t: &Option<TSpec>| t.as_ref().is_none_or(|t| t.fill.moderate());
        m(&self.input)
            && match &self.rotate {
                RotSpec::Replace(q, k) => m(q) && m(k),
                _ => true,
            }
            && match &self.bias {
                BiasSpec::None => true,
                BiasSpec::Dense(t) => t.fill.moderate(),
                BiasSpec::Relative { values, .. } => values.fill.moderate(),
            }
            && match &self.values {
                ValSpec::None => true,
                ValSpec::Table { table, .. } => table.fill.moderate(),
            }
    }
}

#[derive(Debug)]
struct Custom {
    spec: CustomSpec,
    /// The attention's shapes: heads, KV heads, head width, d_model, dtype.
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    d_model: usize,
    dtype: DType,
}

fn hook_error(hook: &str) -> Error {
    Error::InvalidConfig {
        name: "fuzz hook",
        value: hook.to_string(),
        expected: "an answer (the fuzz input asked this hook to fail)".into(),
    }
}

impl Custom {
    fn fails(&self, hook: Hook) -> bool {
        matches!(
            (self.spec.fail, hook),
            (Some(Hook::Input), Hook::Input)
                | (Some(Hook::Rotate), Hook::Rotate)
                | (Some(Hook::Bias), Hook::Bias)
                | (Some(Hook::Values), Hook::Values)
        )
    }

    fn make(
        &self,
        t: &TSpec,
        right: &[usize],
        broadcast_ok: bool,
        like: DType,
    ) -> Result<Tensor, Error> {
        let (dims, _) = t.shape.dims(right, broadcast_ok);
        let dtype = match t.dtype {
            DtSel::Model | DtSel::Model2 => like,
            DtSel::Other(d) => d.0,
        };
        filled(&t.fill, &dims, dtype).ok_or_else(|| hook_error("too large to build"))
    }
}

impl PositionalEncoding for Custom {
    fn add_to_input(&self, x: &Tensor, ctx: &AttentionContext) -> Result<Tensor, Error> {
        if self.fails(Hook::Input) {
            return Err(hook_error("add_to_input"));
        }
        match &self.spec.input {
            None => Ok(x.clone()),
            Some(t) => {
                let b = x.dims().first().copied().unwrap_or(1);
                self.make(t, &[b, ctx.q_len, self.d_model], false, x.dtype())
            }
        }
    }

    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        ctx: &AttentionContext,
    ) -> Result<(Tensor, Tensor), Error> {
        if self.fails(Hook::Rotate) {
            return Err(hook_error("rotate"));
        }
        let b = q.dims().first().copied().unwrap_or(1);
        match &self.spec.rotate {
            RotSpec::Keep | RotSpec::Keep2 => Ok((q, k)),
            RotSpec::Swap => Ok((k, q)),
            RotSpec::Replace(qs, ks) => {
                let q = match qs {
                    Some(t) => self.make(
                        t,
                        &[b, self.heads, ctx.q_len, self.head_dim],
                        false,
                        self.dtype,
                    )?,
                    None => q,
                };
                let k = match ks {
                    Some(t) => self.make(
                        t,
                        &[b, self.kv_heads, ctx.k_len, self.head_dim],
                        false,
                        self.dtype,
                    )?,
                    None => k,
                };
                Ok((q, k))
            }
        }
    }

    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>, Error> {
        if self.fails(Hook::Bias) {
            return Err(hook_error("logits_bias"));
        }
        let b = q.dims().first().copied().unwrap_or(1);
        match &self.spec.bias {
            BiasSpec::None => Ok(None),
            BiasSpec::Dense(t) => Ok(Some(LogitsBias::Dense(self.make(
                t,
                &[b, self.heads, ctx.q_len, ctx.k_len],
                true,
                q.dtype(),
            )?))),
            BiasSpec::Relative {
                values,
                per_query,
                width,
                columns,
            } => {
                let rows = if *per_query { ctx.q_len } else { 1 };
                let v = self.make(values, &[b, self.heads, rows, width.value], true, q.dtype())?;
                let c = columns
                    .build(b, ctx.q_len, ctx.k_len, width.value)
                    .ok_or_else(|| hook_error("columns too large"))?;
                Ok(Some(LogitsBias::Relative(RelativeBias::new(v, c)?)))
            }
        }
    }

    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>, Error> {
        if self.fails(Hook::Values) {
            return Err(hook_error("value_term"));
        }
        match &self.spec.values {
            ValSpec::None => Ok(None),
            ValSpec::Table {
                table,
                width,
                columns,
            } => {
                // The batch is not in the context: ids' batch, or 1 (an offset).
                let b = match ctx.queries {
                    Positions::Ids(ids) => ids.batch(),
                    Positions::Offset(_) => 1,
                };
                let t = self.make(table, &[width.value, self.head_dim], false, self.dtype)?;
                let c = columns
                    .build(b, ctx.q_len, ctx.k_len, width.value)
                    .ok_or_else(|| hook_error("columns too large"))?;
                Ok(Some(RelativeValues::new(t, c)?))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Chunks of input and the cache.

#[derive(Arbitrary, Debug)]
enum XShape {
    Right,
    Right2,
    Right3,
    Right4,
    WrongWidth(Dim<8>),
    Dims(Vec<Up<6>>),
}

#[derive(Arbitrary, Debug, Clone)]
enum BatchSel {
    Match,
    One,
    Other(Up<4>),
}

#[derive(Arbitrary, Debug, Clone)]
enum IdValues {
    Arange(Offset),
    Reverse(Offset),
    Const(Offset),
    Random(u8, Offset),
    Negative,
    PastU32,
}

impl BatchSel {
    /// The batch of ids for inputs of batch `b` (1 broadcasts; others are malformed).
    fn get(&self, b: usize, f: &mut Flags) -> usize {
        match self {
            BatchSel::Match => b,
            BatchSel::One => 1,
            BatchSel::Other(n) => {
                if n.0 != b && n.0 != 1 {
                    f.malformed();
                }
                n.0
            }
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
struct IdsSpec {
    batch: BatchSel,
    len: M<Dim<40>>,
    dtype: IndexDt,
    values: IdValues,
    rank3: bool,
}

#[derive(Arbitrary, Debug)]
enum PosSpec {
    Continue,
    Continue2,
    Offset(Offset),
    Ids(IdsSpec),
    /// Multimodal ids `(3, B, T)`: a patch grid `width` columns wide from `offset` on every
    /// axis (temporal = the patch's index).
    Grid {
        batch: BatchSel,
        offset: Offset,
        width: Up<8>,
    },
}

#[derive(Arbitrary, Debug)]
enum MaskValues {
    Zeros,
    Ones,
    Binary(u8),
    Random(u8),
    /// One batch row (padding) or one query row (additive) masked entirely.
    RowMasked(u8),
    /// Some entries −∞ (the first key of every row kept).
    SomeNegInf(u8),
    /// Some entries at the mask dtype's lowest value (the first key of every row kept).
    SomeLowest(u8),
    /// Every entry at the mask dtype's lowest value.
    AllLowest,
    NaN,
}

#[derive(Arbitrary, Debug)]
struct MaskSpec {
    shape: ShapeSpec,
    dtype: Dt,
    values: MaskValues,
}

fn lowest(d: DType) -> f64 {
    match d {
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_389_251_535_5e38,
        DType::F32 => f32::MIN as f64,
        DType::F64 => f64::MIN,
        _ => 0.0,
    }
}

impl MaskSpec {
    /// Values for a mask of `dims`, whose last axis is the keys.
    fn values(&self, dims: &[usize], padding: bool) -> Vec<f64> {
        // Past MAX_BUILT (or usize), no values: `tensor` then refuses the mask.
        let n = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= MAX_BUILT)
            .unwrap_or(0);
        let keys = dims.last().copied().unwrap_or(1).max(1);
        let low = lowest(self.dtype.0);
        (0..n)
            .map(|i| {
                let first_key = i % keys == 0;
                match &self.values {
                    MaskValues::Zeros => 0.0,
                    MaskValues::Ones => 1.0,
                    MaskValues::Binary(s) => (hash(*s as u64, i) % 2) as f64,
                    MaskValues::Random(s) => unit(*s as u64, i) * 2.0,
                    MaskValues::RowMasked(s) => {
                        let row = i / keys;
                        let masked = row as u64 % 3 == *s as u64 % 3;
                        match (padding, masked) {
                            (true, true) => 0.0,
                            (true, false) => 1.0,
                            (false, true) => low,
                            (false, false) => 0.0,
                        }
                    }
                    MaskValues::SomeNegInf(s) => {
                        if !first_key && hash(*s as u64, i) % 3 == 0 {
                            f64::NEG_INFINITY
                        } else {
                            0.0
                        }
                    }
                    MaskValues::SomeLowest(s) => {
                        if !first_key && hash(*s as u64, i) % 3 == 0 {
                            low
                        } else {
                            0.0
                        }
                    }
                    MaskValues::AllLowest => low,
                    MaskValues::NaN => {
                        if i % 7 == 3 {
                            f64::NAN
                        } else {
                            0.0
                        }
                    }
                }
            })
            .collect()
    }
}

#[derive(Arbitrary, Debug)]
struct ChunkSpec {
    train: bool,
    weights: bool,
    /// Check the execution paths against each other (f32 inference).
    compare: bool,
    t: Up<40>,
    batch: Option<Up<3>>,
    shape: XShape,
    dtype: DtSel,
    fill: Fill,
    positions: PosSpec,
    padding: Option<MaskSpec>,
    attn_mask: Option<MaskSpec>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Forward(ChunkSpec),
    /// A forward without a cache.
    Plain(ChunkSpec),
    Truncate(Up<48>),
    Clone,
    Switch,
    Reset,
    /// The encoding's hooks and public methods called directly with a caller-built context.
    Direct(DirectSpec),
}

#[derive(Arbitrary, Debug)]
enum DirectPos {
    Offset(Offset),
    Ids(IdsSpec),
}

#[derive(Arbitrary, Debug)]
struct DirectSpec {
    batch: Up<3>,
    q_pos: DirectPos,
    q_len: Dim<40>,
    k_pos: DirectPos,
    k_len: Dim<40>,
    causal: bool,
    train: bool,
    x: TSpec,
    q: TSpec,
    k: TSpec,
    len: Dim<64>,
    bthd: bool,
}

// ---------------------------------------------------------------------------------------------
// The plug's data forms, driven directly.

#[derive(Arbitrary, Debug)]
enum PlugCase {
    Bias {
        batch: Up<3>,
        heads: Up<3>,
        per_query: bool,
        width: Dim<24>,
        tq: Dim<12>,
        tk: Dim<12>,
        values: TSpec,
        columns: ColSpec,
        /// Ask for another shape than the rows were made for.
        ask: Option<(Dim<12>, Dim<12>)>,
        dense: bool,
    },
    Values {
        batch: Up<3>,
        heads: Up<3>,
        width: Dim<24>,
        head_dim: Up<6>,
        tq: Up<12>,
        tk: Up<12>,
        table: TSpec,
        columns: ColSpec,
        probs: TSpec,
    },
}

/// The dense bias `RelativeBias::to_dense` must give, from its documented formula.
fn reference_dense(
    values: &[f64],
    (vb, vh, rows, width): (usize, usize, usize, usize),
    columns: &Columns,
    index: Option<(&[f64], usize)>,
    tq: usize,
    tk: usize,
) -> (Vec<usize>, Vec<f64>) {
    let batch = match index {
        Some((_, ib)) => ib.max(vb),
        None => vb,
    };
    let mut out = Vec::with_capacity(batch * vh * tq * tk);
    for b in 0..batch {
        for h in 0..vh {
            for i in 0..tq {
                for j in 0..tk {
                    let col = match columns {
                        Columns::Shift(s) => (j as i128 - i as i128 + *s as i128)
                            .clamp(0, width as i128 - 1)
                            as usize,
                        Columns::Index(_) => {
                            let (ix, ib) = index.expect("index values");
                            let bi = if ib == 1 { 0 } else { b };
                            (ix[(bi * tq + i) * tk + j] as usize).min(width - 1)
                        }
                    };
                    let r = if rows == 1 { 0 } else { i };
                    let bv = if vb == 1 { 0 } else { b };
                    out.push(values[((bv * vh + h) * rows + r) * width + col]);
                }
            }
        }
    }
    (vec![batch, vh, tq, tk], out)
}

/// The largest finite value of a float dtype.
fn max_finite(d: DType) -> f64 {
    match d {
        DType::F16 => 65504.0,
        DType::BF16 => 3.389_531_389_251_535_5e38,
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

/// The step between a format's subnormal numbers (its smallest positive value).
fn subnormal_step(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-24),
        DType::BF16 => 2f64.powi(-133),
        DType::F32 => 2f64.powi(-149),
        _ => 0.0,
    }
}

fn eps(d: DType) -> f64 {
    match d {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::BF16 => 2e-2,
        _ => 2e-3,
    }
}

impl PlugCase {
    fn run(&self, model: DType) {
        match self {
            PlugCase::Bias {
                batch,
                heads,
                per_query,
                width,
                tq,
                tk,
                values,
                columns,
                ask,
                dense,
            } => {
                let rows = if *per_query { tq.value } else { 1 };
                let (dims, _) = values
                    .shape
                    .dims(&[batch.0, heads.0, rows, width.value], true);
                let dtype = values.dtype.get(
                    model,
                    &mut Flags {
                        wellformed: true,
                        moderate: true,
                    },
                );
                let Some(v) = filled(&values.fill, &dims, dtype) else {
                    return;
                };
                let Some(c) = columns.build(batch.0, tq.value, tk.value, width.value) else {
                    return;
                };
                let bias = match RelativeBias::new(v.clone(), c.clone()) {
                    Ok(b) => b,
                    Err(e) => return check_err(&e, "RelativeBias::new"),
                };
                let (aq, ak) = ask.map_or((tq.value, tk.value), |(q, k)| (q.value, k.value));
                let got = if *dense {
                    LogitsBias::Relative(bias.clone()).to_dense(aq, ak)
                } else {
                    bias.to_dense(aq, ak)
                };
                let got = match got {
                    Ok(t) => t,
                    Err(e) => return check_err(&e, "RelativeBias::to_dense"),
                };
                // Ok: compare with the formula.
                let vd = v.dims4().expect("checked by new");
                let index = match &c {
                    Columns::Index(ix) => Some((host(ix), ix.dims()[0])),
                    Columns::Shift(_) => None,
                };
                let (want_dims, want) = reference_dense(
                    &host(&v),
                    vd,
                    &c,
                    index.as_ref().map(|(v, b)| (v.as_slice(), *b)),
                    aq,
                    ak,
                );
                let got_dims = got.dims().to_vec();
                // The batch and heads of the values may stay 1 (broadcast).
                assert_eq!(got_dims.len(), 4, "to_dense rank");
                assert_eq!(&got_dims[2..], &want_dims[2..], "to_dense shape");
                assert_eq!(got.dtype(), v.dtype(), "to_dense dtype");
                let got_host = host(
                    &got.broadcast_as(want_dims.as_slice())
                        .expect("broadcastable"),
                );
                for (n, (g, w)) in got_host.iter().zip(&want).enumerate() {
                    assert!(
                        g == w || (g.is_nan() && w.is_nan()),
                        "to_dense entry {n}: {g} where the formula gives {w}"
                    );
                }
            }
            PlugCase::Values {
                batch,
                heads,
                width,
                head_dim,
                tq,
                tk,
                table,
                columns,
                probs,
            } => {
                let mut f = Flags {
                    wellformed: true,
                    moderate: true,
                };
                let (tdims, _) = table.shape.dims(&[width.value, head_dim.0], false);
                let Some(tab) = filled(&table.fill, &tdims, table.dtype.get(model, &mut f)) else {
                    return;
                };
                let (pdims, _) = probs.shape.dims(&[batch.0, heads.0, tq.0, tk.0], false);
                let Some(p) = filled(&probs.fill, &pdims, probs.dtype.get(model, &mut f)) else {
                    return;
                };
                let Some(c) = columns.build(batch.0, tq.0, tk.0, width.value) else {
                    return;
                };
                let rv = match RelativeValues::new(tab.clone(), c.clone()) {
                    Ok(r) => r,
                    Err(e) => return check_err(&e, "RelativeValues::new"),
                };
                let got = match rv.weighted_sum(&p) {
                    Ok(t) => t,
                    Err(e) => return check_err(&e, "RelativeValues::weighted_sum"),
                };
                let (b, h, q, k) = p.dims4().expect("checked by weighted_sum");
                let (w, d) = tab.dims2().expect("checked by new");
                assert_eq!(got.dims(), &[b, h, q, d], "weighted_sum shape");
                let (pv, tv) = (host(&p), host(&tab));
                let index = match &c {
                    Columns::Index(ix) => Some((host(ix), ix.dims()[0])),
                    Columns::Shift(_) => None,
                };
                let gv = host(&got);
                let finite = pv.iter().chain(&tv).all(|x| x.is_finite());
                let tol = eps(p.dtype()).max(eps(tab.dtype()));
                // Sums near the subnormal range are rounded to its fixed step (2^-24 in f16),
                // whatever their size: each of the k + w roundings may lose half a step.
                let step = subnormal_step(p.dtype()).max(subnormal_step(tab.dtype()));
                // A sum whose terms pass the narrower dtype's range cannot be represented there:
                // ±∞ and ∞ − ∞ (NaN) are what IEEE arithmetic gives, as in PyTorch.
                let limit = max_finite(p.dtype()).min(max_finite(tab.dtype())) / 4.0;
                for bi in 0..b {
                    for hi in 0..h {
                        for i in 0..q {
                            let mut want = vec![0f64; d];
                            let mut scale = 0f64;
                            for j in 0..k {
                                let col = match (&c, &index) {
                                    (Columns::Shift(s), _) => (j as i128 - i as i128 + *s as i128)
                                        .clamp(0, w as i128 - 1)
                                        as usize,
                                    (Columns::Index(_), Some((ix, ib))) => {
                                        let bb = if *ib == 1 { 0 } else { bi };
                                        (ix[(bb * q + i) * k + j] as usize).min(w - 1)
                                    }
                                    _ => unreachable!(),
                                };
                                let pij = pv[((bi * h + hi) * q + i) * k + j];
                                for (e, x) in want.iter_mut().enumerate() {
                                    *x += pij * tv[col * d + e];
                                    scale += (pij * tv[col * d + e]).abs();
                                }
                            }
                            if !finite || scale > 1e30 || scale > limit {
                                continue;
                            }
                            for (e, wv) in want.iter().enumerate() {
                                let g = gv[((bi * h + hi) * q + i) * d + e];
                                let bound = (tol * scale + step) * (k + w) as f64 + 1e-30;
                                assert!(
                                    (g - wv).abs() <= bound,
                                    "weighted_sum [{bi},{hi},{i},{e}] ({:?} weights, {:?} table): {g} where the formula gives {wv}",
                                    p.dtype(),
                                    tab.dtype()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The case.

#[derive(Arbitrary, Debug)]
struct Case {
    attn: AttnSpec,
    enc: EncSpec,
    /// Weights are overwritten with pseudo-random values of this seed.
    seed: u8,
    capacity: Up<8>,
    /// A streaming cache of (sinks, window) instead of a plain one.
    streaming: Option<(Up<8>, Up<24>)>,
    steps: Vec<Step>,
    plug: Vec<PlugCase>,
}

struct Model {
    mha: MultiHeadAttention,
    /// The encoding's configuration (`None`: the custom one) and the variables it was built from.
    config: Option<EncodingConfig>,
    varmap: VarMap,
    /// The same weights with another query block.
    alt: Option<MultiHeadAttention>,
    dtype: DType,
    /// Dropout anywhere in training.
    dropout: bool,
    xpos: bool,
    /// RoPE-Mixed, which reads multimodal positions only.
    mixed: bool,
    custom_moderate: bool,
    /// The encoding is the fuzzer's own, whose answers are made for the block it is asked about.
    custom: bool,
}

impl Case {
    fn run(&self) {
        for p in self.plug.iter().take(3) {
            p.run(self.attn.dtype.0);
        }
        let mut flags = Flags {
            wellformed: true,
            moderate: true,
        };
        let Some(model) = self.build(&mut flags) else {
            trace(|| "no model".into());
            return;
        };
        let mut caches = vec![match &self.streaming {
            Some((sinks, window)) => KvCache::streaming(sinks.0, window.0),
            None => KvCache::with_capacity(1 << self.capacity.0),
        }];
        // Whether a cache may hold non-finite keys or values (0 · NaN is NaN: every later
        // chunk that attends to them has non-finite output, as documented).
        let mut tainted = vec![false];
        // The batch each cache holds, once it holds anything.
        let mut batches: Vec<Option<usize>> = vec![None];
        let mut current = 0;
        for step in self.steps.iter().take(6) {
            match step {
                Step::Forward(c) => {
                    let mut fl = flags;
                    if tainted[current] {
                        fl.immoderate();
                    }
                    let before = caches[current].len();
                    let cached = batches[current].filter(|_| before > 0);
                    let mut appended = None;
                    if !forward(
                        &model,
                        c,
                        Some(&mut caches[current]),
                        fl,
                        cached,
                        &mut appended,
                    ) {
                        tainted[current] = true;
                    }
                    if caches[current].len() > before {
                        batches[current] = appended;
                    }
                }
                Step::Plain(c) => {
                    forward(&model, c, None, flags, None, &mut None);
                }
                Step::Truncate(n) => {
                    let cache = &mut caches[current];
                    let before = (cache.len(), cache.next_position());
                    match cache.truncate(n.0) {
                        Ok(()) => assert_eq!(cache.len(), n.0, "truncate"),
                        Err(e) => {
                            check_err(&e, "KvCache::truncate");
                            assert!(
                                n.0 > before.0,
                                "truncate to {} of {} refused",
                                n.0,
                                before.0
                            );
                            assert_eq!((cache.len(), cache.next_position()), before);
                        }
                    }
                }
                Step::Clone => {
                    let c = caches[current].clone();
                    caches.push(c);
                    tainted.push(tainted[current]);
                    batches.push(batches[current]);
                }
                Step::Switch => current = (current + 1) % caches.len(),
                Step::Reset => {
                    caches[current].reset();
                    tainted[current] = false;
                    batches[current] = None;
                }
                Step::Direct(d) => direct(&model, d),
            }
        }
    }

    fn build(&self, flags: &mut Flags) -> Option<Model> {
        let dev = Device::Cpu;
        let cfg = self.attn.config(flags);
        let dtype = self.attn.dtype.0;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
        let enc_config = self.enc.config(&cfg, flags);
        trace(|| format!("encoding {enc_config:?}"));
        let (encoding, enc_dropout, xpos, custom_moderate): (
            Option<Arc<dyn PositionalEncoding>>,
            f32,
            bool,
            bool,
        ) = match enc_config.clone() {
            Some((c, dropout)) => {
                if dropout > 0.5 {
                    flags.immoderate();
                }
                if let EncodingConfig::Alibi(a) = &c {
                    // m·(j − i) grows with the distance to later keys, which nothing masks
                    // without a causal mask: past f16's range at large distances.
                    if a.mode == AlibiMode::CausalPairwise && !cfg.causal && dtype == DType::F16 {
                        flags.immoderate();
                    }
                }
                let xpos = matches!(&c, EncodingConfig::Rotary(r) if r.xpos_scale_base.is_some());
                match c.build(vb.pp("enc")) {
                    Ok(e) => (e, dropout, xpos, true),
                    Err(e) => {
                        check_err(&e, "EncodingConfig::build");
                        return None;
                    }
                }
            }
            None => {
                let EncSpec::Custom(spec) = &self.enc else {
                    unreachable!()
                };
                if !spec.wellformed() {
                    flags.malformed();
                }
                let custom = Custom {
                    spec: spec.clone(),
                    heads: cfg.num_heads,
                    kv_heads: cfg.num_kv_heads,
                    head_dim: cfg.head_dim,
                    d_model: cfg.d_model,
                    dtype,
                };
                (Some(Arc::new(custom)), 0.0, false, spec.moderate())
            }
        };
        let mha = match MultiHeadAttention::new(&cfg, encoding.clone(), vb.pp("attn")) {
            Ok(m) => m,
            Err(e) => {
                check_err(&e, "MultiHeadAttention::new");
                return None;
            }
        };
        let alt_cfg = cfg
            .clone()
            .with_query_block(Some(1 + self.attn.alt_block.0 * 3))
            .with_logits_budget(crate::BUDGET);
        // A custom encoding's answers are made for the block it is asked about (its values fill
        // the shape it is given), so other query blocks are compared for the crate's own only.
        let alt = match self.enc {
            EncSpec::Custom(_) => None,
            _ => MultiHeadAttention::new(&alt_cfg, encoding.clone(), vb.pp("attn")).ok(),
        };
        // Pseudo-random weights in [-1/√fan_in, 1/√fan_in] (learned tables in [-1, 1]); the
        // learnable ALiBi slopes keep the paper's values.
        {
            let data = varmap.data().lock().expect("varmap");
            for (name, var) in data.iter() {
                if name.ends_with("slopes") {
                    continue;
                }
                let dims = var.dims().to_vec();
                let n: usize = dims.iter().product();
                let scale = if name.ends_with("proj.weight") {
                    1.0 / (*dims.last().unwrap_or(&1) as f64).sqrt()
                } else {
                    1.0
                };
                let seed = hash(self.seed as u64, name.len());
                let v: Vec<f64> = (0..n).map(|i| unit(seed, i) * scale).collect();
                let t = Tensor::from_vec(v, dims.as_slice(), &dev)
                    .and_then(|t| t.to_dtype(var.dtype()))
                    .expect("weights");
                var.set(&t).expect("set weights");
            }
        }
        // Half the models (by the weights' seed) are loaded for inference: the same weights as
        // plain tensors, so that nothing tracks gradients and the block takes its fused
        // inference core and row pass (a `VarMap`'s block takes the differentiable paths).
        let mha = match hash(self.seed as u64, 7) % 2 {
            0 => {
                let frozen: std::collections::HashMap<String, Tensor> = varmap
                    .data()
                    .lock()
                    .expect("varmap")
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
                    .collect();
                let vb = VarBuilder::from_tensors(frozen, dtype, &dev);
                let encoding = match &enc_config {
                    Some((c, _)) => c.build(vb.pp("enc")).expect("the encoding built before"),
                    None => encoding,
                };
                MultiHeadAttention::new(&cfg, encoding, vb.pp("attn")).expect("built before")
            }
            _ => mha,
        };
        Some(Model {
            mha,
            config: enc_config.map(|(c, _)| c),
            varmap,
            alt,
            dtype,
            dropout: cfg.dropout > 0.0 || enc_dropout > 0.0,
            xpos,
            mixed: matches!(self.enc, EncSpec::Mixed { .. }),
            custom_moderate,
            custom: matches!(self.enc, EncSpec::Custom(_)),
        })
    }
}

/// Positions for a chunk of `b` sequences of `t` tokens, and whether they are well formed and
/// small.
fn positions(
    spec: &PosSpec,
    b: usize,
    t: usize,
    f: &mut Flags,
    half: bool,
) -> Result<Option<Positions>, ()> {
    match spec {
        PosSpec::Continue | PosSpec::Continue2 => Ok(None),
        PosSpec::Offset(o) => {
            if !small_offset(o.0) {
                f.malformed();
            }
            if half && o.0 >= 2048 {
                f.immoderate();
            }
            Ok(Some(Positions::Offset(o.0)))
        }
        PosSpec::Ids(ids) => {
            let batch = ids.batch.get(b, f);
            let len = ids.len.get(t, f);
            let n = batch
                .checked_mul(len)
                .filter(|&n| n <= MAX_BUILT)
                .ok_or(())?;
            let (vals, ok): (Vec<f64>, bool) = match &ids.values {
                IdValues::Arange(o) => (
                    (0..n)
                        .map(|i| o.0.saturating_add(i % len.max(1)) as f64)
                        .collect(),
                    small_offset(o.0),
                ),
                IdValues::Reverse(o) => (
                    (0..n)
                        .map(|i| o.0.saturating_add(len - 1 - i % len.max(1)) as f64)
                        .collect(),
                    small_offset(o.0),
                ),
                IdValues::Const(o) => (vec![o.0 as f64; n], small_offset(o.0)),
                IdValues::Random(s, o) => (
                    (0..n)
                        .map(|i| (o.0.saturating_add((hash(*s as u64, i) % 64) as usize)) as f64)
                        .collect(),
                    small_offset(o.0),
                ),
                IdValues::Negative => ((0..n).map(|i| -(i as f64) - 1.0).collect(), false),
                IdValues::PastU32 => (
                    (0..n).map(|i| (1u64 << 32) as f64 + i as f64).collect(),
                    false,
                ),
            };
            if !ok || ids.dtype.get() != DType::U32 && ids.dtype.get() != DType::I64 || ids.rank3 {
                f.malformed();
            }
            if half && vals.iter().any(|&v| v >= 2048.0) {
                f.immoderate();
            }
            let dims: Vec<usize> = if ids.rank3 {
                vec![batch, len, 1]
            } else {
                vec![batch, len]
            };
            let t = tensor(&vals, &dims, ids.dtype.get()).ok_or(())?;
            match Positions::ids(&t) {
                Ok(p) => Ok(Some(p)),
                Err(e) => {
                    check_err(&e, "Positions::ids");
                    Err(())
                }
            }
        }
        PosSpec::Grid {
            batch,
            offset,
            width,
        } => {
            let batch = batch.get(b, f);
            if !small_offset(offset.0) {
                f.malformed();
            }
            if half && offset.0.saturating_add(t) >= 2048 {
                f.immoderate();
            }
            let n = batch.checked_mul(t).filter(|&n| n <= MAX_BUILT).ok_or(())?;
            let w = width.0.max(1);
            let o = offset.0 as f64;
            let mut vals = Vec::with_capacity(3 * n);
            for axis in 0..3 {
                for i in 0..n {
                    let p = i % t.max(1);
                    let v = match axis {
                        0 => p,
                        1 => p / w,
                        _ => p % w,
                    };
                    vals.push(o + v as f64);
                }
            }
            let t = tensor(&vals, &[3, batch, t], DType::U32).ok_or(())?;
            match PositionIds::multimodal(&t) {
                Ok(p) => Ok(Some(Positions::Ids(p))),
                Err(e) => {
                    check_err(&e, "PositionIds::multimodal");
                    Err(())
                }
            }
        }
    }
}

/// One forward; returns whether its values were finite and moderate (otherwise the cache it
/// appended to may now hold non-finite keys and values, which later chunks attend to).
fn forward(
    model: &Model,
    c: &ChunkSpec,
    cache: Option<&mut KvCache>,
    mut f: Flags,
    cached_batch: Option<usize>,
    appended_batch: &mut Option<usize>,
) -> bool {
    let cfg = model.mha.config().clone();
    let half = model.dtype == DType::F16;
    if !model.custom_moderate {
        f.immoderate();
    }
    let cached = cache.as_ref().map_or(0, |c| c.len());
    // No batch given: the cache's (2 for a fresh one).
    let b = c.batch.map_or(cached_batch.unwrap_or(2), |b| b.0);
    if let Some(cache) = &cache {
        if !cache.is_empty() && cached_batch.is_some_and(|cb| cb != b) {
            f.malformed(); // another batch than the cached one
        }
    }
    let t = c.t.0;
    if half && cached + t + 64 >= 2048 {
        f.immoderate();
    }
    // x.
    let x_dtype = c.dtype.get(model.dtype, &mut f);
    let dims: Vec<usize> = match &c.shape {
        XShape::Right | XShape::Right2 | XShape::Right3 | XShape::Right4 => vec![b, t, cfg.d_model],
        XShape::WrongWidth(d) => {
            if d.value != cfg.d_model {
                f.malformed();
            }
            vec![b, t, d.value]
        }
        XShape::Dims(v) => {
            let d: Vec<usize> = v.iter().take(5).map(|x| x.0).collect();
            if d != [b, t, cfg.d_model] {
                f.malformed();
            }
            d
        }
    };
    if !c.fill.moderate() {
        f.immoderate();
    }
    let Some(x) = filled(&c.fill, &dims, x_dtype) else {
        return f.moderate;
    };
    let (xb, xt) = match x.dims() {
        [b, t, _] => (*b, *t),
        _ => (b, t),
    };
    let Ok(pos) = positions(&c.positions, xb, xt, &mut f, half) else {
        return f.moderate;
    };
    // A streaming cache places tokens at its slots: positions of a call's own are refused.
    let streaming = cache.as_ref().and_then(|c| c.streaming_window());
    if streaming.is_some() && pos.is_some() {
        f.malformed();
    }
    if let (None, Some(cache)) = (&pos, &cache) {
        // Positions continue the cache.
        if !small_offset(cache.next_position()) {
            f.malformed();
        }
    }
    let tk = cached + xt;
    // A cache whose storage would pass the budget is refused (`KvCache` documents it): the
    // cached tokens times batch × kv heads × head_dim must fit.
    if cache.is_some() && xb > 0 && xt > 0 {
        let per_position = xb
            .saturating_mul(cfg.num_kv_heads)
            .saturating_mul(cfg.head_dim)
            .max(1);
        if tk > BUDGET / per_position {
            f.malformed();
        }
    }
    // Masks.
    let padding = match &c.padding {
        None => None,
        Some(m) => {
            let (dims, ok) = m.shape.dims(&[xb, tk], false);
            if !ok {
                f.malformed();
            }
            let Some(p) = tensor(&m.values(&dims, true), &dims, m.dtype.0) else {
                return f.moderate;
            };
            Some(p)
        }
    };
    let attn_mask = match &c.attn_mask {
        None => None,
        Some(m) => {
            let (dims, ok) = m.shape.dims(&[xb, cfg.num_heads, xt, tk], true);
            if !ok || !is_float(m.dtype.0) {
                f.malformed();
            }
            match m.values {
                MaskValues::NaN => f.immoderate(),
                MaskValues::AllLowest | MaskValues::RowMasked(_) | MaskValues::SomeLowest(_)
                    if half || !is_float(m.dtype.0) =>
                {
                    f.immoderate()
                }
                _ => {}
            }
            let Some(mt) = tensor(&m.values(&dims, false), &dims, m.dtype.0) else {
                return f.moderate;
            };
            Some(mt)
        }
    };
    let opts = AttentionOptions {
        positions: pos.as_ref(),
        padding_mask: padding.as_ref(),
        attn_mask: attn_mask.as_ref(),
        return_weights: c.weights,
        train: c.train,
        dropout_seed: None,
    };
    // Paths to compare against: a copy of the cache for each.
    // A custom encoding's answers fill the shape of the block they are asked for, so paths are
    // compared for it only when the chunk is one query block: the fused paths run one block
    // where candle's ops run the budget's (the crate's own encodings answer from positions, the
    // same for any blocks).
    let elem = model.dtype.size_in_bytes();
    let one_block = cfg.query_block_for(xb, xt, tk, elem) >= xt;
    let compare = c.compare
        && model.dtype == DType::F32
        && x_dtype == DType::F32
        && !c.train
        && f.moderate
        && (!model.custom || one_block);
    let spare = match (&cache, compare) {
        (Some(cache), true) => vec![(*cache).clone(), (*cache).clone(), (*cache).clone()],
        _ => Vec::new(),
    };
    let before = cache.as_ref().map(|c| (c.len(), c.next_position()));
    // The end of the positions the chunk uses (an upper bound for ids: well-formed ids are
    // small offsets plus at most 64 plus their index).
    let pos_end = match &pos {
        None => before.map_or(0, |(_, next)| next).saturating_add(xt),
        Some(Positions::Offset(o)) => o.saturating_add(xt),
        Some(_) => 2048 + 64 + xt.max(tk),
    };
    // What a call builds is refused past the budget, by design: tables that follow positions ×
    // head width (rotary angles, relative rows), a query block's logits (with a fixed block
    // size the block does not shrink), the cache, the projections. With sizes within 4× of the
    // budget, a budget refusal is an answer.
    let rows = cfg.query_block.unwrap_or(1).clamp(1, xt.max(1));
    // The block checks an empty batch as one sequence (its shapes still need strides that
    // fit), so the rule does too (a batch of 0 had been counted as 0 here).
    let xb1 = xb.max(1);
    let near_budget = [
        cfg.head_dim.saturating_mul(pos_end.max(tk)),
        xb1.saturating_mul(cfg.num_heads)
            .saturating_mul(rows)
            .saturating_mul(tk),
        xb1.saturating_mul(cfg.num_kv_heads)
            .saturating_mul(cfg.head_dim)
            .saturating_mul(tk),
        xb1.saturating_mul(xt)
            .saturating_mul(cfg.num_heads)
            .saturating_mul(cfg.head_dim),
        // The block's activation check takes the widest per-token width, d_model included.
        xb1.saturating_mul(xt).saturating_mul(cfg.d_model),
    ]
    .iter()
    .any(|&n| n > BUDGET / 4);
    let mut cache = cache;
    // The batch a successful call appends: x's, not the one the spec asked for.
    *appended_batch = Some(xb);
    let r = model.mha.forward_with(&x, &opts, cache.as_deref_mut());
    let what = "MultiHeadAttention::forward_with";
    let out = match r {
        Err(e) => {
            trace(|| format!("forward err (wellformed {}): {e}", f.wellformed));
            check_err(&e, what);
            if f.wellformed {
                let allowed = matches!(e, Error::PositionOutOfRange { .. })
                    || (model.xpos && matches!(e, Error::InvalidConfig { .. }))
                    // f16 queries and keys cannot hold a RoPE attention factor past 2^±8 (a
                    // typed refusal since the sixth session, which this rule had missed).
                    || (model.dtype == DType::F16
                        && matches!(e, Error::InvalidConfig { name: "rope attention factor", .. }))
                    || matches!(e, Error::InvalidConfig { name: "fuzz hook", .. })
                    // RoPE-Mixed without multimodal positions for its queries or keys.
                    || (model.mixed && matches!(e, Error::Positions { what: "RoPE-Mixed positions", .. }))
                    || (near_budget
                        && matches!(&e, Error::InvalidConfig { expected, .. } if expected.contains("at most")))
                    // A differentiable call on candle's ops keeps every query block's logits for
                    // the backward: refused when they pass the budget together.
                    || (xb1
                        .saturating_mul(cfg.num_heads)
                        .saturating_mul(xt)
                        .saturating_mul(tk)
                        > BUDGET
                        && matches!(&e, Error::InvalidConfig { expected, .. }
                            if expected.contains("keep for the backward")));
                assert!(allowed, "{what}: well-formed input refused: {e}");
            }
            if let (Some(cache), Some(before)) = (&cache, before) {
                assert_eq!(
                    (cache.len(), cache.next_position()),
                    before,
                    "{what} failed ({e}) but changed the cache"
                );
            }
            return f.moderate;
        }
        Ok(out) => {
            trace(|| {
                format!(
                    "forward ok {:?} moderate {} compare {compare}",
                    x.dims(),
                    f.moderate
                )
            });
            out
        }
    };
    f.moderate &= all_finite(&x)
        && attn_mask
            .as_ref()
            .is_none_or(|m| !host(m).iter().any(|v| v.is_nan() || *v == f64::INFINITY));
    // Shapes.
    assert_eq!(
        out.output.dims(),
        &[xb, xt, cfg.d_model],
        "{what}: output shape"
    );
    assert_eq!(out.output.dtype(), model.dtype, "{what}: output dtype");
    if let Some(cache) = &cache {
        let grown = if xb == 0 || xt == 0 { 0 } else { xt };
        // A streaming cache keeps its sinks and its window.
        let kept = streaming.map_or(usize::MAX, |(s, w)| s.saturating_add(w));
        assert_eq!(
            cache.len(),
            (cached + grown).min(kept.max(cached)),
            "{what}: cache length"
        );
    }
    assert_eq!(
        out.weights.is_some(),
        c.weights,
        "{what}: weights returned iff asked for"
    );
    if let Some(w) = &out.weights {
        assert_eq!(
            w.dims(),
            &[xb, cfg.num_heads, xt, tk],
            "{what}: weights shape"
        );
    }
    if !f.moderate {
        return f.moderate;
    }
    assert!(
        all_finite(&out.output),
        "{what}: non-finite output from finite input"
    );
    if let Some(w) = &out.weights {
        let wv = host(w);
        assert!(
            wv.iter()
                .all(|p| p.is_finite() && *p >= 0.0 && *p <= 1.0 + 1e-3),
            "{what}: weights outside [0, 1]"
        );
        if !c.train && tk > 0 {
            let tol = if half || model.dtype == DType::BF16 {
                5e-2
            } else {
                1e-3
            };
            for (r, row) in wv.chunks(tk).enumerate() {
                let s: f64 = row.iter().sum();
                // Sinks take part of each row's weight (and all of a fully masked row's).
                if cfg.sinks {
                    assert!(
                        s <= 1.0 + tol,
                        "{what}: weights row {r} sums to {s} with sinks"
                    );
                } else {
                    assert!(
                        (s - 1.0).abs() <= tol,
                        "{what}: weights row {r} sums to {s}"
                    );
                }
            }
        }
    }
    if !compare || xb == 0 || xt == 0 {
        return f.moderate;
    }
    // The same chunk on the other paths.
    let mut spare = spare.into_iter();
    let reference = host(&out.output);
    let scale = max_abs(&reference).max(1.0);
    let mut run = |m: &MultiHeadAttention, weights: bool, train: bool, label: &str| {
        let o = AttentionOptions {
            return_weights: weights,
            train,
            ..opts.clone()
        };
        let mut spare_cache = spare.next();
        let got = match m.forward_with(&x, &o, spare_cache.as_mut().filter(|_| before.is_some())) {
            Ok(g) => g,
            // Returned weights are `(B, H, T, Tk)` whole, and a fixed query block's logits are
            // checked against the budget whatever the path (the fused cores never take them,
            // the others do): either may pass the budget where the first path's automatic
            // blocks fit it.
            Err(e)
                if [
                    weights.then_some(xt),
                    m.config().query_block.map(|n| n.clamp(1, xt.max(1))),
                ]
                .into_iter()
                .flatten()
                .any(|rows| {
                    [xb.max(1), cfg.num_heads, rows, tk]
                        .iter()
                        .try_fold(1usize, |n, &d| n.checked_mul(d))
                        .is_none_or(|n| n > BUDGET)
                }) =>
            {
                check_err(&e, label);
                return;
            }
            Err(e) => panic!("{what}: the {label} path refused what the first accepted: {e}"),
        };
        let got = host(&got.output);
        let diff = got
            .iter()
            .zip(&reference)
            .fold(0f64, |d, (a, b)| d.max((a - b).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "{what}: the {label} path differs by {diff:e} (scale {scale})"
        );
    };
    run(
        &model.mha,
        !c.weights,
        false,
        if c.weights { "fused" } else { "row-pass" },
    );
    if let Some(alt) = &model.alt {
        run(alt, c.weights, false, "other query block");
    }
    if !model.dropout {
        run(&model.mha, false, true, "training (ops)");
    }
    f.moderate
}

// ---------------------------------------------------------------------------------------------
// Direct calls.

fn direct_positions(p: &DirectPos, b: usize, len: usize) -> Option<Positions> {
    let mut f = Flags {
        wellformed: true,
        moderate: true,
    };
    match p {
        DirectPos::Offset(o) => Some(Positions::Offset(o.0)),
        DirectPos::Ids(ids) => positions(&PosSpec::Ids(ids.clone()), b, len, &mut f, false)
            .ok()
            .flatten(),
    }
}

fn ok_or_typed<T>(r: Result<T, Error>, what: &str) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            check_err(&e, what);
            None
        }
    }
}

fn direct(model: &Model, d: &DirectSpec) {
    use candle_posenc::{
        Alibi, ClippedRelativeBias, LearnedPositionalEncoding, QkLayout, RotaryEmbedding,
        SinusoidalPositionalEncoding, T5RelativeBias,
    };
    let cfg = model.mha.config();
    let dev = Device::Cpu;
    let b = d.batch.0;
    let (ql, kl) = (d.q_len.value, d.k_len.value);
    let Some(qp) = direct_positions(&d.q_pos, b, ql.min(MAX_BUILT)) else {
        return;
    };
    let Some(kp) = direct_positions(&d.k_pos, b, kl.min(MAX_BUILT)) else {
        return;
    };
    let ctx = AttentionContext::new(&qp, ql, &kp, kl)
        .with_causal(d.causal)
        .with_train(d.train);
    let like = |t: &TSpec, right: &[usize]| {
        let (dims, _) = t.shape.dims(right, false);
        let dtype = match t.dtype {
            DtSel::Model | DtSel::Model2 => model.dtype,
            DtSel::Other(x) => x.0,
        };
        filled(&t.fill, &dims, dtype)
    };
    let x = like(&d.x, &[b, ql, cfg.d_model]);
    let q = like(&d.q, &[b, cfg.num_heads, ql, cfg.head_dim]);
    let k = like(&d.k, &[b, cfg.num_kv_heads, kl, cfg.head_dim]);
    // Positions.
    ok_or_typed(
        Positions::relative_distances(&qp, ql, &kp, kl, &dev),
        "relative_distances",
    );
    ok_or_typed(qp.to_ids(d.len.value, &dev), "Positions::to_ids");
    ok_or_typed(qp.extend(ql, &kp, kl, &dev), "Positions::extend");
    // The hooks.
    if let Some(enc) = model.mha.encoding() {
        if let Some(x) = &x {
            ok_or_typed(enc.add_to_input(x, &ctx), "add_to_input");
        }
        if let (Some(q), Some(k)) = (&q, &k) {
            ok_or_typed(enc.rotate(q.clone(), k.clone(), &ctx), "rotate");
        }
        if let Some(q) = &q {
            if let Some(Some(bias)) = ok_or_typed(enc.logits_bias(q, &ctx), "logits_bias") {
                ok_or_typed(bias.to_dense(ql, kl), "LogitsBias::to_dense");
            }
        }
        if let Some(Some(values)) = ok_or_typed(enc.value_term(&ctx), "value_term") {
            let probs = filled(
                &Fill::Const(Up(3)),
                &[b, cfg.num_heads, ql, kl],
                model.dtype,
            );
            if let Some(p) = probs {
                ok_or_typed(values.weighted_sum(&p), "RelativeValues::weighted_sum");
            }
        }
    }
    // The encodings' own public methods.
    let vb = VarBuilder::from_varmap(&model.varmap, model.dtype, &dev);
    let len = d.len.value;
    let layout = if d.bthd {
        QkLayout::Bthd
    } else {
        QkLayout::Bhtd
    };
    match &model.config {
        Some(EncodingConfig::T5(c)) => {
            if let Some(e) =
                ok_or_typed(T5RelativeBias::new(c, vb.pp("enc")), "T5RelativeBias::new")
            {
                ok_or_typed(e.bias(&qp, ql, &kp, kl), "T5RelativeBias::bias");
            }
        }
        Some(EncodingConfig::ClippedBias(c)) => {
            if let Some(e) = ok_or_typed(
                ClippedRelativeBias::new(c, vb.pp("enc")),
                "ClippedRelativeBias::new",
            ) {
                ok_or_typed(e.bias(&qp, ql, &kp, kl), "ClippedRelativeBias::bias");
            }
        }
        Some(EncodingConfig::Alibi(c)) => {
            let e = if c.learnable {
                Alibi::new_learnable(c, vb.pp("enc"))
            } else {
                Alibi::new(c, &dev)
            };
            if let Some(e) = ok_or_typed(e, "Alibi::new") {
                ok_or_typed(e.bias(&ctx), "Alibi::bias");
            }
        }
        Some(EncodingConfig::Rotary(c)) => {
            if let Some(e) = ok_or_typed(RotaryEmbedding::new(c, &dev), "RotaryEmbedding::new") {
                ok_or_typed(e.cos_sin(&qp, len), "RotaryEmbedding::cos_sin");
                ok_or_typed(e.frequencies(len), "RotaryEmbedding::frequencies");
                if let Some(q) = &q {
                    ok_or_typed(e.rotate_queries(q, &qp, layout), "rotate_queries");
                    if let Some(k) = &k {
                        ok_or_typed(
                            e.rotate_queries_keys(q, k, &qp, &kp, layout),
                            "rotate_queries_keys",
                        );
                    }
                }
            }
        }
        Some(EncodingConfig::Sinusoidal(c)) => {
            if let Some(e) = ok_or_typed(
                SinusoidalPositionalEncoding::new(c, &dev),
                "Sinusoidal::new",
            ) {
                ok_or_typed(e.encodings(len), "Sinusoidal::encodings");
                if let Some(x) = &x {
                    ok_or_typed(
                        e.forward_with_positions(x, &qp, d.train),
                        "Sinusoidal::forward_with_positions",
                    );
                }
            }
        }
        Some(EncodingConfig::Learned(c)) => {
            if let Some(e) = ok_or_typed(
                LearnedPositionalEncoding::new(c, vb.pp("enc")),
                "Learned::new",
            ) {
                ok_or_typed(e.interpolated(len), "Learned::interpolated");
                if let Some(x) = &x {
                    ok_or_typed(
                        e.forward_with_positions(x, &qp, d.train),
                        "Learned::forward_with_positions",
                    );
                }
            }
        }
        _ => {}
    }
}
