//! Checkpoints and configs under attack: truncated files, malformed or oversized safetensors
//! headers, overlapping or out-of-range offsets, wrong dtypes, missing and extra tensors,
//! metadata that lies about the encoding, and random byte corruption (bounded proptest runs).
//! Every case must end in a typed error (never a panic), and a failed load must leave nothing
//! half-loaded.

use crate::common;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarMap};
use candle_posenc::checkpoint::save;
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::{
    AttentionConfig, Checkpoint, EncodingConfig, Error, MultiHeadAttention, Positions, RopeConfig,
    T5Config, T5RelativeBias,
};
use proptest::prelude::*;

const TABLE: &str = "relative_attention_bias.weight";

/// A real checkpoint: a T5 bias table `(8, 2)` and attention projections for d_model 4, with
/// both configurations in the metadata.
fn valid_checkpoint() -> Vec<u8> {
    let dev = Device::Cpu;
    let t5 = T5Config::new(2).with_num_buckets(8).with_max_distance(16);
    let mut meta = EncodingConfig::T5(t5).to_metadata();
    meta.extend(AttentionConfig::new(4, 2).to_metadata());
    let arange = |n: usize, shape: &[usize]| {
        Tensor::arange(0f32, n as f32, &dev)
            .and_then(|t| t.reshape(shape))
            .expect("tensor")
    };
    let mut tensors = HashMap::from([(TABLE.to_string(), arange(16, &[8, 2]))]);
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        tensors.insert(format!("attn.{p}.weight"), arange(16, &[4, 4]));
    }
    write_and_read(&tensors, &meta)
}

/// Saves through the crate's writer and returns the file's bytes.
fn write_and_read(tensors: &HashMap<String, Tensor>, meta: &HashMap<String, String>) -> Vec<u8> {
    let path = std::env::temp_dir().join(format!(
        "posenc_attack_{}_{:?}.safetensors",
        std::process::id(),
        std::thread::current().id()
    ));
    save(&path, tensors, meta).expect("save");
    let bytes = std::fs::read(&path).expect("read back");
    let _ = std::fs::remove_file(&path);
    bytes
}

/// A safetensors file from a raw header text and data section.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Loads `bytes` under `catch_unwind`; a panic fails the test with `label`.
fn load(label: &str, bytes: &[u8]) -> candle_posenc::Result<Checkpoint> {
    catch_unwind(AssertUnwindSafe(|| {
        Checkpoint::from_bytes(bytes, &Device::Cpu)
    }))
    .unwrap_or_else(|_| panic!("{label}: the loader panicked"))
}

/// Everything a caller does with a loaded checkpoint: parse its configurations and build the
/// encoding and attention from its tensors. Panics fail the caller's test; errors are returned.
fn use_checkpoint(ck: &Checkpoint) -> candle_posenc::Result<()> {
    let dev = Device::Cpu;
    let enc = EncodingConfig::from_metadata(ck.metadata(), ck.source())?;
    let att = AttentionConfig::from_metadata(ck.metadata(), ck.source())?;
    let vb = ck.var_builder(DType::F32, &dev);
    let enc = enc.build(vb.clone())?;
    let mha = MultiHeadAttention::new(&att, enc, vb.pp("attn"))?;
    let x = Tensor::ones((1, 3, att.d_model), DType::F32, &dev)?;
    mha.forward_with(&x, &Default::default(), None)?;
    Ok(())
}

#[test]
fn the_valid_checkpoint_loads_and_works() -> anyhow::Result<()> {
    let ck = load("valid", &valid_checkpoint())?;
    use_checkpoint(&ck)?;
    let t5 = T5RelativeBias::new(
        &T5Config::new(2).with_num_buckets(8).with_max_distance(16),
        ck.var_builder(DType::F32, &Device::Cpu),
    )?;
    assert_eq!(t5.weight().to_vec2::<f32>()?[3], [6.0, 7.0]);
    Ok(())
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid_checkpoint();
    for cut in 0..bytes.len() {
        match load(&format!("cut at {cut}"), &bytes[..cut]) {
            Err(Error::Checkpoint { path, reason }) => {
                assert_eq!(path, "<memory>");
                assert!(reason.contains("not a valid safetensors file"), "{reason}");
            }
            other => panic!("cut at {cut} of {}: {other:?}", bytes.len()),
        }
    }
}

#[test]
fn malformed_headers_are_errors() {
    let mut cases = malformed_framing();
    cases.extend(malformed_tensor_entries());
    let mut failures = Vec::new();
    for (label, bytes, needle) in &cases {
        match load(label, bytes) {
            Err(Error::Checkpoint { reason, .. }) if reason.contains(needle) => {}
            other => failures.push(format!("{label}: {other:?}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Files whose header length, encoding or JSON is wrong: (label, bytes, the reason's words).
fn malformed_framing() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let huge_len = |n: u64| {
        let mut b = n.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        b
    };
    vec![
        ("empty file", vec![], "header too small"),
        (
            "header length u64::MAX",
            huge_len(u64::MAX),
            "header too large",
        ),
        (
            "header length 10^12",
            huge_len(1_000_000_000_000),
            "header too large",
        ),
        (
            "header length past the file",
            huge_len(64),
            "invalid header length",
        ),
        (
            "header not UTF-8",
            {
                let mut b = raw("{\"a\": 1}", &[]);
                b[10] = 0xff;
                b
            },
            "invalid UTF-8 in header",
        ),
        (
            "header is not JSON",
            raw("{\"a\":", &[]),
            "invalid JSON in header",
        ),
        (
            "header is an array",
            raw("[1, 2]", &[]),
            "invalid JSON in header",
        ),
    ]
}

/// Headers whose tensor entries (dtype, shape, offsets) or metadata are wrong: (label, bytes,
/// the reason's words).
fn malformed_tensor_entries() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let f32x4 = [0u8; 16];
    vec![
        (
            "unknown dtype",
            raw(
                r#"{"t":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}}"#,
                &f32x4,
            ),
            "invalid JSON in header",
        ),
        (
            "negative shape",
            raw(
                r#"{"t":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}}"#,
                &f32x4,
            ),
            "invalid JSON in header",
        ),
        (
            "reversed offsets",
            raw(
                r#"{"t":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}}"#,
                &f32x4,
            ),
            "invalid offset for tensor",
        ),
        (
            "overlapping offsets",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                &f32x4,
            ),
            "invalid offset for tensor",
        ),
        (
            "offsets past the data",
            raw(
                r#"{"t":{"dtype":"F32","shape":[256],"data_offsets":[0,1024]}}"#,
                &f32x4,
            ),
            "file not fully covered",
        ),
        (
            "shape disagrees with offsets",
            raw(
                r#"{"t":{"dtype":"F32","shape":[8],"data_offsets":[0,16]}}"#,
                &f32x4,
            ),
            "invalid shape, data type, or offset",
        ),
        (
            "shape product overflows",
            raw(
                r#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}}"#,
                &f32x4,
            ),
            "overflow computing buffer size",
        ),
        (
            "metadata value not a string",
            raw(r#"{"__metadata__":{"posenc.encoding":3}}"#, &[]),
            "invalid JSON in header",
        ),
        (
            "data past the last tensor",
            raw(
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                &f32x4,
            ),
            "file not fully covered",
        ),
    ]
}

#[test]
fn tensors_candle_cannot_hold_are_errors() {
    // A BOOL tensor is valid safetensors but has no candle dtype.
    let bytes = raw(
        r#"{"t":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}}"#,
        &[1, 0],
    );
    match load("bool", &bytes) {
        Err(Error::Checkpoint { reason, .. }) => {
            assert!(reason.contains("tensor `t` cannot be loaded"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

fn t5_vb_error(tensors: HashMap<String, Tensor>, meta: HashMap<String, String>) -> Error {
    let ck = load("t5", &write_and_read(&tensors, &meta)).expect("a well-formed file");
    let config = EncodingConfig::from_metadata(ck.metadata(), "t5").expect("valid metadata");
    config
        .build(ck.var_builder(DType::F32, &Device::Cpu))
        .expect_err("building must fail")
}

fn t5_meta(num_heads: usize) -> HashMap<String, String> {
    EncodingConfig::T5(
        T5Config::new(num_heads)
            .with_num_buckets(8)
            .with_max_distance(16),
    )
    .to_metadata()
}

#[test]
fn an_integer_table_is_refused_not_converted() -> anyhow::Result<()> {
    let table = Tensor::arange(0i64, 16, &Device::Cpu)?.reshape((8, 2))?;
    let err = t5_vb_error(HashMap::from([(TABLE.into(), table.clone())]), t5_meta(2));
    match &err {
        Error::Checkpoint { reason, .. } => {
            assert!(reason.contains(TABLE) && reason.contains("I64"), "{reason}");
            assert!(reason.contains("cannot fill a F32 parameter"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // f16 and bf16 tables are floats: converted to the module's dtype as usual.
    let half = Tensor::ones((8, 2), DType::BF16, &Device::Cpu)?;
    let ck = load(
        "bf16",
        &write_and_read(&HashMap::from([(TABLE.into(), half)]), &t5_meta(2)),
    )?;
    let t5 = T5RelativeBias::new(
        &T5Config::new(2).with_num_buckets(8).with_max_distance(16),
        ck.var_builder(DType::F32, &Device::Cpu),
    )?;
    assert_eq!(t5.weight().dtype(), DType::F32);
    Ok(())
}

#[test]
fn missing_and_extra_tensors() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let err = t5_vb_error(
        HashMap::from([(
            "other.weight".into(),
            Tensor::zeros((8, 2), DType::F32, &dev)?,
        )]),
        t5_meta(2),
    );
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == TABLE),
        "{err:?}"
    );
    assert!(err.to_string().contains(TABLE));

    // Extra tensors are ignored; the right one is used.
    let table = Tensor::arange(0f32, 16., &dev)?.reshape((8, 2))?;
    let tensors = HashMap::from([
        (TABLE.to_string(), table),
        (
            "extra.weight".to_string(),
            Tensor::ones((3, 3), DType::F32, &dev)?,
        ),
        (
            "relative_attention_bias.bias".to_string(),
            Tensor::ones(2, DType::F32, &dev)?,
        ),
    ]);
    let ck = load("extra", &write_and_read(&tensors, &t5_meta(2)))?;
    let t5 = T5RelativeBias::new(
        &T5Config::new(2).with_num_buckets(8).with_max_distance(16),
        ck.var_builder(DType::F32, &dev),
    )?;
    // Distance 0 is bucket 0 (bidirectional): row 0 of the table, (0, 1) for heads 0 and 1.
    let bias = t5.bias(&Positions::Offset(0), 1, &Positions::Offset(0), 1)?;
    assert_eq!(bias.flatten_all()?.to_vec1::<f32>()?, [0.0, 1.0]);
    Ok(())
}

#[test]
fn metadata_that_lies_about_the_encoding() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let table = || Tensor::zeros((8, 2), DType::F32, &dev);
    // Says 4 heads, holds a table for 2.
    let err = t5_vb_error(HashMap::from([(TABLE.into(), table()?)]), t5_meta(4));
    match &err {
        Error::TensorShape {
            name,
            expected,
            got,
        } => {
            assert_eq!(
                (name.as_str(), &expected[..], &got[..]),
                (TABLE, &[8, 4][..], &[8, 2][..])
            );
        }
        other => panic!("{other:?}"),
    }
    // Says learned, holds a T5 table.
    let meta =
        EncodingConfig::Learned(candle_posenc::LearnedConfig::new(2).with_max_len(8)).to_metadata();
    let err = t5_vb_error(HashMap::from([(TABLE.into(), table()?)]), meta);
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "weight"),
        "{err:?}"
    );
    // Says rotary with an odd head_dim: refused when the metadata is read.
    let meta = with_field(
        EncodingConfig::Rotary(RopeConfig::new(8)).to_metadata(),
        "head_dim",
        7.into(),
    );
    let err = EncodingConfig::from_metadata(&meta, "lies").expect_err("odd head_dim");
    assert!(err.to_string().contains("head_dim = 7"), "{err}");
    // Says d_model 8, holds projections for 4.
    let mut bytes_meta = t5_meta(2);
    bytes_meta.extend(AttentionConfig::new(8, 2).to_metadata());
    let mut tensors = HashMap::from([(TABLE.to_string(), table()?)]);
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        tensors.insert(
            format!("attn.{p}.weight"),
            Tensor::zeros((4, 4), DType::F32, &dev)?,
        );
    }
    let ck = load("attention lies", &write_and_read(&tensors, &bytes_meta))?;
    match use_checkpoint(&ck) {
        Err(Error::TensorShape {
            name,
            expected,
            got,
        }) => {
            assert_eq!(
                (name.as_str(), expected, got),
                ("attn.q_proj.weight", vec![8, 8], vec![4, 4])
            );
        }
        other => panic!("{other:?}"),
    }
    // Says a kind that does not exist.
    let meta = with_field(t5_meta(2), "kind", "t6".into());
    let err = EncodingConfig::from_metadata(&meta, "lies").expect_err("unknown kind");
    assert!(
        matches!(&err, Error::Checkpoint { reason, .. } if reason.contains("`t6`")),
        "{err:?}"
    );
    Ok(())
}

/// Encoding metadata with one field of its JSON replaced by `value`.
fn with_field(
    mut meta: HashMap<String, String>,
    field: &str,
    value: serde_json::Value,
) -> HashMap<String, String> {
    let key = candle_posenc::checkpoint::ENCODING_KEY;
    let mut json: serde_json::Value = serde_json::from_str(&meta[key]).expect("crate's JSON");
    json[field] = value;
    meta.insert(key.into(), json.to_string());
    meta
}

/// The values of every variable of `varmap`, by name.
fn snapshot(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let data = varmap.data().lock().expect("lock");
    let mut out: Vec<_> = data
        .iter()
        .map(|(k, v)| {
            let vals = v.as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>());
            (k.clone(), vals.expect("values"))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A partial checkpoint, and the error it must give.
type Attempt = (&'static str, HashMap<String, Tensor>, fn(&Error) -> bool);

#[test]
fn a_failed_load_into_changes_nothing() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    varmap.get((2, 3), "a", Init::Const(7.0), DType::F32, &dev)?;
    varmap.get((4,), "b", Init::Const(7.0), DType::F32, &dev)?;
    let before = snapshot(&varmap);
    let good_a = Tensor::ones((2, 3), DType::F32, &dev)?;
    let attempts: Vec<Attempt> = vec![
        (
            "b missing",
            HashMap::from([("a".into(), good_a.clone())]),
            |e| matches!(e, Error::MissingTensor { name } if name == "b"),
        ),
        (
            "b misshapen",
            HashMap::from([
                ("a".into(), good_a.clone()),
                ("b".into(), Tensor::ones(5, DType::F32, &dev)?),
            ]),
            |e| matches!(e, Error::TensorShape { name, .. } if name == "b"),
        ),
        (
            "b integer",
            HashMap::from([
                ("a".into(), good_a.clone()),
                ("b".into(), Tensor::ones(4, DType::U32, &dev)?),
            ]),
            |e| matches!(e, Error::Checkpoint { reason, .. } if reason.contains("`b`") && reason.contains("U32")),
        ),
    ];
    for (label, tensors, expected) in attempts {
        let ck = load(label, &write_and_read(&tensors, &HashMap::new()))?;
        let err = ck.load_into(&varmap).expect_err(label);
        assert!(expected(&err), "{label}: {err:?}");
        assert_eq!(snapshot(&varmap), before, "{label}: the VarMap changed");
    }
    // The complete checkpoint loads every variable.
    let tensors = HashMap::from([
        ("a".into(), good_a),
        ("b".into(), Tensor::ones(4, DType::F16, &dev)?),
    ]);
    load("complete", &write_and_read(&tensors, &HashMap::new()))?.load_into(&varmap)?;
    assert!(snapshot(&varmap)
        .iter()
        .all(|(_, v)| v.iter().all(|&x| x == 1.0)));
    Ok(())
}

/// The valid checkpoint, corrupted three ways: random bytes of the data section overwritten
/// (the file still parses; the values, NaN and infinities included, reach the modules), random
/// bytes of the length prefix and JSON header overwritten, or the file truncated.
fn corrupted() -> impl Strategy<Value = Vec<u8>> {
    let bytes = valid_checkpoint();
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let len = bytes.len();
    let edits =
        |range: std::ops::Range<usize>| proptest::collection::vec((range, any::<u8>()), 1..8);
    let (a, b) = (bytes.clone(), bytes.clone());
    prop_oneof![
        3 => edits(header_end..len).prop_map(move |e| apply(&a, &e)),
        2 => edits(0..header_end).prop_map(move |e| apply(&b, &e)),
        1 => (0..len).prop_map(move |cut| bytes[..cut].to_vec()),
    ]
}

fn apply(bytes: &[u8], edits: &[(usize, u8)]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    for &(at, v) in edits {
        b[at] = v;
    }
    b
}

/// Random JSON text edits of a real HF config.
fn corrupted_json() -> impl Strategy<Value = String> {
    let seed = r#"{"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;
    let pieces = prop_oneof![
        Just("-1"),
        Just("0"),
        Just("1e400"),
        Just("null"),
        Just("\"x\""),
        Just("[]"),
        Just("{}"),
        Just("true"),
        Just("18446744073709551616"),
        Just("0.5"),
        Just("\"yarn\""),
        Just("\"longrope\""),
        Just("\"dynamic\""),
        Just("\"linear\""),
        Just(","),
        Just("\""),
    ];
    proptest::collection::vec((0..seed.len(), 0..4usize, pieces), 1..4).prop_map(move |edits| {
        let mut s = seed.to_string();
        for (at, del, piece) in edits {
            let at = at.min(s.len());
            let end = (at + del).min(s.len());
            s.replace_range(at..end, piece);
        }
        s
    })
}

proptest! {
    // Bounded for CI: 256 corrupted files, 256 corrupted configs.
    #![proptest_config(common::proptest_config(256))]

    /// Corrupted bytes never panic: the load fails with `Error::Checkpoint`, or it succeeds and
    /// using the checkpoint either works or fails with a typed error.
    #[test]
    fn random_corruption_never_panics(bytes in corrupted()) {
        match load("corrupted", &bytes) {
            Err(e) => prop_assert!(matches!(e, Error::Checkpoint { .. }), "{e:?}"),
            Ok(ck) => {
                let used = catch_unwind(AssertUnwindSafe(|| use_checkpoint(&ck)));
                prop_assert!(used.is_ok(), "using a corrupted checkpoint panicked");
                if let Ok(Err(e)) = used {
                    prop_assert!(!matches!(e, Error::Io { .. }), "{e:?}");
                }
            }
        }
    }

    /// Corrupted HF configs parse or fail with a typed error, never panic.
    #[test]
    fn corrupted_hf_configs_never_panic(text in corrupted_json()) {
        let r = catch_unwind(AssertUnwindSafe(|| RopeConfig::from_hf_json(&text)));
        prop_assert!(r.is_ok(), "from_hf_json panicked on {text}");
        if let Ok(Err(e)) = r {
            prop_assert!(matches!(e, Error::HfConfig { .. } | Error::InvalidConfig { .. }), "{e:?}");
        }
    }
}

/// The fuzz seed corpora stay meaningful: every seed checkpoint loads, every seed metadata file
/// and HF config parses (so the fuzzers start from valid inputs and mutate from there).
#[test]
fn fuzz_seeds_are_valid_inputs() -> anyhow::Result<()> {
    let dir = |t: &str| format!("{}/fuzz/corpus/{t}", env!("CARGO_MANIFEST_DIR"));
    let seeds = |t: &str| -> anyhow::Result<Vec<std::path::PathBuf>> {
        let mut v: Vec<_> = std::fs::read_dir(dir(t))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("seed_"))
            })
            .collect();
        v.sort();
        anyhow::ensure!(v.len() >= 5, "too few seeds for {t}");
        Ok(v)
    };
    for p in seeds("checkpoint_load")? {
        let ck = Checkpoint::load(&p, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
        // The configurations a seed carries are current and valid.
        let meta = ck.metadata();
        if meta.contains_key(candle_posenc::checkpoint::ENCODING_KEY) {
            EncodingConfig::from_metadata(meta, ck.source())?;
        }
        if meta.contains_key(candle_posenc::checkpoint::ATTENTION_KEY) {
            AttentionConfig::from_metadata(meta, ck.source())?;
        }
        anyhow::ensure!(
            meta.keys().all(|k| k.starts_with("posenc.")),
            "{}: old metadata keys {meta:?}",
            p.display()
        );
    }
    // An HF config seed is a model's attention layer, or (the rotary settings alone) a RoPE.
    for p in seeds("hf_config")? {
        let text = std::fs::read_to_string(&p)?;
        let layer = HfAttentionConfig::from_json_layer(&text, 0);
        let rope = RopeConfig::from_hf_json(&text);
        anyhow::ensure!(
            layer.is_ok() || rope.is_ok(),
            "{}: neither a layer ({:?}) nor a RoPE ({:?})",
            p.display(),
            layer.err(),
            rope.err()
        );
    }
    for p in seeds("encoding_metadata")? {
        let text = std::fs::read_to_string(&p)?;
        let meta: HashMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EncodingConfig::from_metadata(&meta, "seed")
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    Ok(())
}
