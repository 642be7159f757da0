//! `tune --write`: the chosen thresholds into the config file's
//! `fault_tolerance` table, every comment and the rest of the file kept
//! (`toml_edit`), the file replaced whole (written beside it, then renamed)
//! so a failure leaves the old one.

use std::path::Path;

use toml_edit::{DocumentMut, Item, Table, Value};

use super::Candidate;
use crate::service::ServiceError;

/// Writes `candidate`'s Θ, L and Γ into the `fault_tolerance` table of
/// pipeline `pipeline` (`None`: the file's single `[pipeline]`).
pub fn write_thresholds(path: &Path, pipeline: Option<&str>, candidate: &Candidate) -> Result<(), ServiceError> {
    let failed = |what: String| ServiceError::Unsupported(format!("{}: {what}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let updated = with_thresholds(&text, pipeline, candidate).map_err(failed)?;
    let temporary = path.with_extension("toml.tune");
    std::fs::write(&temporary, updated).map_err(|e| failed(format!("writing {}: {e}", temporary.display())))?;
    std::fs::rename(&temporary, path).map_err(|e| failed(format!("replacing it: {e}")))
}

/// The config's text with the candidate's thresholds.
fn with_thresholds(text: &str, pipeline: Option<&str>, candidate: &Candidate) -> Result<String, String> {
    let mut document: DocumentMut = text.parse().map_err(|e| format!("not TOML: {e}"))?;
    let table = fault_tolerance(&mut document, pipeline)?;
    set(table, "theta", Value::from(candidate.theta));
    set(
        table,
        "max_uncovered",
        Value::from(as_integer(candidate.max_uncovered)?),
    );
    set(table, "max_unacked", Value::from(as_integer(candidate.max_unacked)?));
    Ok(document.to_string())
}

fn as_integer(value: u64) -> Result<i64, String> {
    i64::try_from(value).map_err(|_| format!("{value} does not fit a TOML integer"))
}

fn fault_tolerance<'a>(document: &'a mut DocumentMut, pipeline: Option<&str>) -> Result<&'a mut Table, String> {
    let (path, table) = match pipeline {
        None => ("[pipeline.fault_tolerance]".to_string(), document.get_mut("pipeline")),
        Some(name) => (
            format!("[pipelines.{name}.fault_tolerance]"),
            document.get_mut("pipelines").and_then(|p| p.get_mut(name)),
        ),
    };
    table
        .and_then(|t| t.get_mut("fault_tolerance"))
        .and_then(Item::as_table_mut)
        .ok_or_else(|| format!("no {path} table to write the thresholds into"))
}

/// Sets `key`, keeping the comments around its old value.
fn set(table: &mut Table, key: &str, mut value: Value) {
    match table.get_mut(key) {
        Some(item) => {
            if let Some(old) = item.as_value() {
                *value.decor_mut() = old.decor().clone();
            }
            *item = Item::Value(value);
        }
        None => {
            table.insert(key, Item::Value(value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate() -> Candidate {
        Candidate {
            theta: 270.0,
            max_uncovered: 10_000,
            max_unacked: 40_000,
            bound: 0.0,
            changelog_records_per_item: 0.0,
            replayed_per_failure: 0.0,
            measured: 0.0,
            violations: 0,
            meets_budget: true,
        }
    }

    const ONE: &str = "# the file\n[pipeline]\ninput_topic = \"in\"\n\n[pipeline.fault_tolerance]\nmode = \"approximate\"\n# Θ: what a failure may lose\ntheta = 100000.0 # total\nmax_uncovered = 1000\nmax_unacked = 20000\n";

    #[test]
    fn the_thresholds_change_and_every_comment_stays() {
        let written = with_thresholds(ONE, None, &candidate()).unwrap();
        assert_eq!(
            written,
            ONE.replace("100000.0", "270.0")
                .replace("= 1000\n", "= 10000\n")
                .replace("20000", "40000")
        );
        let parsed: toml::Table = toml::from_str(&written).unwrap();
        assert_eq!(parsed["pipeline"]["fault_tolerance"]["theta"].as_float(), Some(270.0));
    }

    #[test]
    fn a_named_pipeline_is_written_and_a_missing_table_is_an_error() {
        let several = "[pipelines.count.fault_tolerance]\ntheta = 5.0\n";
        let written = with_thresholds(several, Some("count"), &candidate()).unwrap();
        assert!(
            written.contains("theta = 270.0\nmax_uncovered = 10000\nmax_unacked = 40000\n"),
            "{written}"
        );
        let missing = with_thresholds(several, Some("tokenize"), &candidate()).unwrap_err();
        assert!(missing.contains("[pipelines.tokenize.fault_tolerance]"), "{missing}");
        assert!(with_thresholds(ONE, Some("count"), &candidate()).is_err());
    }
}
