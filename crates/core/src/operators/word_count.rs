//! WordCount over text lines.
//!
//! Words are maximal runs of alphanumeric characters, lower-cased. Each occurrence
//! emits the word's new count, so β is the most words a line may have
//! (`max_words_per_line`; longer lines are rejected whole). Divergence: L1 or the
//! max difference of one word; α = β either way (a line of one word repeated moves
//! one count by β).

use serde::{Deserialize, Serialize};

use super::keyed_aggregation::{table_norm, KeyUpdate};
use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{AnalysisConstants, BackupScope, Operator, ProcessError, Rejected};
use crate::structures::{KeyStore, Norm, Tracked, TrackedTable};

const TABLE: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WordCountConfig {
    pub divergence: Norm,
    pub max_words_per_line: u64,
}

impl Default for WordCountConfig {
    fn default() -> Self {
        WordCountConfig {
            divergence: Norm::L1,
            max_words_per_line: 1000,
        }
    }
}

#[derive(Clone, Debug)]
pub struct WordCount {
    config: WordCountConfig,
    counts: TrackedTable<String>,
    word: String,
}

/// The words of a line, as borrowed slices (lower-casing happens later).
pub(crate) fn words(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty())
}

impl WordCount {
    pub fn new(config: WordCountConfig) -> Result<Self, CoreError> {
        let norm = table_norm(config.divergence)?;
        if config.max_words_per_line == 0 {
            return Err(CoreError::parameter(
                "max_words_per_line",
                0,
                "a line may hold at least one word",
            ));
        }
        Ok(WordCount {
            config,
            counts: TrackedTable::new(TABLE, norm),
            word: String::new(),
        })
    }

    /// WordCount whose counts live in `store`, with about `resident_budget` clean
    /// words kept in memory (see [`TrackedTable::with_store`]).
    pub fn with_store(
        config: WordCountConfig,
        store: Box<dyn KeyStore>,
        resident_budget: usize,
    ) -> Result<Self, CoreError> {
        let mut word_count = Self::new(config)?;
        word_count.counts = TrackedTable::with_store(TABLE, word_count.counts.norm(), store, resident_budget);
        Ok(word_count)
    }

    /// The count of `word`, read from the store when it is not in memory.
    pub fn count(&self, word: &str) -> Result<f64, CoreError> {
        Ok(self.counts.lookup(&word.to_string())?.unwrap_or(0.0))
    }

    /// The words in memory (every word without a store) with their counts.
    pub fn iter(&self) -> impl Iterator<Item = (&String, f64)> + '_ {
        self.counts.iter()
    }

    /// Every word with its count, the store's included.
    pub fn counts(&self) -> Result<rustc_hash::FxHashMap<String, f64>, CoreError> {
        self.counts.entries()
    }
}

impl Operator for WordCount {
    type Input = String;
    type Output = KeyUpdate;

    fn process(&mut self, line: &String, outputs: &mut Vec<KeyUpdate>) -> Result<(), ProcessError> {
        let found = words(line).count() as u64;
        if found > self.config.max_words_per_line {
            return Err(Rejected(format!(
                "line has {found} words, over max_words_per_line = {}",
                self.config.max_words_per_line
            ))
            .into());
        }
        for raw in words(line) {
            self.word.clear();
            self.word.extend(raw.chars().flat_map(char::to_lowercase));
            let value = self.counts.add(self.word.as_str(), 1.0)?;
            outputs.push(KeyUpdate {
                key: self.word.as_bytes().to_vec(),
                value,
            });
        }
        Ok(())
    }

    #[inline]
    fn divergence(&self) -> f64 {
        self.counts.divergence()
    }

    fn norm(&self) -> Norm {
        self.counts.norm()
    }

    fn set_theta(&mut self, theta: f64) {
        self.counts.set_theta(theta);
    }

    fn backup(&mut self, seq: u64, scope: BackupScope, out: &mut BackupBatch) {
        self.counts.backup(seq, scope, out);
    }

    fn acknowledge_backup(&mut self, seq: u64) {
        self.counts.acknowledge(seq);
    }

    fn fail_backup(&mut self, seq: u64) {
        self.counts.fail(seq);
    }

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        crate::operator::restore_all(&mut [&mut self.counts], entries)
    }

    fn has_local_state(&self) -> bool {
        self.counts.has_store()
    }

    fn stage_state(&mut self) {
        self.counts.stage_changes();
    }

    fn state_durable(&mut self) {
        self.counts.changes_durable();
    }

    fn load_local_state(&mut self) -> Result<usize, CoreError> {
        self.counts.load_drifted()
    }

    fn constants(&self) -> AnalysisConstants {
        let beta = self.config.max_words_per_line;
        AnalysisConstants {
            alpha: beta as f64,
            beta,
        }
    }

    fn distance(&self, other: &Self) -> f64 {
        self.counts.distance(&other.counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_words_case_insensitively() {
        let mut wc = WordCount::new(WordCountConfig::default()).unwrap();
        let mut out = Vec::new();
        wc.process(&"The cat, the HAT.".to_string(), &mut out).unwrap();
        assert_eq!(wc.count("the").unwrap(), 2.0);
        assert_eq!(wc.count("hat").unwrap(), 1.0);
        assert_eq!(out.len(), 4);
        let mut small = WordCount::new(WordCountConfig {
            max_words_per_line: 2,
            ..Default::default()
        })
        .unwrap();
        assert!(small.process(&"a b c".to_string(), &mut out).is_err());
        assert_eq!(small.count("a").unwrap(), 0.0, "a rejected line changes nothing");
    }
}
