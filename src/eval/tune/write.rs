//! `tune --write`: the chosen thresholds into the config file's
//! `fault_tolerance` table (and a raised β into its `operator` table),
//! every comment and the rest of the file kept
//! (`toml_edit`), the file replaced whole (written beside it, then renamed)
//! so a failure leaves the old one.

use std::path::Path;

use toml_edit::{DocumentMut, Item, Table, Value};

use super::{Candidate, Fanout};
use crate::service::ServiceError;

/// Writes `candidate`'s Θ, L and Γ into the `fault_tolerance` table of
/// pipeline `pipeline` (`None`: the file's single `[pipeline]`), and a
/// raised β into its `operator` table.
pub fn write_choice(
    path: &Path,
    pipeline: Option<&str>,
    candidate: &Candidate,
    fanout: Option<&Fanout>,
) -> Result<(), ServiceError> {
    let failed = |what: String| ServiceError::Unsupported(format!("{}: {what}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let updated = with_choice(&text, pipeline, candidate, fanout).map_err(failed)?;
    let temporary = path.with_extension("toml.tune");
    std::fs::write(&temporary, updated).map_err(|e| failed(format!("writing {}: {e}", temporary.display())))?;
    std::fs::rename(&temporary, path).map_err(|e| failed(format!("replacing it: {e}")))
}

/// The config's text with the candidate's thresholds and the raised β.
fn with_choice(
    text: &str,
    pipeline: Option<&str>,
    candidate: &Candidate,
    fanout: Option<&Fanout>,
) -> Result<String, String> {
    let mut document: DocumentMut = text.parse().map_err(|e| format!("not TOML: {e}"))?;
    let table = pipeline_table(&mut document, pipeline, "fault_tolerance")?;
    set(table, "theta", Value::from(candidate.theta));
    set(
        table,
        "max_uncovered",
        Value::from(as_integer(candidate.max_uncovered)?),
    );
    set(table, "max_unacked", Value::from(as_integer(candidate.max_unacked)?));
    if let Some(fanout) = fanout.filter(|f| f.raised()) {
        let operator = pipeline_table(&mut document, pipeline, "operator")?;
        set(operator, fanout.key, Value::from(as_integer(fanout.chosen)?));
    }
    Ok(document.to_string())
}

fn as_integer(value: u64) -> Result<i64, String> {
    i64::try_from(value).map_err(|_| format!("{value} does not fit a TOML integer"))
}

/// The pipeline's table `name` (`[pipeline.NAME]` or `[pipelines.P.NAME]`).
fn pipeline_table<'a>(
    document: &'a mut DocumentMut,
    pipeline: Option<&str>,
    name: &str,
) -> Result<&'a mut Table, String> {
    let (path, table) = match pipeline {
        None => (format!("[pipeline.{name}]"), document.get_mut("pipeline")),
        Some(pipeline) => (
            format!("[pipelines.{pipeline}.{name}]"),
            document.get_mut("pipelines").and_then(|p| p.get_mut(pipeline)),
        ),
    };
    table
        .and_then(|t| t.get_mut(name))
        .and_then(Item::as_table_mut)
        .ok_or_else(|| format!("no {path} table to write into"))
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
        let written = with_choice(ONE, None, &candidate(), None).unwrap();
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
        let written = with_choice(several, Some("count"), &candidate(), None).unwrap();
        assert!(
            written.contains("theta = 270.0\nmax_uncovered = 10000\nmax_unacked = 40000\n"),
            "{written}"
        );
        let missing = with_choice(several, Some("tokenize"), &candidate(), None).unwrap_err();
        assert!(missing.contains("[pipelines.tokenize.fault_tolerance]"), "{missing}");
        assert!(with_choice(ONE, Some("count"), &candidate(), None).is_err());
    }

    #[test]
    fn a_raised_fanout_is_written_into_the_operator_table_and_a_kept_one_is_not() {
        let text = format!("{ONE}\n[pipeline.operator]\nkind = \"word_count\"\nmax_words_per_line = 64 # β\n");
        let raised = Fanout::of("max_words_per_line", 64, 931);
        assert_eq!(raised.chosen, 1024);
        let written = with_choice(&text, None, &candidate(), Some(&raised)).unwrap();
        assert!(written.contains("max_words_per_line = 1024 # β\n"), "{written}");
        let kept = Fanout::of("max_words_per_line", 64, 12);
        let written = with_choice(&text, None, &candidate(), Some(&kept)).unwrap();
        assert!(written.contains("max_words_per_line = 64 # β\n"), "{written}");
    }
}
