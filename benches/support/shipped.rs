//! The thresholds of a shipped config, for benchmarks that run a workload as
//! its config does.

/// Θ, L and Γ of `configs/<name>`.
pub fn shipped_thresholds(name: &str) -> (f64, u64, u64) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs")
        .join(name);
    let config = afstream::service::config::load(&path, &|_| None).unwrap_or_else(|e| panic!("{e}"));
    let ft = &config.pipeline.fault_tolerance;
    (ft.theta, ft.max_uncovered, ft.max_unacked)
}
