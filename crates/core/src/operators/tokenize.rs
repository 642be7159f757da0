//! Tokenize: the first stage of a two-stage WordCount. Each line becomes its
//! words (WordCount's rule: maximal alphanumeric runs, lower-cased), one
//! output per word, keyed by the word so that the next stage (a count per key)
//! sees every occurrence of a word in one partition. Stateless: divergence 0,
//! α = 0; β = `max_words_per_line` (longer lines are rejected whole).

use serde::{Deserialize, Serialize};

use super::keyed_aggregation::KeyUpdate;
use super::word_count::words;
use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{restore_all, AnalysisConstants, BackupScope, Operator, ProcessError, Rejected};
use crate::structures::Norm;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizeConfig {
    /// β: the most words a line may have.
    pub max_words_per_line: u64,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        TokenizeConfig {
            max_words_per_line: 1000,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Tokenize {
    config: TokenizeConfig,
}

impl Tokenize {
    pub fn new(config: TokenizeConfig) -> Result<Self, CoreError> {
        if config.max_words_per_line == 0 {
            return Err(CoreError::parameter(
                "max_words_per_line",
                0,
                "a line may hold at least one word",
            ));
        }
        Ok(Tokenize { config })
    }
}

impl Operator for Tokenize {
    type Input = String;
    /// The word, and one occurrence of it.
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
        outputs.extend(words(line).map(|word| {
            KeyUpdate {
                key: word
                    .chars()
                    .flat_map(char::to_lowercase)
                    .collect::<String>()
                    .into_bytes(),
                value: 1.0,
            }
        }));
        Ok(())
    }

    fn divergence(&self) -> f64 {
        0.0
    }

    fn norm(&self) -> Norm {
        Norm::L1
    }

    fn set_theta(&mut self, _theta: f64) {}

    fn backup(&mut self, _seq: u64, _scope: BackupScope, _out: &mut BackupBatch) {}

    fn acknowledge_backup(&mut self, _seq: u64) {}

    fn fail_backup(&mut self, _seq: u64) {}

    fn restore(&mut self, entries: &[BackupEntry]) -> Result<(), CoreError> {
        // Only markers can belong to a stateless operator.
        restore_all(&mut [], entries)
    }

    fn constants(&self) -> AnalysisConstants {
        AnalysisConstants {
            alpha: 0.0,
            beta: self.config.max_words_per_line,
        }
    }

    fn distance(&self, _other: &Self) -> f64 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operators::{WordCount, WordCountConfig};

    #[test]
    fn a_line_becomes_the_words_word_count_would_count() {
        let mut tokenize = Tokenize::new(TokenizeConfig { max_words_per_line: 4 }).unwrap();
        let mut count = WordCount::new(WordCountConfig::default()).unwrap();
        let (mut words, mut counted) = (Vec::new(), Vec::new());
        tokenize.process(&"To be, or NOT".to_string(), &mut words).unwrap();
        count.process(&"To be, or NOT".to_string(), &mut counted).unwrap();
        let keys = |updates: &[KeyUpdate]| updates.iter().map(|u| u.key.clone()).collect::<Vec<_>>();
        assert_eq!(keys(&words), keys(&counted));
        assert!(words.iter().all(|w| w.value == 1.0));
        assert!(tokenize.process(&"a b c d e".to_string(), &mut words).is_err());
        assert_eq!(tokenize.constants().beta, 4);
        assert!(Tokenize::new(TokenizeConfig { max_words_per_line: 0 }).is_err());
    }
}
