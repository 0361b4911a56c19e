use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::*;
use std::sync::Arc;
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let enc: Option<Arc<dyn PositionalEncoding>> = match args[1].as_str() {
        "alibi" => Some(Arc::new(Alibi::new(&AlibiConfig::new(8), &dev)?)),
        "t5" => Some(Arc::new(T5RelativeBias::new(
            &T5Config::new(8),
            vb.pp("t5"),
        )?)),
        "shaw" => Some(Arc::new(ShawRelativePosition::new(
            &ShawConfig::new(64, 64),
            vb.pp("s"),
        )?)),
        _ => None,
    };
    let causal = args[2] == "causal";
    let block: Option<usize> = args.get(3).map(|s| s.parse()).transpose()?;
    let cfg = AttentionConfig::new(512, 8)
        .with_causal(causal)
        .with_query_block(block);
    let mha = MultiHeadAttention::new(&cfg, enc, vb.pp("attn"))?;
    let x = Tensor::randn(0f32, 1.0, (2, 1024, 512), &dev)?;
    let n: usize = std::env::var("N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let t = std::time::Instant::now();
    for _ in 0..n {
        let _ = candle_core::Module::forward(&mha, &x)?;
    }
    println!("{:.1} ms/iter", t.elapsed().as_secs_f64() * 1e3 / n as f64);
    Ok(())
}
