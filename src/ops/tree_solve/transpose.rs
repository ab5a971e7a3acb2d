//! Eight samples' rows into SIMD lanes (element e of row l to lane l of element e) and back,
//! eight elements at a time by 8 × 8 transposes in AVX2 registers, for values of 4 bytes (real
//! f32) or 8 (complex f32, moved as 64-bit units). The callers copy the rest one by one.

/// Rows solved together, one per lane.
pub(super) const LANES: usize = 8;

/// Whether [`to_lanes`] and [`from_lanes`] move values `V`.
#[inline(always)]
pub(super) fn available<V>() -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(size_of::<V>(), 4 | 8) {
        return std::is_x86_feature_detected!("avx2");
    }
    false
}

/// `lanes[e][l]` = `rows[l][e]` for e below `len` rounded down to whole groups of eight, the
/// count it returns (0 where not [`available`]).
///
/// # Safety
/// Each `rows[l]` must point to `len` values and `lanes` to `len` groups.
#[inline(always)]
pub(super) unsafe fn to_lanes<V>(
    rows: [*const V; LANES],
    len: usize,
    lanes: *mut [V; LANES],
) -> usize {
    if !available::<V>() {
        return 0;
    }
    let whole = len / LANES * LANES;
    #[cfg(target_arch = "x86_64")]
    for e in (0..whole).step_by(LANES) {
        let src = rows.map(|r| r.add(e));
        avx2::transpose(src, std::array::from_fn(|j| lanes.add(e + j).cast::<V>()));
    }
    whole
}

/// `rows[l][e]` = `lanes[e][l]` for e below `len` rounded down to whole groups of eight, the
/// count it returns (0 where not [`available`]).
///
/// # Safety
/// `lanes` must point to `len` groups and each `rows[l]` to `len` values the caller may
/// write.
#[inline(always)]
pub(super) unsafe fn from_lanes<V>(
    lanes: *const [V; LANES],
    len: usize,
    rows: [*mut V; LANES],
) -> usize {
    if !available::<V>() {
        return 0;
    }
    let whole = len / LANES * LANES;
    #[cfg(target_arch = "x86_64")]
    for e in (0..whole).step_by(LANES) {
        let src = std::array::from_fn(|j| lanes.add(e + j).cast::<V>());
        avx2::transpose(src, rows.map(|r| r.add(e)));
    }
    whole
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// dst[j][l] = src[l][j] for the 8 × 8 values at `src` (eight contiguous per row) of 4 or
    /// 8 bytes.
    #[inline(always)]
    pub(super) unsafe fn transpose<V>(src: [*const V; 8], dst: [*mut V; 8]) {
        if size_of::<V>() == 4 {
            transpose32(src.map(|p| p.cast()), dst.map(|p| p.cast()))
        } else {
            transpose64(src.map(|p| p.cast()), dst.map(|p| p.cast()))
        }
    }

    /// Four 4 × 4 transposes of 64-bit values (rows and columns in halves of four).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn transpose64(src: [*const f64; 8], dst: [*mut f64; 8]) {
        for (rb, cb) in [(0, 0), (0, 4), (4, 0), (4, 4)] {
            let r: [__m256d; 4] = std::array::from_fn(|i| _mm256_loadu_pd(src[rb + i].add(cb)));
            let t = [
                _mm256_unpacklo_pd(r[0], r[1]),
                _mm256_unpackhi_pd(r[0], r[1]),
                _mm256_unpacklo_pd(r[2], r[3]),
                _mm256_unpackhi_pd(r[2], r[3]),
            ];
            let cols = [
                _mm256_permute2f128_pd::<0x20>(t[0], t[2]),
                _mm256_permute2f128_pd::<0x20>(t[1], t[3]),
                _mm256_permute2f128_pd::<0x31>(t[0], t[2]),
                _mm256_permute2f128_pd::<0x31>(t[1], t[3]),
            ];
            for (j, c) in cols.into_iter().enumerate() {
                _mm256_storeu_pd(dst[cb + j].add(rb), c);
            }
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn transpose32(src: [*const f32; 8], dst: [*mut f32; 8]) {
        let r = src.map(|p| _mm256_loadu_ps(p));
        // Pairs of rows interleaved, then four rows per 128-bit half, then the halves joined.
        let lo = |a, b| _mm256_unpacklo_ps(a, b);
        let hi = |a, b| _mm256_unpackhi_ps(a, b);
        let t = [
            lo(r[0], r[1]),
            hi(r[0], r[1]),
            lo(r[2], r[3]),
            hi(r[2], r[3]),
            lo(r[4], r[5]),
            hi(r[4], r[5]),
            lo(r[6], r[7]),
            hi(r[6], r[7]),
        ];
        let s = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        let cols = [
            _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
            _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
        ];
        for (d, c) in dst.into_iter().zip(cols) {
            _mm256_storeu_ps(d, c);
        }
    }
}
