//! The service's config file (TOML): the Kafka connection, the pipeline, its
//! operator and its thresholds.
//!
//! Every table rejects unknown keys, and every value is checked before anything
//! connects, so a bad file fails with the key and the reason.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::core::{CoreError, ExactInterval, FailurePolicy, GlobalThresholds, Mode};
use crate::operators::{
    DistributedSgdConfig, HeavyHitterConfig, JoinConfig, KeyedAggregationConfig, LogisticConfig, TokenizeConfig,
    WordCountConfig,
};

/// Overrides `kafka.bootstrap_servers` of any config file.
pub const ENV_BOOTSTRAP_SERVERS: &str = "AFSTREAM_BOOTSTRAP_SERVERS";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// One pipeline with its Kafka connection: what `run`, `check` and `exact`
/// work on. A file holds one (`[pipeline]`) or several (`[pipelines.NAME]`).
#[derive(Clone, Debug)]
pub struct Config {
    /// The pipeline's name in a file of several.
    pub name: Option<String>,
    /// The connection, with the pipeline's own consumer group.
    pub kafka: KafkaConfig,
    pub pipeline: PipelineConfig,
    /// Prometheus metrics; none unless configured.
    pub metrics: Option<MetricsConfig>,
    /// Its place in a chain of pipelines, if it is a stage of one.
    pub stage: Option<Stage>,
}

impl Config {
    /// Whether outputs carry their source positions: as configured, else when
    /// a later stage of the chain reads them.
    pub fn source_positions(&self) -> bool {
        self.pipeline
            .source_positions
            .unwrap_or_else(|| self.stage.as_ref().is_some_and(|stage| stage.index < stage.stages))
    }
}

/// A stage of a chain: pipelines of one file where each reads the topic the
/// one before writes (tokenize → count). The chain's Θ, L and Γ are those of
/// its last stage; stage i of m runs with Θ/β^(m−i), β the largest fan-out of
/// its stages (the notes' pipeline split; halving then applies per task).
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    /// i, from 1.
    pub index: u32,
    /// m.
    pub stages: u32,
    /// The names of the chain's pipelines, first to last.
    pub chain: Vec<String>,
    /// Their operators, first to last: β, the most outputs one input of any
    /// stage makes, is theirs (`check::fanout`).
    pub operators: Vec<OperatorConfig>,
}

/// A config file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    kafka: KafkaConfig,
    #[serde(default)]
    pipeline: Option<PipelineConfig>,
    #[serde(default)]
    pipelines: BTreeMap<String, PipelineConfig>,
    #[serde(default)]
    metrics: Option<MetricsConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where `/metrics` is served, `host:port`.
    pub address: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    pub bootstrap_servers: String,
    /// The consumer group; also the prefix of the changelog topic's default
    /// name. In a file of several pipelines, each one's group is
    /// `<group_id>-<name>` unless it sets `group_id` itself.
    #[serde(default)]
    pub group_id: String,
    /// librdkafka properties, passed as they are to every client (after
    /// afstream's own defaults, so they win).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Replication factor of the topics afstream creates.
    #[serde(default = "default_replication")]
    pub replication_factor: i32,
    /// How long setting up (metadata, topic creation) keeps trying while the
    /// brokers cannot be reached, so that a service started before its
    /// cluster, or restarted during an outage, waits for it.
    #[serde(default = "default_startup_timeout_ms")]
    pub startup_timeout_ms: u64,
}

impl KafkaConfig {
    /// The settings for `bootstrap_servers` with every default (no group).
    pub fn new(bootstrap_servers: impl Into<String>) -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            group_id: String::new(),
            properties: BTreeMap::new(),
            replication_factor: default_replication(),
            startup_timeout_ms: default_startup_timeout_ms(),
        }
    }
}

fn default_startup_timeout_ms() -> u64 {
    60_000
}

fn default_handoff_quiet_ms() -> u64 {
    500
}

fn default_replication() -> i32 {
    1
}

/// How input and output values are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// A UTF-8 text line (with the record's key, for keyed operators).
    Text,
    /// One JSON object with the fields of the workload's schema in `schemas/`.
    Json,
    /// One Avro datum of the workload's schema in `schemas/`, plain or in
    /// Confluent's wire format (see [`AvroConfig`]).
    Avro,
}

/// How Avro values are framed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Framing {
    /// Confluent's wire format: a zero magic byte and a 4-byte big-endian
    /// schema id before the datum (what Confluent's serializers write).
    #[default]
    Confluent,
    /// The datum alone.
    Plain,
}

/// `[pipeline.avro]`: Avro input and output (with `format = "avro"`).
///
/// afstream has no Schema Registry client: it reads every input record with
/// one writer schema (`input_schema`, resolved against the workload's own), and
/// `input_schema_id` makes it refuse Confluent-framed records written with
/// another one instead of misreading them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AvroConfig {
    /// How input values are framed (default: Confluent's wire format).
    #[serde(default)]
    pub input_framing: Framing,
    /// The schema input values were written with (an `.avsc` file, relative to
    /// the working directory). Default: the workload's schema in `schemas/`.
    #[serde(default)]
    pub input_schema: Option<PathBuf>,
    /// With Confluent framing: the only schema id accepted on input.
    #[serde(default)]
    pub input_schema_id: Option<u32>,
    /// Write outputs in Confluent's wire format with this schema id (that of
    /// the output schema in your registry); plain Avro without it.
    #[serde(default)]
    pub output_schema_id: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// The pipeline's consumer group, instead of the one `kafka.group_id` gives.
    #[serde(default)]
    pub group_id: Option<String>,
    pub input_topic: String,
    /// Created when missing, with as many partitions as the input (one for a
    /// distributed SGD worker's models).
    pub output_topic: String,
    /// A topic every task reads besides its input, every record of it to every
    /// task: a distributed SGD worker's global models (the averager's output).
    /// Read from its last record when a task starts; never committed.
    #[serde(default)]
    pub feedback_topic: Option<String>,
    /// Default: `<group_id>-changelog`. Created when missing: compacted, one
    /// partition per input partition.
    #[serde(default)]
    pub changelog_topic: Option<String>,
    /// Where refused input records go (those that do not decode and those the
    /// operator rejects), with headers naming their source and the reason.
    /// Default: `<group_id>-dead-letters`. Created when missing, one partition
    /// per input partition.
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    pub format: Format,
    /// Avro framing and schemas, with `format = "avro"`.
    #[serde(default)]
    pub avro: Option<AvroConfig>,
    /// The pipeline's local state directory (relative to the working
    /// directory). A process locks it for its group, so two processes never
    /// share one. Keyed operators (WordCount) keep their state here, one
    /// RocksDB store per input partition; without it, state is in memory.
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
    /// The memory budget of each local store.
    #[serde(default)]
    pub store: StoreConfig,
    /// A task taking over a partition whose last marker is not clean first
    /// waits until its changelog has stayed unchanged this long (a previous
    /// owner still writing, up to 20 s); 0 resumes at once.
    #[serde(default = "default_handoff_quiet_ms")]
    pub handoff_quiet_ms: u64,
    /// Whether each output carries its source position (the header
    /// `afstream.position`), so that a downstream afstream stage skips what a
    /// recovery of this one sends again. Default: on for a stage that feeds a
    /// later stage of its chain, off otherwise (a header costs about 30 bytes
    /// an output); set it for a chain split over several files.
    #[serde(default)]
    pub source_positions: Option<bool>,
    pub operator: OperatorConfig,
    /// The thresholds it runs with: its own, or its chain's.
    #[serde(skip)]
    pub fault_tolerance: FaultToleranceConfig,
    /// The thresholds as written (none for a stage before the last of a chain).
    #[serde(default, rename = "fault_tolerance")]
    declared_fault_tolerance: Option<FaultToleranceConfig>,
}

/// The memory budget of a task's local store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// RocksDB's block cache and write buffers, in MiB.
    pub cache_mib: usize,
    /// Clean keys kept in memory besides the drifted ones (which must be).
    pub resident_keys: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            cache_mib: 64,
            resident_keys: 100_000,
        }
    }
}

impl PipelineConfig {
    pub fn changelog_topic(&self, group_id: &str) -> String {
        self.changelog_topic
            .clone()
            .unwrap_or_else(|| format!("{group_id}-changelog"))
    }

    pub fn dead_letter_topic(&self, group_id: &str) -> String {
        self.dead_letter_topic
            .clone()
            .unwrap_or_else(|| format!("{group_id}-dead-letters"))
    }
}

/// The operator and its parameters (`kind` names it). With
/// [`with_operator!`](crate::with_operator), the registry of operator kinds:
/// a variant here, an arm there, and every kind's `ServiceOperator` (codec,
/// schemas) and `Answering` (exact answer, producer workload) impls; the
/// kinds are listed by [`OperatorKind`] (see ARCHITECTURE.md, "Adding an
/// operator").
#[derive(Clone, Debug, PartialEq, Deserialize, strum::EnumDiscriminants)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[strum_discriminants(
    name(OperatorKind),
    derive(strum::EnumIter, strum::IntoStaticStr),
    strum(serialize_all = "snake_case")
)]
pub enum OperatorConfig {
    WordCount(WordCountConfig),
    HeavyHitters(HeavyHitterConfig),
    KeyedAggregation(KeyedAggregationConfig),
    Grep(GrepConfig),
    LogisticRegression(LogisticConfig),
    OnlineJoin(JoinConfig),
    Tokenize(TokenizeConfig),
    /// A distributed SGD worker (one per input partition).
    SgdWorker(DistributedSgdConfig),
    /// The distributed SGD task that averages the workers' models.
    ModelAverager(DistributedSgdConfig),
}

/// Grep: lines matching a regular expression pass, the others do not.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrepConfig {
    /// A regular expression (Rust's `regex` syntax).
    pub pattern: String,
}

impl OperatorConfig {
    /// Its `kind`.
    pub fn kind(&self) -> &'static str {
        OperatorKind::from(self).into()
    }

    /// Whether it reads `format = "text"`: a line (keyed aggregation: the
    /// record's key and a decimal number); the others need fields.
    pub fn reads_text(&self) -> bool {
        matches!(
            self,
            OperatorConfig::WordCount(_)
                | OperatorConfig::KeyedAggregation(_)
                | OperatorConfig::Grep(_)
                | OperatorConfig::Tokenize(_)
        )
    }
}

/// Runs `$body` with `$operator` the operator type of a config and `$config`
/// its parameters: the one place that maps a `kind` to its Rust type.
#[macro_export]
macro_rules! with_operator {
    ($operator_config:expr, |$operator:ident, $config:ident| $body:expr) => {{
        use $crate::service::config::OperatorConfig as Kind;
        match $operator_config {
            Kind::WordCount($config) => {
                type $operator = $crate::operators::WordCount;
                $body
            }
            Kind::HeavyHitters($config) => {
                type $operator = $crate::operators::HeavyHitters;
                $body
            }
            Kind::KeyedAggregation($config) => {
                type $operator = $crate::operators::KeyedAggregation;
                $body
            }
            Kind::Grep($config) => {
                type $operator = $crate::operators::Grep;
                $body
            }
            Kind::LogisticRegression($config) => {
                type $operator = $crate::operators::OnlineLogisticRegression;
                $body
            }
            Kind::OnlineJoin($config) => {
                type $operator = $crate::operators::OnlineJoin;
                $body
            }
            Kind::Tokenize($config) => {
                type $operator = $crate::operators::Tokenize;
                $body
            }
            Kind::SgdWorker($config) => {
                type $operator = $crate::operators::SgdWorker;
                $body
            }
            Kind::ModelAverager($config) => {
                type $operator = $crate::operators::ModelAverager;
                $body
            }
        }
    }};
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModeName {
    None,
    Approximate,
    Exact,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// The papers' policy: each failure halves θ, l and γ for good.
    Halving,
    /// Thresholds never change.
    Fixed,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultToleranceConfig {
    pub mode: ModeName,
    /// Θ: the divergence from the last backup a failure may lose (all tasks).
    pub theta: f64,
    /// L: input items past the last backup marker (all tasks).
    pub max_uncovered: u64,
    /// Γ: outputs not acknowledged by the broker (all tasks).
    pub max_unacked: u64,
    #[serde(default = "default_policy")]
    pub policy: PolicyName,
    /// With the halving policy: a failure stops counting (and the thresholds
    /// come back) this many items after its recovery resumed.
    #[serde(default)]
    pub recover_after_items: Option<u64>,
    /// Exact mode: a complete backup every this many items …
    #[serde(default)]
    pub exact_interval_items: Option<u64>,
    /// … and/or every this many milliseconds.
    #[serde(default)]
    pub exact_interval_ms: Option<u64>,
}

fn default_policy() -> PolicyName {
    PolicyName::Halving
}

/// Only a placeholder until a pipeline's thresholds are resolved.
impl Default for FaultToleranceConfig {
    fn default() -> Self {
        FaultToleranceConfig {
            mode: ModeName::None,
            theta: 1.0,
            max_uncovered: 1,
            max_unacked: 1,
            policy: PolicyName::Halving,
            recover_after_items: None,
            exact_interval_items: None,
            exact_interval_ms: None,
        }
    }
}

impl FaultToleranceConfig {
    pub fn mode(&self) -> Mode {
        match self.mode {
            ModeName::None => Mode::None,
            ModeName::Approximate => Mode::Approximate,
            ModeName::Exact => Mode::Exact(ExactInterval {
                items: self.exact_interval_items,
                millis: self.exact_interval_ms,
            }),
        }
    }

    pub fn failure_policy(&self) -> FailurePolicy {
        match (self.policy, self.recover_after_items) {
            (PolicyName::Fixed, _) => FailurePolicy::Fixed,
            (PolicyName::Halving, Some(window_items)) => FailurePolicy::Recovering { window_items },
            (PolicyName::Halving, None) => FailurePolicy::Halving,
        }
    }

    pub fn global(&self) -> Result<GlobalThresholds, CoreError> {
        GlobalThresholds::new(self.theta, self.max_uncovered, self.max_unacked)
    }
}

/// Reads and checks a config file of one pipeline (or of several, with
/// `name` picking one); `env` looks up environment variables.
pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    load_named(path, env, None)
}

/// Reads a config file and picks its pipeline `name` (needed when the file has
/// several).
pub fn load_named(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
    name: Option<&str>,
) -> Result<Config, ConfigError> {
    let invalid = |message| ConfigError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    let mut all = load_all(path, env)?;
    match name {
        Some(name) => match all.iter().position(|c| c.name.as_deref() == Some(name)) {
            Some(at) => Ok(all.swap_remove(at)),
            None => Err(invalid(format!("no pipeline named {name:?} (it has: {})", names(&all)))),
        },
        None if all.len() == 1 => Ok(all.remove(0)),
        None => Err(invalid(format!(
            "it has {} pipelines ({}): name one with --pipeline",
            all.len(),
            names(&all)
        ))),
    }
}

fn names(configs: &[Config]) -> String {
    let names: Vec<&str> = configs
        .iter()
        .map(|c| c.name.as_deref().unwrap_or("pipeline"))
        .collect();
    names.join(", ")
}

/// Reads and checks a config file: every pipeline it holds.
pub fn load_all(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<Config>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_all(&text, env).map_err(|message| ConfigError::Invalid {
        path: path.to_path_buf(),
        message,
    })
}

/// Parses and checks config text of one pipeline.
pub fn parse(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, String> {
    let mut all = parse_all(text, env)?;
    match all.len() {
        1 => Ok(all.remove(0)),
        n => Err(format!("it has {n} pipelines ({}): name one", names(&all))),
    }
}

/// Finds the chains among a file's pipelines (each reading the topic the one
/// before writes) and gives each pipeline its stage, with the thresholds its
/// chain's last stage declares.
#[allow(clippy::type_complexity)]
fn chains(
    named: &[(Option<String>, PipelineConfig)],
) -> Result<Vec<Option<(Stage, Option<FaultToleranceConfig>)>>, String> {
    let label = |i: usize| named[i].0.clone().unwrap_or_else(|| "pipeline".into());
    let upstream = |i: usize| -> Result<Option<usize>, String> {
        let writers: Vec<usize> = (0..named.len())
            .filter(|&j| j != i && named[j].1.output_topic == named[i].1.input_topic)
            .collect();
        match writers.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(*one)),
            [a, b, ..] => Err(format!(
                "pipelines {} and {} both write {}, which {} reads: a chain is a line of stages",
                label(*a),
                label(*b),
                named[i].1.input_topic,
                label(i)
            )),
        }
    };
    let mut downstream: Vec<Option<usize>> = vec![None; named.len()];
    let mut upstreams = Vec::with_capacity(named.len());
    for (i, (_, pipeline)) in named.iter().enumerate() {
        let up = upstream(i)?;
        if let Some(up) = up {
            if let Some(other) = downstream[up].replace(i) {
                return Err(format!(
                    "pipelines {} and {} both read {}, the output of {}: a chain is a line of stages",
                    label(other),
                    label(i),
                    pipeline.input_topic,
                    label(up)
                ));
            }
        }
        upstreams.push(up);
    }
    let mut stages = vec![None; named.len()];
    for head in (0..named.len()).filter(|&i| upstreams[i].is_none() && downstream[i].is_some()) {
        let mut chain = vec![head];
        while let Some(next) = chain.last().and_then(|&last| downstream[last]) {
            chain.push(next);
        }
        let names: Vec<String> = chain.iter().map(|&i| label(i)).collect();
        let last = chain.last().and_then(|&i| named[i].1.declared_fault_tolerance.clone());
        for (position, &i) in chain.iter().enumerate() {
            stages[i] = Some((
                Stage {
                    index: position as u32 + 1,
                    stages: chain.len() as u32,
                    chain: names.clone(),
                    operators: chain.iter().map(|&i| named[i].1.operator.clone()).collect(),
                },
                last.clone(),
            ));
        }
    }
    if let Some(i) = (0..named.len()).find(|&i| upstreams[i].is_some() && stages[i].is_none()) {
        return Err(format!(
            "pipeline {} reads its own output through a cycle of pipelines ({})",
            label(i),
            named[i].1.input_topic
        ));
    }
    Ok(stages)
}

/// Parses and checks config text: every pipeline, each with its own group.
pub fn parse_all(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<Config>, String> {
    let mut file: ConfigFile = toml::from_str(text).map_err(|e| e.to_string())?;
    if let Some(servers) = env(ENV_BOOTSTRAP_SERVERS).filter(|s| !s.trim().is_empty()) {
        file.kafka.bootstrap_servers = servers;
    }
    if let Some(address) = env(super::metrics::ENV_METRICS_ADDRESS).filter(|s| !s.trim().is_empty()) {
        file.metrics = Some(MetricsConfig { address });
    }
    let named: Vec<(Option<String>, PipelineConfig)> = match (file.pipeline, file.pipelines.is_empty()) {
        (Some(_), false) => return Err("a file holds either [pipeline] or [pipelines.NAME] tables, not both".into()),
        (None, true) => return Err("no pipeline: write a [pipeline] table (or [pipelines.NAME] tables)".into()),
        (Some(pipeline), true) => vec![(None, pipeline)],
        (None, false) => file.pipelines.into_iter().map(|(n, p)| (Some(n), p)).collect(),
    };
    let stages = chains(&named)?;
    let mut configs = Vec::with_capacity(named.len());
    for ((name, mut pipeline), stage) in named.into_iter().zip(stages) {
        let key = |field: &str| match &name {
            Some(name) => format!("pipelines.{name}.{field}"),
            None => format!("pipeline.{field}"),
        };
        pipeline.fault_tolerance = match (&stage, pipeline.declared_fault_tolerance.take()) {
            (Some((stage, _)), Some(_)) if stage.index < stage.stages => {
                return Err(format!(
                    "`{}`: a chain's thresholds are its last stage's (pipelines.{}.fault_tolerance); stage {} of {} \
                     runs with their share",
                    key("fault_tolerance"),
                    stage.chain.last().map_or("", String::as_str),
                    stage.index,
                    stage.stages
                ))
            }
            (_, Some(declared)) => declared,
            (Some((_, Some(last))), None) => last.clone(),
            (_, None) => {
                return Err(format!(
                    "`{}` is missing: mode, theta, max_uncovered, max_unacked",
                    key("fault_tolerance")
                ))
            }
        };
        let stage = stage.map(|(stage, _)| stage);
        let mut kafka = file.kafka.clone();
        kafka.group_id = match (&name, &pipeline.group_id) {
            (_, Some(group)) => group.clone(),
            (Some(name), None) if !file.kafka.group_id.trim().is_empty() => format!("{}-{name}", file.kafka.group_id),
            (Some(name), None) => {
                return Err(format!(
                    "`pipelines.{name}.group_id` or `kafka.group_id` (the prefix of every pipeline's group) must be set"
                ))
            }
            (None, None) => file.kafka.group_id.clone(),
        };
        let config = Config {
            name,
            kafka,
            pipeline,
            metrics: file.metrics.clone(),
            stage,
        };
        validate(&config).map_err(|message| match &config.name {
            // The keys of a named pipeline are under pipelines.NAME.
            Some(name) => message.replace("pipeline.", &format!("pipelines.{name}.")),
            None => message,
        })?;
        configs.push(config);
    }
    // A chain's stages in order, after the pipeline it is named by first.
    configs.sort_by_key(|c| match &c.stage {
        Some(stage) => (stage.chain.first().cloned(), stage.index),
        None => (c.name.clone(), 0),
    });
    for (i, config) in configs.iter().enumerate() {
        for earlier in &configs[..i] {
            if earlier.kafka.group_id == config.kafka.group_id {
                return Err(format!(
                    "pipelines {} and {} share the consumer group {}: each pipeline needs its own",
                    names(std::slice::from_ref(earlier)),
                    names(std::slice::from_ref(config)),
                    config.kafka.group_id
                ));
            }
            let changelog = config.pipeline.changelog_topic(&config.kafka.group_id);
            if earlier.pipeline.changelog_topic(&earlier.kafka.group_id) == changelog {
                return Err(format!(
                    "pipelines {} and {} share the changelog topic {changelog}: each pipeline needs its own",
                    names(std::slice::from_ref(earlier)),
                    names(std::slice::from_ref(config)),
                ));
            }
        }
    }
    Ok(configs)
}

fn validate(config: &Config) -> Result<(), String> {
    let required = [
        ("kafka.bootstrap_servers", &config.kafka.bootstrap_servers),
        ("kafka.group_id", &config.kafka.group_id),
        ("pipeline.input_topic", &config.pipeline.input_topic),
        ("pipeline.output_topic", &config.pipeline.output_topic),
    ];
    for (key, value) in required {
        if value.trim().is_empty() {
            return Err(format!("`{key}` is empty: it must name something"));
        }
    }
    if let Some(metrics) = &config.metrics {
        metrics.address.parse::<std::net::SocketAddr>().map_err(|e| {
            format!(
                "`metrics.address` = {:?}: {e} (write host:port, e.g. 0.0.0.0:9464)",
                metrics.address
            )
        })?;
    }
    if config.kafka.replication_factor < 1 {
        return Err(format!(
            "`kafka.replication_factor` = {}: a topic needs at least one replica",
            config.kafka.replication_factor
        ));
    }
    let pipeline = &config.pipeline;
    let changelog = pipeline.changelog_topic(&config.kafka.group_id);
    let dead_letters = pipeline.dead_letter_topic(&config.kafka.group_id);
    let topics = [
        pipeline.input_topic.as_str(),
        &pipeline.output_topic,
        &changelog,
        &dead_letters,
    ];
    if topics.iter().enumerate().any(|(i, a)| topics[..i].contains(a)) {
        return Err(format!(
            "the input ({}), output ({}), changelog ({changelog}) and dead-letter ({dead_letters}) topics must differ",
            pipeline.input_topic, pipeline.output_topic
        ));
    }
    let ft = &pipeline.fault_tolerance;
    ft.global().map_err(|e| format!("pipeline.fault_tolerance: {e}"))?;
    ft.mode()
        .validate()
        .map_err(|e| format!("pipeline.fault_tolerance: {e}"))?;
    ft.failure_policy()
        .validate()
        .map_err(|e| format!("pipeline.fault_tolerance: {e}"))?;
    if ft.mode != ModeName::Exact && (ft.exact_interval_items.is_some() || ft.exact_interval_ms.is_some()) {
        return Err(
            "pipeline.fault_tolerance: `exact_interval_items` / `exact_interval_ms` apply to mode = \"exact\" only"
                .into(),
        );
    }
    if pipeline.avro.is_some() && pipeline.format != Format::Avro {
        return Err(format!(
            "[pipeline.avro] is set but `pipeline.format` = {:?}: set format = \"avro\" or remove the table",
            pipeline.format
        ));
    }
    if let Some(avro) = &pipeline.avro {
        if avro.input_framing == Framing::Plain && avro.input_schema_id.is_some() {
            return Err(
                "`pipeline.avro.input_schema_id` needs input_framing = \"confluent\": plain Avro carries no schema id"
                    .into(),
            );
        }
    }
    if let OperatorConfig::Grep(grep) = &pipeline.operator {
        regex::Regex::new(&grep.pattern)
            .map_err(|e| format!("`pipeline.operator.pattern` = {:?}: {e}", grep.pattern))?;
    }
    if pipeline.format == Format::Text && !pipeline.operator.reads_text() {
        return Err(format!(
            "`pipeline.format` = \"text\": {} reads records with fields (format = \"json\" or \"avro\"; the fields \
             are those of its schema in schemas/)",
            pipeline.operator.kind()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
