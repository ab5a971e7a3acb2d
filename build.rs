//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on, the way candle's
//! own kernels are built (cudaforge: `CUDA_COMPUTE_CAP` if set, else nvidia-smi; nvcc from
//! `CUDA_ROOT`/`CUDA_PATH`/`PATH`). Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    commit();
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

/// The commit of a build from a git checkout, as `MYO_COMMIT` (a run's `config.json` records
/// it), renewed when HEAD moves.
fn commit() {
    let Ok(head) = std::fs::read_to_string(".git/HEAD") else {
        return;
    };
    println!("cargo::rerun-if-changed=.git/HEAD");
    if let Some(branch) = head.trim().strip_prefix("ref: ") {
        let r = format!(".git/{branch}");
        if std::path::Path::new(&r).exists() {
            println!("cargo::rerun-if-changed={r}");
        }
    }
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output();
    if let Some(out) = out.ok().filter(|o| o.status.success()) {
        let commit = String::from_utf8_lossy(&out.stdout);
        println!("cargo::rustc-env=MYO_COMMIT={}", commit.trim());
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
        // The compute capability the kernels are built for, which the library reports: a
        // build for 7.0 has none of candle's bf16 arithmetic.
        if let Ok(cap) = cudaforge::detect_compute_cap() {
            println!("cargo::rustc-env=MYO_CUDA_COMPUTE_CAP={}", cap.base());
        }
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
