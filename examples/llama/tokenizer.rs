//! Byte-level BPE (GPT-2's scheme) from a GGUF file's own vocabulary and merges.
//!
//! ```text
//! text → control tokens matched whole (`<|im_start|>`, …)
//!      → pre-tokens: each digit alone (`tokenizer.ggml.pre` = "smollm"), then GPT-2's split
//!        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//!      → each pre-token's UTF-8 bytes spelled as GPT-2's printable characters
//!      → merges applied lowest rank first → ids
//! ```
//!
//! SmolLM2's own `tokenizer.json` splits as `Digits(individual_digits) → ByteLevel`, and
//! llama.cpp's "smollm" pre-tokenizer the same (each `\p{N}` alone, then GPT-2's split).
//! (transformers 5.24's tokenizer built from a GGUF keeps GPT-2's split alone for "smollm", so
//! runs of digits can come out differently there.) The one look-ahead of GPT-2's pattern,
//! `\s+(?!\S)` (a run of spaces leaves its last one to the word after it), is done by hand,
//! since the `regex` crate has no look-around.

use std::collections::HashMap;

use anyhow::{bail, Context};
use candle_core::quantized::gguf_file::Value;
use regex::Regex;

/// GPT-2's split without its look-ahead alternative (see the module docs).
const SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// GGUF's token type of control tokens, matched whole in the text.
const CONTROL: i32 = 3;

/// The pre-tokenizers read, by `tokenizer.ggml.pre`: whether digits are split one by one.
const PRE_TOKENIZERS: &[(&str, bool)] = &[("gpt2", false), ("smollm", true)];

/// A byte-level BPE tokenizer.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    /// Control tokens, longest first, so a longer one wins where two start together.
    controls: Vec<(String, u32)>,
    split_digits: bool,
    split: Regex,
    byte_chars: [char; 256],
    char_bytes: HashMap<char, u8>,
    eos: Option<u32>,
}

impl Tokenizer {
    /// The tokenizer of a GGUF file's metadata (`tokenizer.ggml.*`, model `gpt2`).
    pub fn from_gguf(metadata: &HashMap<String, Value>) -> anyhow::Result<Self> {
        let get = |key: &str| {
            metadata
                .get(key)
                .with_context(|| format!("GGUF: no `{key}`"))
        };
        let model = get("tokenizer.ggml.model")?.to_string()?;
        if model != "gpt2" {
            bail!("GGUF: tokenizer `{model}` is not byte-level BPE (`gpt2`)");
        }
        let pre = match metadata.get("tokenizer.ggml.pre") {
            Some(v) => v.to_string()?.as_str(),
            None => "gpt2",
        };
        let Some(&(_, split_digits)) = PRE_TOKENIZERS.iter().find(|(p, _)| *p == pre) else {
            bail!("GGUF: pre-tokenizer `{pre}` is not read here (known: {PRE_TOKENIZERS:?})");
        };
        let tokens: Vec<String> = strings(get("tokenizer.ggml.tokens")?)?;
        let types: Vec<i32> = match metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(Value::to_i32)
                .collect::<Result<_, _>>()?,
            None => vec![1; tokens.len()],
        };
        let mut ranks = HashMap::new();
        for (rank, merge) in strings(get("tokenizer.ggml.merges")?)?
            .into_iter()
            .enumerate()
        {
            let (a, b) = merge
                .split_once(' ')
                .with_context(|| format!("GGUF: merge `{merge}` is not two tokens"))?;
            ranks.entry((a.to_string(), b.to_string())).or_insert(rank);
        }
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut controls: Vec<(String, u32)> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == CONTROL)
            .map(|(i, (t, _))| (t.clone(), i as u32))
            .collect();
        controls.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        let byte_chars = byte_chars();
        let char_bytes = (0..=255u8).map(|b| (byte_chars[b as usize], b)).collect();
        let eos = match metadata.get("tokenizer.ggml.eos_token_id") {
            Some(v) => Some(v.to_u32()?),
            None => None,
        };
        Ok(Self {
            tokens,
            ids,
            ranks,
            controls,
            split_digits,
            split: Regex::new(SPLIT)?,
            byte_chars,
            char_bytes,
            eos,
        })
    }

    /// The end-of-sequence token, if the file names one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The id of a token spelled as the vocabulary spells it.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The ids of `text`, control tokens matched whole.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let (plain, control) = self.next_control(rest);
            self.encode_plain(&rest[..plain], &mut ids);
            match control {
                Some((len, id)) => {
                    ids.push(id);
                    rest = &rest[plain + len..];
                }
                None => rest = "",
            }
        }
        ids
    }

    /// The bytes the ids stand for (control tokens as their text).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            let Some(token) = self.tokens.get(id as usize) else {
                continue;
            };
            for c in token.chars() {
                match self.char_bytes.get(&c) {
                    Some(&b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
        }
        out
    }

    /// The text the ids stand for (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// Where the first control token in `text` starts, and its length and id.
    fn next_control(&self, text: &str) -> (usize, Option<(usize, u32)>) {
        for (start, _) in text.char_indices() {
            let here = &text[start..];
            if let Some((t, id)) = self
                .controls
                .iter()
                .find(|(t, _)| here.starts_with(t.as_str()))
            {
                return (start, Some((t.len(), *id)));
            }
        }
        (text.len(), None)
    }

    /// Text without control tokens: its pre-tokens, each merged.
    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for segment in self.segments(text) {
            let mut at = 0;
            while at < segment.len() {
                let Some(m) = self.split.find_at(segment, at) else {
                    break;
                };
                let end = spaces_end(segment, m.start(), m.end());
                self.merge(&segment[m.start()..end], ids);
                at = end;
            }
        }
    }

    /// The text cut around each digit when the pre-tokenizer splits digits, else whole.
    fn segments<'a>(&self, text: &'a str) -> Vec<&'a str> {
        if !self.split_digits {
            return vec![text];
        }
        let mut out = Vec::new();
        let mut start = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                if start < i {
                    out.push(&text[start..i]);
                }
                out.push(&text[i..i + c.len_utf8()]);
                start = i + c.len_utf8();
            }
        }
        if start < text.len() {
            out.push(&text[start..]);
        }
        out
    }

    /// One pre-token's ids: its bytes as symbols, merged lowest rank first.
    fn merge(&self, piece: &str, ids: &mut Vec<u32>) {
        let mut symbols: Vec<String> = piece
            .bytes()
            .map(|b| self.byte_chars[b as usize].to_string())
            .collect();
        loop {
            let best = symbols
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| {
                    let rank = self.ranks.get(&(w[0].clone(), w[1].clone()))?;
                    Some((*rank, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        ids.extend(symbols.iter().filter_map(|s| self.ids.get(s)));
    }
}

/// The end of a split match: a run of two or more whitespace characters followed by more text
/// gives its last one back to what follows (GPT-2's `\s+(?!\S)`).
fn spaces_end(text: &str, start: usize, end: usize) -> usize {
    let matched = &text[start..end];
    if end == text.len() || !matched.chars().all(char::is_whitespace) {
        return end;
    }
    match matched.char_indices().last() {
        Some((last, _)) if last > 0 => start + last,
        _ => end,
    }
}

/// A GGUF array of strings.
fn strings(value: &Value) -> anyhow::Result<Vec<String>> {
    value
        .to_vec()?
        .iter()
        .map(|v| Ok(v.to_string()?.clone()))
        .collect()
}

/// GPT-2's spelling of each byte as a printable character: the printable Latin-1 bytes as
/// themselves, the others as U+0100 onwards in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        out[b as usize] = match printable(b) {
            true => char::from(b),
            false => {
                next += 1;
                char::from_u32(next - 1).unwrap_or('\0')
            }
        };
    }
    out
}
