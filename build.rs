//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on, the way candle's
//! own kernels are built (cudaforge: `CUDA_COMPUTE_CAP` if set, else nvidia-smi; nvcc from
//! `CUDA_ROOT`/`CUDA_PATH`/`PATH`). Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    #[cfg(feature = "cuda")]
    if let Err(e) = cuda::build() {
        eprintln!("error: building kernels/*.cu failed: {e}");
        eprintln!(
            "hint: the `cuda` feature needs nvcc (CUDA 12.x for sm_70, 12.x or 13.x for sm_80+) and \
             CUDA_COMPUTE_CAP on a machine without a GPU; scripts/cuda-toolchain.sh installs one"
        );
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    pub fn build() -> Result<(), Box<dyn std::error::Error>> {
        // The shared headers: cudaforge recompiles a .cu when its own hash or a watched file
        // changes.
        let mut headers: Vec<String> = std::fs::read_dir("kernels")?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cuh"))
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        headers.sort();
        cudaforge::KernelBuilder::new()
            .source_dir("kernels")
            .watch(headers)
            .arg("-std=c++17")
            .arg("-O3")
            // No --use_fast_math: f32 division stays IEEE and subnormals are kept, so a pivot is
            // rejected exactly when it is zero or not finite, as on the CPU; the kernels are
            // memory-bound, so fast math would buy nothing. (nvcc still fuses a * b + c.)
            .build_ptx()?;
        Ok(())
    }
}
