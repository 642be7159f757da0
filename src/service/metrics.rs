//! Prometheus metrics of the tasks, served at `/metrics` on the configured
//! address. Counters follow the drivers' statistics, published once per poll
//! batch (not per item); gauges show where each task stands against its
//! thresholds.

use std::net::SocketAddr;
use std::time::Duration;

use metrics::{counter, gauge, Counter, Gauge};
use metrics_exporter_prometheus::PrometheusBuilder;

use super::ServiceError;
use crate::core::{DriverStats, RecoveryPlan, TaskThresholds};

/// Overrides `metrics.address` of any config file.
pub const ENV_METRICS_ADDRESS: &str = "AFSTREAM_METRICS_ADDRESS";

/// Starts the exporter (its own thread) and installs it as the process's recorder.
pub fn serve(address: &str) -> Result<SocketAddr, ServiceError> {
    let socket: SocketAddr = address
        .parse()
        .map_err(|e| ServiceError::Metrics(format!("address {address:?}: {e}")))?;
    PrometheusBuilder::new()
        .with_http_listener(socket)
        .install()
        .map_err(|e| ServiceError::Metrics(format!("serving on {socket}: {e}")))?;
    describe();
    Ok(socket)
}

/// Whether a metric counts up or stands at a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

/// Every metric afstream serves, with its help text (docs/running.md lists the same,
/// and the Grafana dashboard uses only these: a test checks both).
pub const METRICS: &[(&str, MetricKind, &str)] = &[
    (
        "afstream_items_processed_total",
        MetricKind::Counter,
        "Input records the task processed (rejected ones included).",
    ),
    (
        "afstream_records_rejected_total",
        MetricKind::Counter,
        "Input records refused: those that did not decode and those the operator rejected.",
    ),
    (
        "afstream_records_undecodable_total",
        MetricKind::Counter,
        "Input records that did not decode (counted in afstream_records_rejected_total too).",
    ),
    (
        "afstream_dead_letters_total",
        MetricKind::Counter,
        "Refused records sent to the dead-letter topic.",
    ),
    (
        "afstream_repeats_skipped_total",
        MetricKind::Counter,
        "Input records skipped because their source position was applied already (an upstream replay).",
    ),
    (
        "afstream_dead_letters_acknowledged_total",
        MetricKind::Counter,
        "Dead letters the broker acknowledged.",
    ),
    (
        "afstream_outputs_produced_total",
        MetricKind::Counter,
        "Output records sent to the producer.",
    ),
    (
        "afstream_outputs_acknowledged_total",
        MetricKind::Counter,
        "Output records the broker acknowledged.",
    ),
    (
        "afstream_backups_total",
        MetricKind::Counter,
        "Backups issued to the changelog.",
    ),
    (
        "afstream_backup_entries_total",
        MetricKind::Counter,
        "Changelog records written by backups.",
    ),
    (
        "afstream_backup_bytes_total",
        MetricKind::Counter,
        "Bytes of changelog records written by backups.",
    ),
    (
        "afstream_backups_failed_total",
        MetricKind::Counter,
        "Backups whose delivery failed (re-issued).",
    ),
    ("afstream_markers_total", MetricKind::Counter, "Backup markers written."),
    (
        "afstream_commits_total",
        MetricKind::Counter,
        "Group offsets stored after acknowledged markers.",
    ),
    (
        "afstream_stalls_total",
        MetricKind::Counter,
        "Poll batches in which input waited for an acknowledgement (of outputs, or of the start marker).",
    ),
    (
        "afstream_recoveries_total",
        MetricKind::Counter,
        "Task starts, by source (marker, committed, beginning, local_store) and whether a failure was counted.",
    ),
    (
        "afstream_state_lost_total",
        MetricKind::Counter,
        "Task starts that found no marker in the changelog although the group had committed an offset: the state of the input before it is lost.",
    ),
    (
        "afstream_fenced_records_total",
        MetricKind::Counter,
        "Changelog records a restore left out: a previous owner wrote them after a newer owner of the partition had started.",
    ),
    (
        "afstream_restored_records_total",
        MetricKind::Counter,
        "Changelog records read at task starts.",
    ),
    (
        "afstream_divergence",
        MetricKind::Gauge,
        "Divergence of the state from its last backup issued.",
    ),
    ("afstream_theta", MetricKind::Gauge, "The task's current θ."),
    (
        "afstream_max_uncovered",
        MetricKind::Gauge,
        "The task's current l: a marker goes out every l/2 items, so a recovery replays about l.",
    ),
    (
        "afstream_max_unacked",
        MetricKind::Gauge,
        "The task's current γ: unacknowledged outputs.",
    ),
    (
        "afstream_items_past_marker",
        MetricKind::Gauge,
        "Items processed past the last acknowledged marker.",
    ),
    (
        "afstream_unacknowledged_outputs",
        MetricKind::Gauge,
        "Outputs not yet acknowledged.",
    ),
    (
        "afstream_marker_round_trip_seconds",
        MetricKind::Gauge,
        "Mean time from a marker's send to its acknowledgement, over the markers acknowledged since the last update: \
         a recovery also replays the items of the markers in flight.",
    ),
    (
        "afstream_failures",
        MetricKind::Gauge,
        "Failures k the task has recovered from (persisted in its markers).",
    ),
    (
        "afstream_recovery_error_bound",
        MetricKind::Gauge,
        "Worst-case state error the task's last recovery may have introduced.",
    ),
    (
        "afstream_broker_errors_total",
        MetricKind::Counter,
        "Errors librdkafka reported on its connections to the brokers (it retries with backoff).",
    ),
    (
        "afstream_brokers_up",
        MetricKind::Gauge,
        "Brokers the consumer is connected to (from librdkafka's statistics).",
    ),
    (
        "afstream_restore_seconds",
        MetricKind::Gauge,
        "How long the task's last start took to read its changelog and restore.",
    ),
    (
        "afstream_consumer_lag",
        MetricKind::Gauge,
        "Input records past the group's committed offset, which follows the acknowledged markers.",
    ),
];

fn describe() {
    for &(name, kind, help) in METRICS {
        match kind {
            MetricKind::Counter => metrics::describe_counter!(name, help),
            MetricKind::Gauge => metrics::describe_gauge!(name, help),
        }
    }
}

/// One task's metric handles, registered once (no lookups on the hot path).
pub struct TaskMetrics {
    items: Counter,
    rejected: Counter,
    undecodable: Counter,
    outputs: Counter,
    outputs_acknowledged: Counter,
    dead_letters: Counter,
    dead_letters_acknowledged: Counter,
    repeats: Counter,
    backups: Counter,
    backup_entries: Counter,
    backup_bytes: Counter,
    backups_failed: Counter,
    markers: Counter,
    commits: Counter,
    stalls: Counter,
    divergence: Gauge,
    theta: Gauge,
    max_uncovered: Gauge,
    max_unacked: Gauge,
    items_past_marker: Gauge,
    unacknowledged_outputs: Gauge,
    marker_round_trip: Gauge,
    failures: Gauge,
    published: DriverStats,
    /// Markers acknowledged and their total round trip, as last published.
    published_round_trips: (u64, Duration),
    published_undecodable: u64,
}

/// Where a task stands, for the gauges.
pub struct TaskPosition {
    pub divergence: f64,
    pub thresholds: TaskThresholds,
    pub items_past_marker: u64,
    pub unacknowledged_outputs: u64,
    pub failures: u32,
    /// Markers acknowledged so far and their total round trip.
    pub marker_round_trips: (u64, Duration),
}

impl TaskMetrics {
    pub fn new(group: &str, partition: i32) -> Self {
        let labels = [("group", group.to_string()), ("partition", partition.to_string())];
        TaskMetrics {
            items: counter!("afstream_items_processed_total", &labels),
            rejected: counter!("afstream_records_rejected_total", &labels),
            undecodable: counter!("afstream_records_undecodable_total", &labels),
            outputs: counter!("afstream_outputs_produced_total", &labels),
            outputs_acknowledged: counter!("afstream_outputs_acknowledged_total", &labels),
            dead_letters: counter!("afstream_dead_letters_total", &labels),
            dead_letters_acknowledged: counter!("afstream_dead_letters_acknowledged_total", &labels),
            repeats: counter!("afstream_repeats_skipped_total", &labels),
            backups: counter!("afstream_backups_total", &labels),
            backup_entries: counter!("afstream_backup_entries_total", &labels),
            backup_bytes: counter!("afstream_backup_bytes_total", &labels),
            backups_failed: counter!("afstream_backups_failed_total", &labels),
            markers: counter!("afstream_markers_total", &labels),
            commits: counter!("afstream_commits_total", &labels),
            stalls: counter!("afstream_stalls_total", &labels),
            divergence: gauge!("afstream_divergence", &labels),
            theta: gauge!("afstream_theta", &labels),
            max_uncovered: gauge!("afstream_max_uncovered", &labels),
            max_unacked: gauge!("afstream_max_unacked", &labels),
            items_past_marker: gauge!("afstream_items_past_marker", &labels),
            unacknowledged_outputs: gauge!("afstream_unacknowledged_outputs", &labels),
            marker_round_trip: gauge!("afstream_marker_round_trip_seconds", &labels),
            failures: gauge!("afstream_failures", &labels),
            published: DriverStats::default(),
            published_round_trips: (0, Duration::ZERO),
            published_undecodable: 0,
        }
    }

    /// Records a task start.
    pub fn started(group: &str, partition: i32, plan: &RecoveryPlan, records: u64, seconds: f64) {
        let labels = [("group", group.to_string()), ("partition", partition.to_string())];
        let source = serde_json::to_value(plan.source)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        counter!(
            "afstream_recoveries_total",
            "group" => group.to_string(),
            "partition" => partition.to_string(),
            "source" => source,
            "failure" => plan.counted_failure.to_string()
        )
        .increment(1);
        counter!("afstream_restored_records_total", &labels).increment(records);
        gauge!("afstream_restore_seconds", &labels).set(seconds);
        gauge!("afstream_recovery_error_bound", &labels).set(plan.introduced.state);
    }

    /// A task started with its state lost (see `afstream_state_lost_total`).
    pub fn state_lost(group: &str, partition: i32) {
        counter!("afstream_state_lost_total", "group" => group.to_string(), "partition" => partition.to_string())
            .increment(1);
    }

    /// Changelog records a restore left out (see `afstream_fenced_records_total`).
    pub fn fenced(group: &str, partition: i32, records: u64) {
        counter!("afstream_fenced_records_total", "group" => group.to_string(), "partition" => partition.to_string())
            .increment(records);
    }

    /// Records a partition's lag from the client's statistics.
    pub fn consumer_lag(group: &str, partition: i32, lag: f64) {
        gauge!("afstream_consumer_lag", "group" => group.to_string(), "partition" => partition.to_string()).set(lag);
    }

    pub fn outputs_acknowledged(&self, count: u64) {
        self.outputs_acknowledged.increment(count);
    }

    pub fn dead_letters_acknowledged(&self, count: u64) {
        self.dead_letters_acknowledged.increment(count);
    }

    /// Publishes what changed since the last call.
    pub fn publish(&mut self, stats: DriverStats, undecodable: u64, position: &TaskPosition) {
        let before = self.published;
        self.items.increment(stats.items - before.items);
        self.rejected.increment(stats.rejected - before.rejected);
        self.outputs.increment(stats.outputs - before.outputs);
        self.dead_letters.increment(stats.dead_letters - before.dead_letters);
        self.repeats.increment(stats.repeats - before.repeats);
        self.backups.increment(stats.backups - before.backups);
        self.backup_entries
            .increment(stats.backup_entries - before.backup_entries);
        self.backup_bytes.increment(stats.backup_bytes - before.backup_bytes);
        self.backups_failed
            .increment(stats.backups_failed - before.backups_failed);
        self.markers.increment(stats.markers - before.markers);
        self.commits.increment(stats.commits - before.commits);
        self.stalls.increment(stats.stalls - before.stalls);
        self.undecodable.increment(undecodable - self.published_undecodable);
        self.published = stats;
        self.published_undecodable = undecodable;
        self.divergence.set(position.divergence);
        self.theta.set(position.thresholds.theta);
        self.max_uncovered.set(position.thresholds.max_uncovered as f64);
        self.max_unacked.set(position.thresholds.max_unacked as f64);
        self.items_past_marker.set(position.items_past_marker as f64);
        self.unacknowledged_outputs.set(position.unacknowledged_outputs as f64);
        self.failures.set(position.failures as f64);
        let (acknowledged, total) = position.marker_round_trips;
        let (before, before_total) = self.published_round_trips;
        if acknowledged > before {
            let mean = total.saturating_sub(before_total).as_secs_f64() / (acknowledged - before) as f64;
            self.marker_round_trip.set(mean);
            self.published_round_trips = (acknowledged, total);
        }
    }
}

/// A client-wide error from librdkafka (a broker went away, all brokers are
/// down, a request timed out): logged and counted. librdkafka reconnects with
/// backoff by itself, and the tasks wait for the acknowledgements they need, so
/// an outage stalls the pipeline without failing it.
pub fn broker_error(client: &'static str, error: &rdkafka::error::KafkaError, reason: &str) {
    use rdkafka::error::RDKafkaErrorCode;
    let code = error.rdkafka_error_code();
    if code == Some(RDKafkaErrorCode::AllBrokersDown) {
        tracing::error!(client, %error, reason, "all brokers are down; reconnecting with backoff");
    } else {
        tracing::warn!(client, %error, reason, "broker connection trouble; librdkafka retries");
    }
    let code = code.map_or_else(|| "other".to_string(), |code| format!("{code:?}"));
    counter!("afstream_broker_errors_total", "client" => client, "code" => code).increment(1);
}

/// The brokers the consumer is connected to, from its statistics.
pub fn brokers_up(group: &str, up: usize) {
    gauge!("afstream_brokers_up", "group" => group.to_string()).set(up as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The `afstream_…` names a text mentions.
    fn names_in(text: &str) -> BTreeSet<String> {
        text.match_indices("afstream_")
            .map(|(at, _)| {
                text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect::<String>()
            })
            .filter(|name| name.len() > "afstream_".len())
            .collect()
    }

    fn listed() -> BTreeSet<String> {
        METRICS.iter().map(|(name, _, _)| name.to_string()).collect()
    }

    fn repo_file(path: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn every_metric_registered_is_described_and_every_described_one_is_in_the_docs() {
        let source = include_str!("metrics.rs");
        let code = &source[..source.find("#[cfg(test)]").unwrap_or(source.len())];
        let used = names_in(code);
        assert_eq!(used, listed(), "metrics registered here against those in METRICS");
        let documented = names_in(&repo_file("docs/running.md"));
        let missing: Vec<_> = listed().difference(&documented).cloned().collect();
        assert!(missing.is_empty(), "docs/running.md does not list {missing:?}");
        for (name, kind, _) in METRICS {
            assert_eq!(
                name.ends_with("_total"),
                *kind == MetricKind::Counter,
                "{name}: counters, and only counters, end in _total"
            );
        }
    }

    #[test]
    fn the_dashboard_and_the_scrape_config_use_only_metrics_afstream_serves() {
        let dashboard = repo_file("configs/monitoring/grafana/dashboards/afstream.json");
        let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
        let panels = parsed["panels"].as_array().map_or(0, Vec::len);
        assert!(panels >= 6, "the dashboard has {panels} panels");
        let used = names_in(&dashboard);
        let unknown: Vec<_> = used.difference(&listed()).cloned().collect();
        assert!(unknown.is_empty(), "the dashboard queries unknown metrics {unknown:?}");
        for shown in [
            "afstream_items_processed_total",
            "afstream_divergence",
            "afstream_theta",
            "afstream_consumer_lag",
            "afstream_recoveries_total",
            "afstream_recovery_error_bound",
        ] {
            assert!(used.contains(shown), "the dashboard does not show {shown}");
        }
    }
}
