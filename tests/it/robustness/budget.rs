//! The size budget is one number a user reads and sets, and every size that follows from a
//! configuration or an input obeys it at once. The budget is lowered for this test's thread
//! only (`BudgetScope`), so the tests beside it keep the default; the process-wide setter is
//! tested in a child process of its own.

use crate::common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::limits::{max_elements, set_max_elements, BudgetScope, MAX_ELEMENTS};
use candle_posenc::plug::{Columns, RelativeBias};
use candle_posenc::{
    AttentionConfig, AttentionContext, AttentionOptions, Error, KvCache, LearnedConfig,
    LearnedPositionalEncoding, MultiHeadAttention, PositionalEncoding, Positions, RopeConfig,
    RotaryEmbedding, ShawConfig, ShawRelativePosition, SinusoidalConfig,
    SinusoidalPositionalEncoding, T5Config, T5RelativeBias,
};

#[test]
fn budget_is_one_number() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    assert_eq!(max_elements(), MAX_ELEMENTS);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let parts = Parts::build(&vb)?;

    let scope = BudgetScope::new(4096);
    assert_eq!(max_elements(), 4096);
    let mut refused = block_work_refused(&parts)?;
    refused.extend(encoding_and_position_work_refused(&parts, &vb)?);
    a_wide_table_still_gives_its_bias(&dev)?;
    validate_checks_its_own_arithmetic();
    assert_eq!(max_elements(), 4096);
    drop(scope);
    assert_eq!(max_elements(), MAX_ELEMENTS);
    for (what, err) in refused {
        assert!(
            matches!(err, Error::InvalidConfig { .. }) && err.to_string().contains("4096"),
            "{what}: {err}"
        );
    }
    parts
        .mha
        .forward_with(&parts.x, &returning_weights(), None)?;
    Ok(())
}

/// Options that ask for the attention weights.
fn returning_weights() -> AttentionOptions<'static> {
    AttentionOptions {
        return_weights: true,
        ..Default::default()
    }
}

/// The modules and inputs that `budget_is_one_number` builds under the full budget and then
/// calls under a budget of 4096 elements.
struct Parts {
    /// A block of 4 heads over 16 features, with its input of 64 tokens.
    mha: MultiHeadAttention,
    x: Tensor,
    shaw: ShawRelativePosition,
    t5: T5RelativeBias,
    /// Ids of 8 sequences of 16 queries, and of 1 sequence of 64 keys.
    ids: Positions,
    keys: Positions,
    /// One head 1024 wide on a model 1 wide, with an input of 8 tokens.
    wide: MultiHeadAttention,
    eight: Tensor,
    /// An f64 block in query blocks of 16, with its input of 64 tokens.
    blocked: MultiHeadAttention,
    x64: Tensor,
}

impl Parts {
    fn build(vb: &VarBuilder) -> anyhow::Result<Self> {
        let dev = vb.device().clone();
        let mha = MultiHeadAttention::new(&AttentionConfig::new(16, 4), None, vb.pp("a"))?;
        let x = Tensor::zeros((1, 64, 16), DType::F32, &dev)?;
        mha.forward_with(&x, &returning_weights(), None)?;
        let shaw = ShawRelativePosition::new(&ShawConfig::new(4, 64), vb.pp("s"))?;
        let t5 = T5RelativeBias::new(&T5Config::new(4), vb.pp("t5"))?;
        let ids = Positions::ids(&Tensor::zeros((8, 16), DType::U32, &dev)?)?;
        let keys = Positions::ids(&Tensor::zeros((1, 64), DType::U32, &dev)?)?;
        // One head 1024 wide on a model 1 wide: its projections fit in 4096 elements.
        let wide = MultiHeadAttention::new(
            &AttentionConfig::new(1, 1).with_head_dim(1024),
            None,
            vb.pp("w"),
        )?;
        let eight = Tensor::zeros((1, 8, 1), DType::F32, &dev)?;
        wide.forward(&eight)?;
        // An f64 block (candle's ops) of constant weights in query blocks of 16: 4 × 16 × 64
        // logits at a time.
        let blocked = MultiHeadAttention::new(
            &AttentionConfig::new(16, 4).with_query_block(Some(16)),
            None,
            VarBuilder::zeros(DType::F64, &dev),
        )?;
        let x64 = Tensor::zeros((1, 64, 16), DType::F64, &dev)?;
        Ok(Self {
            mha,
            x,
            shaw,
            t5,
            ids,
            keys,
            wide,
            eight,
            blocked,
            x64,
        })
    }
}

/// The attention block's work past 4096 elements, each with what it is: logits, logits kept
/// for the backward, queries, a KV cache, projections.
fn block_work_refused(p: &Parts) -> anyhow::Result<Vec<(&'static str, Error)>> {
    let dev = p.x.device();
    let Parts {
        mha,
        x,
        wide,
        eight,
        blocked,
        x64,
        ..
    } = p;
    let weights = returning_weights();
    let train = AttentionOptions {
        train: true,
        ..Default::default()
    };
    Ok(vec![
        (
            "logits of 4 × 64 × 64",
            mha.forward_with(x, &weights, None).unwrap_err(),
        ),
        (
            "logits of 4 × 64 × 64 that candle's ops keep for the backward (blocks of 4 × 16 × 64 \
             fit, and run in inference)",
            {
                blocked.forward_with(x64, &AttentionOptions::default(), None)?;
                blocked.forward_with(x64, &train, None).unwrap_err()
            },
        ),
        (
            "queries of 8 × 1024 (the logits of 8 × 8 fit)",
            wide.forward_with(eight, &AttentionOptions::default(), None)
                .unwrap_err(),
        ),
        ("a KV cache of 1 × 4 × 2048 × 4", {
            let mut cache = KvCache::with_capacity(1);
            let opts = AttentionOptions::default();
            let x = Tensor::zeros((1, 1, 16), DType::F32, dev)?;
            let mut err = None;
            for _ in 0..2048 {
                if let Err(e) = mha.forward_with(&x, &opts, Some(&mut cache)) {
                    err = Some(e);
                    break;
                }
            }
            err.ok_or_else(|| anyhow::anyhow!("the cache grew past the budget"))?
        }),
        (
            "four projections of 64 × 64 (each alone fits)",
            AttentionConfig::new(64, 4).validate().unwrap_err(),
        ),
    ])
}

/// The encodings' tables and biases and the positions' ids and distances past 4096 elements,
/// each with what it is.
fn encoding_and_position_work_refused(
    p: &Parts,
    vb: &VarBuilder,
) -> anyhow::Result<Vec<(&'static str, Error)>> {
    let dev = p.x.device();
    let Parts {
        shaw,
        t5,
        ids,
        keys,
        ..
    } = p;
    let at0 = Positions::Offset(0);
    Ok(vec![
        (
            "a sinusoidal table of 512 × 16",
            SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(16), dev).unwrap_err(),
        ),
        (
            "a learned table of 1024 × 16",
            LearnedPositionalEncoding::new(&LearnedConfig::new(16).with_max_len(1024), vb.pp("l"))
                .unwrap_err(),
        ),
        (
            "RoPE tables for 4096 positions",
            RotaryEmbedding::new(&RopeConfig::new(64).with_max_position(4096), dev).unwrap_err(),
        ),
        (
            "8192 position ids",
            Positions::Offset(0).to_ids(8192, dev).unwrap_err(),
        ),
        (
            "distances of 8 sequences × 16 × 64 ids (16 × 64 alone fit)",
            Positions::relative_distances(ids, 16, keys, 64, dev).unwrap_err(),
        ),
        (
            "T5 rows for 5000 keys",
            t5.logits_bias(
                &Tensor::zeros((1, 4, 1, 4), DType::F32, dev)?,
                &AttentionContext::new(&at0, 1, &at0, 5000),
            )
            .unwrap_err(),
        ),
        (
            "Shaw's products of 2 × 4 × 16 × 129 (200 keys reach every distance)",
            shaw.logits_bias(
                &Tensor::zeros((2, 4, 16, 4), DType::F32, dev)?,
                &AttentionContext::new(&at0, 16, &at0, 200),
            )
            .unwrap_err(),
        ),
        (
            "positions of 2048 cached keys spread over a chunk's 8 sequences (2048 alone fit)",
            Positions::Offset(0).extend(2048, ids, 16, dev).unwrap_err(),
        ),
        (
            "relative rows viewed as 8 × 4 × 64 × 16 (the 8 × 4 × 64 × 1 bias fits)",
            RelativeBias::new(
                Tensor::zeros((1, 1, 1, 16), DType::F32, dev)?.broadcast_as((8, 4, 64, 16))?,
                Columns::Shift(0),
            )?
            .to_dense(64, 1)
            .unwrap_err(),
        ),
    ])
}

/// A table wider than the budget allows to spread over every query still gives its bias:
/// nothing wider than the bias is built.
fn a_wide_table_still_gives_its_bias(dev: &Device) -> anyhow::Result<()> {
    let table = Tensor::arange(0f32, 512.0, dev)?.reshape((1, 1, 1, 512))?;
    let map: Vec<u32> = (0..64u32).map(|n| n * 37 % 512).collect();
    let wide = RelativeBias::new(
        table,
        Columns::Index(Tensor::from_vec(map.clone(), (8, 4, 2), dev)?),
    )?
    .to_dense(4, 2)?;
    assert_eq!(wide.dims(), &[8, 1, 4, 2]);
    let got: Vec<f32> = wide.flatten_all()?.to_vec1()?;
    assert_eq!(got, map.iter().map(|&c| c as f32).collect::<Vec<_>>());
    Ok(())
}

/// With no budget at all, validate's own arithmetic is checked: 2·num_heads + 2·num_kv_heads
/// of 2^63 heads each (one feature wide, so every product before it fits).
fn validate_checks_its_own_arithmetic() {
    let unlimited = BudgetScope::new(usize::MAX);
    let mut heads = AttentionConfig::new(1, 1).with_kv_heads(1 << 63);
    heads.num_heads = 1 << 63;
    let err = heads.validate().unwrap_err();
    assert!(
        matches!(
            &err,
            Error::InvalidConfig {
                name: "num_heads",
                ..
            }
        ) && err.to_string().contains("within usize"),
        "{err}"
    );
    drop(unlimited);
}

/// `set_max_elements` sets the budget of every thread of the process (a scope still wins on
/// its own thread) and returns the previous one. Process-wide, so it runs alone in a child.
#[test]
fn set_max_elements_is_process_wide() -> anyhow::Result<()> {
    if !crate::common::alone() {
        return crate::common::run_alone(concat!(
            module_path!(),
            "::set_max_elements_is_process_wide"
        ));
    }
    assert_eq!(set_max_elements(4096), MAX_ELEMENTS);
    let other = std::thread::spawn(max_elements).join().expect("thread");
    assert_eq!((max_elements(), other), (4096, 4096));
    {
        let _scope = BudgetScope::new(1 << 20);
        assert_eq!(max_elements(), 1 << 20);
        let other = std::thread::spawn(max_elements).join().expect("thread");
        assert_eq!(other, 4096);
    }
    assert_eq!(max_elements(), 4096);
    // Another thread's call is held to it: logits of 4 × 64 × 64 pass 4096.
    let refused = std::thread::spawn(|| -> anyhow::Result<bool> {
        let dev = Device::Cpu;
        let mha = MultiHeadAttention::new(
            &AttentionConfig::new(16, 4),
            None,
            VarBuilder::zeros(DType::F32, &dev),
        )?;
        let x = Tensor::zeros((1, 64, 16), DType::F32, &dev)?;
        let weights = AttentionOptions {
            return_weights: true,
            ..Default::default()
        };
        Ok(matches!(
            mha.forward_with(&x, &weights, None),
            Err(Error::InvalidConfig { .. })
        ))
    })
    .join()
    .expect("thread")?;
    assert!(
        refused,
        "a call on another thread passed the process's budget"
    );
    assert_eq!(set_max_elements(0), 4096, "at least 1");
    assert_eq!(set_max_elements(MAX_ELEMENTS), 1);
    Ok(())
}

/// Work that follows an argument is budgeted before it is built, counting every tensor a stage
/// holds at once: RoPE's f64 frequencies count two elements each, beside the tables built from
/// them; a learned table stretched to
/// the sequence's length computes only the rows its tokens read, so one token far along costs
/// one row where the whole stretch (three tensors of it at once) is refused.
#[test]
fn work_follows_what_a_call_reads() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let cfg = LearnedConfig::new(16)
        .with_max_len(16)
        .with_interpolation(candle_posenc::Interpolation::ToSequenceLength);
    let learned = LearnedPositionalEncoding::new(&cfg, vb.pp("l"))?;
    let token = Tensor::zeros((1, 1, 16), DType::F32, &dev)?;
    let far = Positions::Offset(200);
    // The reference: row 200 of the whole stretch to 201 rows, under the default budget.
    let want = learned.interpolated(201)?.narrow(0, 200, 1)?.unsqueeze(0)?;

    let _scope = BudgetScope::new(4096);
    let scaling = candle_posenc::RopeScaling::None;
    scaling.frequencies(1 << 12, 10_000.0, 0)?;
    match scaling.frequencies(1 << 13, 10_000.0, 0) {
        Err(Error::InvalidConfig { name, .. }) => assert_eq!(name, "rotary_dim"),
        other => panic!("2^12 f64 frequencies under a budget of 4096: {other:?}"),
    }
    // RoPE's first tables with the frequencies behind them: 2 × (63 + 1) × 32 fit, and
    // 2 × (64 + 1) × 32 do not.
    RotaryEmbedding::new(&RopeConfig::new(64).with_max_position(63), &dev)?;
    match RotaryEmbedding::new(&RopeConfig::new(64).with_max_position(64), &dev) {
        Err(Error::InvalidConfig { name, .. }) => assert_eq!(name, "rotary_dim"),
        other => panic!("RoPE tables for 64 positions under a budget of 4096: {other:?}"),
    }
    match learned.interpolated(201) {
        Err(Error::InvalidConfig { name, .. }) => assert_eq!(name, "positions"),
        other => panic!("three 201 × 16 stretches under a budget of 4096: {other:?}"),
    }
    let got = learned.forward_with_positions(&token, &far, false)?;
    assert_eq!(
        common::max_abs_diff(&got, &want)?,
        0.0,
        "one row of the stretch equals the whole stretch's row"
    );
    Ok(())
}

/// The bound the README states: a call whose every checked size is at the budget of `E`
/// elements peaks under 8 × E × 4 bytes allocated beyond what was live before it (the largest
/// set of its stages' live intermediates, f32). Counted by the test binary's allocator in a
/// child process, each call at the largest sizes the budget admits: the block's weights
/// returned, its fused core, a training step with gradients, a RoPE table, a KV cache filled
/// to its storage limit.
#[test]
fn a_call_at_the_budget_peaks_under_its_bound() -> anyhow::Result<()> {
    if !crate::common::alone() {
        return crate::common::run_alone(concat!(
            module_path!(),
            "::a_call_at_the_budget_peaks_under_its_bound"
        ));
    }
    const E: usize = 1 << 21;
    set_max_elements(E);
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let rope = std::sync::Arc::new(RotaryEmbedding::new(&RopeConfig::new(64), &dev)?);
    // Query blocks of 32, so that the projections, not the logits, bound the fused call.
    let cfg = AttentionConfig::new(512, 8)
        .with_causal(true)
        .with_query_block(Some(32));
    let mha = MultiHeadAttention::new(&cfg, Some(rope), vb.pp("a"))?;
    // One small call of each kind first: the thread pool and its arenas are not the call's.
    let small = common::randn(0f32, 1.0, (1, 64, 512), &dev)?;
    let small_var = candle_core::Var::from_tensor(&small)?;
    for options in [
        AttentionOptions::default(),
        AttentionOptions {
            return_weights: true,
            ..Default::default()
        },
        AttentionOptions {
            train: true,
            ..Default::default()
        },
    ] {
        let y = mha.forward_with(small_var.as_tensor(), &options, None)?;
        y.output.sum_all()?.backward()?;
    }
    let mut peaks = Vec::new();
    // Weights returned: 8 heads × T × T logits at the budget.
    let t = ((E / 8) as f64).sqrt() as usize;
    let x = common::randn(0f32, 1.0, (1, t, 512), &dev)?;
    let weights = AttentionOptions {
        return_weights: true,
        ..Default::default()
    };
    peaks.push((
        "weights",
        crate::common::peak::peak_of(|| Ok(mha.forward_with(&x, &weights, None)?))?,
    ));
    // A relative bias (T5's buckets, as a dense row per query) with the weights returned.
    let t5 = std::sync::Arc::new(T5RelativeBias::new(&T5Config::new(8), vb.pp("t5"))?);
    let biased = MultiHeadAttention::new(&cfg, Some(t5), vb.pp("b"))?;
    biased.forward_with(&small, &weights, None)?;
    peaks.push((
        "t5 weights",
        crate::common::peak::peak_of(|| Ok(biased.forward_with(&x, &weights, None)?))?,
    ));
    // The fused core: the projections (T × 3 × 512) at the budget.
    let t = E / (3 * 512);
    let x = common::randn(0f32, 1.0, (1, t, 512), &dev)?;
    peaks.push((
        "fused",
        crate::common::peak::peak_of(|| Ok(mha.forward(&x)?))?,
    ));
    let xv = candle_core::Var::from_tensor(&x)?;
    let train = AttentionOptions {
        train: true,
        ..Default::default()
    };
    peaks.push((
        "training",
        crate::common::peak::peak_of(|| {
            let y = mha.forward_with(xv.as_tensor(), &train, None)?;
            Ok(y.output.sqr()?.sum_all()?.backward()?)
        })?,
    ));
    peaks.push((
        "rope table",
        crate::common::peak::peak_of(|| {
            // Two f32 tables and the f64 frequencies, 32 pairs per row.
            let rope = RotaryEmbedding::new(&RopeConfig::new(64), &dev)?;
            Ok(rope.cos_sin(&Positions::Offset(0), E / 64 - 1)?)
        })?,
    ));
    let token = common::randn(0f32, 1.0, (1, 1, 512), &dev)?;
    let chunk = common::randn(0f32, 1.0, (1, 128, 512), &dev)?;
    peaks.push((
        "kv cache",
        crate::common::peak::peak_of(|| {
            let mut cache = KvCache::new();
            let opts = AttentionOptions::default();
            while mha.forward_with(&chunk, &opts, Some(&mut cache)).is_ok() {}
            while mha.forward_with(&token, &opts, Some(&mut cache)).is_ok() {}
            Ok(())
        })?,
    ));
    let bound = 8 * E * 4;
    for (what, peak) in &peaks {
        println!("{what}: {:.2} × E × 4 bytes", *peak as f64 / (E * 4) as f64);
    }
    for (what, peak) in peaks {
        assert!(peak < bound, "{what}: {peak} bytes, bound {bound}");
        // Each call did hold about a budget's worth (the sizes are at the budget).
        assert!(peak > E * 4 / 2, "{what}: {peak} bytes, not at the budget");
    }
    Ok(())
}
