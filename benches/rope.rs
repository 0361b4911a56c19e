//! RoPE applied to q and k at B4 H16 T2048 D64 f32: the crate's fused path against the
//! ops-built rotate-half path (`x·cos + rotate_half(x)·sin`) measured in the same run, forward
//! and forward + backward; candle-nn's bare fused `rope` is shown for the wrapper's overhead.
//!
//! ```text
//! cargo bench --bench rope              # table of medians and ratios
//! cargo bench --bench rope -- --json    # one JSON object per line as well
//! cargo bench --bench rope -- --quick   # fewer, smaller runs (a smoke test)
//! ```
//!
//! Run it on a quiet machine: a build or test beside it skews the figures by 2x or more.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_posenc::{Positions, QkLayout, RopeConfig, RopeKernel, RotaryEmbedding};

/// What every row reads: q and k of (B, H, T, D), the two RoPE paths, and the command line.
struct Setup {
    dev: Device,
    q: Tensor,
    k: Tensor,
    pos: Positions,
    fused: RotaryEmbedding,
    ops: RotaryEmbedding,
    runs: usize,
    t: usize,
    json: bool,
}

impl Setup {
    /// One row: `name`'s median against `base`'s.
    fn report(&self, name: &str, ms: f64, base: f64) {
        let t = self.t;
        println!("{name:<34} {ms:>12.2} {:>13.2}x", ms / base);
        if self.json {
            println!(
                "{{\"bench\":\"rope\",\"path\":\"{name}\",\"t\":{t},\"median_ms\":{ms:.3},\"ratio_to_ops\":{:.4}}}",
                ms / base
            );
        }
    }

    /// The in-place rotation against candle-nn's rope in `dtype`, as a ratio line.
    fn against_candle(&self, dtype: &str, ratio: f64) {
        let label = if dtype == "f32" { "" } else { "bf16 " };
        println!("{label}in place vs candle-nn rope: {ratio:.2}x (target <= 0.40x)");
        if self.json {
            println!(
                "{{\"bench\":\"rope\",\"path\":\"in_place_vs_candle_rope\",\"dtype\":\"{dtype}\",\"ratio\":{ratio:.4}}}"
            );
        }
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let dev = common::device()?;
    let (b, h, d) = (4, 16, 64);
    let t = if quick { 256 } else { 2048 };
    let rope = |kernel| RotaryEmbedding::new(&RopeConfig::new(d).with_kernel(kernel), &dev);
    let setup = Setup {
        q: Tensor::randn(0f32, 1.0, (b, h, t, d), &dev)?,
        k: Tensor::randn(0f32, 1.0, (b, h, t, d), &dev)?,
        pos: Positions::Offset(0),
        fused: rope(RopeKernel::Fused)?,
        ops: rope(RopeKernel::Ops)?,
        runs: if quick { 3 } else { 11 },
        t,
        json: args.iter().any(|a| a == "--json"),
        dev,
    };
    println!(
        "RoPE on q and k, B{b} H{h} T{t} D{d} f32 on {:?}: median of {} runs",
        setup.dev, setup.runs
    );
    println!("{:<34} {:>12} {:>14}", "path", "median ms", "vs ops");
    forward(&setup)?;
    forward_bf16(&setup)?;
    backward(&setup)?;
    dynamic_steps(&setup)
}

/// The forward: the ops path, the fused one, candle-nn's bare rope and the in-place rotation.
fn forward(s: &Setup) -> Result<()> {
    let (q, k, pos, dev) = (&s.q, &s.k, &s.pos, &s.dev);
    let (cos, sin) = s.fused.cos_sin(pos, s.t)?;
    let forward = |r: &RotaryEmbedding| {
        common::median_ms(s.runs, || {
            let (qr, kr) = r.rotate_queries_keys(q, k, pos, pos, QkLayout::Bhtd)?;
            dev.synchronize()?;
            drop((qr, kr));
            Ok(())
        })
    };
    let ops_fwd = forward(&s.ops)?;
    let fused_fwd = forward(&s.fused)?;
    let bare = common::median_ms(s.runs, || {
        let qr = candle_nn::rotary_emb::rope(q, &cos, &sin)?;
        let kr = candle_nn::rotary_emb::rope(k, &cos, &sin)?;
        dev.synchronize()?;
        drop((qr, kr));
        Ok(())
    })?;
    // In place: the same q and k rotated again each run (the cost does not depend on values).
    let (q_own, k_own) = (q.copy()?, k.copy()?);
    let in_place = common::median_ms(s.runs, || {
        let (qr, kr) = s.fused.rotate_queries_keys_owned(
            q_own.clone(),
            k_own.clone(),
            pos,
            pos,
            QkLayout::Bhtd,
        )?;
        dev.synchronize()?;
        drop((qr, kr));
        Ok(())
    })?;
    s.report("forward, ops rotate-half", ops_fwd, ops_fwd);
    s.report("forward, fused (this crate)", fused_fwd, ops_fwd);
    s.report("forward, candle-nn rope (bare)", bare, ops_fwd);
    s.report("forward, in place (owned q, k)", in_place, ops_fwd);
    s.against_candle("f32", in_place / bare);
    Ok(())
}

/// bf16: candle-nn's rope on bf16 tables against the in-place rotation (f32 arithmetic).
fn forward_bf16(s: &Setup) -> Result<()> {
    let (pos, dev) = (&s.pos, &s.dev);
    let (cos, sin) = s.fused.cos_sin(pos, s.t)?;
    let (qb, kb) = (s.q.to_dtype(DType::BF16)?, s.k.to_dtype(DType::BF16)?);
    let (cb, sb) = (cos.to_dtype(DType::BF16)?, sin.to_dtype(DType::BF16)?);
    let bare_bf16 = common::median_ms(s.runs, || {
        let qr = candle_nn::rotary_emb::rope(&qb, &cb, &sb)?;
        let kr = candle_nn::rotary_emb::rope(&kb, &cb, &sb)?;
        dev.synchronize()?;
        drop((qr, kr));
        Ok(())
    })?;
    let in_place_bf16 = common::median_ms(s.runs, || {
        let (qr, kr) =
            s.fused
                .rotate_queries_keys_owned(qb.clone(), kb.clone(), pos, pos, QkLayout::Bhtd)?;
        dev.synchronize()?;
        drop((qr, kr));
        Ok(())
    })?;
    s.report("bf16 forward, candle-nn rope (bare)", bare_bf16, bare_bf16);
    s.report("bf16 forward, in place", in_place_bf16, bare_bf16);
    s.against_candle("bf16", in_place_bf16 / bare_bf16);
    Ok(())
}

/// Forward + backward of sum(w_q·q' + w_k·k'), the ops path against the fused one.
fn backward(s: &Setup) -> Result<()> {
    let (pos, dev) = (&s.pos, &s.dev);
    let wq = Tensor::randn(0f32, 1.0, s.q.shape(), dev)?;
    let wk = Tensor::randn(0f32, 1.0, s.k.shape(), dev)?;
    let (qv, kv) = (Var::from_tensor(&s.q)?, Var::from_tensor(&s.k)?);
    let backward = |r: &RotaryEmbedding| {
        common::median_ms(s.runs, || {
            let (qr, kr) =
                r.rotate_queries_keys(qv.as_tensor(), kv.as_tensor(), pos, pos, QkLayout::Bhtd)?;
            let loss = ((qr * &wq)?.sum_all()? + (kr * &wk)?.sum_all()?)?;
            let grads = loss.backward()?;
            dev.synchronize()?;
            anyhow::ensure!(grads.get(qv.as_tensor()).is_some(), "no gradient reached q");
            Ok(())
        })
    };
    let ops_bwd = backward(&s.ops)?;
    let fused_bwd = backward(&s.fused)?;
    s.report("forward+backward, ops rotate-half", ops_bwd, ops_bwd);
    s.report("forward+backward, fused", fused_bwd, ops_bwd);
    Ok(())
}

/// One decoding step of dynamic NTK past its original length (2048): the new token's q and k
/// at offset L build only their own row; the same positions given as ids read a table from
/// position 0, which past the original length is rebuilt for every new length (what every
/// step cost before). B1 H16 D64.
fn dynamic_steps(s: &Setup) -> Result<()> {
    let dev = &s.dev;
    let dynamic = RotaryEmbedding::new(
        &RopeConfig::new(s.q.dim(3)?).with_scaling(candle_posenc::RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 2048,
        }),
        dev,
    )?;
    let (q1, k1) = (
        s.q.narrow(0, 0, 1)?.narrow(2, 0, 1)?,
        s.k.narrow(0, 0, 1)?.narrow(2, 0, 1)?,
    );
    println!("dynamic NTK, one decoding step (B1 H16 T1 D64), past the original 2048 positions");
    println!(
        "{:<34} {:>12} {:>14}",
        "position", "median ms", "vs whole table"
    );
    for at in [4096usize, 16384] {
        let step = |positions: &dyn Fn(usize) -> Result<Positions>| {
            let mut next = at;
            common::median_ms(s.runs, || {
                // Each run a new length, as in decoding.
                let p = positions(next)?;
                next += 1;
                let (qr, kr) = dynamic.rotate_queries_keys(&q1, &k1, &p, &p, QkLayout::Bhtd)?;
                dev.synchronize()?;
                drop((qr, kr));
                Ok(())
            })
        };
        let rows = step(&|p| Ok(Positions::Offset(p)))?;
        let whole = step(&|p| Ok(Positions::ids(&Tensor::new(&[[p as u32]], dev)?)?))?;
        println!(
            "{:<34} {rows:>12.3} {:>13.3}x",
            format!("L = {at}, own row"),
            rows / whole
        );
        println!(
            "{:<34} {whole:>12.3} {:>13.3}x",
            format!("L = {at}, whole table"),
            1.0
        );
        if s.json {
            println!(
                "{{\"bench\":\"rope\",\"path\":\"dynamic_step\",\"position\":{at},\"own_row_ms\":{rows:.4},\"whole_table_ms\":{whole:.4}}}"
            );
        }
    }
    Ok(())
}
