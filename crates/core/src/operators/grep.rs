//! Grep: a stateless filter of text lines by a regular expression, the no-state
//! baseline. It has nothing to back up: divergence 0, α = 0, β = 1.

use regex::Regex;

use crate::batch::BackupBatch;
use crate::entry::BackupEntry;
use crate::error::CoreError;
use crate::operator::{restore_all, AnalysisConstants, BackupScope, Operator, ProcessError};
use crate::structures::Norm;

#[derive(Clone, Debug)]
pub struct Grep {
    pattern: Regex,
}

impl Grep {
    pub fn new(pattern: &str) -> Result<Self, CoreError> {
        let pattern = Regex::new(pattern).map_err(|e| CoreError::parameter("pattern", pattern, e.to_string()))?;
        Ok(Grep { pattern })
    }
}

impl Operator for Grep {
    type Input = String;
    type Output = String;

    fn process(&mut self, line: &String, outputs: &mut Vec<String>) -> Result<(), ProcessError> {
        if self.pattern.is_match(line) {
            outputs.push(line.clone());
        }
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
        AnalysisConstants { alpha: 0.0, beta: 1 }
    }

    fn distance(&self, _other: &Self) -> f64 {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_lines_and_rejects_bad_patterns() {
        let mut grep = Grep::new(r"err(or)?\b").unwrap();
        let mut out = Vec::new();
        for line in ["an error here", "all fine", "err"] {
            grep.process(&line.to_string(), &mut out).unwrap();
        }
        assert_eq!(out, vec!["an error here".to_string(), "err".to_string()]);
        assert!(Grep::new("(unclosed").is_err());
    }
}
