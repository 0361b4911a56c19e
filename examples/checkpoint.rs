//! Saving and loading a self-describing checkpoint: the tensors of an attention block and its
//! encoding, with both configurations in the file's metadata, so the block is rebuilt from the
//! file alone.
//!
//! ```sh
//! cargo run --release --example checkpoint            # writes and reads a file in the temp folder
//! ```

use anyhow::ensure;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::attention::{AttentionConfig, AttentionOptions, MultiHeadAttention};
use candle_posenc::checkpoint::{save_varmap, Checkpoint};
use candle_posenc::encoding::EncodingConfig;
use candle_posenc::relative::t5::T5Config;

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    // A block with a learned T5 bias, its weights in a VarMap (as after training).
    let attention = AttentionConfig::new(64, 4).with_causal(true);
    let encoding = EncodingConfig::T5(T5Config::new(4).with_bidirectional(false));
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let block = MultiHeadAttention::new(
        &attention,
        encoding.build(vb.pp("t5"))?,
        vb.pp("layers.0.attn"),
    )?;

    // Both configurations travel as metadata (`posenc.encoding`, `posenc.attention`: JSON).
    let mut metadata = encoding.to_metadata();
    metadata.extend(attention.to_metadata());
    let path =
        std::env::temp_dir().join(format!("posenc-example-{}.safetensors", std::process::id()));
    save_varmap(&path, &varmap, &metadata)?;
    println!(
        "saved {} tensors and metadata {:?} to {}",
        varmap.all_vars().len(),
        metadata.keys().collect::<Vec<_>>(),
        path.display()
    );

    // Rebuilt from the file alone: no configuration in code.
    let file = Checkpoint::load(&path, &dev)?;
    let encoding = EncodingConfig::from_metadata(file.metadata(), file.source())?;
    let attention = AttentionConfig::from_metadata(file.metadata(), file.source())?;
    let vb = file.var_builder(DType::F32, &dev);
    let loaded = MultiHeadAttention::new(
        &attention,
        encoding.build(vb.pp("t5"))?,
        vb.pp("layers.0.attn"),
    )?;
    println!("loaded a {} block: {attention:?}", encoding.kind());

    let x = Tensor::randn(0f32, 1.0, (2, 9, 64), &dev)?;
    let opts = AttentionOptions::default();
    let before = block.forward_with(&x, &opts, None)?.output;
    let after = loaded.forward_with(&x, &opts, None)?.output;
    let diff = (before - after)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("outputs before saving and after loading: max |diff| = {diff:e}");
    std::fs::remove_file(&path)?;
    ensure!(diff < 1e-5, "the loaded block differs ({diff:e})");
    Ok(())
}
