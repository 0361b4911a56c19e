//! The extrapolation experiment's pipeline on a tiny configuration: the task generator, the
//! training loop, evaluation, determinism, checkpoints, and the committed checkpoints in
//! `weights/` that `attention_demo` evaluates.

#[allow(dead_code)]
#[path = "../examples/lm/mod.rs"]
mod lm;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_posenc::{AttentionConfig, EncodingConfig, Interpolation, LearnedConfig, RopeConfig};
use indicatif::ProgressBar;
use lm::data::Task;
use lm::model::{Lm, ModelConfig};
use lm::train::{
    checkpoint_name, evaluate, evaluate_lengths, load, train, variants, Settings, Trained,
    EVAL_STREAM,
};

fn rope(s: &Settings) -> EncodingConfig {
    EncodingConfig::Rotary(RopeConfig::new(s.model.d_model / s.model.num_heads))
}

#[test]
fn sequences_are_deterministic_and_sliceable() {
    let task = Task::default();
    let a = task.sequences(9, 0, 8, 40);
    assert_eq!(a, task.sequences(9, 0, 8, 40));
    assert_eq!(&a[5..8], task.sequences(9, 5, 3, 40).as_slice());
    assert_ne!(a, task.sequences(10, 0, 8, 40));
    assert!(a.iter().all(|s| s.len() == 40));
    assert!(a.iter().flatten().all(|&t| (t as usize) < task.vocab));
}

#[test]
fn sequences_follow_the_copy_and_successor_rules() {
    let task = Task::default();
    let succ = task.successor();
    let mut sorted = succ.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (0..task.vocab as u32).collect::<Vec<_>>(),
        "a permutation"
    );
    let d = task.copy_distance;
    let (mut copies, mut neither, mut n) = (0usize, 0usize, 0usize);
    for s in task.sequences(4, 0, 200, 128) {
        for t in d..s.len() {
            let copy = s[t] == s[t - d];
            copies += usize::from(copy);
            neither += usize::from(!copy && s[t] != succ[s[t - 1] as usize]);
            n += 1;
        }
    }
    let (copy, neither) = (copies as f64 / n as f64, neither as f64 / n as f64);
    // A copy happens with p = 0.7, and any other draw matches by chance with p ≈ 1/32 or more.
    assert!((0.70..0.76).contains(&copy), "copy rate {copy}");
    // Only noise (p = 0.1) can match neither rule, and it misses both with p >= 30/32.
    assert!(
        (0.08..0.11).contains(&neither),
        "rate of tokens no rule explains {neither}"
    );
}

#[test]
fn oracle_matches_a_hand_computation() {
    let task = Task {
        vocab: 4,
        copy_distance: 1,
        p_copy: 0.5,
        p_successor: 0.25,
        seed: 1,
    };
    let succ = task.successor();
    // s[1] copies s[0]; whether it is also s[0]'s successor depends on the permutation.
    let s = vec![2u32, 2];
    let expected = 0.5 + 0.25 * f64::from(u8::from(succ[2] == 2)) + 0.25 / 4.0;
    assert!((task.oracle_prob(&succ, &s, 1) - expected).abs() < 1e-12);
    let (loss, acc) = task.oracle(&[s]);
    assert!((loss + expected.ln()).abs() < 1e-12);
    assert_eq!(acc, 1.0);
}

#[test]
fn training_reduces_the_loss() -> anyhow::Result<()> {
    let s = Settings {
        steps: 30,
        ..Settings::tiny()
    };
    let (_, losses) = train(&s, &rope(&s))?;
    assert_eq!(losses.len(), 30);
    assert!(losses.iter().all(|l| l.is_finite()));
    let first = losses[..5].iter().sum::<f32>() / 5.0;
    let last = losses[25..].iter().sum::<f32>() / 5.0;
    assert!(last < first - 0.1, "loss {first} -> {last}");
    Ok(())
}

#[test]
fn training_is_deterministic() -> anyhow::Result<()> {
    let s = Settings::tiny();
    for enc in [rope(&s), variants(&s)[2].train.clone()] {
        let (_, a) = train(&s, &enc)?;
        let (_, b) = train(&s, &enc)?;
        assert_eq!(a, b, "same seed, same losses, bit for bit ({})", enc.kind());
        let (_, c) = train(
            &Settings {
                seed: 8,
                ..s.clone()
            },
            &enc,
        )?;
        assert_ne!(a, c, "another seed, other losses");
    }
    Ok(())
}

#[test]
fn every_variant_trains_a_step_and_evaluates() -> anyhow::Result<()> {
    let s = Settings {
        steps: 1,
        ..Settings::tiny()
    };
    for v in variants(&s) {
        let (varmap, losses) = train(&s, &v.train)?;
        assert!(losses[0].is_finite(), "{}", v.label);
        let scores = evaluate_lengths(&s, &Trained::new(&s, &v, &varmap)?.model()?, 5, 2, "t")?;
        for (len, score) in s.eval_lengths().iter().zip(&scores) {
            match score {
                Some(sc) => {
                    assert!(sc.loss.is_finite() && sc.loss > 0.0, "{} at {len}", v.label);
                    assert!((0.0..=1.0).contains(&sc.accuracy), "{} at {len}", v.label);
                }
                // Only the learned table without interpolation stops at L.
                None => assert!(v.label == "learned" && *len > s.train_len, "{}", v.label),
            }
        }
    }
    Ok(())
}

#[test]
fn learned_table_ends_at_l_and_interpolation_stretches_it() -> anyhow::Result<()> {
    let s = Settings::tiny();
    let cfg = LearnedConfig::new(s.model.d_model)
        .with_max_len(s.train_len)
        .with_dropout(0.0);
    let zero = VarBuilder::zeros(DType::F32, &Device::Cpu);
    let off = Lm::new(
        &s.model,
        &EncodingConfig::Learned(cfg.clone()),
        zero.clone(),
    )?;
    let stretched = cfg.with_interpolation(Interpolation::ToSequenceLength);
    let on = Lm::new(&s.model, &EncodingConfig::Learned(stretched), zero)?;
    let long = s.task.sequences(1, 0, 2, 2 * s.train_len + 1);
    let bar = ProgressBar::hidden();
    assert!(evaluate(&off, &s.task, &long, 2, &bar)?.is_none());
    assert!(evaluate(&on, &s.task, &long, 2, &bar)?.is_some());
    let short = s.task.sequences(1, 0, 2, s.train_len + 1);
    assert!(evaluate(&off, &s.task, &short, 2, &bar)?.is_some());
    Ok(())
}

#[test]
fn evaluation_of_uniform_logits_is_ln_vocab() -> anyhow::Result<()> {
    // All-zero weights give all-zero logits: loss ln V, and argmax picks token 0.
    let s = Settings::tiny();
    let model: &ModelConfig = &s.model;
    let lm = Lm::new(
        model,
        &EncodingConfig::None,
        VarBuilder::zeros(DType::F32, &Device::Cpu),
    )?;
    let seqs = s.task.sequences(3, 0, 5, 20);
    let score = evaluate(&lm, &s.task, &seqs, 2, &ProgressBar::hidden())?.expect("no table");
    assert!(
        (score.loss - (s.task.vocab as f64).ln()).abs() < 1e-6,
        "{}",
        score.loss
    );
    let d = s.task.copy_distance;
    let zeros = seqs
        .iter()
        .flat_map(|q| &q[d..])
        .filter(|&&t| t == 0)
        .count();
    let scored = seqs.len() * (20 - d);
    assert!((score.accuracy - zeros as f64 / scored as f64).abs() < 1e-12);
    Ok(())
}

#[test]
fn sequences_without_a_scored_target_are_an_error() -> anyhow::Result<()> {
    let s = Settings::tiny();
    let lm = Lm::new(
        &s.model,
        &EncodingConfig::None,
        VarBuilder::zeros(DType::F32, &Device::Cpu),
    )?;
    // copy_distance 3: tokens 0..2 are the unscored prefix, so 3 tokens (2 targets) score none.
    let short = s.task.sequences(1, 0, 2, 3);
    assert!(evaluate(&lm, &s.task, &short, 2, &ProgressBar::hidden()).is_err());
    let tokens = candle_core::Tensor::zeros((2, 3), DType::U32, &Device::Cpu)?;
    assert!(lm::train::batch_loss(&lm, &s.task, &tokens).is_err());
    let tokens = candle_core::Tensor::zeros((2, 4), DType::U32, &Device::Cpu)?;
    assert!(lm::train::batch_loss(&lm, &s.task, &tokens)?
        .to_scalar::<f32>()?
        .is_finite());
    Ok(())
}

#[test]
fn checkpoint_round_trip_gives_the_same_scores() -> anyhow::Result<()> {
    let s = Settings::tiny();
    let v = variants(&s)
        .into_iter()
        .find(|v| v.label == "t5")
        .expect("a t5 row");
    let (varmap, _) = train(&s, &v.train)?;
    let mut ckpt = Trained::new(&s, &v, &varmap)?;
    let before = evaluate_lengths(&s, &ckpt.model()?, EVAL_STREAM, 3, "t")?;
    ckpt.record(&s.eval_lengths(), &before);
    let dir = std::env::temp_dir().join(format!("posenc-lm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("t5.safetensors");
    ckpt.save(&path)?;
    let loaded = load(&path)?;
    std::fs::remove_dir_all(&dir)?;
    assert_eq!(loaded.label, "t5");
    assert_eq!(loaded.task, s.task);
    assert_eq!(loaded.train_len, s.train_len);
    let after = evaluate_lengths(&s, &loaded.lm, EVAL_STREAM, 3, "t")?;
    assert_eq!(before, after);
    let meta = loaded.checkpoint.metadata();
    assert!(meta["posenc.encoding"].starts_with(r#"{"kind":"t5","#));
    assert!(meta["posenc.attention"].contains(r#""causal":true"#));
    assert_eq!(EncodingConfig::from_metadata(meta, "t5")?, v.eval);
    assert_eq!(
        AttentionConfig::from_metadata(meta, "t5")?,
        s.model.attention()
    );
    Ok(())
}

fn weights() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("weights")
}

#[test]
fn committed_checkpoints_reproduce_their_recorded_scores_at_l() -> anyhow::Result<()> {
    let labels: Vec<&str> = variants(&Settings::standard())
        .iter()
        .map(|v| v.label)
        .collect();
    for label in labels {
        let loaded = load(&weights().join(checkpoint_name(label)))?;
        assert_eq!(loaded.label, label);
        let meta = loaded.checkpoint.metadata();
        let l = loaded.train_len;
        let count: usize = meta["lm.eval.sequences"].parse()?;
        let recorded: f64 = meta[&format!("lm.eval.{l}.loss")].parse()?;
        let seqs = loaded.task.sequences(EVAL_STREAM, 0, count, l + 1);
        let score = evaluate(&loaded.lm, &loaded.task, &seqs, 8, &ProgressBar::hidden())?
            .expect("every encoding reaches L");
        assert!(
            (score.loss - recorded).abs() < 1e-4,
            "{label}: {} vs {recorded}",
            score.loss
        );
        if label == "learned" {
            assert_eq!(meta[&format!("lm.eval.{}.loss", 2 * l)], "n/a");
        }
    }
    Ok(())
}
