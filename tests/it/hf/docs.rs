//! Every doc list of the `model_type`s the loader reads names exactly the registry's
//! ([`candle_posenc::hf::model_types`]), and the class-defaults table every type with a family.

use std::collections::BTreeSet;

use candle_posenc::hf::{model_types, HfFamily};

/// The documents that list the types, relative to the crate root, and how many lists each has.
const LISTS: [(&str, usize); 3] = [("src/hf/mod.rs", 1), ("src/lib.rs", 1), ("README.md", 1)];

/// The backticked names of each marked list in `text`: a table's first column (below its
/// header), or every backticked name of a list in prose.
fn lists(text: &str, marker: &str) -> Vec<BTreeSet<String>> {
    let (start_marker, end_marker) = (format!("<!-- {marker} -->"), format!("<!-- /{marker} -->"));
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(&start_marker) {
        let after = &rest[start + start_marker.len()..];
        let end = after.find(&end_marker).unwrap_or(after.len());
        let region = &after[..end];
        // A table's body: the rows after its `|---|` line.
        let rows: Vec<&str> = region
            .lines()
            .skip_while(|l| !l.contains("|---"))
            .skip(1)
            .collect();
        let cells: Vec<&str> = match rows.is_empty() {
            true => vec![region],
            false => rows
                .iter()
                .filter_map(|row| row.split('|').nth(1))
                .collect(),
        };
        found.push(
            cells
                .iter()
                .flat_map(|cell| cell.split('`').skip(1).step_by(2))
                .map(str::to_string)
                .collect(),
        );
        rest = &after[end..];
    }
    found
}

#[test]
fn doc_lists_name_the_registry() -> anyhow::Result<()> {
    let registry: BTreeSet<String> = model_types().map(str::to_string).collect();
    assert!(registry.contains("llama") && registry.contains("gemma4"));
    for (path, count) in LISTS {
        check(path, "model_types", count, &registry)?;
    }
    // The defaults table has a row for each type with a family (not the wrappers).
    let families: BTreeSet<String> = registry
        .iter()
        .filter(|t| HfFamily::from_model_type(t).is_some())
        .cloned()
        .collect();
    assert!(families.contains("t5") && !families.contains("gemma4"));
    check("src/hf/defaults.rs", "family_types", 1, &families)
}

/// Checks that `path` has `count` lists marked `marker`, each naming exactly `expected`.
fn check(
    path: &str,
    marker: &str,
    count: usize,
    expected: &BTreeSet<String>,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))?;
    let found = lists(&text, marker);
    assert_eq!(found.len(), count, "{path}: lists marked {marker}");
    for list in found {
        let missing: Vec<_> = expected.difference(&list).collect();
        let extra: Vec<_> = list.difference(expected).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{path}: missing {missing:?}, not in the registry {extra:?}"
        );
    }
    Ok(())
}

#[test]
fn every_listed_type_is_read() {
    // A file of each type names no unknown model_type (errors, if any, name other keys).
    for model_type in model_types() {
        let json = format!(r#"{{"model_type": "{model_type}"}}"#);
        if let Err(candle_posenc::Error::HfConfig { key, .. }) =
            candle_posenc::HfAttentionConfig::from_json(&json)
        {
            assert_ne!(key, "model_type", "{model_type}");
        }
    }
}
