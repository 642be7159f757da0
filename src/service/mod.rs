//! The Kafka service: `afstream run`, and what it is configured and checked
//! with. The evaluation tools around it are in `crate::eval`.
//!
//! * [`check`]: `afstream check`, what a config runs with, without connecting;
//! * [`config`]: the TOML config file;
//! * [`codec`]: records to operator inputs, outputs to records (text, JSON, Avro);
//! * [`clients`]: every Kafka client afstream makes, and its settings;
//! * [`delivery`]: what a produced record is for, and its delivery report;
//! * [`kafka`]: topics and changelog reading;
//! * [`metrics`]: the Prometheus exporter and each task's metrics;
//! * [`runner`]: the consumer group and one core `TaskDriver` per partition;
//! * [`state`]: the local state directory and its lock;
//! * [`store`]: a task's local RocksDB store.

pub mod check;
pub mod clients;
pub mod codec;
pub mod config;
pub mod delivery;
pub mod kafka;
pub mod metrics;
pub mod runner;
pub mod state;
pub mod store;

use std::sync::atomic::AtomicBool;

use crate::core::CoreError;
use config::Config;
use kafka::KafkaSetupError;
pub use runner::{RunOptions, RunReport, TaskReport};

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Setup(#[from] KafkaSetupError),
    #[error("Kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("{0}")]
    Core(#[from] CoreError),
    #[error("restoring input partition {partition}: {source}")]
    Restore { partition: i32, source: CoreError },
    #[error("rebalance: {0}")]
    Rebalance(String),
    #[error("input partition {partition}: {message}")]
    Task { partition: i32, message: String },
    #[error("clean stop: {0}")]
    Stop(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("producing: {0}")]
    Produce(String),
    #[error("demo: {0}")]
    Demo(String),
    #[error("afstream run: {0}")]
    Child(String),
    #[error("metrics: {0}")]
    Metrics(String),
    #[error("pipeline {name}: {source}")]
    Pipeline { name: String, source: Box<ServiceError> },
    #[error("state directory {path}: {reason}")]
    State { path: std::path::PathBuf, reason: String },
}

/// Runs the configured pipeline until `stop` is set (or its input ends, with
/// `stop_at_end`).
pub fn run(config: &Config, stop: &AtomicBool, options: RunOptions) -> Result<RunReport, ServiceError> {
    serve_metrics(config)?;
    run_one(config, stop, options)
}

fn serve_metrics(config: &Config) -> Result<(), ServiceError> {
    if let Some(metrics) = &config.metrics {
        let address = metrics::serve(&metrics.address)?;
        tracing::info!(%address, "serving Prometheus metrics at /metrics");
    }
    Ok(())
}

fn run_one(config: &Config, stop: &AtomicBool, options: RunOptions) -> Result<RunReport, ServiceError> {
    // Every line a pipeline logs names its group (several may share a process).
    let _span = tracing::info_span!("pipeline", group = %config.kafka.group_id).entered();
    crate::with_operator!(&config.pipeline.operator, |O, c| runner::run_pipeline::<O>(
        config, c, stop, options
    ))
}

/// Creates the topics between the stages of chains (as the upstream would,
/// with the partitions of the chain's input), so a downstream stage never
/// starts before its input exists.
fn create_intermediate_topics(configs: &[Config], stop: &AtomicBool) -> Result<(), ServiceError> {
    for config in configs {
        let Some(stage) = config.stage.as_ref().filter(|s| s.index > 1) else {
            continue;
        };
        let head = configs
            .iter()
            .find(|c| c.stage.as_ref().is_some_and(|s| s.index == 1 && s.chain == stage.chain));
        let Some(head) = head else { continue };
        let upstream = configs
            .iter()
            .find(|c| c.pipeline.output_topic == config.pipeline.input_topic);
        let declared = upstream.and_then(|upstream| {
            crate::with_operator!(&upstream.pipeline.operator, |O, c| {
                <O as codec::ServiceOperator>::output_partitions(c)
            })
        });
        let partitions = match declared {
            Some(partitions) => partitions,
            None => kafka::patiently(&head.kafka, stop, "reading the chain's input metadata", || {
                kafka::partition_count(&head.kafka, &head.pipeline.input_topic)
            })?
            .ok_or_else(|| KafkaSetupError::MissingTopic(head.pipeline.input_topic.clone()))?,
        };
        let spec = [kafka::TopicSpec {
            name: &config.pipeline.input_topic,
            partitions,
            compacted: false,
        }];
        kafka::patiently(&config.kafka, stop, "creating the chain's intermediate topic", || {
            kafka::ensure_topics(&config.kafka, &spec)
        })?;
    }
    Ok(())
}

/// Runs several pipelines of one file side by side, each in its own consumer
/// group on a thread of its own, until `stop` is set (or each input ends, with
/// `stop_at_end`). When one fails, the others stop cleanly and its error is
/// returned, naming it.
pub fn run_all(configs: &[Config], stop: &AtomicBool, options: RunOptions) -> Result<Vec<RunReport>, ServiceError> {
    use std::sync::atomic::Ordering;
    if let [config] = configs {
        return Ok(vec![run(config, stop, options)?]);
    }
    if let Some(first) = configs.first() {
        serve_metrics(first)?;
    }
    create_intermediate_topics(configs, stop)?;
    // With --stop-at-end a chain's stages run one after the other, so that each
    // reads its upstream's whole output; otherwise every pipeline runs at once,
    // and so does a chain whose stages feed back (a distributed learner's
    // workers wait for their averager).
    let feeds_back = |config: &Config| {
        let chain = config.stage.as_ref().map(|s| &s.chain);
        configs
            .iter()
            .any(|c| c.stage.as_ref().map(|s| &s.chain) == chain && c.pipeline.feedback_topic.is_some())
    };
    let mut units: Vec<Vec<&Config>> = Vec::new();
    for config in configs {
        match (&config.stage, units.last_mut()) {
            (Some(stage), Some(unit)) if options.stop_at_end && stage.index > 1 && !feeds_back(config) => {
                unit.push(config)
            }
            _ => units.push(vec![config]),
        }
    }
    let stop_all = AtomicBool::new(false);
    let results = std::thread::scope(|scope| {
        let running: Vec<_> = units
            .into_iter()
            .map(|unit| {
                let stop_all = &stop_all;
                scope.spawn(move || {
                    let mut results = Vec::new();
                    for config in unit {
                        if stop_all.load(Ordering::SeqCst) {
                            break;
                        }
                        let result = run_one(config, stop_all, options);
                        let failed = result.is_err();
                        results.push((config, result));
                        if failed {
                            stop_all.store(true, Ordering::SeqCst);
                        }
                    }
                    results
                })
            })
            .collect();
        while !running.iter().all(|r| r.is_finished()) {
            if stop.load(Ordering::SeqCst) {
                stop_all.store(true, Ordering::SeqCst);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let mut results = Vec::new();
        for unit in running {
            match unit.join() {
                Ok(unit) => results.extend(unit),
                Err(_) => return Err(ServiceError::Unsupported("a pipeline's thread panicked".into())),
            }
        }
        Ok(results)
    })?;
    let mut reports = Vec::with_capacity(results.len());
    for (config, result) in results {
        match result {
            Ok(report) => reports.push(report),
            Err(source) => {
                return Err(ServiceError::Pipeline {
                    name: config.name.clone().unwrap_or_else(|| config.kafka.group_id.clone()),
                    source: Box::new(source),
                })
            }
        }
    }
    Ok(reports)
}
