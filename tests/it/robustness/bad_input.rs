//! Bad-input sweep: every public constructor, forward pass, position type, config parser and
//! loader is fed invalid input and must answer with the expected [`Error`] variant, with a
//! message naming the offending value and what was expected. Each case runs under
//! `catch_unwind`, so a panic (or an allocation abort guarded against too late) fails the test
//! instead of passing silently.
//!
//! Cases are grouped by area; each area is one test that runs all its cases and reports every
//! failure at once.

use crate::common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    alibi_slopes, Alibi, AlibiConfig, AlibiMode, AttentionConfig, AttentionContext,
    AttentionOptions, Checkpoint, ClippedBiasConfig, ClippedRelativeBias, Columns, EncodingConfig,
    Error, Interpolation, KvCache, LearnedConfig, LearnedPositionalEncoding, LongRopeScaling,
    MultiHeadAttention, PositionIds, PositionalEncoding, Positions, QkLayout, RelativeValues,
    RopeConfig, RopeMixed, RopeMixedConfig, RopeScaling, RotaryEmbedding, ShawConfig,
    ShawRelativePosition, SinusoidalConfig, SinusoidalPositionalEncoding, T5Config, T5RelativeBias,
    YarnScaling,
};
use serde_json::json;

/// Which `Error` variant a case must produce.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Config,
    OutOfRange,
    Rank,
    Shape,
    Positions,
    DType,
    Missing,
    TensorShape,
    Checkpoint,
    HfConfig,
    Io,
}

fn kind_of(e: &Error) -> Option<Kind> {
    Some(match e {
        Error::InvalidConfig { .. } => Kind::Config,
        Error::PositionOutOfRange { .. } => Kind::OutOfRange,
        Error::Rank { .. } => Kind::Rank,
        Error::Shape { .. } => Kind::Shape,
        Error::Positions { .. } => Kind::Positions,
        Error::DType { .. } => Kind::DType,
        Error::MissingTensor { .. } => Kind::Missing,
        Error::TensorShape { .. } => Kind::TensorShape,
        Error::Checkpoint { .. } => Kind::Checkpoint,
        Error::HfConfig { .. } => Kind::HfConfig,
        Error::Io { .. } => Kind::Io,
        _ => return None,
    })
}

/// Collects the cases of one area and checks each under `catch_unwind`.
struct Sweep {
    area: &'static str,
    count: usize,
    failures: Vec<String>,
}

impl Sweep {
    fn new(area: &'static str) -> Self {
        Self {
            area,
            count: 0,
            failures: Vec::new(),
        }
    }

    /// `f` must fail with `kind`, and the message must contain every string of `needles`
    /// (the offending value and the expectation).
    fn case<T>(
        &mut self,
        label: &str,
        kind: Kind,
        needles: &[&str],
        f: impl FnOnce() -> candle_posenc::Result<T>,
    ) {
        self.count += 1;
        match catch_unwind(AssertUnwindSafe(f)) {
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.failures.push(format!("{label}: PANICKED: {msg}"));
            }
            Ok(Ok(_)) => self.failures.push(format!("{label}: returned Ok")),
            Ok(Err(e)) => {
                let text = e.to_string();
                if kind_of(&e) != Some(kind) {
                    self.failures
                        .push(format!("{label}: expected {kind:?}, got {e:?} ({text})"));
                    return;
                }
                for n in needles {
                    if !text.contains(n) {
                        self.failures
                            .push(format!("{label}: message `{text}` does not mention `{n}`"));
                    }
                }
            }
        }
    }

    fn finish(self, at_least: usize) {
        assert!(
            self.failures.is_empty(),
            "{} of {} {} cases failed:\n{}",
            self.failures.len(),
            self.count,
            self.area,
            self.failures.join("\n")
        );
        assert!(
            self.count >= at_least,
            "{}: only {} cases",
            self.area,
            self.count
        );
    }
}

fn cpu() -> Device {
    Device::Cpu
}

fn zeros_vb() -> VarBuilder<'static> {
    VarBuilder::zeros(DType::F32, &Device::Cpu)
}

fn x(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, &Device::Cpu).expect("test input")
}

fn ids(rows: &[Vec<u32>]) -> Positions {
    Positions::Ids(PositionIds::from_rows(rows, &Device::Cpu).expect("test ids"))
}

const HUGE: usize = 1_000_000_000_000; // 10^12

#[test]
fn positions() {
    let mut s = Sweep::new("positions");
    let dev = cpu();
    s.case("ids of rank 1", Kind::Rank, &["rank 1", "rank 2"], || {
        PositionIds::new(&Tensor::new(&[0u32, 1], &dev)?)
    });
    s.case("ids of dtype f32", Kind::DType, &["F32", "integer"], || {
        PositionIds::new(&Tensor::new(&[[0f32, 1.]], &dev)?)
    });
    s.case("negative id", Kind::Config, &["-3", "non-negative"], || {
        PositionIds::new(&Tensor::new(&[[0i64, -3]], &dev)?)
    });
    s.case(
        "id past u32",
        Kind::Config,
        &["5000000000", "4294967295"],
        || PositionIds::new(&Tensor::new(&[[5_000_000_000i64]], &dev)?),
    );
    s.case(
        "ragged rows",
        Kind::Shape,
        &["[2, 1]", "same length"],
        || PositionIds::from_rows(&[vec![0, 1], vec![0]], &dev),
    );
    s.case("no rows", Kind::Shape, &["at least one row"], || {
        PositionIds::from_rows(&[], &dev)
    });
    s.case(
        "offset past MAX_POSITION",
        Kind::Config,
        &["4294967295", "at most"],
        || Positions::Offset(u32::MAX as usize).check(1, 2),
    );
    s.case(
        "offset that overflows usize",
        Kind::Config,
        &[&usize::MAX.to_string()],
        || Positions::Offset(usize::MAX).check(1, 2),
    );
    s.case(
        "offset to_ids past u32",
        Kind::Config,
        &["4294967295"],
        || Positions::Offset(u32::MAX as usize).to_ids(4, &dev),
    );
    s.case(
        "extend past usize",
        Kind::Config,
        &["position offset"],
        || Positions::Offset(usize::MAX - 1).extend(4, &Positions::Offset(0), 1, &dev),
    );
    s.case(
        "ids of wrong length",
        Kind::Shape,
        &["(2, 3) or (1, 3)", "[1, 2]"],
        || ids(&[vec![0, 1]]).check(2, 3),
    );
    s.case(
        "relative distances batch mismatch",
        Kind::Shape,
        &["batch 1 or 2"],
        || {
            Positions::relative_distances(
                &ids(&[vec![0], vec![1]]),
                1,
                &ids(&[vec![0], vec![1], vec![2]]),
                1,
                &dev,
            )
        },
    );
    s.case(
        "relative distances of 10^12 pairs",
        Kind::Config,
        &["1000000 × 1000000", "at most 2147483648"],
        || {
            let o = Positions::Offset(0);
            Positions::relative_distances(&o, 1_000_000, &o, 1_000_000, &dev)
        },
    );
    s.finish(13);
}

#[test]
fn sinusoidal() {
    let mut s = Sweep::new("sinusoidal");
    let dev = cpu();
    let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(8).with_max_len(16), &dev)
        .expect("valid config");
    s.case(
        "odd d_model",
        Kind::Config,
        &["d_model = 7", "even"],
        || SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(7), &dev),
    );
    s.case("zero d_model", Kind::Config, &["d_model = 0"], || {
        SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(0), &dev)
    });
    s.case(
        "max_len 10^12",
        Kind::Config,
        &["max_len = 1000000000000", "at most"],
        || {
            let c = SinusoidalConfig::new(8).with_max_len(HUGE);
            SinusoidalPositionalEncoding::new(&c, &dev)
        },
    );
    s.case("NaN base", Kind::Config, &["base = NaN", "finite"], || {
        let c = SinusoidalConfig::new(8).with_base(f64::NAN);
        SinusoidalPositionalEncoding::new(&c, &dev)
    });
    s.case("negative base", Kind::Config, &["base = -2", "> 1"], || {
        let c = SinusoidalConfig::new(8).with_base(-2.0);
        SinusoidalPositionalEncoding::new(&c, &dev)
    });
    s.case(
        "dropout 1.5",
        Kind::Config,
        &["dropout = 1.5", "[0, 1)"],
        || {
            let c = SinusoidalConfig::new(8).with_dropout(1.5);
            SinusoidalPositionalEncoding::new(&c, &dev)
        },
    );
    s.case("NaN dropout", Kind::Config, &["dropout = NaN"], || {
        let c = SinusoidalConfig::new(8).with_dropout(f32::NAN);
        SinusoidalPositionalEncoding::new(&c, &dev)
    });
    s.case(
        "input of rank 2",
        Kind::Rank,
        &["rank 2", "expected rank 3"],
        || pe.forward_t(&x(&[3, 8]), false),
    );
    s.case(
        "input of wrong width",
        Kind::Shape,
        &["[1, 3, 6]", "(batch, seq_len, 8)"],
        || pe.forward_t(&x(&[1, 3, 6]), false),
    );
    s.case("integer input", Kind::DType, &["U32", "float"], || {
        pe.forward_t(&Tensor::zeros((1, 3, 8), DType::U32, &dev)?, false)
    });
    s.case(
        "offset past u32",
        Kind::Config,
        &["position offset", "at most"],
        || pe.forward_with_positions(&x(&[1, 3, 8]), &Positions::Offset(u32::MAX as usize), false),
    );
    s.case(
        "offset whose table is absurd",
        Kind::Config,
        &["at most 2147483648"],
        || pe.forward_with_positions(&x(&[1, 3, 8]), &Positions::Offset(1 << 30), false),
    );
    s.case(
        "ids of wrong length",
        Kind::Shape,
        &["position ids", "[1, 2]", "expected (1, 3) to match"],
        || pe.forward_with_positions(&x(&[1, 3, 8]), &ids(&[vec![0, 1]]), false),
    );
    s.case(
        "encodings(10^12)",
        Kind::Config,
        &["1000000000000", "at most"],
        || pe.encodings(HUGE),
    );
    s.finish(14);
}

#[test]
fn learned() {
    let mut s = Sweep::new("learned");
    let dev = cpu();
    let cfg = LearnedConfig::new(4).with_max_len(8);
    let pe = LearnedPositionalEncoding::new(&cfg, zeros_vb()).expect("valid config");
    s.case("zero d_model", Kind::Config, &["d_model = 0"], || {
        LearnedPositionalEncoding::new(&LearnedConfig::new(0), zeros_vb())
    });
    s.case(
        "max_len 10^12",
        Kind::Config,
        &["max_len = 1000000000000", "at most"],
        || LearnedPositionalEncoding::new(&LearnedConfig::new(4).with_max_len(HUGE), zeros_vb()),
    );
    s.case(
        "interpolation shorter than table",
        Kind::Config,
        &["= 4", "at least max_len (8)"],
        || {
            let c = cfg.clone().with_interpolation(Interpolation::ToLength(4));
            LearnedPositionalEncoding::new(&c, zeros_vb())
        },
    );
    s.case(
        "table of wrong shape",
        Kind::Shape,
        &["[8, 5]", "(8, 4)"],
        || LearnedPositionalEncoding::from_table(&cfg, x(&[8, 5])),
    );
    s.case("missing table", Kind::Missing, &["weight"], || {
        let vb = VarBuilder::from_tensors(HashMap::new(), DType::F32, &dev);
        LearnedPositionalEncoding::new(&cfg, vb)
    });
    s.case(
        "offset past table",
        Kind::OutOfRange,
        &["position 10", "0..8"],
        || pe.forward_with_positions(&x(&[1, 3, 4]), &Positions::Offset(8), false),
    );
    s.case(
        "id past table",
        Kind::OutOfRange,
        &["position 9", "0..8"],
        || pe.forward_with_positions(&x(&[1, 2, 4]), &ids(&[vec![0, 9]]), false),
    );
    s.case(
        "interpolated(0)",
        Kind::Config,
        &["= 0", "at least 1"],
        || pe.interpolated(0),
    );
    s.case(
        "interpolated(10^12)",
        Kind::Config,
        &["1000000000000", "at most"],
        || pe.interpolated(HUGE),
    );
    s.case(
        "interpolation to an absurd length",
        Kind::OutOfRange,
        &["0..536870912"],
        || {
            let c = cfg
                .clone()
                .with_interpolation(Interpolation::ToSequenceLength);
            let pe = LearnedPositionalEncoding::new(&c, zeros_vb())?;
            pe.forward_with_positions(&x(&[1, 1, 4]), &Positions::Offset(1 << 31), false)
        },
    );
    s.case("integer input", Kind::DType, &["I64", "float"], || {
        pe.forward_t(&Tensor::zeros((1, 3, 4), DType::I64, &dev)?, false)
    });
    s.case(
        "integer table",
        Kind::DType,
        &["learned table", "U32", "float"],
        || LearnedPositionalEncoding::from_table(&cfg, Tensor::zeros((8, 4), DType::U32, &dev)?),
    );
    s.case(
        "integer VarBuilder",
        Kind::DType,
        &["learned table", "I64", "float"],
        || LearnedPositionalEncoding::new(&cfg, VarBuilder::zeros(DType::I64, &dev)),
    );
    s.finish(13);
}

#[test]
fn relative() {
    let mut s = Sweep::new("relative");
    let dev = cpu();
    let alibi = Alibi::new(&AlibiConfig::new(4), &dev).expect("valid");
    let t5 = T5RelativeBias::new(&T5Config::new(2), zeros_vb()).expect("valid");
    let shaw = ShawRelativePosition::new(&ShawConfig::new(4, 2).with_values(true), zeros_vb())
        .expect("valid");
    alibi_configs(&mut s);
    alibi_inputs(&mut s, &alibi);
    t5_configs_and_inputs(&mut s, &t5);
    clipped_and_shaw_configs_and_inputs(&mut s, &shaw);
    relative_value_sums_past_the_budget(&mut s);
    relative_context_ranges(&mut s, &alibi, &t5, &shaw);
    s.finish(30);
}

/// ALiBi's settings: heads, head range, slopes, learnability.
fn alibi_configs(s: &mut Sweep) {
    let dev = cpu();
    s.case(
        "alibi zero heads",
        Kind::Config,
        &["num_heads = 0", "at least 1"],
        || Alibi::new(&AlibiConfig::new(0), &dev),
    );
    s.case(
        "alibi head range outside",
        Kind::Config,
        &["6..10", "0..8"],
        || Alibi::new(&AlibiConfig::new(8).with_head_range(6, 4), &dev),
    );
    s.case(
        "alibi 10^12 heads",
        Kind::Config,
        &["num_heads = 1000000000000", "at most"],
        || Alibi::new(&AlibiConfig::new(HUGE), &dev),
    );
    s.case(
        "alibi_slopes(10^12)",
        Kind::Config,
        &["1000000000000", "at most"],
        || alibi_slopes(HUGE),
    );
    s.case(
        "alibi learnable through new",
        Kind::Config,
        &["learnable = true"],
        || Alibi::new(&AlibiConfig::new(4).with_learnable(true), &dev),
    );
}

/// ALiBi's queries, and the positions its bias is asked for.
fn alibi_inputs(s: &mut Sweep, alibi: &Alibi) {
    let o = Positions::Offset(0);
    let dev = cpu();
    s.case(
        "alibi queries of rank 3",
        Kind::Rank,
        &["rank 3", "expected rank 4"],
        || alibi.logits_bias(&x(&[1, 3, 8]), &AttentionContext::new(&o, 3, &o, 3)),
    );
    s.case(
        "alibi queries with wrong heads",
        Kind::Shape,
        &["[1, 3, 2, 8]", "4 heads"],
        || alibi.logits_bias(&x(&[1, 3, 2, 8]), &AttentionContext::new(&o, 2, &o, 2)),
    );
    s.case(
        "alibi bias at an offset past u32",
        Kind::Config,
        &["position offset"],
        || {
            let far = Positions::Offset(usize::MAX - 1);
            alibi.bias(&AttentionContext::new(&far, 4, &Positions::Offset(0), 4))
        },
    );
    s.case(
        "alibi bias with ids of the wrong length",
        Kind::Shape,
        &["position ids"],
        || {
            let k = ids(&[vec![0, 1, 2]]);
            alibi.bias(&AttentionContext::new(&Positions::Offset(0), 2, &k, 2))
        },
    );
    s.case(
        "alibi symmetric bias of 10^12 entries",
        Kind::Config,
        &["1000000 × 1000000", "at most"],
        || {
            let a = Alibi::new(&AlibiConfig::new(2).with_mode(AlibiMode::Symmetric), &dev)?;
            a.bias(&AttentionContext::new(&o, 1_000_000, &o, 1_000_000))
        },
    );
    s.case(
        "alibi causal ids of another batch",
        Kind::Shape,
        &["key position ids", "batch 1 or 2", "[3, 1]"],
        || {
            let (q, k) = (ids(&[vec![0], vec![1]]), ids(&[vec![0], vec![1], vec![2]]));
            alibi.bias(&AttentionContext::new(&q, 1, &k, 1).with_causal(true))
        },
    );
}

/// T5's buckets, its table's shape, and the size and batches of the bias it is asked for.
fn t5_configs_and_inputs(s: &mut Sweep, t5: &T5RelativeBias) {
    let dev = cpu();
    s.case(
        "t5 too few buckets",
        Kind::Config,
        &["num_buckets = 2", "at least 4"],
        || T5RelativeBias::new(&T5Config::new(2).with_num_buckets(2), zeros_vb()),
    );
    s.case(
        "t5 max_distance inside exact range",
        Kind::Config,
        &["max_distance = 4"],
        || T5RelativeBias::new(&T5Config::new(2).with_max_distance(4), zeros_vb()),
    );
    s.case(
        "t5 10^12 buckets",
        Kind::Config,
        &["1000000000000", "at most"],
        || {
            let c = T5Config::new(2)
                .with_num_buckets(HUGE)
                .with_max_distance(HUGE * 4);
            T5RelativeBias::new(&c, zeros_vb())
        },
    );
    s.case(
        "t5 table of wrong shape",
        Kind::TensorShape,
        &["[32, 3]", "[32, 2]"],
        || {
            let t = HashMap::from([("relative_attention_bias.weight".to_string(), x(&[32, 3]))]);
            T5RelativeBias::new(
                &T5Config::new(2),
                VarBuilder::from_tensors(t, DType::F32, &dev),
            )
        },
    );
    s.case(
        "t5 bias of 10^12 entries",
        Kind::Config,
        &["1000000", "at most"],
        || {
            t5.bias(
                &Positions::Offset(0),
                1_000_000,
                &Positions::Offset(0),
                1_000_000,
            )
        },
    );
    s.case(
        "t5 ids of another batch",
        Kind::Shape,
        &["key position ids", "batch 1 or 2", "[3, 1]"],
        || {
            let q = ids(&[vec![0], vec![1]]);
            t5.bias(&q, 1, &ids(&[vec![0], vec![1], vec![2]]), 1)
        },
    );
}

/// The clipped bias's and Shaw's settings, and the queries and weights Shaw is given.
fn clipped_and_shaw_configs_and_inputs(s: &mut Sweep, shaw: &ShawRelativePosition) {
    let o = Positions::Offset(0);
    s.case(
        "clipped zero distance",
        Kind::Config,
        &["max_distance = 0"],
        || ClippedRelativeBias::new(&ClippedBiasConfig::new(2, 0), zeros_vb()),
    );
    s.case("clipped huge table", Kind::Config, &["at most"], || {
        ClippedRelativeBias::new(&ClippedBiasConfig::new(1 << 20, 1 << 29), zeros_vb())
    });
    s.case(
        "shaw zero head_dim",
        Kind::Config,
        &["head_dim = 0"],
        || ShawRelativePosition::new(&ShawConfig::new(0, 2), zeros_vb()),
    );
    s.case(
        "shaw distance 2^21",
        Kind::Config,
        &["max_distance = 2097152", "2^20"],
        || ShawRelativePosition::new(&ShawConfig::new(4, 1 << 21), zeros_vb()),
    );
    s.case(
        "shaw huge head_dim",
        Kind::Config,
        &["head_dim = 1000000000000", "at most"],
        || ShawRelativePosition::new(&ShawConfig::new(HUGE, 4), zeros_vb()),
    );
    s.case(
        "shaw queries of wrong head_dim",
        Kind::Shape,
        &["[1, 2, 3, 5]", "4"],
        || shaw.logits_bias(&x(&[1, 2, 3, 5]), &AttentionContext::new(&o, 3, &o, 3)),
    );
    s.case(
        "shaw probs of rank 3",
        Kind::Rank,
        &["attention weights", "rank 3"],
        || {
            let term = shaw.value_term(&AttentionContext::new(&o, 3, &o, 3))?;
            term.expect("a value term").weighted_sum(&x(&[2, 3, 3]))
        },
    );
}

/// Relative values: a weighted sum whose output or contiguous weights pass the budget.
fn relative_value_sums_past_the_budget(s: &mut Sweep) {
    // The weighted sum's output (batch × heads × queries × features) is budgeted before the
    // product: weights as a broadcast view and a wide table made it 2^32 floats, an
    // allocation abort (found by the fuzzer).
    s.case(
        "relative values weighted sum past the budget",
        Kind::Config,
        &["65536", "weighted sum", "at most"],
        || {
            let table = Tensor::zeros((3, 1 << 16), DType::F32, &cpu()).expect("small");
            let values = RelativeValues::new(table, Columns::Shift(1))?;
            let probs = Tensor::zeros((), DType::F32, &cpu())
                .and_then(|z| z.broadcast_as((1, 64, 1024, 3)))
                .expect("a view");
            values.weighted_sum(&probs)
        },
    );
    // So are the weights made contiguous for the column sums: a broadcast view of 2^38
    // weights with a narrow table passed both checks above (a second look at the same class).
    s.case(
        "relative values weighted sum over broadcast weights past the budget",
        Kind::Config,
        &["attention weights", "[1, 64, 65536, 65536]", "at most"],
        || {
            let table = Tensor::zeros((3, 4), DType::F32, &cpu()).expect("small");
            let values = RelativeValues::new(table, Columns::Shift(1))?;
            let probs = Tensor::zeros((), DType::F32, &cpu())
                .and_then(|z| z.broadcast_as((1, 64, 65536, 65536)))
                .expect("a view");
            values.weighted_sum(&probs)
        },
    );
}

/// Every relative encoding checks its context's ranges the same way before computing a
/// distance (Shaw computed 0 − i64::MIN; T5 and the clipped bias skipped the check when a
/// side was empty, then overflowed s + len).
fn relative_context_ranges(
    s: &mut Sweep,
    alibi: &Alibi,
    t5: &T5RelativeBias,
    shaw: &ShawRelativePosition,
) {
    let o = Positions::Offset(0);
    let far = Positions::Offset(1 << 63);
    let end = Positions::Offset(usize::MAX);
    let clipped =
        ClippedRelativeBias::new(&ClippedBiasConfig::new(2, 4), zeros_vb()).expect("valid");
    s.case(
        "shaw logits bias, queries at 2^63",
        Kind::Config,
        &["position offset = 9223372036854775808", "at most"],
        || shaw.logits_bias(&x(&[1, 2, 1, 4]), &AttentionContext::new(&far, 1, &o, 1)),
    );
    s.case(
        "shaw value term, keys at 2^63",
        Kind::Config,
        &["position offset = 9223372036854775808"],
        || shaw.value_term(&AttentionContext::new(&o, 1, &far, 1)),
    );
    s.case(
        "t5 logits bias, no queries, keys at usize::MAX",
        Kind::Config,
        &["position offset = 18446744073709551615"],
        || t5.logits_bias(&x(&[1, 2, 0, 4]), &AttentionContext::new(&o, 0, &end, 1)),
    );
    s.case(
        "clipped logits bias, no queries, keys at usize::MAX",
        Kind::Config,
        &["position offset = 18446744073709551615"],
        || clipped.logits_bias(&x(&[1, 2, 0, 4]), &AttentionContext::new(&o, 0, &end, 1)),
    );
    s.case(
        "t5 bias, no queries, keys at usize::MAX",
        Kind::Config,
        &["position offset = 18446744073709551615"],
        || t5.bias(&o, 0, &end, 1),
    );
    s.case(
        "alibi logits bias, no keys, queries at usize::MAX",
        Kind::Config,
        &["position offset = 18446744073709551615"],
        || alibi.logits_bias(&x(&[1, 4, 1, 4]), &AttentionContext::new(&end, 1, &o, 0)),
    );
}

#[test]
fn rotary() {
    let mut s = Sweep::new("rotary");
    rope_configs(&mut s);
    rope_inputs(&mut s);
    rope_mixed_configs_and_inputs(&mut s);
    s.finish(22);
}

/// RoPE's settings: head_dim, rotary_dim, base, xPos scale and each scaling's factors.
fn rope_configs(s: &mut Sweep) {
    let new = |c: RopeConfig| RotaryEmbedding::new(&c, &Device::Cpu);
    s.case(
        "odd head_dim",
        Kind::Config,
        &["head_dim = 7", "even"],
        || new(RopeConfig::new(7)),
    );
    s.case(
        "rotary_dim > head_dim",
        Kind::Config,
        &["rotary_dim = 16", "at most head_dim = 8"],
        || new(RopeConfig::new(8).with_rotary_dim(16)),
    );
    s.case("NaN base", Kind::Config, &["base = NaN"], || {
        new(RopeConfig::new(8).with_base(f64::NAN))
    });
    s.case("base 0.5", Kind::Config, &["base = 0.5", "> 1"], || {
        new(RopeConfig::new(8).with_base(0.5))
    });
    s.case(
        "negative xPos scale",
        Kind::Config,
        &["xpos_scale_base = -1"],
        || new(RopeConfig::new(8).with_xpos(-1.0)),
    );
    s.case(
        "negative linear factor",
        Kind::Config,
        &["-2", "> 0"],
        || new(RopeConfig::new(8).with_scaling(RopeScaling::Linear { factor: -2.0 })),
    );
    s.case("infinite yarn factor", Kind::Config, &["inf"], || {
        new(RopeConfig::new(8).with_scaling(RopeScaling::Yarn(YarnScaling::new(f64::INFINITY, 64))))
    });
    s.case(
        "longrope factor list too short",
        Kind::Config,
        &["4"],
        || {
            new(
                RopeConfig::new(8).with_scaling(RopeScaling::LongRope(LongRopeScaling {
                    short_factor: vec![1.0],
                    long_factor: vec![1.0; 4],
                    original_max_position_embeddings: 64,
                    factor: 2.0,
                    attention_factor: None,
                })),
            )
        },
    );
}

/// RoPE's queries and keys (rank, head_dim, batch, dtype) and the positions it rotates them to.
fn rope_inputs(s: &mut Sweep) {
    let dev = cpu();
    let rope = RotaryEmbedding::new(&RopeConfig::new(8), &dev).expect("valid");
    let q = x(&[2, 2, 3, 8]);
    let off = Positions::Offset(0);
    s.case(
        "queries of rank 3",
        Kind::Rank,
        &["rank 3", "expected rank 4"],
        || rope.rotate_queries(&x(&[2, 3, 8]), &off, QkLayout::Bhtd),
    );
    s.case(
        "queries of wrong head_dim",
        Kind::Shape,
        &["[2, 2, 3, 6]", "8"],
        || rope.rotate_queries(&x(&[2, 2, 3, 6]), &off, QkLayout::Bhtd),
    );
    s.case(
        "keys of another batch",
        Kind::Shape,
        &["[3, 2, 3, 8]", "batch 2"],
        || rope.rotate_queries_keys(&q, &x(&[3, 2, 3, 8]), &off, &off, QkLayout::Bhtd),
    );
    s.case(
        "integer queries",
        Kind::DType,
        &["U32", "f32, f64, bf16 or f16"],
        || {
            let q = Tensor::zeros((1, 1, 2, 8), DType::U32, &dev)?;
            rope.rotate_queries(&q, &off, QkLayout::Bhtd)
        },
    );
    s.case(
        "integer queries, owned",
        Kind::DType,
        &["I64", "f32, f64, bf16 or f16"],
        || {
            let q = Tensor::zeros((1, 1, 2, 8), DType::I64, &dev)?;
            rope.rotate_queries_keys_owned(q.clone(), q, &off, &off, QkLayout::Bhtd)
        },
    );
    s.case(
        "offset past u32",
        Kind::Config,
        &["position offset"],
        || rope.rotate_queries(&q, &Positions::Offset(u32::MAX as usize), QkLayout::Bhtd),
    );
    s.case(
        "ids of another batch",
        Kind::Shape,
        &["position ids", "(2, 3)"],
        || {
            let p = ids(&[vec![0, 1, 2], vec![0, 1, 2], vec![0, 1, 2]]);
            rope.rotate_queries(&q, &p, QkLayout::Bhtd)
        },
    );
    s.case(
        "cos_sin past u32",
        Kind::Config,
        &[
            "position offset = 18446744073709551613",
            "at most 4294967296",
        ],
        || rope.cos_sin(&Positions::Offset(usize::MAX - 2), 4),
    );
}

/// RoPE-Mixed reads its input and 2-D positions through the same checks.
fn rope_mixed_configs_and_inputs(s: &mut Sweep) {
    let dev = cpu();
    let q = x(&[2, 2, 3, 8]);
    let off = Positions::Offset(0);
    let mixed_vars = VarMap::new();
    let mixed = RopeMixed::new(
        &RopeMixedConfig::new(2, 8),
        common::seeded_vb(&mixed_vars, DType::F32, &dev),
    )
    .expect("valid");
    let grid = Positions::Ids(
        PositionIds::multimodal(&Tensor::zeros((3, 2, 3), DType::U32, &dev).expect("ids"))
            .expect("valid"),
    );
    s.case(
        "RoPE-Mixed head_dim not a multiple of 4",
        Kind::Config,
        &["head_dim = 6", "multiple of 4"],
        || {
            let vm = VarMap::new();
            RopeMixed::new(
                &RopeMixedConfig::new(2, 6),
                common::seeded_vb(&vm, DType::F32, &dev),
            )
        },
    );
    s.case(
        "RoPE-Mixed input of rank 2",
        Kind::Rank,
        &["RoPE-Mixed input", "rank 2"],
        || mixed.rotate_one(&x(&[5, 3]), &grid),
    );
    s.case(
        "RoPE-Mixed integer input",
        Kind::DType,
        &["RoPE-Mixed input", "U32"],
        || {
            let q = Tensor::zeros((2, 2, 3, 8), DType::U32, &dev)?;
            mixed.rotate_one(&q, &grid)
        },
    );
    s.case(
        "RoPE-Mixed input of other heads",
        Kind::Shape,
        &["RoPE-Mixed input", "[2, 3, 3, 8]"],
        || mixed.rotate_one(&x(&[2, 3, 3, 8]), &grid),
    );
    s.case(
        "RoPE-Mixed at one-dimensional positions",
        Kind::Positions,
        &["RoPE-Mixed positions", "multimodal"],
        || mixed.rotate_one(&q, &off),
    );
    s.case(
        "RoPE-Mixed keys shared by grouped query heads",
        Kind::Shape,
        &["RoPE-Mixed keys", "grouped KV heads", "[2, 1, 3, 8]"],
        || {
            let ctx = AttentionContext::new(&grid, 3, &grid, 3);
            mixed.rotate(q.clone(), x(&[2, 1, 3, 8]), &ctx)
        },
    );
}

#[test]
fn attention() {
    let mut s = Sweep::new("attention");
    attention_configs(&mut s);
    let mha = causal_rope_block();
    attention_input_tensors(&mut s, &mha);
    attention_masks_positions_and_cache(&mut s, &mha);
    s.finish(16);
}

/// A causal block of 2 heads over 8 features with RoPE, its weights from a fresh `VarMap`.
fn causal_rope_block() -> MultiHeadAttention {
    let dev = cpu();
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let rope = RotaryEmbedding::new(&RopeConfig::new(4), &dev).expect("valid");
    MultiHeadAttention::new(
        &AttentionConfig::new(8, 2).with_causal(true),
        Some(Arc::new(rope)),
        vb,
    )
    .expect("valid")
}

/// The block's settings (heads, scale, blocks, budget, sizes) and its weights' dtype.
fn attention_configs(s: &mut Sweep) {
    let dev = cpu();
    s.case("zero heads", Kind::Config, &["num_heads = 0"], || {
        AttentionConfig::new(8, 0).validate()
    });
    s.case(
        "heads not dividing d_model",
        Kind::Config,
        &["head_dim = 0", "divide d_model (8)"],
        || AttentionConfig::new(8, 3).validate(),
    );
    s.case(
        "kv heads not dividing heads",
        Kind::Config,
        &["num_kv_heads = 3", "divisor of num_heads (4)"],
        || AttentionConfig::new(8, 4).with_kv_heads(3).validate(),
    );
    s.case(
        "NaN softmax scale",
        Kind::Config,
        &["softmax_scale = NaN"],
        || {
            AttentionConfig::new(8, 2)
                .with_softmax_scale(f64::NAN)
                .validate()
        },
    );
    s.case(
        "query blocks of zero queries",
        Kind::Config,
        &["query_block = 0", "at least 1 query"],
        || {
            AttentionConfig::new(8, 2)
                .with_query_block(Some(0))
                .validate()
        },
    );
    s.case(
        "zero logits budget",
        Kind::Config,
        &["logits_budget = 0", "at least 1 byte"],
        || AttentionConfig::new(8, 2).with_logits_budget(0).validate(),
    );
    s.case(
        "d_model 10^12",
        Kind::Config,
        &["1000000000000", "at most"],
        || MultiHeadAttention::new(&AttentionConfig::new(HUGE, 1), None, zeros_vb()),
    );
    s.case("head_dim 10^9", Kind::Config, &["at most"], || {
        let c = AttentionConfig::new(8, 2).with_head_dim(1_000_000_000);
        MultiHeadAttention::new(&c, None, zeros_vb())
    });
    s.case(
        "integer weights",
        Kind::DType,
        &["attention weights", "U32", "float"],
        || {
            MultiHeadAttention::new(
                &AttentionConfig::new(8, 2),
                None,
                VarBuilder::zeros(DType::U32, &dev),
            )
        },
    );
}

/// The input's rank, width and dtype, and weights asked for past the budget.
fn attention_input_tensors(s: &mut Sweep, mha: &MultiHeadAttention) {
    let dev = cpu();
    let fwd = |x: &Tensor, o: &AttentionOptions| mha.forward_with(x, o, None).map(|o| o.output);
    s.case(
        "input of rank 4",
        Kind::Rank,
        &["rank 4", "expected rank 3"],
        || fwd(&x(&[1, 1, 3, 8]), &AttentionOptions::default()),
    );
    s.case(
        "input of wrong width",
        Kind::Shape,
        &["[1, 3, 6]", "(batch, seq_len, 8)"],
        || fwd(&x(&[1, 3, 6]), &AttentionOptions::default()),
    );
    s.case("integer input", Kind::DType, &["U8", "float"], || {
        fwd(
            &Tensor::zeros((1, 3, 8), DType::U8, &dev)?,
            &AttentionOptions::default(),
        )
    });
    s.case(
        "weights of 5·10^9 entries asked for",
        Kind::Config,
        &[
            "sequence length = 50000",
            "queries per block (50000) × keys (50000)",
            "at most",
        ],
        || {
            fwd(
                &x(&[1, 50_000, 8]),
                &AttentionOptions {
                    return_weights: true,
                    ..Default::default()
                },
            )
        },
    );
    s.case(
        "f16 input to f32 weights",
        Kind::DType,
        &[
            "attention input x",
            "F16",
            "f32, the dtype of the attention weights",
        ],
        || {
            fwd(
                &x(&[1, 3, 8]).to_dtype(DType::F16)?,
                &AttentionOptions::default(),
            )
        },
    );
}

/// Masks and position ids of the wrong shape, and a cache chunk of another batch.
fn attention_masks_positions_and_cache(s: &mut Sweep, mha: &MultiHeadAttention) {
    let dev = cpu();
    let fwd = |x: &Tensor, o: &AttentionOptions| mha.forward_with(x, o, None).map(|o| o.output);
    s.case(
        "padding mask of wrong shape",
        Kind::Shape,
        &["[1, 2]", "(1, 3)"],
        || {
            let pad = Tensor::ones((1, 2), DType::U8, &dev)?;
            let o = AttentionOptions {
                padding_mask: Some(&pad),
                ..Default::default()
            };
            fwd(&x(&[1, 3, 8]), &o)
        },
    );
    s.case(
        "additive mask not broadcastable",
        Kind::Shape,
        &["[5, 5]", "(1, 2, 3, 3)"],
        || {
            let m = x(&[5, 5]);
            let o = AttentionOptions {
                attn_mask: Some(&m),
                ..Default::default()
            };
            fwd(&x(&[1, 3, 8]), &o)
        },
    );
    s.case(
        "position ids of wrong length",
        Kind::Shape,
        &["position ids", "(1, 3)"],
        || {
            let p = ids(&[vec![0, 1]]);
            let o = AttentionOptions {
                positions: Some(&p),
                ..Default::default()
            };
            fwd(&x(&[1, 3, 8]), &o)
        },
    );
    s.case(
        "cache chunk of another batch",
        Kind::Shape,
        &["KV cache", "batch 1"],
        || {
            let mut cache = KvCache::new();
            mha.forward_with(
                &x(&[1, 2, 8]),
                &AttentionOptions::default(),
                Some(&mut cache),
            )?;
            mha.forward_with(
                &x(&[2, 1, 8]),
                &AttentionOptions::default(),
                Some(&mut cache),
            )
        },
    );
}

#[test]
fn configs_and_metadata() {
    let mut s = Sweep::new("configs");
    hf_rope_configs(&mut s);
    encoding_metadata(&mut s);
    attention_metadata_and_checkpoint_files(&mut s);
    s.finish(17);
}

/// RoPE read from a `config.json`: bad JSON, mistyped or missing keys, absurd sizes.
fn hf_rope_configs(s: &mut Sweep) {
    let hf = |t: &'static str| move || RopeConfig::from_hf_json(t);
    s.case(
        "hf: not JSON",
        Kind::HfConfig,
        &["<root>", "not valid JSON"],
        hf("{"),
    );
    s.case(
        "hf: array root",
        Kind::HfConfig,
        &["<root>", "object"],
        hf("[1, 2]"),
    );
    s.case(
        "hf: rope_theta string",
        Kind::HfConfig,
        &["rope_theta", "\"big\"", "a number"],
        hf(r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_theta": "big"}"#),
    );
    s.case(
        "hf: negative head_dim",
        Kind::HfConfig,
        &["head_dim", "-8", "non-negative integer"],
        hf(r#"{"head_dim": -8, "rope_theta": 10000.0}"#),
    );
    s.case("hf: factor string", Kind::HfConfig, &["rope_scaling.factor", "\"two\""], hf(
        r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": "two"}}"#,
    ));
    s.case("hf: unknown rope_type", Kind::HfConfig, &["rope_scaling.rope_type", "warp"], hf(
        r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": {"rope_type": "warp"}}"#,
    ));
    s.case(
        "hf: missing hidden_size",
        Kind::HfConfig,
        &["hidden_size", "missing"],
        hf(r#"{"num_attention_heads": 4}"#),
    );
    s.case(
        "hf: zero heads",
        Kind::HfConfig,
        &["num_attention_heads", "is 0"],
        hf(r#"{"hidden_size": 64, "num_attention_heads": 0}"#),
    );
    s.case(
        "hf: absurd head_dim",
        Kind::HfConfig,
        &["`head_dim`", "head_dim = 1000000000000"],
        hf(r#"{"head_dim": 1000000000000, "max_position_embeddings": 4096}"#),
    );
    s.case(
        "hf: rope_scaling not an object",
        Kind::HfConfig,
        &["rope_scaling", "an object"],
        hf(r#"{"hidden_size": 64, "num_attention_heads": 4, "rope_scaling": 2}"#),
    );
}

/// An encoding's checkpoint metadata: missing, in the old format, mistyped, not JSON, lying.
fn encoding_metadata(s: &mut Sweep) {
    let meta = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let enc_meta = |v: serde_json::Value| meta(&[("posenc.encoding", &v.to_string())]);
    s.case(
        "metadata without the encoding",
        Kind::Checkpoint,
        &["m.safetensors", "posenc.encoding", "missing"],
        || EncodingConfig::from_metadata(&meta(&[]), "m.safetensors"),
    );
    s.case(
        "metadata in the old one-key-per-field format",
        Kind::Checkpoint,
        &[
            "posenc.encoding",
            "missing",
            "`posenc.kind`",
            "no longer read",
        ],
        || {
            let m = meta(&[("posenc.kind", "sinusoidal"), ("posenc.d_model", "8")]);
            EncodingConfig::from_metadata(&m, "m")
        },
    );
    s.case(
        "metadata encoding without kind",
        Kind::Checkpoint,
        &["posenc.encoding", "missing field `kind`"],
        || EncodingConfig::from_metadata(&enc_meta(json!({"d_model": 8})), "m"),
    );
    s.case(
        "metadata unknown kind",
        Kind::Checkpoint,
        &["posenc.encoding", "`warp`", "sinusoidal", "rotary"],
        || EncodingConfig::from_metadata(&enc_meta(json!({"kind": "warp"})), "m"),
    );
    s.case(
        "metadata d_model not a number",
        Kind::Checkpoint,
        &["posenc.encoding", r#""abc""#, "expected usize"],
        || {
            let m = enc_meta(json!({"kind": "sinusoidal", "d_model": "abc"}));
            EncodingConfig::from_metadata(&m, "m")
        },
    );
    s.case(
        "metadata that is not JSON",
        Kind::Checkpoint,
        &[
            "posenc.encoding",
            "EOF while parsing",
            r#"{"kind":"sinusoidal","#,
        ],
        || {
            let m = meta(&[("posenc.encoding", r#"{"kind":"sinusoidal","#)]);
            EncodingConfig::from_metadata(&m, "m")
        },
    );
    s.case(
        "metadata that lies: odd d_model",
        Kind::Config,
        &["d_model = 7"],
        || {
            let m = enc_meta(json!({"kind": "sinusoidal", "d_model": 7}));
            EncodingConfig::from_metadata(&m, "m")
        },
    );
}

/// The block's metadata with a scale JSON cannot hold or a negative one; checkpoint files
/// that do not exist or hold nothing.
fn attention_metadata_and_checkpoint_files(s: &mut Sweep) {
    s.case(
        "attention metadata NaN scale (JSON has no NaN: written as null)",
        Kind::Checkpoint,
        &["posenc.attention", "invalid type: null, expected f64"],
        || {
            let m = AttentionConfig::new(8, 2)
                .with_softmax_scale(f64::NAN)
                .to_metadata();
            AttentionConfig::from_metadata(&m, "m")
        },
    );
    s.case(
        "attention metadata negative scale",
        Kind::Config,
        &["softmax_scale = -1"],
        || {
            let m = AttentionConfig::new(8, 2)
                .with_softmax_scale(-1.0)
                .to_metadata();
            AttentionConfig::from_metadata(&m, "m")
        },
    );
    s.case(
        "checkpoint file that does not exist",
        Kind::Io,
        &["/nonexistent/model.safetensors"],
        || Checkpoint::load("/nonexistent/model.safetensors", &Device::Cpu),
    );
    let ck = Checkpoint::from_bytes(&[], &Device::Cpu).err();
    s.case(
        "checkpoint of zero bytes",
        Kind::Checkpoint,
        &["<memory>", "not a valid safetensors file"],
        || ck.map_or(Ok(()), Err),
    );
}

/// Every encoding behind the attention plug, for the empty-input checks.
fn all_encodings(
    dev: &Device,
) -> candle_posenc::Result<Vec<(&'static str, Arc<dyn PositionalEncoding>)>> {
    let vb = || VarBuilder::zeros(DType::F32, dev);
    Ok(vec![
        ("none", Arc::new(NoEncoding)),
        (
            "sinusoidal",
            Arc::new(SinusoidalPositionalEncoding::new(
                &SinusoidalConfig::new(8),
                dev,
            )?),
        ),
        (
            "learned",
            Arc::new(LearnedPositionalEncoding::new(
                &LearnedConfig::new(8),
                vb(),
            )?),
        ),
        (
            "rotary",
            Arc::new(RotaryEmbedding::new(&RopeConfig::new(4), dev)?),
        ),
        ("alibi", Arc::new(Alibi::new(&AlibiConfig::new(2), dev)?)),
        (
            "t5",
            Arc::new(T5RelativeBias::new(&T5Config::new(2), vb())?),
        ),
        (
            "clipped",
            Arc::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(2, 3),
                vb(),
            )?),
        ),
        (
            "shaw",
            Arc::new(ShawRelativePosition::new(
                &ShawConfig::new(4, 3).with_values(true),
                vb(),
            )?),
        ),
    ])
}

#[derive(Debug)]
struct NoEncoding;
impl PositionalEncoding for NoEncoding {}

/// Empty sequences are valid input: every encoding, alone and inside attention (with and without
/// a cache, causal or not), returns an empty output of the right shape instead of panicking in a
/// candle kernel.
#[test]
fn empty_sequences_give_empty_outputs() -> anyhow::Result<()> {
    let dev = cpu();
    let mut failures = Vec::new();
    for (name, enc) in all_encodings(&dev)? {
        for causal in [false, true] {
            let r = catch_unwind(AssertUnwindSafe(|| -> candle_posenc::Result<Vec<usize>> {
                let vb = VarBuilder::zeros(DType::F32, &dev);
                let cfg = AttentionConfig::new(8, 2).with_causal(causal);
                let mha = MultiHeadAttention::new(&cfg, Some(enc.clone()), vb)?;
                let none = AttentionOptions::default();
                let out = mha.forward_with(&x(&[2, 0, 8]), &none, None)?;
                // An empty chunk into an empty cache, then into a filled one.
                let mut cache = KvCache::new();
                mha.forward_with(&x(&[2, 0, 8]), &none, Some(&mut cache))?;
                mha.forward_with(&x(&[2, 3, 8]), &none, Some(&mut cache))?;
                let o2 = mha.forward_with(&x(&[2, 0, 8]), &none, Some(&mut cache))?;
                assert_eq!(o2.output.dims(), &[2, 0, 8]);
                assert_eq!(cache.len(), 3);
                // The hooks themselves, called directly with no token.
                let (p0, p3) = (Positions::Offset(0), Positions::Offset(3));
                let empty = enc.add_to_input(&x(&[2, 0, 8]), &AttentionContext::chunk(&p0, 0))?;
                assert_eq!(empty.dims(), &[2, 0, 8]);
                let q = x(&[2, 2, 0, 4]);
                let ctx = AttentionContext::chunk(&p3, 0).with_causal(causal);
                let (rq, _) = enc.rotate(q.clone(), q.clone(), &ctx)?;
                assert_eq!(rq.dims(), &[2, 2, 0, 4]);
                for tk in [0, 3] {
                    let ctx = AttentionContext::new(&p3, 0, &p0, tk).with_causal(causal);
                    if let Some(bias) = enc.logits_bias(&q, &ctx)? {
                        // ALiBi's causal bias is one row per head, broadcast over the queries.
                        let dense = bias.to_dense(0, tk)?;
                        assert!(
                            dense.broadcast_as((2, 2, 0, tk)).is_ok(),
                            "{:?}",
                            dense.dims()
                        );
                    }
                    let probs = x(&[2, 2, 0, tk]);
                    if let Some(term) = enc.value_term(&ctx)? {
                        assert_eq!(term.weighted_sum(&probs)?.dims()[2], 0);
                    }
                }
                Ok(out.output.dims().to_vec())
            }));
            match r {
                Ok(Ok(d)) if d == [2, 0, 8] => {}
                Ok(Ok(d)) => failures.push(format!("{name} causal={causal}: shape {d:?}")),
                Ok(Err(e)) => failures.push(format!("{name} causal={causal}: error {e}")),
                Err(_) => failures.push(format!("{name} causal={causal}: PANICKED")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Valid inputs at the extremes must not abort on allocation: ids far apart (distances spanning
/// 2^32) in the relative biases, and a KV cache asked for 10^12 positions of capacity.
#[test]
fn extreme_but_valid_inputs() -> anyhow::Result<()> {
    let dev = cpu();
    let cfg = ClippedBiasConfig::new(2, 3);
    let table = Tensor::new(
        &[
            [0f32, 10.],
            [1., 11.],
            [2., 12.],
            [3., 13.],
            [4., 14.],
            [5., 15.],
            [6., 16.],
        ],
        &dev,
    )?;
    let rb = ClippedRelativeBias::new(
        &cfg,
        VarBuilder::from_tensors(
            HashMap::from([("bias_table.weight".to_string(), table)]),
            DType::F32,
            &dev,
        ),
    )?;
    let far = Positions::Ids(PositionIds::from_rows(&[vec![0, u32::MAX - 1]], &dev)?);
    let bias = rb.bias(&far, 2, &far, 2)?;
    // Rows (i) and columns (j): distance j − i clipped to [-3, 3], row index d + 3.
    let want = [[[3f32, 6.], [0., 3.]], [[13., 16.], [10., 13.]]];
    assert_eq!(bias.squeeze(0)?.to_vec3::<f32>()?, want);

    let rope = RotaryEmbedding::new(&RopeConfig::new(4), &dev)?;
    let mha = MultiHeadAttention::new(
        &AttentionConfig::new(8, 2),
        Some(Arc::new(rope)),
        zeros_vb(),
    )?;
    let mut cache = KvCache::with_capacity(HUGE);
    let none = AttentionOptions::default();
    for _ in 0..3 {
        mha.forward_with(&x(&[1, 2, 8]), &none, Some(&mut cache))?;
    }
    assert_eq!(cache.len(), 6);
    Ok(())
}
