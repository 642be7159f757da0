//! `afstream demo`: the whole story on a real broker in one command. Seeded
//! Zipf packets go into an input topic; a heavy-hitter pipeline (`afstream run`,
//! a child process) is killed with SIGKILL at seeded points of its progress and
//! started again; the last run processes the input to its end and stops
//! cleanly. Then the answer is checked against the exact one, and each
//! partition's final state (read back from its changelog) against a
//! failure-free run over the same records, beside the bound of its failures.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::child::Run;
pub use super::child::{logged_recoveries, LoggedRecovery};
use super::produce::{packet_records, produce, InputRecord};
use crate::core::{AnalysisConstants, GlobalThresholds, Operator, Placement, ThresholdPolicy};
use crate::operators::heavy_hitters::detection_accuracy;
use crate::operators::{HeavyHitterConfig, HeavyHitters, HitterThreshold};
use crate::service::codec::{Codec, ServiceOperator};
use crate::service::config::KafkaConfig;
use crate::service::kafka::{ChangelogLoader, TopicReader};
use crate::service::ServiceError;

/// How long any one step may take.
const STEP_DEADLINE: Duration = Duration::from_secs(300);

#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub kafka: KafkaConfig,
    pub packets: usize,
    pub partitions: usize,
    pub failures: usize,
    pub seed: u64,
    /// Config and logs of the runs go here.
    pub dir: PathBuf,
    /// The thresholds Θ, L, Γ.
    pub theta: f64,
    pub max_uncovered: u64,
    pub max_unacked: u64,
}

fn config_text(options: &DemoOptions, group: &str, input: &str, output: &str, threshold: f64) -> String {
    let properties: Vec<String> = options
        .kafka
        .properties
        .iter()
        .map(|(k, v)| format!("{k:?} = {v:?}"))
        .collect();
    format!(
        r#"[kafka]
bootstrap_servers = {servers:?}
group_id = {group:?}
properties = {{ {properties} }}

[pipeline]
input_topic = {input:?}
output_topic = {output:?}
format = "json"

[pipeline.operator]
kind = "heavy_hitters"
threshold = {{ bytes = {threshold:?} }}
max_weight = 1500

[pipeline.fault_tolerance]
mode = "approximate"
theta = {theta:?}
max_uncovered = {l}
max_unacked = {gamma}
"#,
        servers = options.kafka.bootstrap_servers,
        properties = properties.join(", "),
        theta = options.theta,
        l = options.max_uncovered,
        gamma = options.max_unacked,
    )
}

fn demo_error(what: &str) -> impl Fn(String) -> ServiceError + '_ {
    move |e| ServiceError::Demo(format!("{what}: {e}"))
}

fn say(out: &mut dyn Write, text: impl AsRef<str>) {
    let _ = writeln!(out, "{}", text.as_ref());
    let _ = out.flush();
}

/// The exact answer over the generated packets.
struct Truth {
    flow_bytes: HashMap<Vec<u8>, f64>,
    /// A heavy hitter: a flow with more than 1% of all bytes.
    threshold: f64,
    hitters: HashSet<String>,
}

impl Truth {
    fn of(records: &[InputRecord]) -> Result<Self, ServiceError> {
        let mut flow_bytes: HashMap<Vec<u8>, f64> = HashMap::new();
        for record in records {
            let mut packet = HeavyHitters::empty_input();
            Codec::Json
                .decode::<HeavyHitters>(None, &record.value, &mut packet)
                .map_err(demo_error("a generated packet"))?;
            *flow_bytes.entry(packet.flow).or_default() += packet.bytes as f64;
        }
        let total: f64 = flow_bytes.values().sum();
        let threshold = (total / 100.0).round();
        let hitters = flow_bytes
            .iter()
            .filter(|(_, bytes)| **bytes >= threshold)
            .map(|(flow, _)| String::from_utf8_lossy(flow).into_owned())
            .collect();
        Ok(Truth {
            flow_bytes,
            threshold,
            hitters,
        })
    }
}

/// One demo: its topics, its config and where its runs log.
struct Demo<'a> {
    options: &'a DemoOptions,
    group: String,
    input: String,
    output: String,
    config_path: PathBuf,
}

/// Runs the demo, writing what happens to `out` as it goes.
pub fn run_demo(options: &DemoOptions, out: &mut dyn Write) -> Result<(), ServiceError> {
    std::fs::create_dir_all(&options.dir).map_err(|e| ServiceError::Demo(format!("{}: {e}", options.dir.display())))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let group = format!("afstream-demo-{stamp}");
    let demo = Demo {
        options,
        input: format!("{group}-packets"),
        output: format!("{group}-heavy-hitters"),
        config_path: options.dir.join("heavy-hitters.toml"),
        group,
    };
    let records = packet_records(options.packets, options.seed).map_err(ServiceError::Demo)?;
    let truth = Truth::of(&records)?;
    say(
        out,
        format!(
            "1. producing {} packets of Zipf-distributed flows to {} ({} partitions, keyed by flow)",
            records.len(),
            demo.input,
            options.partitions
        ),
    );
    produce(&options.kafka, &demo.input, options.partitions, &records)?;
    let config = config_text(options, &demo.group, &demo.input, &demo.output, truth.threshold);
    std::fs::write(&demo.config_path, config)
        .map_err(|e| ServiceError::Demo(format!("{}: {e}", demo.config_path.display())))?;
    say(
        out,
        format!(
            "2. heavy hitters (flows over 1% of the bytes: {} bytes), Θ = {}, L = {}, Γ = {}; config {}",
            truth.threshold,
            options.theta,
            options.max_uncovered,
            options.max_unacked,
            demo.config_path.display()
        ),
    );
    let changelog = ChangelogLoader::new(
        &options.kafka_with_group(&demo.group),
        &format!("{}-changelog", demo.group),
    )?;
    let mut logs = demo.killed_runs(&changelog, records.len() as u64, out)?;
    let log = options.dir.join("final.log");
    say(
        out,
        "4. starting again; this run processes the input to its end and stops cleanly",
    );
    Run::start(&demo.config_path, log.clone(), true)?.wait()?;
    logs.push(log);
    let mut recoveries = Vec::new();
    for log in &logs {
        let text = std::fs::read_to_string(log).map_err(|e| ServiceError::Demo(format!("{}: {e}", log.display())))?;
        recoveries.extend(logged_recoveries(&text));
    }
    let reader = TopicReader::new(&options.kafka_with_group(&demo.group), "demo-reader")?;
    let detected = demo.detected(&reader)?;
    say_recoveries(&recoveries, out);
    let (within, max_bound) = demo.final_states(&reader, &changelog, &recoveries, truth.threshold, out)?;
    say_answer(&truth, &detected, within, max_bound, out);
    say(out, format!("logs: {}", options.dir.display()));
    if within {
        Ok(())
    } else {
        Err(ServiceError::Demo("a partition's error exceeded its bound".into()))
    }
}

impl Demo<'_> {
    /// Starts the pipeline once per failure and SIGKILLs it at a seeded
    /// point of its progress (the input its markers cover); the runs' logs.
    fn killed_runs(
        &self,
        changelog: &ChangelogLoader,
        total: u64,
        out: &mut dyn Write,
    ) -> Result<Vec<PathBuf>, ServiceError> {
        let options = self.options;
        let mut rng = StdRng::seed_from_u64(options.seed ^ 0x5eed);
        let mut points: Vec<f64> = (0..options.failures).map(|_| rng.gen_range(0.1..0.8)).collect();
        points.sort_by(f64::total_cmp);
        let mut logs = Vec::new();
        for (i, fraction) in points.iter().enumerate() {
            let log = options.dir.join(format!("run-{}.log", i + 1));
            let mut run = Run::start(&self.config_path, log.clone(), false)?;
            let deadline = Instant::now() + STEP_DEADLINE;
            let late = |what: String| ServiceError::Demo(format!("run {} {what}; see {}", i + 1, log.display()));
            // Wait until this run's tasks have started (restored, start marker
            // written), so that each kill interrupts a run that is processing.
            while run.started_tasks() < options.partitions {
                run.check_alive()?;
                if Instant::now() > deadline {
                    return Err(late(format!("started no tasks within {STEP_DEADLINE:?}")));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let at_start = self.covered(changelog);
            // Input never waits for a marker, so a restarted run may be near the
            // end before its tasks are counted: the kill then comes at once (a
            // marker may never cover the last l/2 items of a partition before the
            // clean stop).
            let target = ((fraction * total as f64) as u64)
                .max(at_start + total / 50)
                .min((total - total / 50).max(at_start));
            loop {
                run.check_alive()?;
                let covered = self.covered(changelog);
                if covered >= target {
                    run.kill();
                    say(
                        out,
                        format!(
                            "3.{} SIGKILL after {covered} of {total} packets were covered by markers ({:.0}%)",
                            i + 1,
                            100.0 * covered as f64 / total as f64
                        ),
                    );
                    break;
                }
                if Instant::now() > deadline {
                    return Err(late(format!("did not reach {target} packets within {STEP_DEADLINE:?}")));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            logs.push(log);
        }
        Ok(logs)
    }

    /// The input the partitions' last markers cover.
    fn covered(&self, changelog: &ChangelogLoader) -> u64 {
        (0..self.options.partitions as i32)
            // The changelog exists once the service has started.
            .filter_map(|p| changelog.last_marker(p).ok().flatten())
            .map(|marker| marker.input_offset)
            .sum()
    }

    /// The flows the pipeline's output names.
    fn detected(&self, reader: &TopicReader) -> Result<HashSet<String>, ServiceError> {
        let mut detected = HashSet::new();
        for partition in 0..self.options.partitions as i32 {
            reader
                .read_all(&self.output, partition, |m| {
                    if let Some(key) = rdkafka::Message::key(m) {
                        detected.insert(String::from_utf8_lossy(key).into_owned());
                    }
                })
                .map_err(demo_error("reading the output"))?;
        }
        Ok(detected)
    }

    /// Each partition's final state (from its changelog) against a
    /// failure-free run over its records, beside its bounds; whether every
    /// one is within its bound, and the largest bound.
    fn final_states(
        &self,
        reader: &TopicReader,
        changelog: &ChangelogLoader,
        recoveries: &[LoggedRecovery],
        threshold: f64,
        out: &mut dyn Write,
    ) -> Result<(bool, f64), ServiceError> {
        let options = self.options;
        let config = HeavyHitterConfig {
            threshold: HitterThreshold::Bytes(threshold),
            max_weight: 1500,
            ..HeavyHitterConfig::default()
        };
        let probe = HeavyHitters::new(config)?;
        let constants: AnalysisConstants = probe.constants();
        let policy = ThresholdPolicy::new(
            GlobalThresholds::new(options.theta, options.max_uncovered, options.max_unacked)?,
            crate::core::FailurePolicy::Halving,
            Placement {
                parallelism: options.partitions as u32,
                ..Placement::default()
            },
            probe.norm(),
            constants,
        )?;
        say(out, "");
        say(
            out,
            "final state, per partition (the largest counter difference, in bytes):",
        );
        say(
            out,
            " partition  failures  failure-free vs after failures  logged bounds  bound from Θ, L, k",
        );
        let mut within = true;
        let mut max_bound: f64 = 0.0;
        for partition in 0..options.partitions as i32 {
            let mut clean = HeavyHitters::new(config)?;
            let mut packet = HeavyHitters::empty_input();
            let mut outputs = Vec::new();
            reader
                .read_all(&self.input, partition, |m| {
                    if let Some(value) = rdkafka::Message::payload(m) {
                        if Codec::Json.decode::<HeavyHitters>(None, value, &mut packet).is_ok() {
                            let _ = clean.process(&packet, &mut outputs);
                            outputs.clear();
                        }
                    }
                })
                .map_err(demo_error("reading the input back"))?;
            let state = changelog.load(partition)?;
            let mut recovered = HeavyHitters::new(config)?;
            recovered.restore(&state.entries)?;
            let failures = state.marker.map(|m| m.failures).unwrap_or(0);
            let error = recovered.distance(&clean);
            let logged: f64 = recoveries
                .iter()
                .filter(|r| r.partition == partition)
                .map(|r| r.bound_state)
                .sum();
            let bound = policy.bound_after(failures, constants).state;
            within &= error <= logged.min(bound) + 1e-9;
            max_bound = max_bound.max(logged.min(bound));
            say(
                out,
                format!(" {partition:>9}  {failures:>8}  {error:>30.0}  {logged:>13.0}  {bound:>18.0}"),
            );
        }
        Ok((within, max_bound))
    }
}

fn say_recoveries(recoveries: &[LoggedRecovery], out: &mut dyn Write) {
    say(out, "");
    say(out, "recoveries, as the service logged them:");
    say(
        out,
        " partition  failure k  resumed at offset  worst-case error it may add (bytes)",
    );
    for r in recoveries {
        say(
            out,
            format!(
                " {:>9}  {:>9}  {:>17}  {:>12.0}",
                r.partition, r.failures, r.resume_offset, r.bound_state
            ),
        );
    }
}

/// The detected heavy hitters against the exact ones; each flow missed or
/// wrongly detected with its distance from the threshold.
fn say_answer(truth: &Truth, detected: &HashSet<String>, within: bool, max_bound: f64, out: &mut dyn Write) {
    let accuracy = detection_accuracy(detected, &truth.hitters);
    say(out, "");
    say(
        out,
        format!(
            "heavy hitters: {} exact, {} detected; precision {:.3}, recall {:.3}, F1 {:.3}",
            truth.hitters.len(),
            detected.len(),
            accuracy.precision,
            accuracy.recall,
            accuracy.f1
        ),
    );
    say(
        out,
        if within {
            "every partition's error is within its bound"
        } else {
            "A BOUND WAS EXCEEDED"
        },
    );
    let mut wrong: Vec<(&String, bool)> = truth.hitters.difference(detected).map(|f| (f, true)).collect();
    wrong.extend(detected.difference(&truth.hitters).map(|f| (f, false)));
    wrong.sort();
    for (flow, missed) in wrong {
        let bytes = truth.flow_bytes.get(flow.as_bytes()).copied().unwrap_or(0.0);
        let distance = (bytes - truth.threshold).abs();
        say(
            out,
            format!(
                "  {} {flow}: {bytes} bytes exactly, {distance:.0} from the threshold{}",
                if missed { "missed" } else { "false positive" },
                if distance <= max_bound {
                    ", inside the error bound"
                } else {
                    ""
                }
            ),
        );
    }
}

impl DemoOptions {
    fn kafka_with_group(&self, group: &str) -> KafkaConfig {
        KafkaConfig {
            group_id: group.to_string(),
            properties: self.kafka.properties.clone(),
            ..self.kafka.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recoveries_are_read_from_the_service_log() {
        let log = "2026-12-03T17:30:50Z  WARN afstream::service::runner: recovered from a failure partition=1 \
                   source=Marker resume_offset=3440 failures=2 restored_records=8247 changelog_end=8250 restore_seconds=0.25 \
                   bound_state=3400.0 bound_outputs=3700.0 bound_lost_outputs=500\n2026-12-03T17:30:51Z  INFO task started partition=0";
        assert_eq!(
            logged_recoveries(log),
            vec![LoggedRecovery {
                partition: 1,
                failures: 2,
                resume_offset: 3440,
                bound_state: 3400.0,
                bound_outputs: 3700.0,
                bound_lost_outputs: 500.0,
                restore_seconds: 0.25,
                changelog_end: Some(8250),
            }]
        );
    }
}
