// The counter-based hash of the dropout masks (kernels/dropout.cu, kernels/epilogue.cu; the
// CPU's is src/ops/dropout/mod.rs): entry (row, feature) of a call is kept when
// dropout_hash(site_hash, first_row + row, feature) >> 11 >= threshold.
#pragma once
#include "values.cuh"

// SplitMix64's finaliser.
__device__ __forceinline__ u64 dropout_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// One step of the key chain: the hash so far combined with the next coordinate.
__device__ __forceinline__ u64 dropout_absorb(u64 h, u64 v) {
    return dropout_mix(h ^ (v * 0x9e3779b97f4a7c15ULL));
}

// Whether entry (row, feature) of a call with this site hash and threshold is kept.
__device__ __forceinline__ bool dropout_kept(u64 site_hash, u64 row, u64 feature, u64 threshold) {
    return (dropout_absorb(dropout_absorb(site_hash, row), feature) >> 11) >= threshold;
}

// The site hash of a launch: `site_hash` as the host made it from (seed, step, site), or, where
// `key` points to the device's key word — the step's key, the chain so far of (seed, step) —
// made here from that word and `site`, the same chain, so that a launch captured in a CUDA graph
// masks each replay with the seed and step written before it.
__device__ __forceinline__ u64 dropout_site_hash(u64 site_hash, const u64 *key, u64 site) {
    return key ? dropout_absorb(*key, site) : site_hash;
}
