//! The extrapolation experiment's pipeline on a tiny configuration: the task generator, the
//! training loop, evaluation, determinism, checkpoints, and the committed checkpoints in
//! `weights/` that `attention_demo` evaluates.

#[allow(dead_code)]
#[path = "../../../examples/lm/mod.rs"]
mod lm;

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use candle_posenc::{AttentionConfig, EncodingConfig, Interpolation, LearnedConfig, RopeConfig};
use indicatif::ProgressBar;
use lm::data::Task;
use lm::model::{Lm, ModelConfig};
use lm::text::{Corpus, Document};
use lm::text_eval::{evaluate_text, TextEval, TextScores};
use lm::text_report::{load_text, run_seed, spread, table, RowRuns, SeedRun, TextSettings, View};
use lm::train::{
    checkpoint_name, evaluate, evaluate_lengths, load, text_variants, train, variants, Settings,
    Trained, Variant, EVAL_STREAM,
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

/// Training on the fused training core gives the same loss curve as on candle's ops, up to f32
/// summation order: 150 steps of AdamW from the same seeded start on the same batches, for a
/// rotary encoding, learned relative biases (T5, the clipped bias) and Shaw's learned keys and
/// values, causal.
#[test]
fn fused_training_follows_the_unfused_loss_curve() -> anyhow::Result<()> {
    use candle_core::{DType, Device};
    use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap};
    let s = Settings {
        steps: 150,
        ..Settings::tiny()
    };
    let h = s.model.num_heads;
    let encodings = [
        rope(&s),
        EncodingConfig::T5(candle_posenc::T5Config::new(h)),
        EncodingConfig::ClippedBias(candle_posenc::ClippedBiasConfig::new(h, 4)),
        EncodingConfig::Shaw(candle_posenc::ShawConfig::new(s.model.d_model / h, 4)),
    ];
    for encoding in &encodings {
        let curve = |unfused: bool| -> anyhow::Result<Vec<f32>> {
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, DType::F32, &Device::Cpu);
            let lm = Lm::new(&s.model, encoding, vb)?.with_unfused_attention(unfused);
            lm::model::seeded_init(&varmap, s.seed)?;
            let params = ParamsAdamW {
                lr: s.lr,
                ..Default::default()
            };
            let mut opt = AdamW::new(varmap.all_vars(), params)?;
            let mut losses = Vec::new();
            for step in 0..s.steps {
                opt.set_learning_rate(s.lr_at(step));
                let tokens = s.task.sequences(
                    lm::train::TRAIN_STREAM,
                    step * s.batch,
                    s.batch,
                    s.train_len + 1,
                );
                let tokens = lm::train::batch_tensor(&tokens)?;
                let loss = lm::train::batch_loss(&lm, &s.task, &tokens)?;
                opt.backward_step(&loss)?;
                losses.push(loss.to_scalar::<f32>()?);
            }
            Ok(losses)
        };
        let (fused, unfused) = (curve(false)?, curve(true)?);
        let worst = fused
            .iter()
            .zip(&unfused)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0f32, f32::max);
        let (first, last) = (unfused[0], unfused[s.steps - 1]);
        assert!(
            last < first - 0.1,
            "{}: the loss falls ({first} -> {last})",
            encoding.kind()
        );
        assert!(
            worst <= 1e-5,
            "{}: the curves part by {worst:e}",
            encoding.kind()
        );
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

/// The rows that have a checkpoint of their own (the others reuse a trained row's weights).
fn trained_labels() -> Vec<&'static str> {
    text_variants(&Settings::standard())
        .into_iter()
        .filter(|v| v.train == v.eval)
        .map(|v| v.label)
        .collect()
}

#[test]
fn committed_checkpoints_are_text_models_that_describe_themselves() -> anyhow::Result<()> {
    let corpus_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare");
    let corpus = if corpus_dir.is_dir() {
        Some(Corpus::load(&corpus_dir)?)
    } else {
        None
    };
    for label in trained_labels() {
        let loaded = load_text(&weights().join(checkpoint_name(label)))?;
        assert_eq!(loaded.label, label);
        let l = loaded.train_len;
        assert_eq!(l, 64);
        let vocab = loaded.lm.config().vocab;
        assert_eq!(vocab, loaded.alphabet.len() + 1);
        assert!(
            loaded.alphabet.windows(2).all(|w| w[0] < w[1]),
            "a sorted alphabet"
        );
        // Every recorded score beats a uniform guess; a learned table has none past L.
        for m in [1, 2, 4, 8, 16] {
            for view in ["windows", "sliding"] {
                match loaded.recorded(view, m * l)? {
                    Some(v) => assert!(
                        v.is_finite() && v < (vocab as f64).ln(),
                        "{label} {view} {m}L: {v}"
                    ),
                    None => assert!(label == "learned" && m > 1, "{label} {view} {m}L: n/a"),
                }
            }
        }
        // With the corpus at hand, the recorded score at L is reproduced.
        if let Some(c) = &corpus {
            assert_eq!(c.alphabet, loaded.alphabet);
            let tokens: usize = loaded.checkpoint.metadata()["lm.eval.tokens"].parse()?;
            let e = TextEval {
                train_len: l,
                multiples: vec![1],
                tokens,
                slide_tokens: l / 2,
                batch_tokens: 8192,
            };
            let got = evaluate_text(&loaded.lm, &c.held_out, &e, &ProgressBar::hidden())?;
            let (got, recorded) = (
                got.windows[0].expect("L"),
                loaded.recorded("windows", l)?.expect("L"),
            );
            assert!(
                (got - recorded).abs() < 1e-4,
                "{label}: {got} vs {recorded}"
            );
        }
    }
    let bytes: u64 = std::fs::read_dir(weights())?
        .map(|e| Ok(e?.metadata()?.len()))
        .sum::<std::io::Result<u64>>()?;
    assert!(bytes < 5 << 20, "weights/ holds {bytes} bytes");
    Ok(())
}

#[test]
fn corpus_holds_out_whole_documents_and_round_trips() -> anyhow::Result<()> {
    let docs = (0..9)
        .map(|i| Document {
            name: format!("d{i}"),
            text: format!("doc {i}: abc\r\n"),
        })
        .collect();
    let c = Corpus::from_documents("t", docs)?;
    assert_eq!(c.held_out_names, ["d3"]);
    assert_eq!(c.train_names.len(), 8);
    assert!(!c.alphabet.contains(&'\r'), "carriage returns are dropped");
    assert_eq!(c.vocab(), c.alphabet.len() + 1);
    assert_eq!(c.decode(&c.encode("doc 1: abc\n")), "doc 1: abc\n");
    // '3' occurs only in the held-out document: it is unknown to the model.
    assert_eq!(c.encode("3"), vec![0]);
    assert_eq!(
        c.decode(&c.held_out),
        format!("doc {}: abc\n", lm::text::UNKNOWN)
    );
    assert_eq!(c.train.len(), 8 * "doc 0: abc\n".len());
    assert!(Corpus::from_documents(
        "one",
        vec![Document {
            name: "a".into(),
            text: "x".into()
        }]
    )
    .is_err());
    Ok(())
}

#[test]
fn corpus_loads_folders_and_single_files() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("posenc-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for i in 0..8 {
        std::fs::write(dir.join(format!("p{i}_gut.txt")), format!("play {i}\n"))?;
    }
    std::fs::write(dir.join("README.txt"), "not a play")?;
    let c = Corpus::load(&dir)?;
    assert_eq!(c.held_out_names, ["p3_gut.txt"]);
    assert_eq!(c.train_names.len(), 7, "README.txt is not read");
    let file = dir.join("one.txt");
    let text: String = (0..20).map(|i| format!("line {i}\n")).collect();
    std::fs::write(&file, &text)?;
    let c = Corpus::load(&file)?;
    std::fs::remove_dir_all(&dir)?;
    // Ten parts of two lines; the last part is held out.
    assert_eq!(c.decode(&c.held_out), "line 18\nline 19\n");
    assert_eq!(c.train.len() + c.held_out.len(), text.chars().count());
    Ok(())
}

#[test]
fn training_windows_are_seeded_and_sliceable() -> anyhow::Result<()> {
    let c = Corpus::generated(5, 12, 2000)?;
    assert_eq!(c.held_out_names, ["scene 3", "scene 10"]);
    let a = c.train_windows(9, 0, 6, 33);
    assert_eq!(a, c.train_windows(9, 0, 6, 33));
    assert_eq!(&a[2..6], c.train_windows(9, 2, 4, 33).as_slice());
    assert_ne!(a, c.train_windows(10, 0, 6, 33));
    for w in &a {
        assert_eq!(w.len(), 33);
        // Each window is a contiguous piece of the training text.
        assert!(c.train.windows(33).any(|x| x == w.as_slice()));
    }
    Ok(())
}

/// A seeded model of `encoding` for the tiny text settings.
fn text_model(s: &TextSettings, encoding: &EncodingConfig) -> anyhow::Result<Lm> {
    let varmap = candle_nn::VarMap::new();
    let lm = Lm::new(
        &s.train.model,
        encoding,
        common::seeded_vb(&varmap, DType::F32, &Device::Cpu),
    )?;
    lm::model::seeded_init(&varmap, 3)?;
    Ok(lm)
}

#[test]
fn text_views_score_the_characters_they_say() -> anyhow::Result<()> {
    let c = Corpus::generated(5, 12, 2000)?;
    let s = TextSettings::tiny(c.vocab());
    let lm = text_model(&s, &rope(&s.train))?;
    let e = &s.eval;
    let got = evaluate_text(&lm, &c.held_out, e, &ProgressBar::hidden())?;
    let (l, stride) = (e.train_len, e.stride());
    let held = &c.held_out;
    // The mean loss of predictions `first..` of explicit windows (the training path's loss).
    let direct = |windows: Vec<&[u32]>, first: usize| -> anyhow::Result<f64> {
        let n = windows[0].len();
        let flat: Vec<u32> = windows.concat();
        let t = candle_core::Tensor::from_vec(flat, (windows.len(), n), &Device::Cpu)?;
        Ok(f64::from(
            lm::train::scored_loss(&lm, first, &t)?.to_scalar::<f32>()?,
        ))
    };
    for (i, m) in e.multiples.iter().enumerate() {
        let n = m * l;
        let windows = (0..e.tokens / n)
            .map(|k| &held[k * n..k * n + n + 1])
            .collect();
        let want = direct(windows, 0)?;
        assert!(
            (got.windows[i].expect("rope") - want).abs() < 1e-5,
            "windows at {n}"
        );
        let longest = 4 * l;
        let windows = (0..e.slide_tokens / stride)
            .map(|k| &held[longest + (k + 1) * stride - n..longest + (k + 1) * stride + 1])
            .collect();
        let want = direct(windows, n - stride)?;
        assert!(
            (got.sliding[i].expect("rope") - want).abs() < 1e-5,
            "sliding at {n}"
        );
    }
    // The buckets split the longest windows' predictions evenly.
    assert_eq!(got.buckets.len(), 4);
    let mean = got.buckets.iter().map(|b| b.expect("rope")).sum::<f64>() / 4.0;
    assert!((mean - got.windows[2].expect("rope")).abs() < 1e-6);
    // Too little held-out text is an error, not a shorter evaluation.
    assert!(evaluate_text(&lm, &held[..e.needed() - 1], e, &ProgressBar::hidden()).is_err());
    Ok(())
}

#[test]
fn text_evaluation_of_uniform_logits_is_ln_vocab() -> anyhow::Result<()> {
    let c = Corpus::generated(5, 12, 2000)?;
    let s = TextSettings::tiny(c.vocab());
    let lm = Lm::new(
        &s.train.model,
        &EncodingConfig::None,
        VarBuilder::zeros(DType::F32, &Device::Cpu),
    )?;
    let got = evaluate_text(&lm, &c.held_out, &s.eval, &ProgressBar::hidden())?;
    let ln_v = (c.vocab() as f64).ln();
    for v in got.windows.iter().chain(&got.sliding).chain(&got.buckets) {
        assert!(
            (v.expect("no table") - ln_v).abs() < 1e-5,
            "{v:?} vs {ln_v}"
        );
    }
    Ok(())
}

#[test]
fn text_pipeline_is_deterministic_and_round_trips() -> anyhow::Result<()> {
    let c = Corpus::generated(5, 12, 2000)?;
    let s = TextSettings::tiny(c.vocab());
    let only: Vec<String> = ["learned", "learned+interp", "rope", "rope+sinks", "alibi"]
        .map(String::from)
        .to_vec();
    let dir = std::env::temp_dir().join(format!("posenc-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut saved = Vec::new();
    let first = run_seed(&s, &c, 1, Some(&only), |v: &Variant, ckpt: Trained| {
        let path = dir.join(checkpoint_name(v.label));
        ckpt.save(&path)?;
        saved.push(path);
        Ok(())
    })?;
    let again = run_seed(&s, &c, 1, Some(&only), |_: &Variant, _: Trained| Ok(()))?;
    let other = run_seed(&s, &c, 2, Some(&only), |_: &Variant, _: Trained| Ok(()))?;
    let labels: Vec<&str> = first.iter().map(|(l, _)| l.as_str()).collect();
    assert_eq!(
        labels,
        ["learned", "learned+interp", "rope", "rope+sinks", "alibi"]
    );
    // Sinks are a model of their own, not the rope model's weights again.
    assert_ne!(first[2].1.scores, first[3].1.scores);
    for ((a, b), o) in first.iter().zip(&again).zip(&other) {
        assert_eq!(
            a.1.scores, b.1.scores,
            "{}: the same seed, the same numbers",
            a.0
        );
        assert_ne!(
            a.1.scores, o.1.scores,
            "{}: another seed, other numbers",
            a.0
        );
        assert!(a.1.final_train_loss.is_finite());
    }
    // The learned table ends at L; stretched, the same weights read every length.
    let learned = &first[0].1.scores;
    assert!(learned.windows[0].is_some() && learned.windows[1..].iter().all(Option::is_none));
    assert!(learned.buckets.iter().all(Option::is_none));
    assert!(first[1].1.scores.windows.iter().all(Option::is_some));
    assert_eq!(
        learned.windows[0], first[1].1.scores.windows[0],
        "interpolation is the identity at L"
    );
    // Only trained rows are saved, and a saved model scores what it recorded.
    assert_eq!(saved.len(), 4);
    for path in &saved {
        let loaded = load_text(path)?;
        assert_eq!(loaded.alphabet, c.alphabet);
        assert_eq!(loaded.lm.config().sinks, loaded.label == "rope+sinks");
        let got = evaluate_text(&loaded.lm, &c.held_out, &s.eval, &ProgressBar::hidden())?;
        let want = &first
            .iter()
            .find(|(l, _)| *l == loaded.label)
            .expect("a row")
            .1
            .scores;
        assert_eq!(&got, want, "{}", loaded.label);
        for (i, n) in s.eval.lengths().into_iter().enumerate() {
            let recorded = loaded.recorded("windows", n)?;
            assert_eq!(recorded.is_some(), want.windows[i].is_some());
            if let (Some(r), Some(w)) = (recorded, want.windows[i]) {
                assert!((r - w).abs() < 1e-6);
            }
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn tables_give_mean_and_spread_over_seeds() {
    let scores = |w: [f64; 2], b: [f64; 4]| TextScores {
        windows: w.map(Some).to_vec(),
        buckets: b.map(Some).to_vec(),
        sliding: w.map(|x| Some(x / 2.0)).to_vec(),
    };
    let run = |seed, scores| SeedRun {
        seed,
        final_train_loss: 1.0,
        scores,
    };
    let rows = vec![
        RowRuns {
            label: "a".into(),
            trained_with: "alibi".into(),
            runs: vec![
                run(1, scores([1.0, 2.0], [1.0, 2.0, 3.0, 5.0])),
                run(2, scores([2.0, 4.0], [1.0, 2.0, 3.0, 5.0])),
            ],
        },
        RowRuns {
            label: "b".into(),
            trained_with: "learned".into(),
            runs: vec![run(
                1,
                TextScores {
                    windows: vec![Some(1.0), None],
                    buckets: vec![None; 4],
                    sliding: vec![Some(1.0), None],
                },
            )],
        },
    ];
    let e = TextEval {
        train_len: 8,
        multiples: vec![1, 4],
        tokens: 64,
        slide_tokens: 16,
        batch_tokens: 64,
    };
    let t = table(View::Windows, &e, &rows);
    assert!(
        t.starts_with("| encoding | 8 (1L) | 32 (4L) |\n|---|---|---|\n"),
        "{t}"
    );
    // Mean and sample standard deviation: {1, 2} → 1.5 ± 0.707; {2, 4} → 3 ± 1.414.
    assert!(t.contains("| a | 1.500 ± 0.707 | 3.000 ± 1.414 |"), "{t}");
    assert!(
        t.contains("| b | 1.000 ± 0.000 | n/a (table ends at 8) |"),
        "{t}"
    );
    let t = table(View::Sliding, &e, &rows);
    assert!(t.contains("| a | 0.750 ± 0.354 | 1.500 ± 0.707 |"), "{t}");
    // Buckets [0, L), [L, 2L), [2L, 4L): the last averages two L-wide buckets.
    let t = table(View::Buckets, &e, &rows);
    assert!(
        t.starts_with("| encoding | [0, L) | [L, 2L) | [2L, 4L) |"),
        "{t}"
    );
    assert!(
        t.contains("| a | 1.000 ± 0.000 | 2.000 ± 0.000 | 4.000 ± 0.000 |"),
        "{t}"
    );
    let sp = spread(&[Some(1.0), Some(3.0), Some(2.0)]).expect("three values");
    assert_eq!((sp.mean, sp.std, sp.min, sp.max), (2.0, 1.0, 1.0, 3.0));
    assert!(spread(&[Some(1.0), None]).is_none());
}
