//! Every Kafka client afstream makes, and its settings: to follow a config
//! value to the client it reaches, read this module only.
//!
//! Each client starts from the brokers, then afstream's defaults for its job,
//! then the user's `kafka.properties` for its role (keys prefixed `consumer.`
//! or `producer.` go to that kind of client only: Kafka Streams'
//! convention), then the settings a guarantee depends on, which no property
//! overrides (`GAPLESS_CHANGELOG`).

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, ProducerContext};

use super::config::KafkaConfig;
use super::delivery::DeliveryReports;

/// What a client is for: it takes the user's properties for its role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClientRole {
    Consumer,
    Producer,
    Admin,
}

impl ClientRole {
    /// The librdkafka property a configured key sets for this role, if any.
    fn property(self, key: &str) -> Option<&str> {
        match (key.strip_prefix("consumer."), key.strip_prefix("producer.")) {
            (Some(property), _) => (self == ClientRole::Consumer).then_some(property),
            (_, Some(property)) => (self == ClientRole::Producer).then_some(property),
            _ => Some(key),
        }
    }
}

/// The settings of a client: the brokers, afstream's defaults, then the user's
/// properties for its role.
fn client_config(kafka: &KafkaConfig, role: ClientRole, defaults: &[(&str, &str)]) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.bootstrap_servers);
    if role == ClientRole::Consumer {
        // Only the group consumer joins a group, but librdkafka checks every
        // consumer's properties against it (`max.poll.interval.ms` may not
        // be below it): each gets the member's.
        config.set(SESSION_TIMEOUT.0, SESSION_TIMEOUT.1);
    }
    for (key, value) in defaults {
        config.set(*key, *value);
    }
    for (key, value) in &kafka.properties {
        if let Some(property) = role.property(key) {
            config.set(property, value);
        }
    }
    config
}

/// A consumer that only reads metadata.
pub fn metadata_client(kafka: &KafkaConfig) -> Result<BaseConsumer, KafkaError> {
    client_config(kafka, ClientRole::Consumer, &[]).create()
}

/// The admin client that creates topics and reads their configs.
pub fn admin_client(kafka: &KafkaConfig) -> Result<AdminClient<DefaultClientContext>, KafkaError> {
    client_config(kafka, ClientRole::Admin, &[]).create()
}

/// A consumer that reads partitions by assignment and commits nothing. It
/// needs a group id to be assigned anything (librdkafka's rule); `group` is
/// never joined. With `report_ends`, reaching a partition's end is reported.
pub fn assigned_reader(kafka: &KafkaConfig, group: &str, report_ends: bool) -> Result<BaseConsumer, KafkaError> {
    client_config(
        kafka,
        ClientRole::Consumer,
        &[
            ("group.id", group),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("enable.partition.eof", if report_ends { "true" } else { "false" }),
        ],
    )
    .create()
}

/// The member's session: a member that crashed is out of the group (and its
/// partitions move) this long after its last heartbeat.
const SESSION_TIMEOUT: (&str, &str) = ("session.timeout.ms", "6000");

/// The member's consumer of the input topic. The group's offset follows
/// acknowledged markers: the tasks store offsets and librdkafka commits them
/// in the background (nothing waits on a commit).
pub fn group_consumer<C: ConsumerContext>(
    kafka: &KafkaConfig,
    statistics: bool,
    context: C,
) -> Result<BaseConsumer<C>, KafkaError> {
    client_config(
        kafka,
        ClientRole::Consumer,
        &[
            ("group.id", kafka.group_id.as_str()),
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "false"),
            ("auto.offset.reset", "earliest"),
            // Incremental rebalances: only the partitions that move stop (and
            // are handed off); the others run on.
            ("partition.assignment.strategy", "cooperative-sticky"),
            ("heartbeat.interval.ms", "1500"),
            // Consumer lag for the metrics; parsed only when they are served.
            ("statistics.interval.ms", if statistics { "5000" } else { "0" }),
        ],
    )
    .create_with_context(context)
}

/// How long the changelog's records wait to be batched. Backups and markers
/// go out almost at once, since a recovery replays the items of the markers
/// in flight; not at once: at 0 librdkafka's broker thread spins whenever
/// records wait behind the requests an idempotent producer keeps in flight
/// (measured in `docs/benchmarks.md`).
const CHANGELOG_LINGER_MS: &str = "1";
/// How long outputs wait to be batched in mode none.
const OUTPUT_LINGER_MS: &str = "5";
/// Where markers wait for outputs (every mode but none), their linger adds to
/// every window of a task with an output per item: it is kept short.
const OUTPUT_LINGER_MS_MARKERS_WAIT: &str = "1";

/// The changelog's producer is gapless: a record lands only if every record
/// before it in the partition landed. A marker goes out right behind its
/// backup's entries and recovery trusts that a marker in the log has them all
/// before it. librdkafka's gapless guarantee turns any failure that could
/// leave a gap into a fatal error; a record that times out is the one gap it
/// allows, so records never time out (during an outage input waits on the
/// window instead). Set after the user's properties: recovery depends on them.
const GAPLESS_CHANGELOG: &[(&str, &str)] = &[("enable.gapless.guarantee", "true"), ("message.timeout.ms", "0")];

/// The producers of a member's tasks: outputs and changelog apart, so that
/// each keeps its own order (the changelog's within its partition, gapless;
/// outputs' per key) and lingers as its records need. A user's
/// `producer.linger.ms` sets both.
pub struct TaskProducers {
    pub outputs: BaseProducer<DeliveryReports>,
    pub changelog: BaseProducer<DeliveryReports>,
}

impl TaskProducers {
    /// `markers_wait`: markers wait for outputs (every mode but none).
    pub fn new(kafka: &KafkaConfig, markers_wait: bool) -> Result<Self, KafkaError> {
        let output_linger_ms = if markers_wait {
            OUTPUT_LINGER_MS_MARKERS_WAIT
        } else {
            OUTPUT_LINGER_MS
        };
        Ok(TaskProducers {
            outputs: idempotent_producer(kafka, output_linger_ms, &[], DeliveryReports::default())?,
            changelog: idempotent_producer(
                kafka,
                CHANGELOG_LINGER_MS,
                GAPLESS_CHANGELOG,
                DeliveryReports::default(),
            )?,
        })
    }
}

/// An idempotent producer lingering `linger_ms`, with `fixed` properties
/// over the user's.
pub fn idempotent_producer<C: ProducerContext>(
    kafka: &KafkaConfig,
    linger_ms: &str,
    fixed: &[(&str, &str)],
    context: C,
) -> Result<BaseProducer<C>, KafkaError> {
    idempotent_config(kafka, linger_ms, fixed).create_with_context(context)
}

fn idempotent_config(kafka: &KafkaConfig, linger_ms: &str, fixed: &[(&str, &str)]) -> ClientConfig {
    let mut config = client_config(
        kafka,
        ClientRole::Producer,
        &[
            ("enable.idempotence", "true"),
            ("linger.ms", linger_ms),
            ("compression.type", "lz4"),
        ],
    );
    for (key, value) in fixed {
        config.set(*key, *value);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(properties: &[(&str, &str)]) -> KafkaConfig {
        KafkaConfig {
            group_id: "g".into(),
            properties: properties.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..KafkaConfig::new("broker:9092")
        }
    }

    #[test]
    fn a_prefixed_property_reaches_only_its_kind_of_client_and_wins_over_defaults() {
        let kafka = user(&[
            ("consumer.fetch.wait.max.ms", "10"),
            ("producer.linger.ms", "50"),
            ("client.id", "afstream-test"),
        ]);
        let consumer = client_config(&kafka, ClientRole::Consumer, &[]);
        assert_eq!(consumer.get("fetch.wait.max.ms"), Some("10"));
        assert_eq!(consumer.get("linger.ms"), None);
        assert_eq!(consumer.get("client.id"), Some("afstream-test"));
        let producer = client_config(&kafka, ClientRole::Producer, &[("linger.ms", "5")]);
        assert_eq!(producer.get("linger.ms"), Some("50"), "the user's property wins");
        assert_eq!(producer.get("fetch.wait.max.ms"), None);
        let admin = client_config(&kafka, ClientRole::Admin, &[]);
        assert_eq!((admin.get("fetch.wait.max.ms"), admin.get("linger.ms")), (None, None));
        assert_eq!(admin.get("bootstrap.servers"), Some("broker:9092"));
    }

    #[test]
    fn a_poll_interval_under_librdkafkas_default_session_is_taken_by_every_consumer() {
        let kafka = user(&[("consumer.max.poll.interval.ms", "7000")]);
        assert!(metadata_client(&kafka).is_ok());
        assert!(assigned_reader(&kafka, "g", true).is_ok());
        assert!(group_consumer(&kafka, false, rdkafka::consumer::DefaultConsumerContext).is_ok());
    }

    #[test]
    fn no_property_turns_off_the_changelogs_gapless_guarantee() {
        let kafka = user(&[
            ("producer.enable.gapless.guarantee", "false"),
            ("producer.message.timeout.ms", "30000"),
        ]);
        let config = idempotent_config(&kafka, CHANGELOG_LINGER_MS, GAPLESS_CHANGELOG);
        assert_eq!(config.get("enable.idempotence"), Some("true"));
        assert_eq!(config.get("enable.gapless.guarantee"), Some("true"));
        assert_eq!(config.get("message.timeout.ms"), Some("0"));
    }
}
