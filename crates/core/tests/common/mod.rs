//! What the core's property tests share.

use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence, RngSeed};

/// `default_cases` cases from a fixed seed, so CI is repeatable;
/// `AFSTREAM_PROPTEST_CASES=N` runs more and `AFSTREAM_PROPTEST_SEED=random` (or
/// a number) explores new streams. Failing cases are saved beside the test and
/// re-run first.
pub fn proptest_config(default_cases: u32) -> ProptestConfig {
    let cases = std::env::var("AFSTREAM_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let rng_seed = match std::env::var("AFSTREAM_PROPTEST_SEED").ok().as_deref() {
        Some("random") => RngSeed::Random,
        Some(n) => RngSeed::Fixed(n.parse().unwrap_or(0xaf)),
        None => RngSeed::Fixed(0xaf),
    };
    ProptestConfig {
        cases,
        rng_seed,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default()
    }
}
