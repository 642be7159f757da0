//! Online Ripple Join of two streams on a key, estimating COUNT and SUM of the join
//! from Bernoulli samples of both sides, with a 95% confidence interval.
//!
//! A tuple is sampled when the hash of its side and id falls under the sampling
//! rate, so a replayed tuple gets the same decision. Per join key the state keeps
//! the sampled tuple count and value sum of each side; the estimates are kept
//! incrementally:
//!
//! * COUNT = Σ_k a_k·b_k / p², with a_k, b_k the sampled counts of key k;
//! * SUM   = Σ_k (s^L_k·b_k + a_k·s^R_k) / p², the sum of left + right value over
//!   all joined pairs;
//! * Var(COUNT) is estimated without bias per key as
//!   (a²b² − (a² − a(1−p))(b² − b(1−p))) / p⁴ and summed over keys; SUM's interval
//!   is COUNT's relative width applied to SUM (an approximation).
//!
//! Divergence: the difference in sampled-tuple count (L1 over the counts); α = 1,
//! β = 1 (an estimate is emitted every `emit_every` items).
//!
//! State: one table from (key, side) to the sampled count, each carrying the
//! side's value sum ([`TrackedTable::with_carried`]). A key's sum changes
//! exactly when its count does, so the count's drift decides when both are
//! written, in one changelog record (structure tag 3). Changelogs written
//! before kept them as two tables (tags 1 and 2, one record each); a restore
//! still reads those, and applies them before the records of tag 3, which are
//! newer wherever both hold a key. A backup writes every key changed since
//! it was last written (no θ is set on the table): the join's drift comes one
//! sampled tuple at a time, spread over many keys, so writing only the
//! largest drifts down to θ/2 would write as many records in twice as many
//! backups.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::batch::BackupBatch;
use crate::entry::{decode_f64, BackupEntry, MARKER_TAG};
use crate::error::CoreError;
use crate::operator::{AnalysisConstants, BackupScope, Operator, ProcessError, Rejected};
use crate::structures::{Norm, TableKey, Tracked, TrackedTable};

/// (key, side) → sampled count, carrying the side's value sum.
const PAIRS: u8 = 3;
/// Changelogs written before the pairs: (key, side) → sampled count.
const LEGACY_COUNTS: u8 = 1;
/// Changelogs written before the pairs: (key, side) → sum of sampled values.
const LEGACY_SUMS: u8 = 2;
const Z95: f64 = 1.959_963_984_540_054;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    Left,
    Right,
}

impl Side {
    fn code(self) -> u8 {
        match self {
            Side::Left => 0,
            Side::Right => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JoinConfig {
    /// p: the fraction of each stream sampled (the papers: 10%).
    pub sampling_rate: f64,
    /// Emit an estimate every this many items.
    pub emit_every: u64,
}

impl Default for JoinConfig {
    fn default() -> Self {
        JoinConfig {
            sampling_rate: 0.1,
            emit_every: 1000,
        }
    }
}

/// One tuple of either stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinTuple {
    pub side: Side,
    /// Unique within its side: decides the sampling.
    pub id: u64,
    pub key: u64,
    pub value: f64,
}

/// The running estimate of the join.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct JoinEstimate {
    pub count: f64,
    pub count_ci95: f64,
    pub sum: f64,
    pub sum_ci95: f64,
    pub sampled: u64,
}

#[derive(Clone, Debug)]
pub struct OnlineJoin {
    config: JoinConfig,
    /// (key, side) → sampled tuples, carrying the sum of their values.
    pairs: TrackedTable<(u64, u8)>,
    raw_count: f64,
    raw_sum: f64,
    raw_variance: f64,
    sampled: u64,
    since_emit: u64,
}

impl OnlineJoin {
    pub fn new(config: JoinConfig) -> Result<Self, CoreError> {
        if !(config.sampling_rate > 0.0 && config.sampling_rate <= 1.0) {
            return Err(CoreError::parameter(
                "sampling_rate",
                config.sampling_rate,
                "a fraction in (0, 1]",
            ));
        }
        if config.emit_every == 0 {
            return Err(CoreError::parameter("emit_every", 0, "emit at least every 1 item"));
        }
        Ok(OnlineJoin {
            config,
            pairs: TrackedTable::with_carried(PAIRS, Norm::L1),
            raw_count: 0.0,
            raw_sum: 0.0,
            raw_variance: 0.0,
            sampled: 0,
            since_emit: 0,
        })
    }

    fn sampled_tuple(&self, tuple: &JoinTuple) -> bool {
        let hash = xxh3_64_with_seed(&tuple.id.to_le_bytes(), u64::from(tuple.side.code()));
        (hash as f64) < self.config.sampling_rate * u64::MAX as f64
    }

    fn key_variance(&self, a: f64, b: f64) -> f64 {
        let q = 1.0 - self.config.sampling_rate;
        a * a * b * b - (a * a - a * q) * (b * b - b * q)
    }

    /// The current estimate.
    pub fn estimate(&self) -> JoinEstimate {
        let p2 = self.config.sampling_rate.powi(2);
        let count = self.raw_count / p2;
        let count_ci95 = Z95 * (self.raw_variance.max(0.0)).sqrt() / p2;
        let sum = self.raw_sum / p2;
        let relative = if count > 0.0 { count_ci95 / count } else { 0.0 };
        JoinEstimate {
            count,
            count_ci95,
            sum,
            sum_ci95: (sum * relative).abs(),
            sampled: self.sampled,
        }
    }

    fn recompute_estimates(&mut self) {
        let (mut count, mut sum, mut variance, mut sampled) = (0.0, 0.0, 0.0, 0.0);
        for (&(key, side), a, sa) in self.pairs.iter_pairs() {
            sampled += a;
            if side != Side::Left.code() {
                continue;
            }
            let (b, sb) = self.pairs.get_pair(&(key, Side::Right.code())).unwrap_or((0.0, 0.0));
            count += a * b;
            sum += sa * b + a * sb;
            variance += self.key_variance(a, b);
        }
        self.raw_count = count;
        self.raw_sum = sum;
        self.raw_variance = variance;
        self.sampled = sampled as u64;
    }
}

impl Operator for OnlineJoin {
    type Input = JoinTuple;
    type Output = JoinEstimate;

    fn process(&mut self, tuple: &JoinTuple, outputs: &mut Vec<JoinEstimate>) -> Result<(), ProcessError> {
        if !tuple.value.is_finite() {
            return Err(Rejected(format!("join value {} is not a finite number", tuple.value)).into());
        }
        if self.sampled_tuple(tuple) {
            let (mine, other) = match tuple.side {
                Side::Left => (Side::Left.code(), Side::Right.code()),
                Side::Right => (Side::Right.code(), Side::Left.code()),
            };
            let (other_count, other_sum) = self.pairs.get_pair(&(tuple.key, other)).unwrap_or((0.0, 0.0));
            let (count, _) = self.pairs.add_pair(&(tuple.key, mine), 1.0, tuple.value)?;
            let before = count - 1.0;
            self.raw_count += other_count;
            self.raw_sum += tuple.value * other_count + other_sum;
            self.raw_variance += self.key_variance(before + 1.0, other_count) - self.key_variance(before, other_count);
            self.sampled += 1;
        }
        self.since_emit += 1;
        if self.since_emit >= self.config.emit_every {
            self.since_emit = 0;
            outputs.push(self.estimate());
        }
        Ok(())
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.pairs.divergence()
    }

    fn norm(&self) -> Norm {
        Norm::L1
    }

    /// No θ on the table: a backup writes every key changed since it was last
    /// written (see the module docs).
    fn set_theta(&mut self, _theta: f64) {}

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        // A backup for l within θ leaves the pairs unwritten: a sum is then
        // off by at most the largest value times its count's drift.
        self.pairs.backup(seq, scope, out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        self.pairs.acknowledge(seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        self.pairs.fail(seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        // The two tables of older changelogs first: a pair record of a key
        // is newer than either of its records there.
        for entry in entries {
            let tag = entry.tag()?;
            match tag {
                LEGACY_COUNTS | LEGACY_SUMS => self.restore_legacy(tag, entry)?,
                PAIRS | MARKER_TAG => {}
                _ => return Err(unknown_tag(tag)),
            }
        }
        for entry in entries.iter().filter(|entry| entry.tag().ok() == Some(PAIRS)) {
            self.pairs.restore(entry)?;
        }
        self.recompute_estimates();
        Ok(())
    }

    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants { alpha: 1.0, beta: 1 }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.pairs.distance(&other.pairs)
    }
}

impl OnlineJoin {
    /// A record of the count or the sum table of a changelog written before
    /// the pairs. A deletion sets zero, or nothing for a key not held.
    fn restore_legacy(&mut self, tag: u8, entry: &BackupEntry) -> Result<(), CoreError> {
        let key = <(u64, u8)>::read_key(entry.key_body())?;
        let number = match entry.value.as_deref() {
            Some(bytes) => decode_f64(bytes)?,
            None if self.pairs.get_pair(&key).is_none() => return Ok(()),
            None => 0.0,
        };
        if tag == LEGACY_COUNTS {
            self.pairs.restore_value(&key, number)
        } else {
            self.pairs.restore_carried(&key, number)
        }
    }
}

fn unknown_tag(tag: u8) -> CoreError {
    CoreError::undecodable(
        "entry key",
        format!("structure tag {tag} belongs to no structure of the online join"),
    )
}

/// The exact COUNT and SUM of the join of a finite stream, for accuracy checks.
pub fn exact_join(stream: &[JoinTuple]) -> (f64, f64) {
    use std::collections::HashMap;
    let mut per_key: HashMap<u64, [f64; 4]> = HashMap::new();
    for t in stream {
        let cell = per_key.entry(t.key).or_default();
        let side = t.side.code() as usize;
        cell[side] += 1.0;
        cell[2 + side] += t.value;
    }
    per_key.values().fold((0.0, 0.0), |(count, sum), [a, b, sa, sb]| {
        (count + a * b, sum + sa * b + a * sb)
    })
}

/// |estimate − exact| / |exact| (0 when both are 0).
pub fn relative_error(estimate: f64, exact: f64) -> f64 {
    if exact == 0.0 {
        if estimate == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (estimate - exact).abs() / exact.abs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(n: u64, keys: u64) -> Vec<JoinTuple> {
        (0..n)
            .map(|i| JoinTuple {
                side: if i % 2 == 0 { Side::Left } else { Side::Right },
                id: i,
                key: (i / 2) % keys,
                value: (i % 7) as f64,
            })
            .collect()
    }

    #[test]
    fn full_sampling_is_exact() {
        let data = stream(2000, 50);
        let mut join = OnlineJoin::new(JoinConfig {
            sampling_rate: 1.0,
            emit_every: 1,
        })
        .unwrap();
        let mut out = Vec::new();
        for t in &data {
            join.process(t, &mut out).unwrap();
        }
        let (count, sum) = exact_join(&data);
        let est = join.estimate();
        assert_eq!(est.count, count);
        assert!((est.sum - sum).abs() < 1e-6 * sum);
        assert_eq!(est.count_ci95, 0.0, "no sampling, no uncertainty");
        assert_eq!(out.len(), 2000);
    }

    #[test]
    fn sampled_estimate_is_close_and_restores_exactly() {
        let data = stream(40_000, 20);
        let mut join = OnlineJoin::new(JoinConfig::default()).unwrap();
        let mut out = Vec::new();
        for t in &data {
            join.process(t, &mut out).unwrap();
        }
        let (count, _) = exact_join(&data);
        let est = join.estimate();
        assert!(relative_error(est.count, count) < 0.15, "{} vs {count}", est.count);
        assert!((est.count - count).abs() <= 2.5 * est.count_ci95, "within the interval");
        let mut entries = BackupBatch::new(0);
        join.backup(0, BackupScope::Complete, &mut entries);
        let mut restored = OnlineJoin::new(JoinConfig::default()).unwrap();
        restored.restore(&entries.entries().unwrap()).unwrap();
        assert_eq!(restored.estimate(), JoinEstimate { ..est });
        assert_eq!(join.distance(&restored), 0.0);
    }

    #[test]
    fn a_sampled_key_and_side_is_one_record_with_its_count_and_sum() {
        let data = stream(400, 50);
        let mut join = OnlineJoin::new(JoinConfig {
            sampling_rate: 1.0,
            emit_every: 1000,
        })
        .unwrap();
        for t in &data {
            join.process(t, &mut Vec::new()).unwrap();
        }
        let mut records = BackupBatch::new(1);
        join.backup(1, BackupScope::Complete, &mut records);
        // 50 keys, both sides sampled in each.
        assert_eq!(records.len(), 100);
        let mut restored = OnlineJoin::new(JoinConfig::default()).unwrap();
        restored.restore(&records.entries().unwrap()).unwrap();
        let (count, sum) = exact_join(&data);
        let p2 = JoinConfig::default().sampling_rate.powi(2);
        assert_eq!(restored.estimate().count * p2, count, "the counts came back");
        assert!(
            (restored.estimate().sum * p2 - sum).abs() < 1e-6 * sum,
            "the sums came back"
        );
    }

    #[test]
    fn a_changelog_of_separate_count_and_sum_tables_still_restores() {
        use crate::entry::{encode_f64, entry_key};
        let data = stream(2000, 20);
        let mut join = OnlineJoin::new(JoinConfig::default()).unwrap();
        for t in &data {
            join.process(t, &mut Vec::new()).unwrap();
        }
        // What a build before the pairs logged: a count record (tag 1) and a
        // sum record (tag 2) per key and side.
        let mut legacy = Vec::new();
        for (key, count, sum) in join.pairs.iter_pairs() {
            let mut body = Vec::new();
            key.write_key(&mut body);
            legacy.push(BackupEntry::new(
                entry_key(LEGACY_COUNTS, &body),
                Some(encode_f64(count)),
            ));
            legacy.push(BackupEntry::new(entry_key(LEGACY_SUMS, &body), Some(encode_f64(sum))));
        }
        let mut restored = OnlineJoin::new(JoinConfig::default()).unwrap();
        restored.restore(&legacy).unwrap();
        let mut pairs = BackupBatch::new(1);
        join.clone().backup(1, BackupScope::Complete, &mut pairs);
        let mut from_pairs = OnlineJoin::new(JoinConfig::default()).unwrap();
        from_pairs.restore(&pairs.entries().unwrap()).unwrap();
        assert_eq!(restored.estimate(), from_pairs.estimate());
        assert_eq!(join.distance(&restored), 0.0);
        // A pair record written since supersedes them, wherever it stands.
        let (&(key, side), count, sum) = join.pairs.iter_pairs().next().unwrap();
        let mut newer = BackupBatch::new(9);
        let mut later = join.clone();
        later.pairs.add_pair(&(key, side), 1.0, 5.0).unwrap();
        later.backup(9, BackupScope::Drifted, &mut newer);
        let mut mixed = newer.entries().unwrap();
        mixed.extend(legacy);
        let mut restored = OnlineJoin::new(JoinConfig::default()).unwrap();
        restored.restore(&mixed).unwrap();
        assert_eq!(restored.pairs.get_pair(&(key, side)), Some((count + 1.0, sum + 5.0)));
    }

    #[test]
    fn bad_values_and_parameters_are_rejected() {
        let mut join = OnlineJoin::new(JoinConfig::default()).unwrap();
        let bad = JoinTuple {
            side: Side::Left,
            id: 1,
            key: 1,
            value: f64::NAN,
        };
        assert!(join.process(&bad, &mut Vec::new()).is_err());
        assert!(OnlineJoin::new(JoinConfig {
            sampling_rate: 0.0,
            emit_every: 1
        })
        .is_err());
    }
}
