//! One NVRTC cache for every CUDA program of the crate: a program's PTX is compiled at first
//! use, for the GPU generation [`ARCH`], and kept for the process (candle's
//! `get_or_load_custom_func` keeps the loaded module per device).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::error::{Error, Result};

/// The virtual architecture the kernels are compiled for: `mma.m16n8k16` with bf16 operands,
/// `ldmatrix` and `cvt.rn.bf16x2` need sm_80 (A100, H100, H200 and later).
pub(crate) const ARCH: &str = "compute_80";

/// The PTX of each program by its name and NVRTC options.
type PtxCache = HashMap<(&'static str, Vec<String>), Arc<str>>;

/// The PTX of every program compiled so far.
static PTX: Mutex<Option<PtxCache>> = Mutex::new(None);

/// The PTX of one of the crate's CUDA programs (`name`, its `source`) with the -D `defines`,
/// compiled by NVRTC for [`ARCH`] at first use and cached for the process.
///
/// # Errors
/// [`Error::Kernel`] naming `label` with NVRTC's log.
pub(crate) fn ptx(
    name: &'static str,
    source: &str,
    defines: Vec<String>,
    label: &str,
) -> Result<Arc<str>> {
    let mut cache = PTX.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    let key = (name, defines);
    if let Some(ptx) = cache.get(&key) {
        return Ok(ptx.clone());
    }
    let options = CompileOptions {
        arch: Some(ARCH),
        options: key.1.clone(),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, options).map_err(|e| Error::Kernel {
        kernel: label.to_string(),
        reason: format!("NVRTC: {e}"),
    })?;
    let ptx: Arc<str> = ptx.to_src().into();
    cache.insert(key, ptx.clone());
    Ok(ptx)
}
