//! Heavy-hitter detection with a Count-Min sketch weighted by bytes.
//!
//! Every packet adds its bytes to one counter in each of `depth` rows; a flow's
//! estimate is the smallest of its counters, which never undercounts. A flow is
//! reported once, the first time its estimate crosses the threshold (absolute
//! bytes, or a fraction of all bytes seen).
//!
//! Divergence: the largest drift of one counter from its backup (a per-key
//! maximum, so it needs no split across partitions), and only the counters over θ
//! are backed up. α is the largest packet (`max_weight`), β = 1.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{
    acknowledge_all, backup_all, fail_all, restore_all, AnalysisConstants, BackupScope, Operator, ProcessError,
    Rejected,
};
use crate::structures::{Norm, Tracked, TrackedSet, TrackedValue, TrackedVector};

const SKETCH: u8 = 1;
const TOTAL: u8 = 2;
const REPORTED: u8 = 3;

/// When a flow is a heavy hitter.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HitterThreshold {
    /// At least this many bytes.
    Bytes(f64),
    /// At least this fraction of all bytes seen so far.
    Fraction(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeavyHitterConfig {
    pub depth: usize,
    pub width: usize,
    pub threshold: HitterThreshold,
    /// The largest packet accepted, in bytes: α of the bound.
    pub max_weight: u64,
}

impl Default for HeavyHitterConfig {
    fn default() -> Self {
        HeavyHitterConfig {
            depth: 4,
            width: 8192,
            // The papers' heavy hitter: a flow over 10 MB.
            threshold: HitterThreshold::Bytes(10e6),
            max_weight: 65_535,
        }
    }
}

/// One packet of a flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowPacket {
    pub flow: Vec<u8>,
    pub bytes: u64,
}

/// A flow reported as a heavy hitter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeavyHitter {
    pub flow: Vec<u8>,
    pub estimate: f64,
}

/// The counter of a flow's hash in one row. Double hashing (Kirsch–Mitzenmacher)
/// gives the rows independent-enough positions from one 64-bit hash, and the
/// multiply-shift maps to [0, width) without a division.
#[inline]
fn cell(hash: u64, row: u64, width: u64) -> u32 {
    let h = hash.wrapping_add(row.wrapping_mul(hash.rotate_left(32) | 1));
    (row * width + ((h as u128 * width as u128) >> 64) as u64) as u32
}

#[derive(Clone, Debug)]
pub struct HeavyHitters {
    config: HeavyHitterConfig,
    sketch: TrackedVector,
    total: TrackedValue,
    /// Hashes of the flows already reported (64 bits: collisions are negligible).
    reported: TrackedSet<u64>,
}

impl HeavyHitters {
    pub fn new(config: HeavyHitterConfig) -> Result<Self, CoreError> {
        if config.depth == 0 || config.depth > 64 {
            return Err(CoreError::parameter("depth", config.depth, "between 1 and 64 rows"));
        }
        if config.width == 0 {
            return Err(CoreError::parameter(
                "width",
                config.width,
                "at least one counter per row",
            ));
        }
        if config.max_weight == 0 {
            return Err(CoreError::parameter(
                "max_weight",
                config.max_weight,
                "packets weigh at least one byte",
            ));
        }
        match config.threshold {
            HitterThreshold::Bytes(b) if !(b.is_finite() && b > 0.0) => {
                return Err(CoreError::parameter("threshold.bytes", b, "a positive number of bytes"))
            }
            HitterThreshold::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                return Err(CoreError::parameter("threshold.fraction", f, "a fraction in (0, 1]"))
            }
            _ => {}
        }
        let cells = config
            .depth
            .checked_mul(config.width)
            .ok_or_else(|| CoreError::parameter("width", config.width, "depth × width overflows"))?;
        Ok(HeavyHitters {
            config,
            sketch: TrackedVector::new(SKETCH, Norm::Max, cells)?,
            total: TrackedValue::new(TOTAL),
            reported: TrackedSet::new(REPORTED),
        })
    }

    pub fn config(&self) -> &HeavyHitterConfig {
        &self.config
    }

    /// The sketch's estimate of a flow's bytes (never below the truth).
    pub fn estimate(&self, flow: &[u8]) -> f64 {
        let hash = xxh3_64(flow);
        let width = self.config.width as u64;
        (0..self.config.depth as u64)
            .map(|row| self.sketch.get(cell(hash, row, width)))
            .fold(f64::INFINITY, f64::min)
    }

    /// All bytes seen.
    pub fn total_bytes(&self) -> f64 {
        self.total.get()
    }

    fn threshold_bytes(&self) -> f64 {
        match self.config.threshold {
            HitterThreshold::Bytes(bytes) => bytes,
            HitterThreshold::Fraction(fraction) => fraction * self.total.get(),
        }
    }

    /// Whether the state holds that this flow was reported.
    pub fn was_reported(&self, flow: &[u8]) -> bool {
        self.reported.contains(&xxh3_64(flow))
    }

    /// Whether a flow counts as a heavy hitter by the current sketch.
    pub fn is_heavy(&self, flow: &[u8]) -> bool {
        self.estimate(flow) >= self.threshold_bytes()
    }

    /// The largest counter difference between two sketches.
    pub fn sketch_distance(&self, other: &HeavyHitters) -> f64 {
        self.sketch.distance(&other.sketch)
    }
}

impl Operator for HeavyHitters {
    type Input = FlowPacket;
    type Output = HeavyHitter;

    #[inline]
    fn process(&mut self, packet: &FlowPacket, outputs: &mut Vec<HeavyHitter>) -> Result<(), ProcessError> {
        if packet.bytes > self.config.max_weight {
            return Err(Rejected(format!(
                "packet of {} bytes is over max_weight = {}",
                packet.bytes, self.config.max_weight
            ))
            .into());
        }
        let weight = packet.bytes as f64;
        let hash = xxh3_64(&packet.flow);
        let width = self.config.width as u64;
        let mut estimate = f64::INFINITY;
        for row in 0..self.config.depth as u64 {
            let cell = cell(hash, row, width);
            self.sketch.add(cell, weight);
            estimate = estimate.min(self.sketch.get(cell));
        }
        self.total.add(weight);
        if estimate >= self.threshold_bytes() && !self.reported.contains(&hash) {
            self.reported.insert(hash);
            outputs.push(HeavyHitter {
                flow: packet.flow.clone(),
                estimate,
            });
        }
        Ok(())
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.sketch.divergence()
    }

    fn norm(&self) -> Norm {
        Norm::Max
    }

    fn set_theta(&mut self, theta: f64) {
        self.sketch.set_theta(theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        backup_all(
            &mut [&mut self.sketch, &mut self.total, &mut self.reported],
            seq,
            scope,
            out,
        );
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        acknowledge_all(&mut [&mut self.sketch, &mut self.total, &mut self.reported], seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        fail_all(&mut [&mut self.sketch, &mut self.total, &mut self.reported], seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        restore_all(&mut [&mut self.sketch, &mut self.total, &mut self.reported], entries)
    }

    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants {
            alpha: self.config.max_weight as f64,
            beta: 1,
        }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.sketch_distance(other)
    }
}

/// Precision, recall and F1 of a detected set against the true one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DetectionAccuracy {
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
}

/// Scores detected heavy hitters against the exact ones. Empty sets score 1.
pub fn detection_accuracy<T: Eq + std::hash::Hash>(detected: &HashSet<T>, truth: &HashSet<T>) -> DetectionAccuracy {
    let hits = detected.intersection(truth).count() as f64;
    let precision = if detected.is_empty() {
        1.0
    } else {
        hits / detected.len() as f64
    };
    let recall = if truth.is_empty() {
        1.0
    } else {
        hits / truth.len() as f64
    };
    let f1 = if precision + recall == 0.0 {
        0.0
    } else {
        2.0 * precision * recall / (precision + recall)
    };
    DetectionAccuracy { precision, recall, f1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(flow: &str, bytes: u64) -> FlowPacket {
        FlowPacket {
            flow: flow.as_bytes().to_vec(),
            bytes,
        }
    }

    #[test]
    fn reports_a_flow_once_when_it_crosses_the_threshold() {
        let config = HeavyHitterConfig {
            threshold: HitterThreshold::Bytes(3000.0),
            ..HeavyHitterConfig::default()
        };
        let mut hh = HeavyHitters::new(config).unwrap();
        let mut out = Vec::new();
        for _ in 0..2 {
            hh.process(&packet("big", 1000), &mut out).unwrap();
        }
        hh.process(&packet("small", 10), &mut out).unwrap();
        assert!(out.is_empty());
        hh.process(&packet("big", 1000), &mut out).unwrap();
        hh.process(&packet("big", 1000), &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].flow, b"big");
        assert!(hh.estimate(b"big") >= 4000.0);
        assert!(hh.is_heavy(b"big") && !hh.is_heavy(b"small"));
    }

    #[test]
    fn oversized_packets_are_rejected_without_changing_state() {
        let mut hh = HeavyHitters::new(HeavyHitterConfig::default()).unwrap();
        let mut out = Vec::new();
        let err = hh.process(&packet("x", 1 << 20), &mut out).unwrap_err();
        assert!(err.to_string().contains("max_weight"));
        assert_eq!(hh.total_bytes(), 0.0);
    }

    #[test]
    fn bad_parameters_are_errors() {
        for config in [
            HeavyHitterConfig {
                depth: 0,
                ..Default::default()
            },
            HeavyHitterConfig {
                width: 0,
                ..Default::default()
            },
            HeavyHitterConfig {
                threshold: HitterThreshold::Fraction(1.5),
                ..Default::default()
            },
            HeavyHitterConfig {
                threshold: HitterThreshold::Bytes(f64::NAN),
                ..Default::default()
            },
        ] {
            assert!(HeavyHitters::new(config).is_err());
        }
    }

    #[test]
    fn partial_backup_holds_only_counters_over_theta() {
        let mut hh = HeavyHitters::new(HeavyHitterConfig::default()).unwrap();
        hh.set_theta(1500.0);
        let mut out = Vec::new();
        hh.process(&packet("a", 1000), &mut out).unwrap();
        hh.process(&packet("b", 100), &mut out).unwrap();
        assert!(hh.divergence() <= 1500.0);
        hh.process(&packet("a", 1000), &mut out).unwrap();
        assert_eq!(hh.divergence(), 2000.0);
        let mut entries = BackupBatch::new(0);
        hh.backup(0, BackupScope::Drifted, &mut entries);
        let counters = entries.iter().filter(|e| e.key[0] == SKETCH).count();
        assert_eq!(counters, 4, "one counter per row for flow a, none for b");
        assert!(
            hh.divergence() <= 1500.0,
            "measured from the backup issued, acknowledged or not"
        );
        hh.fail_backup(0);
        let mut again = BackupBatch::new(1);
        hh.backup(1, BackupScope::Owed, &mut again);
        let owed = again.iter().filter(|e| e.key[0] == SKETCH).count();
        assert_eq!(owed, counters, "a failed backup's counters are owed again");
        hh.acknowledge_backup(1);
        assert!(hh.divergence() <= 1500.0);
        let mut restored = HeavyHitters::new(HeavyHitterConfig::default()).unwrap();
        restored.restore(&entries.entries().unwrap()).unwrap();
        assert_eq!(restored.estimate(b"a"), 2000.0);
        assert_eq!(restored.estimate(b"b"), 0.0, "b's drift was under θ");
    }

    #[test]
    fn accuracy_scores() {
        let detected: HashSet<_> = [1, 2, 3, 4].into_iter().collect();
        let truth: HashSet<_> = [1, 2, 3].into_iter().collect();
        let a = detection_accuracy(&detected, &truth);
        assert_eq!(a.precision, 0.75);
        assert_eq!(a.recall, 1.0);
    }
}
