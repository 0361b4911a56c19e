//! The fused CUDA attention kernel (`src/attention/cuda`, the `cuda` feature) against the same
//! block computed on the CPU in f64 from the same bf16/f16 (or f32) weights and input: every zoo
//! encoding, causal and bidirectional, lengths that are not a multiple of the kernel's tile,
//! padding (a sequence padded whole included), grouped KV heads, ids, decoding with a cache,
//! windows, soft caps and sinks, every specialised head dimension.
//!
//! Each test turns the kernel on for its own thread (`FusedKernelScope`), and counts the
//! launches of its own thread's calls. Without the `cuda` feature it holds no test.
#![cfg(feature = "cuda")]

use crate::common;

use candle_core::{DType, Device, Module, Tensor};
use candle_posenc::cuda::{kernel_launches, FusedKernelScope};
use candle_posenc::{
    AttentionConfig, AttentionOptions, EncodingConfig, KvCache, LatentConfig, Positions, QkLayout,
    RotaryEmbedding, ShawConfig,
};

/// The device's output against the f64 CPU block's: within 1e-2 of the largest output (q, k,
/// v and the weights `P` are rounded to the operand type, about 2^-8 relative, as in
/// PyTorch's flash kernels).
fn close(got: &Tensor, want: &Tensor, what: &str) -> anyhow::Result<()> {
    close_within(got, want, 1e-2, what)
}

/// `got` finite and within `tol` of the largest of `want` (absolute and relative).
fn close_within(got: &Tensor, want: &Tensor, tol: f64, what: &str) -> anyhow::Result<()> {
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let finite = got
        .flatten_all()?
        .to_vec1::<f64>()?
        .iter()
        .all(|x| x.is_finite());
    assert!(finite, "{what}: a non-finite result");
    common::assert_close_scaled(&got, want, tol, tol, what)
}

struct Case<'a> {
    config: &'a EncodingConfig,
    attn: AttentionConfig,
    dtype: DType,
    batch: usize,
    len: usize,
    /// Leading padded keys of the second sequence (all of them: a row masked whole).
    padded: Option<usize>,
    ids: bool,
}

/// One case at a time on the GPU.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Scales the projections into queries and keys of `varmap` (and Inkling's states, which each
/// query mixes into its relative logits) by 0.1 (then rounds them to bf16, exact in every
/// operand type): logits of order one, as a trained model's. (Inkling's untamed, the CPU's bf16
/// block was 0.95% of the largest output off f64, against 0.2–0.55% tamed.) The zoo's noise (0.5 on
/// every weight) gives logits of ±60, rows nearly one-hot, whose weights move by whole percents
/// when q and k are rounded to bf16 on any correct path: candle's CPU block in bf16 was 7.5% of
/// the largest output from f64 there, and 0.5% after this (f16 0.06%, f32 1e-6).
fn tame_logits(varmap: &candle_nn::VarMap) -> anyhow::Result<()> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("a VarMap's lock was poisoned"))?;
    for (name, var) in data.iter() {
        // Every projection into queries or keys: q_proj and k_proj, and a latent block's
        // q_a/q_b and kv_a/kv_b (kv_b's values scale with its keys, which no tolerance minds).
        let into_qk = name.contains("attn.") && name.ends_with(".weight") && name.contains("proj");
        // Inkling's states, which each query mixes into its relative logits.
        let into_rows = name.contains("enc.") && name.contains("r_proj");
        if (into_qk && !name.contains("v_proj") && !name.contains("o_proj")) || into_rows {
            let t = (var.as_tensor() * 0.1)?.to_dtype(DType::BF16)?;
            var.set(&t.to_dtype(var.dtype())?)?;
        }
    }
    Ok(())
}

/// Runs `case` on GPU 0 with the kernel on and on the CPU in f64; returns the kernel's
/// launches.
fn run(case: &Case) -> anyhow::Result<u64> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let d_model = case.attn.d_model;
    let (_, varmap) = common::zoo::attention(case.config, &case.attn, case.dtype, &cpu)?;
    tame_logits(&varmap)?;
    let on_gpu = common::zoo::attention_from(case.config, &case.attn, &varmap, case.dtype, &gpu)?;
    let on_cpu = common::zoo::attention_from(case.config, &case.attn, &varmap, DType::F64, &cpu)?;
    let x =
        common::randn(0f32, 1.0, (case.batch, case.len, d_model), &cpu)?.to_dtype(case.dtype)?;
    let pad = case
        .padded
        .map(|n| -> anyhow::Result<Tensor> {
            let mut rows = vec![1u8; case.batch * case.len];
            rows[(case.batch - 1) * case.len..][..n.min(case.len)].fill(0);
            Ok(Tensor::from_vec(rows, (case.batch, case.len), &cpu)?)
        })
        .transpose()?;
    let ids: Vec<u32> = (0..case.len as u32).map(|i| 3 * i + 1).collect();
    let ids = Tensor::from_vec(ids, (1, case.len), &cpu)?;
    let (p_cpu, p_gpu) = (
        Positions::ids(&ids)?,
        Positions::ids(&ids.to_device(&gpu)?)?,
    );
    let pad_gpu = pad.as_ref().map(|p| p.to_device(&gpu)).transpose()?;
    let before = kernel_launches();
    let got = on_gpu.forward_with(
        &x.to_device(&gpu)?,
        &AttentionOptions {
            positions: case.ids.then_some(&p_gpu),
            padding_mask: pad_gpu.as_ref(),
            ..Default::default()
        },
        None,
    )?;
    let launches = kernel_launches() - before;
    let want = on_cpu.forward_with(
        &x.to_dtype(DType::F64)?,
        &AttentionOptions {
            positions: case.ids.then_some(&p_cpu),
            padding_mask: pad.as_ref(),
            ..Default::default()
        },
        None,
    )?;
    let what = format!(
        "{} {:?} B{} T{} padded {:?} ids {}",
        case.config.kind(),
        case.dtype,
        case.batch,
        case.len,
        case.padded,
        case.ids
    );
    match case.dtype {
        // f32 operands: each product as three TF32 ones, about f32's own rounding.
        DType::F32 => close_within(&got.output, &want.output, 1e-5, &what)?,
        _ => close(&got.output, &want.output, &what)?,
    }
    Ok(launches)
}

/// Every zoo encoding and Shaw's keys alone, causal and not, bf16 and f16, T = 100 (one full
/// and one partial tile), with and without padding; every one takes the kernel (Shaw's value
/// term too: with offsets its columns are a shift).
fn every_encoding_equals_f64() -> anyhow::Result<()> {
    let (d_model, heads) = (256, 4);
    let mut configs = common::zoo::configs(d_model, heads, 64);
    configs.push(EncodingConfig::Shaw(
        ShawConfig::new(64, 16).with_values(false),
    ));
    for config in configs {
        for causal in [true, false] {
            for dtype in [DType::BF16, DType::F16] {
                for padded in [None, Some(7)] {
                    let attn = AttentionConfig::new(d_model, heads)
                        .with_kv_heads(2)
                        .with_causal(causal);
                    let case = Case {
                        config: &config,
                        attn,
                        dtype,
                        batch: 2,
                        len: 100,
                        padded,
                        ids: false,
                    };
                    let launches = run(&case)?;
                    assert!(launches > 0, "{} took candle's ops", config.kind());
                }
            }
        }
    }
    Ok(())
}

/// f32 blocks take the f32 kernel at its head dimensions (32 and 64), each product as three
/// TF32 ones: within 1e-5 of the largest output of the f64 block (the bound for f32),
/// for every zoo encoding, causal and not, padded (a row masked whole included), grouped
/// heads; windows, soft caps, sinks and ids. Head dimension 128 takes candle's ops.
fn f32_equals_f64() -> anyhow::Result<()> {
    for head_dim in [32, 64] {
        let (heads, d_model) = (4, 4 * head_dim);
        for config in common::zoo::configs(d_model, heads, head_dim) {
            for causal in [true, false] {
                for padded in [None, Some(7), Some(100)] {
                    let case = Case {
                        config: &config,
                        attn: AttentionConfig::new(d_model, heads)
                            .with_kv_heads(2)
                            .with_causal(causal),
                        dtype: DType::F32,
                        batch: 2,
                        len: 100,
                        padded,
                        ids: false,
                    };
                    let launches = run(&case)?;
                    assert!(
                        launches > 0,
                        "{} d{head_dim} took candle's ops",
                        config.kind()
                    );
                }
            }
        }
    }
    let (d_model, heads) = (256, 4);
    let configs = common::zoo::configs(d_model, heads, 64);
    let shapes = [
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_sliding_window(Some(16))
            .with_sinks(true),
        AttentionConfig::new(d_model, heads)
            .with_sliding_window(Some(40))
            .with_logit_softcap(Some(5.0)),
    ];
    for attn in shapes {
        for config in [&configs[0], &configs[3], &configs[11]] {
            let case = Case {
                config,
                attn: attn.clone(),
                dtype: DType::F32,
                batch: 2,
                len: 150,
                padded: Some(5),
                ids: true,
            };
            assert!(run(&case)? > 0, "{} {attn:?}", config.kind());
        }
    }
    // No f32 specialisation at head dimension 128: candle's ops, as exact.
    let none = EncodingConfig::None;
    let wide = Case {
        config: &none,
        attn: AttentionConfig::new(256, 2).with_causal(true),
        dtype: DType::F32,
        batch: 2,
        len: 70,
        padded: None,
        ids: false,
    };
    assert_eq!(run(&wide)?, 0, "f32 at head dimension 128 took a kernel");
    Ok(())
}

/// f32 training takes the kernels too (the backward's products as three TF32 ones): every
/// variable's gradient (the input's, the projections', the learned terms' and Shaw's tables)
/// within 1e-5 of the largest of the f64 block's (ALiBi's slopes: see [`conditioning`]).
fn f32_training_equals_f64() -> anyhow::Result<()> {
    learned_term_gradients(DType::F32, 1e-5)
}

/// A sequence whose every key is padded comes out finite (uniform over its keys, as on the
/// other paths), bidirectional and causal.
fn rows_masked_whole() -> anyhow::Result<()> {
    let configs = common::zoo::configs(128, 2, 64);
    for causal in [false, true] {
        let case = Case {
            config: &configs[0],
            attn: AttentionConfig::new(128, 2).with_causal(causal),
            dtype: DType::BF16,
            batch: 2,
            len: 70,
            padded: Some(70),
            ids: false,
        };
        assert!(run(&case)? > 0);
    }
    Ok(())
}

/// Positions as ids, every grouping of KV heads, and every specialised head dimension (Shaw's
/// value term through ids is an index map, which takes candle's ops).
fn ids_groups_and_head_dims() -> anyhow::Result<()> {
    for head_dim in [32, 64, 96, 128] {
        for kv_heads in [1, 2, 4] {
            let (heads, d_model) = (4, 4 * head_dim);
            let configs = common::zoo::configs(d_model, heads, head_dim);
            for config in [&configs[3], &configs[7], &configs[11], &configs[13]] {
                let case = Case {
                    config,
                    attn: AttentionConfig::new(d_model, heads)
                        .with_kv_heads(kv_heads)
                        .with_causal(true),
                    dtype: DType::BF16,
                    batch: 1,
                    len: 65,
                    padded: None,
                    ids: true,
                };
                let fused = !matches!(config, EncodingConfig::Shaw(c) if c.values);
                assert_eq!(run(&case)? > 0, fused, "{} d{head_dim}", config.kind());
            }
        }
    }
    Ok(())
}

/// Sliding windows (causal and not), soft caps, sinks and chunked attention (chunks counted from
/// each sequence's first kept key: with padding they differ between the sequences).
fn windows_softcaps_and_sinks() -> anyhow::Result<()> {
    let (d_model, heads) = (256, 4);
    let configs = common::zoo::configs(d_model, heads, 64);
    let shapes = [
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_sliding_window(Some(16)),
        AttentionConfig::new(d_model, heads).with_sliding_window(Some(40)),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_logit_softcap(Some(5.0)),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_sinks(true),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_attention_chunk(Some(48)),
    ];
    for attn in shapes {
        for config in [&configs[0], &configs[3], &configs[8], &configs[11]] {
            for padded in [None, Some(5)] {
                let case = Case {
                    config,
                    attn: attn.clone(),
                    dtype: DType::BF16,
                    batch: 2,
                    len: 150,
                    padded,
                    ids: false,
                };
                assert!(run(&case)? > 0, "{} {attn:?}", config.kind());
            }
        }
    }
    Ok(())
}

/// Decoding: a prefill of 70 or 600 tokens then three single tokens through a KV cache
/// (queries not at the keys' start, Tq ≠ Tk; at 600 the keys are split across thread blocks
/// and merged by the combining kernel) equals the f64 block's whole forward, plain, with sinks
/// and with a sliding window.
fn decoding_equals_the_whole_forward() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let (d_model, heads) = (256, 4);
    let causal = AttentionConfig::new(d_model, heads)
        .with_kv_heads(2)
        .with_causal(true);
    let shapes = [
        causal.clone(),
        causal.clone().with_sinks(true),
        causal.with_sliding_window(Some(100)),
    ];
    for attn in &shapes {
        for config in common::zoo::configs(d_model, heads, 64) {
            for prefill in [70, 600] {
                let (_, varmap) = common::zoo::attention(&config, attn, DType::BF16, &cpu)?;
                tame_logits(&varmap)?;
                let on_gpu =
                    common::zoo::attention_from(&config, attn, &varmap, DType::BF16, &gpu)?;
                let on_cpu = common::zoo::attention_from(&config, attn, &varmap, DType::F64, &cpu)?;
                let len = prefill + 3;
                let x = common::randn(0f32, 1.0, (1, len, d_model), &cpu)?.to_dtype(DType::BF16)?;
                let want = on_cpu.forward(&x.to_dtype(DType::F64)?)?;
                let xg = x.to_device(&gpu)?;
                let mut cache = KvCache::new();
                let opts = AttentionOptions::default();
                let mut outs = vec![
                    on_gpu
                        .forward_with(&xg.narrow(1, 0, prefill)?, &opts, Some(&mut cache))?
                        .output,
                ];
                let before = kernel_launches();
                for t in prefill..len {
                    outs.push(
                        on_gpu
                            .forward_with(&xg.narrow(1, t, 1)?, &opts, Some(&mut cache))?
                            .output,
                    );
                }
                assert!(
                    kernel_launches() > before,
                    "{} took candle's ops",
                    config.kind()
                );
                let got = Tensor::cat(&outs, 1)?;
                let what = format!("decoding {} after {prefill}, {attn:?}", config.kind());
                close(&got, &want, &what)?;
            }
        }
    }
    Ok(())
}

/// The rotation in place on CUDA (`rope_in_place.cu`) equals the CPU's for every pair layout,
/// axis order, partial rotary, xPos, per-sequence ids and dtype, within the type's rounding
/// (the GPU may fuse a product and a sum), leaving the pass-through features alone.
fn rotation_in_place_equals_the_cpu() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let ids = Tensor::new(&[[3u32, 0, 9, 1, 4], [7, 7, 2, 100, 5]], &cpu)?;
    let (ids_cpu, ids_gpu) = (
        Positions::ids(&ids)?,
        Positions::ids(&ids.to_device(&gpu)?)?,
    );
    let configs = common::zoo::rope_variants();
    for cfg in configs {
        let (on_cpu, on_gpu) = (
            RotaryEmbedding::new(&cfg, &cpu)?,
            RotaryEmbedding::new(&cfg, &gpu)?,
        );
        for layout in [QkLayout::Bhtd, QkLayout::Bthd] {
            let shape = match layout {
                QkLayout::Bhtd => (2, 3, 5, 16),
                QkLayout::Bthd => (2, 5, 3, 16),
            };
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let offsets = (Positions::Offset(4), Positions::Offset(0));
                for (cpu_pos, gpu_pos) in [
                    (&offsets, &offsets),
                    (
                        &(ids_cpu.clone(), ids_cpu.clone()),
                        &(ids_gpu.clone(), ids_gpu.clone()),
                    ),
                ] {
                    let q = common::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dtype)?;
                    let k = common::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dtype)?;
                    let (qc, kc) = on_cpu.rotate_queries_keys_owned(
                        q.copy()?,
                        k.copy()?,
                        &cpu_pos.0,
                        &cpu_pos.1,
                        layout,
                    )?;
                    let before = kernel_launches();
                    let (qg, kg) = on_gpu.rotate_queries_keys_owned(
                        q.to_device(&gpu)?,
                        k.to_device(&gpu)?,
                        &gpu_pos.0,
                        &gpu_pos.1,
                        layout,
                    )?;
                    assert!(kernel_launches() > before, "the rotation ran in place");
                    let what = format!("{cfg:?} {layout:?} {dtype:?}");
                    assert_eq!(qg.dtype(), dtype, "{what}");
                    // Relative to the largest value: each side's tables are its own device's
                    // cos, sin and powers (a few f32 roundings apart), and xPos scales keys
                    // by up to ~50 at these positions (1e-6 absolute failed on an H100 at
                    // 7.6e-6, one rounding of such a key).
                    let tol = match dtype {
                        DType::F32 | DType::F64 => 1e-6,
                        _ => 1e-2,
                    };
                    let (qg, kg) = (qg.to_device(&cpu)?, kg.to_device(&cpu)?);
                    common::assert_close_scaled(&qg, &qc, tol, tol, &what)?;
                    common::assert_close_scaled(&kg, &kc, tol, tol, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// The gradient of a rotation on CUDA equals the CPU's: by the in-place kernel by −θ for f32
/// tables (a launch is counted), through candle's kernels for f64 and bf16; both pair
/// layouts, both axis orders, partial rotary, offsets and per-sequence ids.
fn rotation_gradient_equals_the_cpu() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let ids = Tensor::new(&[[3u32, 0, 9, 1, 4], [7, 7, 2, 100, 5]], &cpu)?;
    let positions = |dev: &Device, by_ids: bool| -> anyhow::Result<Positions> {
        Ok(match by_ids {
            true => Positions::ids(&ids.to_device(dev)?)?,
            false => Positions::Offset(3),
        })
    };
    for cfg in common::zoo::rope_variants().into_iter().take(4) {
        for layout in [QkLayout::Bhtd, QkLayout::Bthd] {
            let shape = match layout {
                QkLayout::Bhtd => (2, 3, 5, 16),
                QkLayout::Bthd => (2, 5, 3, 16),
            };
            for dtype in [DType::F32, DType::F64, DType::BF16] {
                for by_ids in [false, true] {
                    let x = common::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dtype)?;
                    let probe = common::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dtype)?;
                    let grad_on = |dev: &Device| -> anyhow::Result<Tensor> {
                        let rope = RotaryEmbedding::new(&cfg, dev)?;
                        let var = candle_core::Var::from_tensor(&x.to_device(dev)?)?;
                        let at = positions(dev, by_ids)?;
                        let y = rope.rotate_queries(var.as_tensor(), &at, layout)?;
                        let loss = (y * probe.to_device(dev)?)?.sum_all()?;
                        let grads = loss.backward()?;
                        let g = grads.get(var.as_tensor()).expect("a gradient");
                        Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)
                    };
                    let before = kernel_launches();
                    let got = grad_on(&gpu)?;
                    if dtype == DType::F32 {
                        assert!(kernel_launches() > before, "the backward ran in place");
                    }
                    let what = format!("{cfg:?} {layout:?} {dtype:?} ids {by_ids}");
                    let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-6 };
                    common::assert_close(&got, &grad_on(&cpu)?, tol, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// A latent (MLA) block, whose values are narrower than its queries and keys, takes the kernel
/// (its values padded to the head width) and equals the f64 block. (It was expected to take
/// candle's ops; on an H200 it launched the kernel and matched.)
fn latent_blocks_take_the_kernel() -> anyhow::Result<()> {
    let configs = common::zoo::configs(256, 4, 64);
    let plain = AttentionConfig::new(256, 4).with_causal(true);
    let latent = plain
        .clone()
        .with_head_dim(64)
        .with_latent(Some(LatentConfig::new(Some(96), 64, 16, 32)));
    let case = |attn| Case {
        config: &configs[0],
        attn,
        dtype: DType::BF16,
        batch: 2,
        len: 70,
        padded: None,
        ids: false,
    };
    assert!(run(&case(plain))? > 0, "a plain block takes the kernel");
    // The latent block pads its narrower value heads with zeros to the head width, so the
    // kernel takes it as it is; `run` compares the output with the f64 CPU block's.
    assert!(run(&case(latent))? > 0, "MLA's block takes the kernel");
    Ok(())
}

/// Shaw with values on the kernel at every head dimension, causal and not, with rows masked
/// whole: tables of 3 columns (2 when causal halves them: no interior column), 9, and more
/// than the keys (every tile in the band).
fn shaw_value_terms() -> anyhow::Result<()> {
    for head_dim in [32, 64, 96, 128] {
        let (heads, d_model) = (2, 2 * head_dim);
        for k in [1, 4, 200] {
            let config = EncodingConfig::Shaw(ShawConfig::new(head_dim, k).with_values(true));
            for causal in [true, false] {
                for padded in [None, Some(130)] {
                    let case = Case {
                        config: &config,
                        attn: AttentionConfig::new(d_model, heads).with_causal(causal),
                        dtype: DType::BF16,
                        batch: 2,
                        len: 130,
                        padded,
                        ids: false,
                    };
                    let what = format!("d{head_dim} k {k} causal {causal} padded {padded:?}");
                    assert!(run(&case)? > 0, "{what} took candle's ops");
                }
            }
        }
    }
    Ok(())
}

/// Training through the kernels' backward: the gradient of `Σ probe · out` with respect to
/// the input, through the projections and the backward kernel's dq, dk and dv, equals the f64
/// CPU block's, for no encoding, RoPE, ALiBi, T5 and Shaw's keys and values, causal and not,
/// grouped heads, padding, a soft cap, sinks, a window, chunks, every head dimension; the
/// forward and the backward must both have taken the kernels.
fn training_equals_f64() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    for head_dim in [32, 64, 96, 128] {
        let (heads, d_model) = (4, 4 * head_dim);
        let configs = common::zoo::configs(d_model, heads, head_dim);
        let shaw = EncodingConfig::Shaw(ShawConfig::new(head_dim, 4).with_values(true));
        let shapes = [
            AttentionConfig::new(d_model, heads).with_kv_heads(2),
            AttentionConfig::new(d_model, heads).with_causal(true),
            AttentionConfig::new(d_model, heads)
                .with_causal(true)
                .with_logit_softcap(Some(5.0))
                .with_sinks(true),
            AttentionConfig::new(d_model, heads).with_sliding_window(Some(20)),
            AttentionConfig::new(d_model, heads)
                .with_causal(true)
                .with_attention_chunk(Some(32)),
        ];
        for attn in shapes {
            for config in [&configs[0], &configs[3], &configs[7], &configs[11], &shaw] {
                for padded in [None, Some(9)] {
                    let (_, varmap) = common::zoo::attention(config, &attn, DType::BF16, &cpu)?;
                    tame_logits(&varmap)?;
                    let (len, batch) = (100, 2);
                    let x = common::randn(0f32, 1.0, (batch, len, d_model), &cpu)?
                        .to_dtype(DType::BF16)?;
                    let probe = common::randn(0f32, 1.0, (batch, len, d_model), &cpu)?;
                    let mut pad = vec![1u8; batch * len];
                    if let Some(n) = padded {
                        pad[len..len + n].fill(0);
                    }
                    let pad = Tensor::from_vec(pad, (batch, len), &cpu)?;
                    let grad_on = |dev: &Device, dtype: DType| -> anyhow::Result<Tensor> {
                        let mha = common::zoo::attention_from(config, &attn, &varmap, dtype, dev)?;
                        let var =
                            candle_core::Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
                        let pad = pad.to_device(dev)?;
                        let opts = AttentionOptions {
                            padding_mask: padded.is_some().then_some(&pad),
                            train: true,
                            ..Default::default()
                        };
                        let out = mha.forward_with(var.as_tensor(), &opts, None)?.output;
                        let probe = probe.to_dtype(dtype)?.to_device(dev)?;
                        let loss =
                            (out.to_dtype(DType::F32)? * probe.to_dtype(DType::F32)?)?.sum_all()?;
                        let grads = loss.backward()?;
                        let g = grads.get(var.as_tensor()).expect("a gradient");
                        Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)
                    };
                    let before = kernel_launches();
                    let got = grad_on(&gpu, DType::BF16)?;
                    let launches = kernel_launches() - before;
                    let what = format!("{} d{head_dim} {attn:?} padded {padded:?}", config.kind());
                    // One forward and one backward launch per query block (RoPE's rotations
                    // in place count too, so its blocks are not counted here).
                    if !matches!(config, EncodingConfig::Rotary(_)) {
                        assert!(launches >= 2, "{what}: {launches} launches");
                    }
                    // P and dS are rounded to bf16 for their products (about 2^-8 each).
                    close_within(&got, &grad_on(&cpu, DType::F64)?, 3e-2, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// A user's mask that takes a gradient trains through the kernels (a dense term whose
/// gradient the backward sums), and its gradient equals the f64 CPU block's.
fn training_with_a_learned_mask() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let (d_model, heads, len) = (128, 2, 40);
    let attn = AttentionConfig::new(d_model, heads);
    let config = EncodingConfig::None;
    let (_, varmap) = common::zoo::attention(&config, &attn, DType::BF16, &cpu)?;
    tame_logits(&varmap)?;
    let x = common::randn(0f32, 1.0, (1, len, d_model), &cpu)?.to_dtype(DType::BF16)?;
    let mask = common::randn(0f32, 1.0, (1, 1, len, len), &cpu)?;
    let grads_on = |dev: &Device, dtype: DType| -> anyhow::Result<(Tensor, u64)> {
        let mha = common::zoo::attention_from(&config, &attn, &varmap, dtype, dev)?;
        let m = candle_core::Var::from_tensor(&mask.to_dtype(dtype)?.to_device(dev)?)?;
        let before = kernel_launches();
        let opts = AttentionOptions {
            attn_mask: Some(m.as_tensor()),
            train: true,
            ..Default::default()
        };
        let out = mha
            .forward_with(&x.to_dtype(dtype)?.to_device(dev)?, &opts, None)?
            .output;
        let grads = out.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(m.as_tensor()).expect("the mask's gradient");
        Ok((
            g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?,
            kernel_launches() - before,
        ))
    };
    let (got, launches) = grads_on(&gpu, DType::BF16)?;
    assert!(
        launches >= 2,
        "a learned mask did not take the kernels: {launches} launches"
    );
    let (want, _) = grads_on(&cpu, DType::F64)?;
    close_within(&got, &want, 3e-2, "the mask's gradient")
}

/// Training an encoding's own parameters through the kernels: T5's tables, the clipped bias's,
/// learnable ALiBi slopes (causal and symmetric) and Shaw's relative keys, alone and with its
/// relative values (aⱽ's table through the gathered weights), causal or not, with
/// grouped heads, a soft cap, and padding that masks a row whole. Every variable's gradient
/// (the encoding's and the projections') equals the f64 CPU block's from the same values, and
/// the forward and backward kernels ran.
fn training_gives_learned_terms_their_gradients() -> anyhow::Result<()> {
    // P and dS are rounded to bf16 for their products (about 2^-8 each).
    learned_term_gradients(DType::BF16, 3e-2)
}

/// [`training_gives_learned_terms_their_gradients`] for a block in `dtype`, every gradient
/// within `tol` of the largest of the f64 block's.
fn learned_term_gradients(dtype: DType, tol: f64) -> anyhow::Result<()> {
    use candle_nn::VarMap;
    use candle_posenc::{AlibiConfig, AlibiMode, ClippedBiasConfig, MultiHeadAttention, T5Config};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let (heads, head_dim) = (4, 64);
    let d_model = heads * head_dim;
    let configs = [
        EncodingConfig::T5(T5Config::new(heads)),
        EncodingConfig::T5(T5Config::new(heads).with_bidirectional(false)),
        EncodingConfig::ClippedBias(ClippedBiasConfig::new(heads, 8)),
        EncodingConfig::Alibi(AlibiConfig::new(heads).with_learnable(true)),
        EncodingConfig::Alibi(
            AlibiConfig::new(heads)
                .with_learnable(true)
                .with_mode(AlibiMode::Symmetric),
        ),
        EncodingConfig::Shaw(ShawConfig::new(head_dim, 6).with_values(false)),
        EncodingConfig::Shaw(ShawConfig::new(head_dim, 6).with_values(true)),
    ];
    let shapes = [
        AttentionConfig::new(d_model, heads).with_kv_heads(2),
        AttentionConfig::new(d_model, heads).with_causal(true),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_logit_softcap(Some(4.0)),
    ];
    let (batch, len) = (2, 90);
    let x = common::randn(0f32, 1.0, (batch, len, d_model), &cpu)?.to_dtype(DType::BF16)?;
    let probe = common::randn(0f32, 1.0, (batch, len, d_model), &cpu)?;
    let mut keep = vec![1u8; batch * len];
    keep[len..len + 11].fill(0);
    let pad = Tensor::from_vec(keep, (batch, len), &cpu)?;
    for config in &configs {
        for attn in &shapes {
            for padded in [false, true] {
                // The variables drawn once on the CPU, then copied to each side's own VarMap.
                let start = VarMap::new();
                let vb = common::seeded_vb(&start, DType::F32, &cpu);
                MultiHeadAttention::new(attn, config.build(vb.pp("enc"))?, vb.pp("attn"))?;
                for var in common::sorted_vars(&start) {
                    let noise = common::randn(0f32, 0.3, var.shape(), &cpu)?;
                    var.set(
                        &(var.as_tensor() + noise)?
                            .to_dtype(DType::BF16)?
                            .to_dtype(DType::F32)?,
                    )?;
                }
                tame_logits(&start)?;
                let values = common::zoo::named_tensors(&start)?;
                let grads_on = |dev: &Device, dtype: DType| -> anyhow::Result<Vec<Tensor>> {
                    let varmap = VarMap::new();
                    let mut vars = Vec::new();
                    {
                        let mut data = varmap
                            .data()
                            .lock()
                            .map_err(|_| anyhow::anyhow!("varmap lock"))?;
                        for (name, t) in &values {
                            let var =
                                candle_core::Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?)?;
                            vars.push(var.as_tensor().clone());
                            data.insert(name.clone(), var);
                        }
                    }
                    let vb = common::seeded_vb(&varmap, dtype, dev);
                    let mha =
                        MultiHeadAttention::new(attn, config.build(vb.pp("enc"))?, vb.pp("attn"))?;
                    let pad = pad.to_device(dev)?;
                    let opts = AttentionOptions {
                        padding_mask: padded.then_some(&pad),
                        train: true,
                        ..Default::default()
                    };
                    let out = mha
                        .forward_with(&x.to_dtype(dtype)?.to_device(dev)?, &opts, None)?
                        .output;
                    let probe = probe.to_dtype(dtype)?.to_device(dev)?;
                    let loss =
                        (out.to_dtype(DType::F32)? * probe.to_dtype(DType::F32)?)?.sum_all()?;
                    let grads = loss.backward()?;
                    vars.iter()
                        .zip(&values)
                        .map(|(v, (name, _))| {
                            let g = grads
                                .get(v)
                                .ok_or_else(|| anyhow::anyhow!("{name} gets no gradient"))?;
                            Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)
                        })
                        .collect()
                };
                let what = format!("{} {attn:?} padded {padded}", config.kind());
                let before = kernel_launches();
                let got = grads_on(&gpu, dtype).map_err(|e| e.context(what.clone()))?;
                let launches = kernel_launches() - before;
                assert!(launches >= 2, "{what}: {launches} launches");
                let want = grads_on(&cpu, DType::F64).map_err(|e| e.context(what.clone()))?;
                for ((name, _), (got, want)) in values.iter().zip(got.iter().zip(&want)) {
                    close_within(
                        got,
                        want,
                        tol * conditioning(name),
                        &format!("{what}: {name}"),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// How much looser than the other gradients the variable `name`'s is checked. ALiBi's slopes
/// take `Σ_ij dS_ij · d_ij` over every logit, where each row's `dS` sums to zero: the result is
/// a small remainder of summands up to `T` times larger, and any path's rounding is relative to
/// the summands. Measured on the CPU against the f64 block (B2 T90, the shapes above), as a
/// fraction of the largest gradient: candle's ops in bf16 0.04–0.40 for the slopes against at
/// most 0.027 for T5's and the clipped bias's tables, the fused f32 core up to 0.92e-5 against
/// 0.08e-5; on an H200 the kernels 0.051 (bf16) and 2.7e-5 (f32) for the slopes, where the
/// tolerance was 0.03 and 1e-5.
fn conditioning(name: &str) -> f64 {
    if name.ends_with("slopes") {
        10.0
    } else {
        1.0
    }
}

/// Another encoding's answers, with the queries, the row width and the value table's width of
/// every query block it is asked for (`logits_bias`, then `value_term`).
#[derive(Debug)]
struct Recorded {
    inner: Box<dyn candle_posenc::plug::PositionalEncoding>,
    calls: std::sync::Mutex<Vec<(usize, usize, usize)>>,
}

impl candle_posenc::plug::PositionalEncoding for Recorded {
    fn logits_bias(
        &self,
        q: &Tensor,
        ctx: &candle_posenc::plug::AttentionContext,
    ) -> candle_posenc::Result<Option<candle_posenc::plug::LogitsBias>> {
        use candle_posenc::plug::LogitsBias;
        let bias = self.inner.logits_bias(q, ctx)?;
        let width = match &bias {
            Some(LogitsBias::Relative(r)) => r.width(),
            Some(LogitsBias::Dense(t)) => t.dims().last().copied().unwrap_or(0),
            // A separable bias (one value per key), and any other form: as wide as the keys.
            Some(_) => ctx.k_len,
            None => 0,
        };
        self.calls
            .lock()
            .expect("calls")
            .push((ctx.q_len, width, 0));
        Ok(bias)
    }

    fn value_term(
        &self,
        ctx: &candle_posenc::plug::AttentionContext,
    ) -> candle_posenc::Result<Option<candle_posenc::plug::RelativeValues>> {
        let values = self.inner.value_term(ctx)?;
        if let (Some(v), Some(last)) = (&values, self.calls.lock().expect("calls").last_mut()) {
            last.2 = v.width();
        }
        Ok(values)
    }
}

/// Causal Shaw rows widen along the chunk (a query sees distances back to its clip), so the
/// kernels' query blocks are sized where the rows are widest, not by the first block's: every
/// hook call's rows (and, in training, the backward's two value-term rows per query beside
/// them, as wide as the value table cut to the rows' span) stay within the logits budget,
/// where sizing by the first block would pass it about 12-fold in both. The output, and in
/// training every gradient, equals the f64 CPU block's (in one query block).
fn shaw_rows_fit_the_budget() -> anyhow::Result<()> {
    use candle_nn::{VarBuilder, VarMap};
    use candle_posenc::{MultiHeadAttention, ShawRelativePosition};
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _kernel = FusedKernelScope::new(true);
    let (gpu, cpu) = (Device::new_cuda(0)?, Device::Cpu);
    let (heads, head_dim, k, len) = (2, 64, 100, 1024);
    let d_model = heads * head_dim;
    let shaw = ShawConfig::new(head_dim, k);
    // Eight queries' bf16 logits (the logits' own blocks; 32 KiB).
    let budget = 8 * heads * len * 2;
    let attn = AttentionConfig::new(d_model, heads).with_causal(true);
    let start = VarMap::new();
    let vb = common::seeded_vb(&start, DType::F32, &cpu);
    ShawRelativePosition::new(&shaw, vb.pp("enc"))?;
    MultiHeadAttention::new(&attn, None, vb.pp("attn"))?;
    for var in common::sorted_vars(&start) {
        let noise = common::randn(0f32, 0.3, var.shape(), &cpu)?;
        var.set(
            &(var.as_tensor() + noise)?
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?,
        )?;
    }
    tame_logits(&start)?;
    let values = common::zoo::named_tensors(&start)?;
    let x = common::randn(0f32, 1.0, (1, len, d_model), &cpu)?.to_dtype(DType::BF16)?;
    let probe = common::randn(0f32, 1.0, (1, len, d_model), &cpu)?;
    for train in [false, true] {
        // (output, gradients of every variable, the hook's calls, kernel launches)
        type Side = (Tensor, Vec<Tensor>, Vec<(usize, usize, usize)>, u64);
        let side = |dev: &Device, dtype: DType, budget: usize| -> anyhow::Result<Side> {
            let varmap = VarMap::new();
            let mut vars = Vec::new();
            {
                let mut data = varmap
                    .data()
                    .lock()
                    .map_err(|_| anyhow::anyhow!("varmap lock"))?;
                for (name, t) in &values {
                    let t = t.to_dtype(dtype)?.to_device(dev)?;
                    let var = candle_core::Var::from_tensor(&t)?;
                    vars.push(var.as_tensor().clone());
                    data.insert(name.clone(), var);
                }
            }
            let vb = match train {
                true => common::seeded_vb(&varmap, dtype, dev),
                false => VarBuilder::from_tensors(
                    vars.iter()
                        .zip(&values)
                        .map(|(v, (name, _))| (name.clone(), v.detach()))
                        .collect(),
                    dtype,
                    dev,
                ),
            };
            let recorded = std::sync::Arc::new(Recorded {
                inner: Box::new(ShawRelativePosition::new(&shaw, vb.pp("enc"))?),
                calls: Default::default(),
            });
            let mha = MultiHeadAttention::new(
                &attn.clone().with_logits_budget(budget),
                Some(recorded.clone()),
                vb.pp("attn"),
            )?;
            let opts = AttentionOptions {
                train,
                ..Default::default()
            };
            let before = kernel_launches();
            let out = mha
                .forward_with(&x.to_dtype(dtype)?.to_device(dev)?, &opts, None)?
                .output;
            let grads = match train {
                true => {
                    let probe = probe.to_device(dev)?;
                    let loss = (out.to_dtype(DType::F32)? * probe)?.sum_all()?;
                    let grads = loss.backward()?;
                    vars.iter()
                        .zip(&values)
                        .map(|(v, (name, _))| {
                            let g = grads
                                .get(v)
                                .ok_or_else(|| anyhow::anyhow!("{name} gets no gradient"))?;
                            Ok(g.to_device(&Device::Cpu)?.to_dtype(DType::F64)?)
                        })
                        .collect::<anyhow::Result<_>>()?
                }
                false => Vec::new(),
            };
            let launches = kernel_launches() - before;
            let out = out.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
            let calls = std::mem::take(&mut *recorded.calls.lock().expect("calls"));
            Ok((out, grads, calls, launches))
        };
        let (out, grads, calls, launches) = side(&gpu, DType::BF16, budget)?;
        let what = format!("causal Shaw k = {k}, train {train}");
        assert!(launches >= 1, "{what}: took candle's ops");
        // One hook call per query block: the blocks are sized from the encoding's declared
        // footprint, with no probing calls before them.
        let queries: usize = calls.iter().map(|&(n, _, _)| n).sum();
        assert_eq!(queries, len, "{what}: blocks {calls:?}");
        for &(n, width, values) in &calls {
            // The backward keeps two f32 rows per query as wide as the value table.
            let beside = if train { 2 * values } else { 0 };
            let bytes = heads * n * (width + beside) * 4;
            assert!(
                bytes <= budget,
                "{what}: {n} queries of {width} + {beside} columns: {bytes} bytes, {calls:?}"
            );
        }
        let (want, want_grads, _, _) = side(&cpu, DType::F64, usize::MAX)?;
        close(&out, &want, &what)?;
        for ((name, _), (got, want)) in values.iter().zip(grads.iter().zip(&want_grads)) {
            // P and dS are rounded to bf16 for their products (about 2^-8 each).
            close_within(got, want, 3e-2, &format!("{what}: {name}"))?;
        }
    }
    Ok(())
}

/// The tests, named `cuda::…` so that the GPU runner's filter finds them.
mod cuda {
    #[test]
    fn shaw_rows_fit_the_budget() -> anyhow::Result<()> {
        super::shaw_rows_fit_the_budget()
    }
    #[test]
    fn training_with_a_learned_mask() -> anyhow::Result<()> {
        super::training_with_a_learned_mask()
    }
    #[test]
    fn training_gives_learned_terms_their_gradients() -> anyhow::Result<()> {
        super::training_gives_learned_terms_their_gradients()
    }
    #[test]
    fn training_equals_f64() -> anyhow::Result<()> {
        super::training_equals_f64()
    }
    #[test]
    fn every_encoding_equals_f64() -> anyhow::Result<()> {
        super::every_encoding_equals_f64()
    }
    #[test]
    fn rows_masked_whole() -> anyhow::Result<()> {
        super::rows_masked_whole()
    }
    #[test]
    fn f32_equals_f64() -> anyhow::Result<()> {
        super::f32_equals_f64()
    }
    #[test]
    fn f32_training_equals_f64() -> anyhow::Result<()> {
        super::f32_training_equals_f64()
    }
    #[test]
    fn ids_groups_and_head_dims() -> anyhow::Result<()> {
        super::ids_groups_and_head_dims()
    }
    #[test]
    fn windows_softcaps_and_sinks() -> anyhow::Result<()> {
        super::windows_softcaps_and_sinks()
    }
    #[test]
    fn decoding_equals_the_whole_forward() -> anyhow::Result<()> {
        super::decoding_equals_the_whole_forward()
    }
    #[test]
    fn shaw_value_terms() -> anyhow::Result<()> {
        super::shaw_value_terms()
    }
    #[test]
    fn latent_blocks_take_the_kernel() -> anyhow::Result<()> {
        super::latent_blocks_take_the_kernel()
    }
    #[test]
    fn rotation_in_place_equals_the_cpu() -> anyhow::Result<()> {
        super::rotation_in_place_equals_the_cpu()
    }
    #[test]
    fn rotation_gradient_equals_the_cpu() -> anyhow::Result<()> {
        super::rotation_gradient_equals_the_cpu()
    }
}
