//! Reading HF `config.json` values: typed getters over one JSON object, whose errors name the
//! key (with its dotted prefix) and say what was expected.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

pub(crate) fn problem(key: impl Into<String>, problem: impl Into<String>) -> Error {
    Error::HfConfig {
        key: key.into(),
        problem: problem.into(),
    }
}

/// One JSON object and the dotted prefix its keys are reported under.
pub(crate) struct Obj<'a> {
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) prefix: &'a str,
}

impl<'a> Obj<'a> {
    pub(crate) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value at `key`, `None` when absent or `null`.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| problem(self.name(key), format!("is {v}, expected a number"))),
        }
    }

    pub(crate) fn usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .or_else(|| {
                    // `8192.0` is an integer written as a float; HF accepts it.
                    v.as_f64()
                        .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= u32::MAX as f64)
                        .map(|x| x as u64)
                })
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    problem(
                        self.name(key),
                        format!("is {v}, expected a non-negative integer"),
                    )
                }),
        }
    }

    pub(crate) fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| problem(self.name(key), format!("is {v}, expected true or false"))),
        }
    }

    pub(crate) fn str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| problem(self.name(key), format!("is {v}, expected a string"))),
        }
    }

    pub(crate) fn list(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || problem(self.name(key), "expected a list of numbers");
        let items = v.as_array().ok_or_else(bad)?;
        items
            .iter()
            .map(|x| x.as_f64().filter(|x| x.is_finite()).ok_or_else(bad))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub(crate) fn required<T>(&self, key: &str, value: Option<T>) -> Result<T> {
        value.ok_or_else(|| problem(self.name(key), "is missing"))
    }
}

/// The first of `keys` present (as a non-negative integer) and its name, or an error naming
/// the first.
pub(crate) fn first<'k>(obj: &Obj, keys: &[&'k str]) -> Result<(usize, &'k str)> {
    for key in keys {
        if let Some(v) = obj.usize(key)? {
            return Ok((v, key));
        }
    }
    Err(problem(
        keys.first().copied().unwrap_or("?"),
        "is missing (needed when head_dim is absent)",
    ))
}

/// The top-level object of `config.json` text.
///
/// # Errors
/// [`Error::HfConfig`] naming `<root>` for text that is not JSON or not an object.
pub(crate) fn parse_root(text: &str) -> Result<Map<String, Value>> {
    let root: Value = serde_json::from_str(text)
        .map_err(|e| problem("<root>", format!("is not valid JSON: {e}")))?;
    match root {
        Value::Object(map) => Ok(map),
        _ => Err(problem("<root>", "is not a JSON object")),
    }
}
