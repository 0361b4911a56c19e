//! The positional plan of every layer of a model, read from its `config.json`: what a user
//! checks before porting a model — each layer's encoding (RoPE θ, scaling, rotary width,
//! multimodal bands, or none), sliding window, chunks, causality, logit soft cap, sinks,
//! query/key norm and attention temperature.
//!
//! ```sh
//! # The configurations of the repository's HF fixtures (written by HF's config classes):
//! cargo run --example layer_plan
//! # Any model's config.json:
//! cargo run --example layer_plan -- path/to/config.json
//! ```

use anyhow::Context;
use candle_core::Device;
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::encoding::EncodingConfig;
use candle_posenc::hf::HfAttentionConfig;

/// One line per layer: the layer's plan.
fn plan(name: &str, json: &str) -> anyhow::Result<()> {
    let value: serde_json::Value = serde_json::from_str(json)?;
    let root = value.get("text_config").unwrap_or(&value);
    let layers = ["num_hidden_layers", "n_layer", "num_layers"]
        .iter()
        .find_map(|k| root.get(*k).and_then(serde_json::Value::as_u64))
        .unwrap_or(1) as usize;
    println!("{name} ({layers} layers)");
    for layer in 0..layers {
        let config = match HfAttentionConfig::from_json_layer(json, layer) {
            Ok(c) => c,
            Err(e) => {
                println!("  layer {layer:>2}: not loadable: {e}");
                continue;
            }
        };
        let a = &config.attention;
        let encoding = match &config.encoding {
            EncodingConfig::Rotary(r) => {
                let mut s = format!(
                    "RoPE θ={} {} rotary {}/{}",
                    r.base,
                    r.scaling.name(),
                    r.rotary_dim,
                    r.head_dim
                );
                if let Some(m) = r.mrope {
                    let layout = if m.interleaved {
                        "interleaved"
                    } else {
                        "bands"
                    };
                    s += &format!(" M-RoPE {:?} {layout}", m.sections);
                }
                if let Some(a) = r.axial {
                    s += &format!(" axial 2-D ({a:?})");
                }
                s
            }
            EncodingConfig::None => "NoPE".to_string(),
            other => other.kind().to_string(),
        };
        let mut extras = Vec::new();
        match (a.sliding_window, a.causal) {
            (Some(w), true) => extras.push(format!("window of the last {w}")),
            (Some(w), false) => extras.push(format!("window ±{w}")),
            _ => {}
        }
        if let Some(c) = a.attention_chunk {
            extras.push(format!("chunks of {c}"));
        }
        if !a.causal {
            extras.push("bidirectional".to_string());
        }
        if let Some(c) = a.logit_softcap {
            extras.push(format!("softcap {c}"));
        }
        if a.sinks {
            extras.push("sinks".to_string());
        }
        if let Some(n) = a.qk_norm {
            let scale = if n.learned_scale {
                ""
            } else {
                " without scale"
            };
            extras.push(format!("q/k norm {:?}{scale}", n.scope));
        }
        if a.k_eq_v {
            extras.push("values = keys".to_string());
        }
        if a.value_norm.is_some() {
            extras.push("value norm".to_string());
        }
        if let Some(l) = a.latent {
            extras.push(format!(
                "latent attention (q rank {:?}, kv rank {}, RoPE on {} of {}, values {})",
                l.q_lora_rank, l.kv_lora_rank, l.rope_dim, a.head_dim, l.v_head_dim
            ));
        }
        if let Some(t) = a.attention_temperature {
            extras.push(format!(
                "temperature 1 + {}·ln(1 + ⌊(p + 1)/{}⌋)",
                t.attn_scale, t.floor_scale
            ));
        }
        println!(
            "  layer {layer:>2}: {encoding}; {} heads / {} KV × {}, scale {:.4}{}{}",
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.softmax_scale,
            if extras.is_empty() { "" } else { "; " },
            extras.join(", ")
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(path) = args.first() {
        let json = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        return plan(path, &json);
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf_layers.safetensors"
    );
    let file = Checkpoint::load(path, &Device::Cpu)
        .context("the default configurations come from the repository's test fixtures")?;
    let mut names: Vec<&String> = file
        .metadata()
        .keys()
        // One entry per model: the fixture's layer tags and T5's decoder share a config.
        .filter(|k| {
            !k.contains(".prefix")
                && !k.contains(".layer")
                && !k.ends_with(".1")
                && !k.ends_with(".padded")
                && *k != "t5_decoder"
        })
        .collect();
    names.sort();
    for name in names {
        plan(name.trim_end_matches(".0"), &file.metadata()[name])?;
    }
    Ok(())
}
