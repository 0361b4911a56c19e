//! The crate's error type.
//!
//! Every failure that depends on the caller's input (a shape, a length, a configuration value, a
//! checkpoint) is reported as an [`Error`] variant that names the offending value and what was
//! expected. Failures inside candle's kernels are wrapped as [`Error::Candle`], except the two
//! that concern checkpoints (a tensor that is missing or has the wrong shape), which are turned
//! into [`Error::MissingTensor`] and [`Error::TensorShape`] so callers can match on them, and
//! a checkpoint tensor of the wrong dtype, which becomes [`Error::Checkpoint`], and two
//! operands on different devices, which become [`Error::Device`].

use candle_core::{DType, Device, DeviceLocation, Shape, Tensor};
use candle_nn::{Init, VarBuilder};

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in candle-posenc.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of its valid range (zero heads, odd dimension, bad factor).
    #[error("invalid configuration: {name} = {value}, expected {expected}")]
    InvalidConfig {
        /// The configuration field.
        name: &'static str,
        /// The value that was given, printed.
        value: String,
        /// What a valid value looks like.
        expected: String,
    },

    /// A position is past the end of a table that cannot grow (a learned table).
    #[error(
        "position {position} is past the end of the {table} table, which holds positions 0..{len}"
    )]
    PositionOutOfRange {
        /// Which table (e.g. "learned positional").
        table: &'static str,
        /// The first position that does not fit (exclusive upper bound requested).
        position: usize,
        /// Number of positions the table holds.
        len: usize,
    },

    /// A tensor has the wrong rank.
    #[error("{what} has rank {got} (shape {shape:?}), expected rank {expected}")]
    Rank {
        /// Which argument.
        what: &'static str,
        /// The rank that was expected.
        expected: usize,
        /// The rank that was given.
        got: usize,
        /// The full shape that was given.
        shape: Vec<usize>,
    },

    /// A tensor has the wrong shape.
    #[error("{what} has shape {got:?}, expected {expected}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// What was expected, in words (dimensions may be symbolic).
        expected: String,
        /// The shape that was given.
        got: Vec<usize>,
    },

    /// Positions lack what an encoding reads from them: one position per token (an offset, or
    /// ids without axes) where the encoding rotates by each token's row and column (axial 2-D
    /// RoPE, RoPE-Mixed), which only multimodal ids give.
    #[error("{what} are {got}, expected {expected}")]
    Positions {
        /// Which encoding's positions.
        what: &'static str,
        /// What was expected, in words.
        expected: String,
        /// What was given, in words (an offset, or ids and their shape).
        got: String,
    },

    /// A tensor has a dtype the operation does not accept.
    #[error("{what} has dtype {got:?}, expected {expected}")]
    DType {
        /// Which argument.
        what: &'static str,
        /// Accepted dtypes, in words.
        expected: &'static str,
        /// The dtype that was given.
        got: candle_core::DType,
    },

    /// A tensor is on another device than the one it must be combined with (the block's
    /// weights and input, or the other operand of one of candle's ops).
    #[error("{what} is on {got}, expected a tensor on {expected}")]
    Device {
        /// Which argument (or, from inside candle, which op found the two devices).
        what: &'static str,
        /// The device expected, printed.
        expected: String,
        /// The device the tensor is on, printed.
        got: String,
    },

    /// A checkpoint lacks a tensor that a module needs.
    #[error("checkpoint has no tensor named `{name}`")]
    MissingTensor {
        /// Full dotted name of the tensor.
        name: String,
    },

    /// A checkpoint tensor has the wrong shape.
    #[error("checkpoint tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// Full dotted name of the tensor.
        name: String,
        /// Shape the module needs.
        expected: Vec<usize>,
        /// Shape found in the checkpoint.
        got: Vec<usize>,
    },

    /// A checkpoint file cannot be read or parsed, or its metadata is inconsistent.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file (or `"<memory>"` for buffers).
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A model's `config.json` lacks a key, or a key has the wrong type or an unknown value.
    #[error("config.json: `{key}` {problem}")]
    HfConfig {
        /// The key, dotted for nested ones (e.g. `rope_scaling.factor`).
        key: String,
        /// What is wrong with it and what was expected.
        problem: String,
    },

    /// An I/O error while reading or writing a file.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },

    /// One of the crate's own GPU kernels failed to compile, load or launch (the `cuda`
    /// feature's fused attention).
    #[error("kernel {kernel}: {reason}")]
    Kernel {
        /// The kernel and its specialisation (e.g. `posenc_flash_forward d64 bf16`).
        kernel: String,
        /// What failed: the compiler's log, or the driver's error.
        reason: String,
    },

    /// An error raised by candle itself (kernels, devices, dtype conversions).
    #[error(transparent)]
    Candle(candle_core::Error),
}

impl Error {
    /// Shorthand for [`Error::InvalidConfig`].
    pub(crate) fn config(
        name: &'static str,
        value: impl std::fmt::Display,
        expected: impl Into<String>,
    ) -> Self {
        Error::InvalidConfig {
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }

    /// Shorthand for [`Error::Shape`].
    pub(crate) fn shape(what: &'static str, expected: impl Into<String>, got: &Shape) -> Self {
        Error::Shape {
            what,
            expected: expected.into(),
            got: got.dims().to_vec(),
        }
    }
}

/// Strips candle's wrappers (backtraces, context, paths) to reach the error that was raised.
fn innermost(err: &candle_core::Error) -> &candle_core::Error {
    match err {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. }
        | candle_core::Error::WithPath { inner, .. } => innermost(inner),
        other => other,
    }
}

impl From<candle_core::Error> for Error {
    fn from(err: candle_core::Error) -> Self {
        match innermost(&err) {
            candle_core::Error::CannotFindTensor { path } => {
                Error::MissingTensor { name: path.clone() }
            }
            candle_core::Error::UnexpectedShape { msg, expected, got } => {
                match msg.strip_prefix("shape mismatch for ") {
                    Some(name) => Error::TensorShape {
                        name: name.to_string(),
                        expected: expected.dims().to_vec(),
                        got: got.dims().to_vec(),
                    },
                    None => Error::Candle(err),
                }
            }
            // Raised by the checkpoint's VarBuilder backend (see `Checkpoint::var_builder`),
            // which can only return candle errors: "checkpoint <path>: tensor `<name>` ...".
            candle_core::Error::Msg(msg) => {
                match msg
                    .strip_prefix("checkpoint ")
                    .and_then(|m| m.split_once(": tensor `"))
                {
                    Some((path, rest)) => Error::Checkpoint {
                        path: path.to_string(),
                        reason: format!("tensor `{rest}"),
                    },
                    None => Error::Candle(err),
                }
            }
            // Two operands of one op on two devices: typed, though candle names only its op
            // (the crate checks its own inputs where it takes them, see `check_device`).
            candle_core::Error::DeviceMismatchBinaryOp { lhs, rhs, op } => Error::Device {
                what: op,
                expected: format!("{lhs:?} (the op's first operand)"),
                got: format!("{rhs:?}"),
            },
            _ => Error::Candle(err),
        }
    }
}

/// Lets our modules implement candle's `Module` trait, whose error type is `candle_core::Error`.
impl From<Error> for candle_core::Error {
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(inner) => inner,
            other => candle_core::Error::Wrapped(Box::new(other)),
        }
    }
}

/// Whether `dtype` is one of the float dtypes the crate computes in: f32, f64, bf16 or f16
/// (candle's 8-bit and smaller floats pass `DType::is_float` but have no matmul).
pub(crate) fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// [`Error::DType`] naming `what` unless [`is_float`]: the one rule for every table, weight,
/// input and bias the crate reads.
pub(crate) fn check_float(what: &'static str, dtype: DType) -> Result<()> {
    if !is_float(dtype) {
        return Err(Error::DType {
            what,
            expected: "a float dtype (f32, f64, bf16 or f16)",
            got: dtype,
        });
    }
    Ok(())
}

/// The largest finite value of a float dtype the crate computes in (`None` for the others):
/// the one statement of each format's range that factors, masks and narrowing casts are
/// checked against.
pub(crate) fn largest_finite(dtype: DType) -> Option<f64> {
    match dtype {
        DType::F16 => Some(f64::from(half::f16::MAX)),
        DType::BF16 => Some(f64::from(half::bf16::MAX)),
        DType::F32 => Some(f64::from(f32::MAX)),
        DType::F64 => Some(f64::MAX),
        _ => None,
    }
}

/// A format's limit as messages print it: f16's as `65504`, the wider ones in exponent form.
pub(crate) fn shown(limit: f64) -> String {
    match limit < 1e6 {
        true => format!("{limit}"),
        false => format!("{limit:e}"),
    }
}

/// Checks a factor that multiplies activations held in `dtype` (a softmax scale, a
/// temperature's largest factor): past the format's largest finite value it turns
/// every activation of magnitude one or more into ±∞.
///
/// `name` and `value` are the setting the factor comes from (the two differ where the factor
/// is computed from the setting); `role` says what the factor multiplies, for the message.
///
/// # Errors
/// [`Error::InvalidConfig`] naming `name` and `value`, with the factor and `dtype`'s largest
/// finite value, when the factor is NaN or past it in magnitude.
pub(crate) fn check_factor(
    name: &'static str,
    value: f64,
    (factor, role): (f64, &str),
    dtype: DType,
) -> Result<()> {
    let Some(limit) = largest_finite(dtype) else {
        return Ok(());
    };
    if factor.abs() <= limit {
        return Ok(());
    }
    let (d, limit) = (dtype.as_str(), shown(limit));
    let expected = match factor == value {
        true => format!("at most {limit} ({d}'s largest finite value) for {d} weights: {role}"),
        false => format!(
            "a value whose factor (here {factor:e}) is at most {limit} ({d}'s largest finite value) for {d} weights: {role}"
        ),
    };
    Err(Error::config(name, value, expected))
}

/// Where a cast to a narrower float format turned finite values into ±∞: the largest magnitude
/// among the finite values of `t` that `cast` (`t` cast to another float dtype, on the same
/// device) holds as ±∞, or `None` when every finite value stayed finite (always, for a cast
/// to a format at least as wide). NaN and ±∞ already in `t` are not this check's: they keep
/// their meaning, as everywhere in the crate.
///
/// # Errors
/// Candle's, from the comparisons (on a GPU the answer reads back one byte, and the
/// magnitude when there is one).
pub(crate) fn overflowed(t: &Tensor, cast: &Tensor) -> Result<Option<f64>> {
    let (Some(from), Some(to)) = (largest_finite(t.dtype()), largest_finite(cast.dtype())) else {
        return Ok(None);
    };
    if to >= from || t.elem_count() == 0 {
        return Ok(None);
    }
    let size = t.abs()?;
    let became = cast
        .abs()?
        .eq(f64::INFINITY)?
        .mul(&size.lt(f64::INFINITY)?)?;
    if became.flatten_all()?.max(0)?.to_scalar::<u8>()? == 0 {
        return Ok(None);
    }
    let largest = became
        .where_cond(&size, &size.zeros_like()?)?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    Ok(Some(largest))
}

/// The dtype rule of every constructor that takes a `VarBuilder`: the builder's dtype is the
/// dtype its learned tensors are created or loaded in, so it must be a float one ([`check_float`])
/// — an integer builder would create a table of integers, or truncate the values a checkpoint
/// holds. Checked first, before anything is created in a `VarMap`, by every constructor alike,
/// whether or not its scheme has learned tensors (one rule, not one per scheme).
///
/// # Errors
/// [`Error::DType`] naming `what` for a builder of another dtype.
pub(crate) fn check_var_builder(what: &'static str, vb: &VarBuilder) -> Result<()> {
    check_float(what, vb.dtype())
}

/// The learned tensor `name` of `shape`, loaded from `vb` or created there with `init`, and
/// checked to be float: a `VarMap` hands back a variable it already holds in that variable's
/// own dtype, whatever the builder's. The builder itself is checked first by its constructor
/// ([`check_var_builder`]).
///
/// # Errors
/// As `VarBuilder::get_with_hints` ([`Error::MissingTensor`], [`Error::TensorShape`],
/// [`Error::Checkpoint`]); [`Error::DType`] naming `what` for a tensor that is not float.
pub(crate) fn learned(
    vb: &VarBuilder,
    what: &'static str,
    shape: impl Into<Shape>,
    name: &str,
    init: Init,
) -> Result<Tensor> {
    let t = vb.get_with_hints(shape, name, init)?;
    check_float(what, t.dtype())?;
    Ok(t)
}

/// Checks that `value` is a positive normal f32 (finite, at least `f32::MIN_POSITIVE`): what a
/// scale or an ε must be to keep finite input finite in every float dtype the crate runs in.
///
/// # Errors
/// [`Error::InvalidConfig`] naming `name` otherwise.
pub(crate) fn check_normal_f32(name: &'static str, value: f64) -> Result<()> {
    if !(value.is_finite() && value >= f32::MIN_POSITIVE as f64 && value <= f32::MAX as f64) {
        return Err(Error::config(
            name,
            value,
            "a finite number > 0 within f32's normal range",
        ));
    }
    Ok(())
}

/// [`Error::Device`] naming `what` unless `t` lives on `device`: the one check of a tensor's
/// device where the crate takes it (candle would otherwise fail inside an op).
///
/// # Errors
/// [`Error::Device`] when `t` is on another device than `device`.
pub(crate) fn check_device(what: &'static str, t: &Tensor, device: &Device) -> Result<()> {
    device_error(what, device.location(), t.device().location())
}

/// [`Error::Device`] naming `what` unless the two locations are one device (the comparison
/// of [`check_device`], on locations so it can be tested without a second device).
fn device_error(what: &'static str, expected: DeviceLocation, got: DeviceLocation) -> Result<()> {
    if expected != got {
        return Err(Error::Device {
            what,
            expected: format!("{expected:?}"),
            got: format!("{got:?}"),
        });
    }
    Ok(())
}

/// Validates a dropout probability.
pub(crate) fn check_dropout(p: f32) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::config("dropout", p, "a probability in [0, 1)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device comparison on locations (a CPU-only build cannot make a second device), and
    /// candle's own mismatch error turned into the same variant.
    #[test]
    fn devices_compare_by_location() {
        let cuda = DeviceLocation::Cuda { gpu_id: 1 };
        assert!(device_error("x", DeviceLocation::Cpu, DeviceLocation::Cpu).is_ok());
        let err = device_error("padding mask", DeviceLocation::Cpu, cuda).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Device {
                    what: "padding mask",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "padding mask is on Cuda { gpu_id: 1 }, expected a tensor on Cpu"
        );
        assert!(check_device(
            "x",
            &Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(),
            &Device::Cpu
        )
        .is_ok());
        let candle = candle_core::Error::DeviceMismatchBinaryOp {
            lhs: DeviceLocation::Cpu,
            rhs: cuda,
            op: "matmul",
        }
        .bt();
        let err = Error::from(candle);
        assert!(
            matches!(&err, Error::Device { what: "matmul", .. }),
            "{err}"
        );
    }
}
