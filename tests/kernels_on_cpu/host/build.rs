//! Compiles kernels/*.cu as host C++ (through the one-file-per-kernel units in src/) with the
//! CUDA stand-ins of include/, and the fiber launcher.

fn main() {
    let kernels = "../../../kernels";
    for dir in [kernels, "include", "src"] {
        println!("cargo::rerun-if-changed={dir}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include("include")
        .include("src")
        .files([
            "src/launcher.cpp",
            "src/scan.cpp",
            "src/tree_solve.cpp",
            "src/tree_lanes.cpp",
            "src/tree_sweep.cpp",
            "src/head_solve.cpp",
            "src/dropout.cpp",
            "src/adamw.cpp",
            "src/gelu.cpp",
            "src/layer_norm.cpp",
            "src/channel.cpp",
            "src/batch_norm.cpp",
            "src/s5_discretize.cpp",
            "src/s5_readout.cpp",
            "src/s5_timed.cpp",
            "src/epilogue.cpp",
            "src/masked_mean.cpp",
            "src/cross_entropy.cpp",
            "src/embedding.cpp",
            "src/gather.cpp",
            "src/grad_norm.cpp",
        ])
        .opt_level(2)
        // The arithmetic of the CPU twins: no fused multiply-adds.
        .flag("-ffp-contract=off")
        // Dynamic shared memory is a byte array that kernels address as their value type.
        .flag("-fno-strict-aliasing")
        // `extern __shared__` arrays are `extern thread_local` with no dynamic initialisation:
        // no TLS init hook to call (a weak, unresolved one crashes in a PIE).
        .flag("-fno-extern-tls-init")
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-unknown-pragmas")
        .compile("kernels_on_cpu");
}
