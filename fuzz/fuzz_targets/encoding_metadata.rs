//! Fuzzes the checkpoint metadata parsers directly (faster than through safetensors): the input
//! is read as `key=value` lines, and `EncodingConfig::from_metadata` and
//! `AttentionConfig::from_metadata` must give `Ok` or an `Err`, never a panic. A configuration
//! that parses must survive a round trip through `to_metadata`.
//!
//! Run: `cargo +nightly fuzz run encoding_metadata fuzz/corpus/encoding_metadata -- -runs=1000000`
#![no_main]

use std::collections::HashMap;

use candle_posenc::{AttentionConfig, EncodingConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let metadata: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Ok(c) = EncodingConfig::from_metadata(&metadata, "fuzz") {
        let again = EncodingConfig::from_metadata(&c.to_metadata(), "fuzz")
            .expect("a parsed configuration round-trips");
        assert_eq!(format!("{again:?}"), format!("{c:?}"));
    }
    if let Ok(c) = AttentionConfig::from_metadata(&metadata, "fuzz") {
        let again = AttentionConfig::from_metadata(&c.to_metadata(), "fuzz")
            .expect("a parsed configuration round-trips");
        assert_eq!(again, c);
    }
});
