//! Prometheus metrics of the tasks, served at `/metrics` on the configured
//! address. Counters follow the drivers' statistics, published once per poll
//! batch (not per item); gauges show where each task stands against its
//! thresholds.

use std::net::SocketAddr;

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

fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        "afstream_items_processed_total",
        "Input records the task processed (rejected ones included)."
    );
    describe_counter!(
        "afstream_records_rejected_total",
        "Input records the operator rejected."
    );
    describe_counter!(
        "afstream_records_undecodable_total",
        "Input records that did not decode (skipped, logged)."
    );
    describe_counter!(
        "afstream_outputs_produced_total",
        "Output records sent to the producer."
    );
    describe_counter!(
        "afstream_outputs_acknowledged_total",
        "Output records the broker acknowledged."
    );
    describe_counter!("afstream_backups_total", "Backups issued to the changelog.");
    describe_counter!("afstream_backup_entries_total", "Changelog records written by backups.");
    describe_counter!(
        "afstream_backup_bytes_total",
        "Bytes of changelog records written by backups."
    );
    describe_counter!(
        "afstream_backups_failed_total",
        "Backups whose delivery failed (re-issued)."
    );
    describe_counter!("afstream_markers_total", "Backup markers written.");
    describe_counter!(
        "afstream_commits_total",
        "Group offsets stored after acknowledged markers."
    );
    describe_counter!(
        "afstream_stalls_total",
        "Poll batches in which input waited for an acknowledgement."
    );
    describe_counter!(
        "afstream_recoveries_total",
        "Task starts, by source (marker, committed, beginning, local_store) and whether a failure was counted."
    );
    describe_counter!(
        "afstream_restored_records_total",
        "Changelog records read at task starts."
    );
    describe_gauge!(
        "afstream_divergence",
        "Divergence of the state from its last acknowledged backup."
    );
    describe_gauge!("afstream_theta", "The task's current θ.");
    describe_gauge!(
        "afstream_items_threshold",
        "The task's current l: items past the last marker."
    );
    describe_gauge!(
        "afstream_outputs_threshold",
        "The task's current γ: unacknowledged outputs."
    );
    describe_gauge!(
        "afstream_items_past_marker",
        "Items processed past the last acknowledged marker."
    );
    describe_gauge!("afstream_unacknowledged_outputs", "Outputs not yet acknowledged.");
    describe_gauge!(
        "afstream_failures",
        "Failures k the task has recovered from (persisted in its markers)."
    );
    describe_gauge!(
        "afstream_recovery_error_bound",
        "Worst-case state error the task's last recovery may have introduced."
    );
    describe_gauge!(
        "afstream_restore_seconds",
        "How long the task's last start took to read its changelog and restore."
    );
}

/// One task's metric handles, registered once (no lookups on the hot path).
pub struct TaskMetrics {
    items: Counter,
    rejected: Counter,
    undecodable: Counter,
    outputs: Counter,
    outputs_acknowledged: Counter,
    backups: Counter,
    backup_entries: Counter,
    backup_bytes: Counter,
    backups_failed: Counter,
    markers: Counter,
    commits: Counter,
    stalls: Counter,
    divergence: Gauge,
    theta: Gauge,
    items_threshold: Gauge,
    outputs_threshold: Gauge,
    items_past_marker: Gauge,
    unacknowledged_outputs: Gauge,
    failures: Gauge,
    published: DriverStats,
    published_undecodable: u64,
}

/// Where a task stands, for the gauges.
pub struct TaskPosition {
    pub divergence: f64,
    pub thresholds: TaskThresholds,
    pub items_past_marker: u64,
    pub unacknowledged_outputs: u64,
    pub failures: u32,
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
            backups: counter!("afstream_backups_total", &labels),
            backup_entries: counter!("afstream_backup_entries_total", &labels),
            backup_bytes: counter!("afstream_backup_bytes_total", &labels),
            backups_failed: counter!("afstream_backups_failed_total", &labels),
            markers: counter!("afstream_markers_total", &labels),
            commits: counter!("afstream_commits_total", &labels),
            stalls: counter!("afstream_stalls_total", &labels),
            divergence: gauge!("afstream_divergence", &labels),
            theta: gauge!("afstream_theta", &labels),
            items_threshold: gauge!("afstream_items_threshold", &labels),
            outputs_threshold: gauge!("afstream_outputs_threshold", &labels),
            items_past_marker: gauge!("afstream_items_past_marker", &labels),
            unacknowledged_outputs: gauge!("afstream_unacknowledged_outputs", &labels),
            failures: gauge!("afstream_failures", &labels),
            published: DriverStats::default(),
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

    /// Records a partition's lag from the client's statistics.
    pub fn consumer_lag(group: &str, partition: i32, lag: f64) {
        gauge!("afstream_consumer_lag", "group" => group.to_string(), "partition" => partition.to_string()).set(lag);
    }

    pub fn outputs_acknowledged(&self, count: u64) {
        self.outputs_acknowledged.increment(count);
    }

    /// Publishes what changed since the last call.
    pub fn publish(&mut self, stats: DriverStats, undecodable: u64, position: &TaskPosition) {
        let before = self.published;
        self.items.increment(stats.items - before.items);
        self.rejected.increment(stats.rejected - before.rejected);
        self.outputs.increment(stats.outputs - before.outputs);
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
        self.items_threshold.set(position.thresholds.items as f64);
        self.outputs_threshold.set(position.thresholds.outputs as f64);
        self.items_past_marker.set(position.items_past_marker as f64);
        self.unacknowledged_outputs.set(position.unacknowledged_outputs as f64);
        self.failures.set(position.failures as f64);
    }
}
