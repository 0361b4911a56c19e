//! The layering of ARCHITECTURE.md, checked on the sources: the base imports nothing above it,
//! the encodings never import the block (nor the block an encoding), and the `cuda` feature is
//! named outside a `cuda/` folder only where candle's op traits need a `cuda_fwd` method; and
//! the tests draw their random data only from the seeded stream.

use std::path::{Path, PathBuf};

/// The crate's modules (files or folders under `src/`) by layer, lowest first.
const BASE: [&str; 10] = [
    "error",
    "limits",
    "positions",
    "vision",
    "matmul",
    "graft",
    "checkpoint",
    "cpu",
    "cuda",
    "plug",
];
const ENCODINGS: [&str; 3] = ["absolute", "rotary", "relative"];
const ABOVE: [&str; 3] = ["attention", "encoding", "hf"];

/// Every `.rs` file under `dir`, recursively.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The top-level module a file of `src/` belongs to (`attention` for
/// `src/attention/cuda/kernel.rs`, `matmul` for `src/matmul.rs`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("a file under src/");
    let first = rel.components().next().expect("a path");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

/// The file's lines that are code, not comments or docs.
fn code_lines(file: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(file).expect("a readable source");
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect()
}

/// Every `crate::<module>` a module's code names, with where.
fn crate_refs(module: &str) -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for file in sources(&src)
        .into_iter()
        .filter(|f| module_of(&src, f) == module)
    {
        for (n, line) in code_lines(&file) {
            for (i, _) in line.match_indices("crate::") {
                let name: String = line[i + 7..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                found.push((name, format!("{}:{n}", file.display())));
            }
        }
    }
    found
}

/// Asserts that `modules` name none of `forbidden`.
fn names_none(modules: &[&str], forbidden: &[&str]) {
    for module in modules {
        let bad: Vec<_> = crate_refs(module)
            .into_iter()
            .filter(|(name, _)| forbidden.contains(&name.as_str()))
            .collect();
        assert!(bad.is_empty(), "{module} names a module above it: {bad:?}");
    }
}

#[test]
fn the_base_names_nothing_above_it() {
    let above: Vec<&str> = ENCODINGS.iter().chain(&ABOVE).copied().collect();
    names_none(&BASE, &above);
    // The plug sits on the rest of the base; the rest of the base never names it.
    names_none(&BASE[..BASE.len() - 1], &["plug"]);
}

#[test]
fn encodings_and_the_block_never_name_each_other() {
    names_none(&ENCODINGS, &ABOVE);
    names_none(&["attention"], &ENCODINGS);
    names_none(&["attention"], &["encoding", "hf"]);
}

#[test]
fn the_cuda_feature_is_named_in_cuda_folders_and_at_most_three_places_besides() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let outside: Vec<String> = sources(&src)
        .into_iter()
        .filter(|f| !f.components().any(|c| c.as_os_str() == "cuda"))
        .flat_map(|f| {
            code_lines(&f)
                .into_iter()
                .filter(|(_, l)| l.contains("feature = \"cuda\""))
                .map(move |(n, _)| format!("{}:{n}", f.display()))
        })
        .collect();
    assert!(outside.len() <= 3, "{outside:?}");
}

/// Tests draw their random data from `tests/it/common/seeded.rs`, never from candle's unseeded
/// generator, so that every run checks the same values: no code line of `src/` or `tests/it/`
/// (doc examples aside, which draw as a user's code would) calls candle's random constructors,
/// and no test builds a `VarMap`'s variables through `VarBuilder::from_varmap`.
#[test]
fn tests_draw_only_seeded_data() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The stream itself, and this file, which names the calls.
    let allowed = [
        root.join("tests/it/common/seeded.rs"),
        root.join("tests/it/structure.rs"),
    ];
    let unseeded = [
        "Tensor::randn(",
        "Tensor::rand(",
        "Var::randn(",
        "Var::rand(",
        "randn_like(",
        "rand_like(",
        "VarBuilder::from_varmap(",
    ];
    let mut found = Vec::new();
    for file in sources(&root.join("src"))
        .into_iter()
        .chain(sources(&root.join("tests/it")))
    {
        if allowed.contains(&file) {
            continue;
        }
        for (line, code) in code_lines(&file) {
            if let Some(call) = unseeded.iter().find(|c| code.contains(*c)) {
                found.push(format!("{}:{line}: {call}", file.display()));
            }
        }
    }
    assert!(found.is_empty(), "unseeded draws: {found:#?}");
}
