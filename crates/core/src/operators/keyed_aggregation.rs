//! Count or sum per key.
//!
//! Divergence: L1 (the total drift over all keys, which adds up across partitions)
//! or the max difference of one key (per key, no split), chosen in config. α is 1
//! for counts and `max_abs_value` for sums; β = 1 (the key's new value is emitted).

use serde::{Deserialize, Serialize};

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{AnalysisConstants, BackupScope, Operator, ProcessError, Rejected};
use crate::structures::{KeyStore, Norm, Tracked, TrackedTable};

const TABLE: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    Count,
    Sum,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KeyedAggregationConfig {
    pub aggregate: Aggregate,
    pub divergence: Norm,
    /// Sums only: values larger in magnitude are rejected (α of the bound).
    pub max_abs_value: f64,
}

impl Default for KeyedAggregationConfig {
    fn default() -> Self {
        KeyedAggregationConfig {
            aggregate: Aggregate::Count,
            divergence: Norm::L1,
            max_abs_value: 1e6,
        }
    }
}

/// A keyed number.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyedValue {
    pub key: Vec<u8>,
    pub value: f64,
}

/// A key's new aggregate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyUpdate {
    pub key: Vec<u8>,
    pub value: f64,
}

/// Checks a divergence choice for a per-key table of numbers.
pub(crate) fn table_norm(norm: Norm) -> Result<Norm, CoreError> {
    match norm {
        Norm::L1 | Norm::Max | Norm::L2 => Ok(norm),
        Norm::KeyCount => Err(CoreError::parameter(
            "divergence",
            "key_count",
            "counts change without new keys; use l1, l2 or max",
        )),
    }
}

#[derive(Clone, Debug)]
pub struct KeyedAggregation {
    config: KeyedAggregationConfig,
    table: TrackedTable<Vec<u8>>,
}

impl KeyedAggregation {
    pub fn new(config: KeyedAggregationConfig) -> Result<Self, CoreError> {
        let norm = table_norm(config.divergence)?;
        if config.aggregate == Aggregate::Sum && !(config.max_abs_value.is_finite() && config.max_abs_value > 0.0) {
            return Err(CoreError::parameter(
                "max_abs_value",
                config.max_abs_value,
                "a positive number: it is α of the bound",
            ));
        }
        Ok(KeyedAggregation {
            config,
            table: TrackedTable::new(TABLE, norm),
        })
    }

    /// Keyed aggregation whose values live in `store`, with about
    /// `resident_budget` clean keys kept in memory (see [`TrackedTable::with_store`]).
    pub fn with_store(
        config: KeyedAggregationConfig,
        store: Box<dyn KeyStore>,
        resident_budget: usize,
    ) -> Result<Self, CoreError> {
        let mut aggregation = Self::new(config)?;
        aggregation.table = TrackedTable::with_store(TABLE, aggregation.table.norm(), store, resident_budget);
        Ok(aggregation)
    }

    /// The value of `key`, read from the store when it is not in memory.
    pub fn get(&self, key: &[u8]) -> Result<Option<f64>, CoreError> {
        self.table.lookup(&key.to_vec())
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Vec<u8>, f64)> + '_ {
        self.table.iter()
    }
}

impl Operator for KeyedAggregation {
    type Input = KeyedValue;
    type Output = KeyUpdate;

    fn process(&mut self, item: &KeyedValue, outputs: &mut Vec<KeyUpdate>) -> Result<(), ProcessError> {
        let delta = match self.config.aggregate {
            Aggregate::Count => 1.0,
            Aggregate::Sum => {
                if !(item.value.is_finite() && item.value.abs() <= self.config.max_abs_value) {
                    return Err(Rejected(format!(
                        "value {} is not a finite number within ±max_abs_value = {}",
                        item.value, self.config.max_abs_value
                    ))
                    .into());
                }
                item.value
            }
        };
        let value = self.table.add(item.key.as_slice(), delta)?;
        outputs.push(KeyUpdate {
            key: item.key.clone(),
            value,
        });
        Ok(())
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.table.divergence()
    }

    fn norm(&self) -> Norm {
        self.table.norm()
    }

    fn set_theta(&mut self, theta: f64) {
        self.table.set_theta(theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        self.table.backup(seq, scope, out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        self.table.acknowledge(seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        self.table.fail(seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        crate::operator::restore_all(&mut [&mut self.table], entries)
    }

    fn has_local_state(&self) -> bool {
        self.table.has_store()
    }

    fn stage_state(&mut self) {
        self.table.stage_changes();
    }

    fn state_durable(&mut self) {
        self.table.changes_durable();
    }

    fn load_local_state(&mut self) -> Result<usize, CoreError> {
        self.table.load_drifted()
    }

    fn constants(&self) -> AnalysisConstants {
        let alpha = match self.config.aggregate {
            Aggregate::Count => 1.0,
            Aggregate::Sum => self.config.max_abs_value,
        };
        AnalysisConstants { alpha, beta: 1 }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.table.distance(&other.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_sums_per_key() {
        let mut sums = KeyedAggregation::new(KeyedAggregationConfig {
            aggregate: Aggregate::Sum,
            ..Default::default()
        })
        .unwrap();
        let mut out = Vec::new();
        for (key, value) in [("a", 2.0), ("b", 1.0), ("a", -0.5)] {
            sums.process(
                &KeyedValue {
                    key: key.as_bytes().to_vec(),
                    value,
                },
                &mut out,
            )
            .unwrap();
        }
        assert_eq!(sums.get(b"a"), Ok(Some(1.5)));
        assert_eq!(out.last().map(|u| u.value), Some(1.5));
        let too_big = KeyedValue {
            key: b"a".to_vec(),
            value: 1e9,
        };
        assert!(sums.process(&too_big, &mut out).is_err());
        assert_eq!(sums.get(b"a"), Ok(Some(1.5)));
        assert!(KeyedAggregation::new(KeyedAggregationConfig {
            divergence: Norm::KeyCount,
            ..Default::default()
        })
        .is_err());
    }
}
