//! Dropout keep-masks from a counter-based hash, made on the tensor's own device: on CUDA by
//! `kernels/dropout.cu`, on the CPU by the loop below, its twin. Entry (row, feature) is kept
//! when the top 53 bits of absorb(absorb(site_hash, first_row + row), feature), read as a
//! uniform number in [0, 1), are at least p. Being a function of coordinates rather than of a
//! generator's state, a mask is the same on every device, for a batch run whole or in shards,
//! and after a resumption.

use candle_core::{bail, DType, Device, Result, Tensor};

pub mod cuda;

/// SplitMix64's finaliser: a bijective mix whose outputs pass as independent uniform words.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One step of the key chain: the hash so far combined with the next coordinate.
pub fn absorb(h: u64, v: u64) -> u64 {
    mix(h ^ v.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Whether entry (row, feature) of a call with `site_hash` is kept under `bound`
/// ([`threshold`]).
pub(crate) fn kept(site_hash: u64, row: u64, feature: u64, bound: u64) -> bool {
    absorb(absorb(site_hash, row), feature) >> 11 >= bound
}

/// The bound on a hash's top 53 bits k from which an entry is kept: ceil(p·2⁵³), so that
/// k ≥ bound exactly when k·2⁻⁵³ ≥ p (both sides exact in f64).
pub(crate) fn threshold(p: f64) -> u64 {
    (p * (1u64 << 53) as f64).ceil() as u64
}

/// The keep-mask of one dropout call: (rows, features) of 1 (kept) and 0 (dropped) in `dtype`
/// on `device`, for a drop rate `p` in [0, 1). See the module docs for the hash.
pub fn dropout_keep(
    site_hash: u64,
    first_row: u64,
    rows: usize,
    features: usize,
    p: f64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        bail!("dropout: the rate must be in [0, 1), got {p}");
    }
    let bound = threshold(p);
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let plan = cuda::keep_plan(rows, features, site_hash, first_row, p, dtype)?;
            cuda::launch_keep(dev, &plan, dtype, (rows, features))
        }
        _ => {
            let keep: Vec<f32> = (0..rows as u64)
                .flat_map(|r| (0..features as u64).map(move |f| (r, f)))
                .map(|(r, f)| {
                    if kept(site_hash, first_row + r, f, bound) {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect();
            Tensor::from_vec(keep, (rows, features), device)?.to_dtype(dtype)
        }
    }
}
